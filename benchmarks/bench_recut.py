"""plan.recut=auto measured: the same run with and without re-cutting, in alternated rounds.

    python benchmarks/bench_recut.py [--rounds 3] [--steps 16] [--every 4] [--out DIR] [KEY=VALUE ...]

Each round trains the tiny model twice on the same data and the same starting cut (by default
one that leaves stage 0 a single layer: 'plan.stages=[vision.embed:vision.embed,vision.block.0:llm.head]'),
once with plan.recut=off and once with plan.recut=auto (which order goes first alternates by
round). Both runs save every --every steps; the auto run re-cuts at its first checkpoint when
the planner predicts the gain. Printed per round and as medians: the re-cut (step, new cut,
predicted gain), and for both runs the samples/s over the same steps after the re-cut (the
median step time of the steps after the first one following the relaunch), and the loss at the
last step of each (the runs train the same samples: they must agree to fp32 rounding).
Extra KEY=VALUE overrides go to every run (e.g. data=curriculum, parallel.pp=3). The figures
depend on how busy the machine is; `uptime` is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD_CUT = "plan.stages=[vision.embed:vision.embed,vision.block.0:llm.head]"


def run(run_dir: Path, args: list[str]) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "mmpipe", "train", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mmpipe-bench-recut"))
    ap.add_argument("extra", nargs="*", help="KEY=VALUE overrides for every run (default: the bad cut)")
    a = ap.parse_args()
    common = [f"train.steps={a.steps}", f"train.save_every={a.every}", *(a.extra or [BAD_CUT])]
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    gains, keep_sps, cut_sps = [], [], []
    for r in range(a.rounds):
        order = ["off", "auto"] if r % 2 == 0 else ["auto", "off"]
        lines = {m: run(a.out / f"round{r}-{m}", [*common, f"plan.recut={m}"]) for m in order}
        cuts = [m for m in lines["auto"] if (m.get("recut") or {}).get("recut")]
        if not cuts:
            print(f"round {r}: no re-cut (the planner kept the cut at every checkpoint)", flush=True)
            continue
        k = cuts[0]["step"]
        later = range(k + 2, a.steps + 1)  # the first step after the relaunch includes its start-up
        sps = {}
        for m, ms in lines.items():
            by_step = {x["step"]: x for x in ms}
            sps[m] = statistics.median(by_step[s]["samples"] / by_step[s]["step_time"] for s in later)
        gain = sps["auto"] / sps["off"] - 1
        gains.append(gain)
        keep_sps.append(sps["off"])
        cut_sps.append(sps["auto"])
        rec = cuts[0]["recut"]
        predicted = f"{rec['predicted_gain']:+.1%}" if rec.get("predicted_gain") is not None else "old cut infeasible"
        print(f"round {r}: re-cut after step {k}: {rec['old']} -> {rec['new']} (predicted {predicted}); steps "
              f"{later.start}-{a.steps}: kept cut {sps['off']:.1f} samples/s, re-cut {sps['auto']:.1f} samples/s "
              f"({gain:+.1%}); last loss {lines['off'][-1]['loss']:.6f} vs {lines['auto'][-1]['loss']:.6f}",
              flush=True)
    if gains:
        print(f"median over {len(gains)} rounds: kept cut {statistics.median(keep_sps):.1f} samples/s, re-cut "
              f"{statistics.median(cut_sps):.1f} samples/s, measured gain {statistics.median(gains):+.1%}", flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
