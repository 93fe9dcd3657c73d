"""The GPU check of issue 31 in one table: run it on a GPU machine, paste the table into the README.

Each row is one `mmpipe train` launched as a user launches it (a subprocess, the shipped data),
read back from its metrics.jsonl:

- the README command with an empty kernel cache, then again with the cache the first run filled
  (first-step latency cold and warm);
- the 0.58 B configuration of issue 31 (the tiny model widened to a 2048-wide, 12-block decoder;
  579.7 M parameters) at 256 samples a step, bf16, one GPU, under the data-aware, packed-ffd and
  ds-default policies, and once in fp32;
- with two GPUs or more, the same bf16 run at pp=2; with four or more, pp=2 x dp=2 (NCCL).

Columns: steps done, the first step's time (compile included), the steady step (median of the
steps after the first two), samples/s over those steps, the model-FLOPs utilisation and the
fraction of the step's lower bound (medians, against the preset of the device the run described),
the optimizer's and the feed's share of a step, and the measured peak memory against the
planner's prediction (largest stage). The rows share one time budget (`--budget`, seconds); a row
the budget cannot hold is listed as skipped, never silently dropped.

Usage (from the repository root):
    python benchmarks/gpu_check.py                 # on a GPU machine: about 7 minutes
    python benchmarks/gpu_check.py --smoke         # on a CPU: the tiny model, a few steps (the
                                                   # script's own check; its figures mean nothing)
Writes OUT/gpu_check.json (default OUT: runs/gpu-check) beside each row's run folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE_AUDIO = "data.path='data/shards/train-{000000..000007}.tar'"
"""The shipped shards without the video mix (for a machine without PyAV)."""
WIDE = ["model.llm.hidden=2048", "model.llm.mlp=5632", "model.llm.heads=16", "model.llm.kv_heads=8",
        "model.llm.blocks=12", "model.vision.proj=[2048,2048]", "model.audio.proj=[2048]",
        "train.global_batch=256"]
"""Issue 31's 0.58 B configuration (579,745,920 parameters on one stage)."""
WARMUP = 2
"""Steps left out of the steady figures (the first compiles; the second may meet a new shape)."""


@dataclass(frozen=True)
class Row:
    name: str
    overrides: list[str]
    gpus: int = 0
    """GPUs the row needs (0: runs anywhere)."""
    cap_s: float = 150.0
    """The most this row may take of the budget."""


@dataclass
class Result:
    name: str
    status: str
    """ok | failed (exit N) | skipped (why) | timed out."""
    overrides: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    steps: int = 0
    first_step_s: float | None = None
    steady_step_s: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None
    bound_fraction: float | None = None
    optim_share: float | None = None
    feed_share: float | None = None
    mem_measured_gb: float | None = None
    mem_predicted_gb: float | None = None


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rows(*, smoke: bool, out: Path) -> list[Row]:
    data = [] if importlib.util.find_spec("av") else [IMAGE_AUDIO]  # no PyAV: no video shards
    cold = [f"launcher.cache_dir={out / 'kernel-cache'}", *data]
    if smoke:  # the tiny model on this machine: checks the script, not the device
        return [Row("README command, cold cache", [*cold, "train.steps=4"]),
                Row("README command, warm cache", [*cold, "train.steps=4"]),
                Row("tiny data-aware", [*data, "train.steps=4", "parallel.pp=1", "parallel.dp=1"]),
                Row("tiny packed-ffd", [*data, "train.steps=4", "parallel.pp=1", "parallel.dp=1",
                                        "plan.policy=packed-ffd"])]
    wide = [*data, *WIDE, "train.steps=10", f"launcher.cache_dir={out / 'kernel-cache'}"]
    one = ["parallel.pp=1", "parallel.dp=1"]
    return [
        Row("README command, cold cache", [*cold, "train.steps=8"], cap_s=90),
        Row("README command, warm cache", [*cold, "train.steps=8"], cap_s=60),
        Row("0.58B bf16 data-aware", [*wide, *one, "train.precision=bf16"], gpus=1),
        Row("0.58B bf16 packed-ffd", [*wide, *one, "train.precision=bf16", "plan.policy=packed-ffd"], gpus=1),
        Row("0.58B bf16 ds-default", [*wide, *one, "train.precision=bf16", "plan.policy=ds-default"], gpus=1),
        Row("0.58B fp32 data-aware", [*wide, *one, "train.precision=fp32"], gpus=1),
        Row("0.58B bf16 pp=2", [*wide, "parallel.pp=2", "parallel.dp=1", "train.precision=bf16"], gpus=2),
        Row("0.58B bf16 pp=2 x dp=2", [*wide, "parallel.pp=2", "parallel.dp=2", "train.precision=bf16"], gpus=4),
    ]


