"""Fault injection: stop training at random moments, mostly inside checkpoint saves, resume,
and check that every resumed run ends exactly where an uninterrupted run ends.

    python benchmarks/fault_injection.py [--trials 20] [--steps 6] [--signal KILL|TERM] [--seed 0]
        [--resume-with KEY=VALUE ...] [KEY=VALUE ...]

Extra KEY=VALUE overrides go to every run (e.g. train.lora.r=8 for a LoRA run). With
--resume-with, the resumed runs get those overrides too (another layout: parallel.pp=3,
parallel.dp=2, train.zero_stage=1, plan.stages=...), and a resumed run is compared with the
reference within fp32 rounding (losses and gradient norms relative 1e-5, the samples of every
step, the final layer files' tensors), since the reduction order differs between layouts; give
plan.across_replicas=true to every run when the dp changes (the steps' samples then do not
depend on it).

One uninterrupted reference run first (`mmpipe train`, pp=2, a checkpoint every step), watched
to measure how long a save takes (from its folder appearing to its commit marker). Then each
trial starts the same run in a fresh directory and stops it:
  - KILL: SIGKILL to every rank and the launcher at once (a lost node), half the trials a
    random moment inside the save of a random step, half at a random moment of the run;
  - TERM: SIGTERM to the launcher with train.save_on_signal=true (a scheduler's preemption):
    it passes the signal to every rank, they agree on a step, commit it and end (status 143).
It then resumes with train.resume=RUN_DIR (from scratch when nothing was committed yet) and
compares with the reference: loss, lr and grad_norm of every step, the samples every rank
fed, and every tensor of the final checkpoint (bitwise). A kill "landed inside a save" when
the newest step folder had no commit marker afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
MARKER = "committed.json"


EXTRA: list[str] = []
"""The command line's extra overrides, given to every run."""
RESUME_WITH: list[str] = []
"""--resume-with: overrides only the resumed runs get (another layout: parallel.pp=3, ...)."""


def overrides(steps: int) -> list[str]:
    """The run every trial repeats: tiny model, pp=2, a checkpoint every step, samples recorded;
    every step planned from the data alone (plan.refit=false: from step 9 on, a run re-planned
    with its measured step times groups the samples by those times, which no two runs share)."""
    return [f"train.steps={steps}", "train.save_every=1", "train.keep_last=2", "train.record_samples=true",
            "plan.refit=false", *EXTRA]


