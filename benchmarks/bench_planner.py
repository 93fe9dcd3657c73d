"""Planner benchmark: plan quality against tuned baselines and the lower bound, and speed.

    python benchmarks/bench_planner.py [--trainable vision.proj,llm] [--hardware h100]

Part 1: every public workload x each model preset it fits, pp=4 dp=2 global_batch=256
micro_batches=8: mean simulated step time of the data-aware plan, of each tuned baseline,
the lower bound (total compute at the top of the efficiency curve / (pp*dp)) and the ratio.
Part 2: time of planning one step (balance_step, partition fixed) for N=256..4096 samples
on one core. Times are medians of repeated runs (3 per step, 5 per N); run it under
`taskset -c 1` on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from mmpipe.model.geometry import features  # noqa: E402
from mmpipe.model.group import model_from_group  # noqa: E402
from mmpipe.planner.balancer import balance_step  # noqa: E402
from mmpipe.planner.command import run_plan  # noqa: E402
from mmpipe.planner.cost import build_cost_model  # noqa: E402
from mmpipe.planner.hardware import hardware_from_dict  # noqa: E402
from mmpipe.planner.partition import data_aware_stages  # noqa: E402
from mmpipe.planner.samples import sample_table  # noqa: E402
from mmpipe.planner.stage_cost import stage_costs  # noqa: E402
from mmpipe.planner.trace import read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "mmpipe" / "data" / "workloads"
PAIRS = [("llava-pretrain", "llava-1.5-7b"), ("llava-pretrain", "qwen2-vl-7b"), ("llava-pretrain", "omni-7b"),
         ("llava-sft", "llava-1.5-7b"), ("llava-sft", "qwen2-vl-7b"), ("llava-sft", "omni-7b"),
         ("vision-dynamic", "llava-1.5-7b"), ("vision-dynamic", "qwen2-vl-7b"), ("vision-dynamic", "omni-7b"),
         ("audio-caption", "qwen2-audio-7b"), ("audio-caption", "omni-7b")]


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "mmpipe" / "conf" / kind / f"{name}.yaml").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainable", default="vision.proj,llm")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--workloads", default=str(WORKLOADS))
    ap.add_argument("--skip-scaling", action="store_true")
    args = ap.parse_args()
    hw = hardware_from_dict(load("hardware", args.hardware))
    wl = Path(args.workloads)
    print(f"pp=4 dp=2 global_batch=256 micro_batches=8 hardware={hw.name} trainable=[{args.trainable}]")
    print(f"{'workload':<15} {'model':<15} {'data-aware':>10} {'ds-default':>10} {'llava-grp':>10} "
          f"{'packed-ffd':>10} {'lower bd':>9} {'ratio':>6} {'beats all':>9} {'plan ms/step':>12}")
    for trace, mname in PAIRS:
        m = model_from_group(load("model", mname)).spec
        tr = tuple(args.trainable.split(","))
        if mname == "qwen2-audio-7b":
            tr = tuple(t.replace("vision", "audio") for t in tr)
        elif mname == "omni-7b" and "vision.proj" in tr:
            tr = tr + ("audio.proj",)
        plan = run_plan(model=m, hardware=hw, pp=4, dp=2, global_batch=256, micro_batches=8,
                        trainable=tr, policy="data-aware", trace_path=str(wl / f"{trace}.jsonl"),
                        out=None, steps=None, plot=None, quiet=True)
        pred = plan["predicted"]
        ours = float(np.mean(pred["step_time_s"]))
        base = {b: float(np.mean(v["step_time_s"])) if v["fits"] else float("inf")
                for b, v in pred["baselines"].items()}
        lb = float(np.mean(pred["lower_bound_s"]))
        ms = _time_steps(m, hw, tr, wl / f"{trace}.jsonl", plan)
        print(f"{trace:<15} {mname:<15} {ours:>9.3f}s {base['ds-default']:>9.3f}s "
              f"{base['llava-grouped']:>9.3f}s {base['packed-ffd']:>9.3f}s {lb:>8.3f}s "
              f"{ours / lb:>6.2f} {'yes' if all(ours <= v for v in base.values()) else 'NO':>9} "
              f"{ms:>12.1f}", flush=True)
    if not args.skip_scaling:
        scaling(hw, wl)


def _time_steps(m, hw, tr, trace, plan) -> float:
    feats = [features(m, x) for x in read_trace(trace)]
    cost = build_cost_model(model=m, hardware=hw, trainable=tr, dp=2)
    table = sample_table(feats)
    sc = stage_costs(cost, [tuple(s) for s in plan["stages"]], plan["recompute"])
    times = []
    for k in range(len(feats) // 256):
        rows = range(k * 256, (k + 1) * 256)
        times.append(float(np.median([_once(sc, table, rows) for _ in range(3)])))
    return 1e3 * float(np.mean(times))


def scaling(hw, wl: Path) -> None:
    print("\nplanning time of one step (balance_step), qwen2-vl-7b on vision-dynamic, pp=4 dp=2, one core")
    print(f"{'N':>6} {'ms':>8} {'ms per 256 samples':>19}")
    m = model_from_group(load("model", "qwen2-vl-7b")).spec
    base = [features(m, x) for x in read_trace(wl / "vision-dynamic.jsonl")]
    cost = build_cost_model(model=m, hardware=hw, trainable=("vision.proj", "llm"), dp=2)
    table0 = sample_table(base)
    sp = data_aware_stages(cost, table0, [list(range(256))], pp=4, dp=2, micro_batches=8)
    sc = stage_costs(cost, sp.stages, sp.recompute)
    for n in (256, 512, 1024, 2048, 4096):
        feats = (base * (n // len(base) + 1))[:n]
        table = sample_table(feats)
        best = float(np.median([_once(sc, table, range(n)) for _ in range(5)]))
        print(f"{n:>6} {best * 1e3:>8.1f} {best * 1e3 * 256 / n:>19.1f}", flush=True)


def _once(sc, table, rows) -> float:
    t0 = time.perf_counter()
    balance_step(sc, table, rows, dp=2, micro_batches=8)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