def summarise(row: Row, run_dir: Path, status: str, wall: float) -> Result:
    r = Result(name=row.name, status=status, overrides=row.overrides, wall_s=round(wall, 1))
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    r.steps = len(steps)
    if not steps:
        return r
    r.first_step_s = steps[0]["step_time"]
    steady = steps[WARMUP:] or steps[-1:]
    med = lambda key: statistics.median(s[key] for s in steady) if all(key in s for s in steady) else None  # noqa: E731
    r.steady_step_s = med("step_time")
    r.samples_per_s = sum(s["samples"] for s in steady) / sum(s["step_time"] for s in steady)
    r.mfu, r.bound_fraction = med("mfu"), med("bound_fraction")
    r.optim_share = statistics.median(s.get("optim_s", 0.0) / s["step_time"] for s in steady)
    r.feed_share = statistics.median(s.get("feed_s", 0.0) / s["step_time"] for s in steady)
    measured = [max(s.get("stage_peak_mem_gb") or [0.0]) for s in steps]
    predicted = [max(s.get("predicted_peak_mem_gb") or [0.0]) for s in steps]
    r.mem_measured_gb, r.mem_predicted_gb = max(measured), max(predicted)
    return r


def run_row(row: Row, out: Path, left_s: float) -> Result:
    run_dir = out / re.sub(r"[^A-Za-z0-9.=-]+", "-", row.name).strip("-")  # a name Hydra's grammar takes
    cmd = [sys.executable, "-m", "mmpipe", "train", *row.overrides, f"hydra.run.dir={run_dir}"]
    log = out / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=min(row.cap_s, left_s)).returncode
        status = "ok" if code == 0 else f"failed (exit {code}; see {log})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {min(row.cap_s, left_s):.0f} s (figures of the steps done; see {log})"
    return summarise(row, run_dir, status, time.perf_counter() - t0)


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[Result], device: str) -> str:
    head = ("| run | status | steps | first step s | steady step s | samples/s | MFU | bound | optimizer | feed "
            "| memory GB measured / predicted |")
    lines = [f"GPU check on {device}, {time.strftime('%Y-%m-%d')}", "", head, "|" + "---|" * 11]
    for r in results:
        mem = f"{fmt(r.mem_measured_gb, '.1f')} / {fmt(r.mem_predicted_gb, '.1f')}" if r.steps else "-"
        lines.append(f"| {r.name} | {r.status} | {r.steps} | {fmt(r.first_step_s, '.1f')} | "
                     f"{fmt(r.steady_step_s, '.3f')} | {fmt(r.samples_per_s, '.1f')} | {fmt(r.mfu, '.1%')} | "
                     f"{fmt(r.bound_fraction, '.1%')} | {fmt(r.optim_share, '.1%')} | {fmt(r.feed_share, '.1%')} | "
                     f"{mem} |")
    by = {r.name: r for r in results}
    ratios = []
    for base in ("packed-ffd", "ds-default"):
        a, b = by.get("0.58B bf16 data-aware"), by.get(f"0.58B bf16 {base}")
        if a and b and a.samples_per_s and b.samples_per_s:
            ratios.append(f"data-aware / {base}: {a.samples_per_s / b.samples_per_s:.2f}x samples/s")
    if ratios:
        lines += ["", "; ".join(ratios)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=450.0, help="seconds shared by the rows (default 450)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on a CPU: checks the script only")
    args = ap.parse_args()
    gpus = gpu_count()
    if not gpus and not args.smoke:
        print("gpu_check: no CUDA device (use --smoke to check the script on a CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = "CPU (smoke: figures mean nothing)" if args.smoke else f"{gpus} x {_gpu_name()}"
    deadline = time.perf_counter() + args.budget
    results = []
    for row in rows(smoke=args.smoke, out=args.out):
        left = deadline - time.perf_counter()
        if row.gpus > gpus:
            results.append(Result(name=row.name, status=f"skipped (needs {row.gpus} GPUs, {gpus} here)"))
        elif left < 20:
            results.append(Result(name=row.name, status=f"skipped ({max(left, 0):.0f} s of the budget left)"))
        else:
            results.append(run_row(row, args.out, left))
        print(f"gpu_check: {row.name}: {results[-1].status}", flush=True)
    text = table(results, device)
    print(text)
    (args.out / "gpu_check.json").write_text(json.dumps({"device": device, "rows": [asdict(r) for r in results]},
                                                        indent=2) + "\n")
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in results) else 1


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