def start(run_dir: Path, args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen([sys.executable, "-m", "mmpipe", "train", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def step_folders(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(((int(p.name[4:]), p) for p in root.iterdir() if p.name[4:].isdigit()), reverse=True)


def committed(run_dir: Path) -> list[int]:
    return [s for s, p in step_folders(run_dir) if (p / MARKER).is_file()]


def watch_saves(proc: subprocess.Popen, run_dir: Path) -> tuple[list[float], float]:
    """Seconds from each step folder's appearance to its commit marker, and from the first
    metrics line to the last commit, while `proc` runs."""
    seen: dict[int, float] = {}
    first = None
    done: dict[int, float] = {}
    while proc.poll() is None:
        now = time.monotonic()
        if first is None and trained(run_dir):
            first = now
        for s, p in step_folders(run_dir):
            seen.setdefault(s, now)
            if s not in done and (p / MARKER).is_file():
                done[s] = now
        time.sleep(0.002)
    last = max(done.values(), default=time.monotonic())
    return [done[s] - seen[s] for s in done if s in seen], last - (first or last)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 300) -> bool:
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if ready():
            return True
        time.sleep(0.002)
    return False


def trained(run_dir: Path) -> bool:
    """Whether the run has written its first step's metrics line (training is under way)."""
    path = run_dir / "metrics.jsonl"
    return path.is_file() and path.stat().st_size > 0


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensors(x, prefix: str = ""):
    if torch.is_tensor(x):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from tensors(v, f"{prefix}[{i}]")


def step_samples(run_dir: Path) -> dict[int, list[str]]:
    """Every step's sample keys over all recording ranks (each replica's first and last stage)."""
    out: dict[int, set[str]] = {}
    for f in run_dir.glob("samples_rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["step"], set()).update(k for mb in rec["micro_batches"] for k in mb)
    return {s: sorted(v) for s, v in out.items()}


def compare_across_layouts(run_dir: Path, ref: Path, steps: int) -> list[str]:
    """What differs between a run resumed on another layout and the reference, within fp32
    rounding (the reduction order differs between layouts): loss and grad_norm (relative 1e-5),
    lr exactly, the samples of every step, and every tensor of the final layer files."""
    diffs = []
    got, want = metrics(run_dir), metrics(ref)
    if [r["step"] for r in got] != list(range(1, steps + 1)):
        diffs.append(f"metrics steps {[r['step'] for r in got]}")
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > 1e-5 * abs(b[key]):
                diffs.append(f"step {a['step']} {key} {a[key]} vs {b[key]}")
        if a["lr"] != b["lr"]:
            diffs.append(f"step {a['step']} lr differs")
    if step_samples(run_dir) != step_samples(ref):
        diffs.append("the steps' samples differ")
    final = f"checkpoints/step{steps}"
    for f in sorted((ref / final).glob("layer_*-model_states.pt")):
        a = torch.load(f, map_location="cpu", weights_only=True)
        other = run_dir / final / f.name
        b = torch.load(other, map_location="cpu", weights_only=True) if other.is_file() else {}
        if a.keys() != b.keys() or any(float((a[k] - b[k]).abs().max()) > 1e-6 + 1e-4 * float(a[k].abs().max())
                                       for k in a):
            diffs.append(f"{final}/{f.name} differs")
    return diffs


def compare(run_dir: Path, ref: Path, steps: int) -> list[str]:
    """What differs between a resumed run and the reference (empty: it continued exactly)."""
    if RESUME_WITH:
        return compare_across_layouts(run_dir, ref, steps)
    diffs = []
    got, want = metrics(run_dir), metrics(ref)
    if [r["step"] for r in got] != list(range(1, steps + 1)):
        diffs.append(f"metrics steps {[r['step'] for r in got]}")
    for key in ("loss", "lr", "grad_norm"):
        if [r[key] for r in got] != [r[key] for r in want]:
            diffs.append(f"{key} differs")
    for f in sorted(ref.glob("samples_rank*.jsonl")):
        if not (run_dir / f.name).is_file() or (run_dir / f.name).read_text() != f.read_text():
            diffs.append(f"{f.name} differs")
    final = f"checkpoints/step{steps}"
    for f in sorted((ref / final).glob("*.pt")):
        if f.name.startswith("rng_"):
            continue
        a = dict(tensors(torch.load(f, map_location="cpu", weights_only=True)))
        other = run_dir / final / f.name
        b = dict(tensors(torch.load(other, map_location="cpu", weights_only=True))) if other.is_file() else {}
        if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
            diffs.append(f"{final}/{f.name} differs")
    return diffs


@dataclass(kw_only=True)
class Trial:
    """One interrupted and resumed run."""

    how: str
    """What stopped it: KILL in a save, KILL at any time, TERM."""
    stopped_at: float = 0.0
    """Seconds after the start."""
    in_save: bool = False
    """The newest step folder had no commit marker after the stop."""
    resumed_from: int = 0
    """Newest committed step when resuming (0: none, restarted)."""
    diffs: list[str] = field(default_factory=list)
    """What did not continue exactly."""
    notes: list[str] = field(default_factory=list)
    """Messages checked along the way."""


def trial(run_dir: Path, ref: Path, *, steps: int, how: str, save_s: float, run_s: float,
          rng: random.Random) -> Trial:
    t = Trial(how=how)
    shutil.rmtree(run_dir, ignore_errors=True)
    args = overrides(steps) + (["train.save_on_signal=true"] if how == "TERM" else [])
    t0 = time.monotonic()
    proc = start(run_dir, args)
    target = rng.randint(1, steps - 1)
    if how == "KILL-save":
        folder = run_dir / "checkpoints" / f"step{target}"
        wait_for(proc, lambda: folder.is_dir() and not (folder / MARKER).exists())
        time.sleep(rng.uniform(0, save_s))
    else:
        wait_for(proc, lambda: trained(run_dir))
        time.sleep(rng.uniform(0, run_s) if how == "KILL-any" else rng.uniform(0, run_s / 2))
    t.stopped_at = time.monotonic() - t0
    if how == "TERM":
        proc.send_signal(signal.SIGTERM)
        code, out = finish(proc)
        # what the user sees: the launcher echoes rank 0 while the ranks save and stop
        line = next((l for l in out.splitlines() if l.startswith("stopped on SIGTERM after step")), "")
        if line and code != 128 + signal.SIGTERM or not line and code != 0:
            t.diffs.append(f"the SIGTERM run exited {code}: {out[-600:]}")
        t.notes.append(line or "finished before the signal was seen")
    else:
        victims = ranks(proc) + ([psutil.Process(proc.pid)] if proc.poll() is None else [])
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        finish(proc)
    folders = step_folders(run_dir)
    t.in_save = bool(folders) and not (folders[0][1] / MARKER).is_file()
    done = committed(run_dir)
    t.resumed_from = done[0] if done else 0
    if t.resumed_from == steps:  # stopped after the last commit: nothing to resume
        t.diffs += compare(run_dir, ref, steps)
        return t
    resume = [f"train.resume={run_dir}"] if done else []
    code, out = finish(start(run_dir, overrides(steps) + RESUME_WITH + resume))
    if code != 0:
        t.diffs.append(f"resume exited {code}: {out[-600:]}")
        return t
    if done:
        said = f"resumed from step {t.resumed_from} (checkpoint {run_dir / 'checkpoints' / f'step{t.resumed_from}'})"
        if said not in out:
            t.diffs.append(f"resume did not say {said!r}")
        partial = [s for s, p in folders if s > t.resumed_from]
        for s in partial:
            if f"skipping {run_dir / 'checkpoints' / f'step{s}'}: not committed" not in out:
                t.diffs.append(f"no warning for the unfinished step{s}")
    t.diffs += compare(run_dir, ref, steps)
    kept = committed(run_dir)
    if kept[:2] != [steps, steps - 1] or len(kept) > 3:
        t.diffs.append(f"train.keep_last=2 kept {kept}")
    return t


def reference(run_dir: Path, steps: int) -> tuple[float, float]:
    """Run uninterrupted; return the median save time and the time from the first metrics line
    to the last commit, both seen from outside."""
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = start(run_dir, overrides(steps))
    saves, run_s = watch_saves(proc, run_dir)
    code, out = finish(proc)
    if code != 0:
        raise RuntimeError(f"reference run failed ({code}):\n{out[-3000:]}")
    return (sorted(saves)[len(saves) // 2] if saves else 0.3), run_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mmpipe-fault-injection"))
    ap.add_argument("--resume-with", action="append", default=[], metavar="KEY=VALUE",
                    help="an override only the resumed runs get (repeat it): resume on another layout, e.g. "
                         "--resume-with parallel.pp=3 --resume-with train.zero_stage=1; then runs compare within "
                         "fp32 rounding, not bit for bit")
    ap.add_argument("extra", nargs="*", help="KEY=VALUE overrides for every run")
    a = ap.parse_args()
    EXTRA[:] = a.extra
    RESUME_WITH[:] = a.resume_with
    rng = random.Random(a.seed)
    ref = a.out / "reference"
    save_s, run_s = reference(ref, a.steps)
    print(f"reference: {a.steps} steps, median save {save_s * 1000:.0f} ms (folder to commit marker, seen from "
          f"outside), {run_s:.1f} s from the first metrics line to the last commit", flush=True)
    results = []
    for i in range(a.trials):
        how = "TERM" if a.signal == "TERM" else ("KILL-save" if i % 2 == 0 else "KILL-any")
        t = trial(a.out / f"trial{i:02d}", ref, steps=a.steps, how=how, save_s=save_s, run_s=run_s, rng=rng)
        results.append(t)
        print(f"trial {i:2d} {t.how:9s} at {t.stopped_at:5.1f}s  in a save: {'yes' if t.in_save else 'no ':3s}  "
              f"resumed from step {t.resumed_from}  {'OK' if not t.diffs else 'FAILED: ' + '; '.join(t.diffs)}"
              + (f"  ({t.notes[0]})" if t.notes else ""),
              flush=True)
    ok = sum(not t.diffs for t in results)
    print(f"trials {len(results)} | stopped inside a save {sum(t.in_save for t in results)} | "
          f"restarted from scratch {sum(t.resumed_from == 0 for t in results)} | resumes exact {ok}/{len(results)}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
