"""Planner benchmark: plan quality against tuned baselines and the lower bound, the layout
search, and speed.

    python benchmarks/bench_planner.py [--trainable vision.proj,llm] [--hardware h100]
        [--headroom 0.08] [--skip-layouts] [--skip-scaling] [--pairs omni-mix:qwen2.5-omni-7b,...]

Part 1 (efficiency table): every public workload x each model preset it fits, pp=4 dp=2
global_batch=256 micro_batches=8, plan.memory_headroom in force: mean simulated step time of
the data-aware plan and of each tuned baseline, the lower bound (total compute at the top of
the efficiency curve / (pp*dp)), the ratio and the efficiency (bound / step time; the target
is 0.78). Then, per pair, where the ratio comes from (each a factor of it): `split` = the
busiest stage's marginal work over the mean (layer granularity and memory), `floor` = the
least `split` any contiguous cut can have, `fixed` = the busiest stage's busy time over its
marginal work (per-micro-batch overhead and the small-micro-batch efficiency loss), `idle` =
step time over that busy time (bubble), and the layout `parallel.devices=8
parallel.pp=auto parallel.dp=auto` chooses, with its efficiency.
Part 2: CPU time of the layout search (`choose_layout`) for N = 8, 16, 64 devices on a
256-sample step. Part 3: time of planning one step (balance_step, partition fixed) for
N=256..4096 samples. Run it under `taskset -c 1` on a shared machine.
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
from mmpipe.planner.api import PlanProblem, choose_layout  # noqa: E402
from mmpipe.planner.balancer import balance_step  # noqa: E402
from mmpipe.planner.command import PlanInput, PlanOutput, run_plan  # noqa: E402
from mmpipe.planner.cost import build_cost_model  # noqa: E402
from mmpipe.planner.hardware import hardware_from_dict  # noqa: E402
from mmpipe.planner.layout import min_max_cut  # noqa: E402
from mmpipe.planner.partition import data_aware_stages  # noqa: E402
from mmpipe.planner.samples import sample_table  # noqa: E402
from mmpipe.planner.stage_cost import sample_work, stage_costs  # noqa: E402
from mmpipe.planner.step import evaluate_step  # noqa: E402
from mmpipe.planner.trace import read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "data" / "workloads"
PAIRS = [("llava-pretrain", "llava-1.5-7b"), ("llava-pretrain", "qwen2-vl-7b"), ("llava-pretrain", "omni-7b"),
         ("llava-sft", "llava-1.5-7b"), ("llava-sft", "qwen2-vl-7b"), ("llava-sft", "omni-7b"),
         ("vision-dynamic", "llava-1.5-7b"), ("vision-dynamic", "qwen2-vl-7b"), ("vision-dynamic", "omni-7b"),
         ("audio-caption", "qwen2-audio-7b"), ("audio-caption", "omni-7b"),
         ("llava-pretrain", "llava-onevision-qwen2-7b"), ("llava-sft", "llava-onevision-qwen2-7b"),
         ("vision-dynamic", "llava-onevision-qwen2-7b"), ("llava-pretrain", "llava-next-mistral-7b"),
         ("llava-sft", "llava-next-mistral-7b"), ("vision-dynamic", "llava-next-mistral-7b"),
         ("llava-pretrain", "qwen3-vl-8b"), ("llava-sft", "qwen3-vl-8b"), ("vision-dynamic", "qwen3-vl-8b"),
         ("llava-pretrain", "qwen2.5-vl-7b"), ("llava-sft", "qwen2.5-vl-7b"), ("vision-dynamic", "qwen2.5-vl-7b"),
         ("vision-dynamic", "qwen2.5-omni-7b"), ("audio-caption", "qwen2.5-omni-7b"), ("omni-mix", "qwen2.5-omni-7b"),
         ("omni-mix", "omni-7b"), ("video-mix", "qwen2-vl-7b"), ("video-mix", "llava-onevision-qwen2-7b"),
         ("video-mix", "qwen2.5-vl-7b"), ("video-mix", "qwen2.5-omni-7b")]
TARGET = 0.78
"""Efficiency (lower bound / step time) the data-aware plan is meant to reach."""


def load(kind: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / kind / f"{name}.yaml").read_text())


def trainable_for(mname: str, trainable: str) -> tuple[str, ...]:
    tr = tuple(trainable.split(","))
    if mname == "qwen2-audio-7b":
        tr = tuple(t.replace("vision", "audio") for t in tr)
    elif mname in ("omni-7b", "qwen2.5-omni-7b") and "vision.proj" in tr:
        tr = tr + ("audio.proj",)
    return tr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainable", default="vision.proj,llm")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--headroom", type=float, default=0.08)
    ap.add_argument("--workloads", default=str(WORKLOADS))
    ap.add_argument("--skip-layouts", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--pairs", default="", help="only these workload:model pairs, comma-separated")
    args = ap.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else PAIRS
    hw = hardware_from_dict(load("hardware", args.hardware))
    wl = Path(args.workloads)
    print(f"pp=4 dp=2 global_batch=256 micro_batches=8 hardware={hw.name} trainable=[{args.trainable}] "
          f"memory_headroom={args.headroom}")
    print(f"{'workload':<15} {'model':<24} {'data-aware':>10} {'ds-default':>10} {'llava-grp':>10} "
          f"{'packed-ffd':>10} {'lower bd':>9} {'ratio':>6} {'eff.':>5} {'beats all':>9} {'plan ms/step':>12}")
    rows = []
    for trace, mname in pairs:
        m = model_from_group(load("model", mname)).spec
        tr = trainable_for(mname, args.trainable)
        problem = PlanProblem(model=m, hardware=hw, pp=4, dp=2, global_batch=256, micro_batches=8,
                              trainable=tr, policy="data-aware", memory_headroom=args.headroom)
        plan = run_plan(problem, PlanInput(trace_path=str(wl / f"{trace}.jsonl")), output=PlanOutput(quiet=True))
        pred = plan["predicted"]
        ours = float(np.mean(pred["step_time_s"]))
        base = {b: float(np.mean(v["step_time_s"])) if v["fits"] else float("inf")
                for b, v in pred["baselines"].items()}
        lb = float(np.mean(pred["lower_bound_s"]))
        ms = _time_steps(m, hw, tr, wl / f"{trace}.jsonl", plan, args.headroom)
        print(f"{trace:<15} {mname:<24} {ours:>9.3f}s {base['ds-default']:>9.3f}s "
              f"{base['llava-grouped']:>9.3f}s {base['packed-ffd']:>9.3f}s {lb:>8.3f}s "
              f"{ours / lb:>6.3f} {lb / ours:>5.3f} {'yes' if all(ours <= v for v in base.values()) else 'NO':>9} "
              f"{ms:>12.1f}", flush=True)
        rows.append((trace, mname, tr, plan))
    print("\nwhere the ratio comes from (ratio = split x fixed x idle; floor: least split of any cut), and "
          "parallel.devices=8 with pp=auto dp=auto:")
    print(f"{'workload':<15} {'model':<24} {'ratio':>6} {'split':>6} {'floor':>6} {'fixed':>6} {'idle':>6} "
          f"{'m/replica':>9} {'auto':>5} {'eff.':>5} {'search s':>8}")
    for trace, mname, tr, plan in rows:
        _explain(trace, mname, tr, plan, hw, wl, args.headroom, layouts=not args.skip_layouts)
    if not args.skip_layouts:
        layout_timing(hw, wl, args.headroom)
    if not args.skip_scaling:
        scaling(hw, wl)


def _explain(trace, mname, tr, plan, hw, wl: Path, headroom: float, *, layouts: bool) -> None:
    """The factors of the plan's ratio, averaged over its steps (slowest replica)."""
    m = model_from_group(load("model", mname)).spec
    feats = [features(m, x) for x in read_trace(wl / f"{trace}.jsonl")]
    table = sample_table(feats)
    cost = build_cost_model(model=m, hardware=hw, trainable=tr, dp=2, memory_headroom=headroom)
    sc = stage_costs(cost, [tuple(s) for s in plan["stages"]], plan["recompute"])
    L = len(cost.layers)
    single = stage_costs(cost, [(i, i + 1) for i in range(L)], [False] * L)
    split, floor, fixed, idle, mbs = [], [], [], [], []
    for k, step in enumerate(plan["steps"]):
        ev = evaluate_step(sc, table, step["replicas"], packing=True)
        r = ev.slowest
        rows = [i for mb in step["replicas"][r] for i in mb]
        work, _, _ = sample_work(sc, table.rows(rows))
        per_stage = work.sum(axis=0)
        s = int(np.argmax(ev.replicas[r].busy))
        lb = plan["predicted"]["lower_bound_s"][k]
        split.append(per_stage.max() / lb)
        per_layer, _, _ = sample_work(single, table.rows(rows))
        floor.append(min_max_cut(per_layer.sum(axis=0).tolist(), sc.pp) / lb)
        fixed.append(ev.replicas[r].busy[s] / per_stage.max())
        idle.append(ev.step_time / ev.replicas[r].busy[s])
        mbs.append(len(step["replicas"][r]))
    ratio = float(np.mean(plan["predicted"]["step_time_s"]) / np.mean(plan["predicted"]["lower_bound_s"]))
    auto = eff = secs = "-"
    if layouts:
        t0 = time.process_time()
        choice = choose_layout(PlanProblem(model=m, hardware=hw, trainable=tr, devices=8, global_batch=256,
                                           micro_batches=8, memory_headroom=headroom), feats[:512])
        secs = f"{time.process_time() - t0:.2f}"
        auto, eff = f"{choice.best.pp}x{choice.best.dp}", f"{choice.best.efficiency:.3f}"
    print(f"{trace:<15} {mname:<24} {ratio:>6.3f} {np.mean(split):>6.3f} {np.mean(floor):>6.3f} "
          f"{np.mean(fixed):>6.3f} {np.mean(idle):>6.3f} {np.mean(mbs):>9.1f} {auto:>5} {eff:>5} {secs:>8}",
          flush=True)


def layout_timing(hw, wl: Path, headroom: float) -> None:
    print("\nlayout search (choose_layout: bound, estimate every layout, plan the best in full), "
          "256-sample steps, 2 probe steps, CPU seconds")
    print(f"{'workload':<15} {'model':<12} {'trainable':<16} {'N':>3} {'search s':>8} {'chosen':>7} {'eff.':>6} "
          f"{'planned':>7} {'estimated':>9} {'bounded':>7}")
    for trace, mname, trainable in (("vision-dynamic", "qwen2-vl-7b", "vision.proj,llm"),
                                    ("llava-pretrain", "qwen2-vl-7b", "all"),
                                    ("audio-caption", "omni-7b", "all")):
        m = model_from_group(load("model", mname)).spec
        tr = trainable_for(mname, trainable)
        feats = [features(m, x) for x in read_trace(wl / f"{trace}.jsonl")][:512]
        for n in (8, 16, 64):
            t0 = time.process_time()
            choice = choose_layout(PlanProblem(model=m, hardware=hw, trainable=tr, devices=n, global_batch=256,
                                               micro_batches=1, memory_headroom=headroom), feats)
            secs = time.process_time() - t0
            how = [x.how for x in choice.layouts]
            print(f"{trace:<15} {mname:<12} {trainable:<16} {n:>3} {secs:>8.2f} "
                  f"{f'{choice.best.pp}x{choice.best.dp}':>7} {choice.best.efficiency:>6.3f} "
                  f"{how.count('planned'):>7} {how.count('estimated'):>9} {how.count('bounded'):>7}", flush=True)


def _time_steps(m, hw, tr, trace, plan, headroom: float) -> float:
    feats = [features(m, x) for x in read_trace(trace)]
    cost = build_cost_model(model=m, hardware=hw, trainable=tr, dp=2, memory_headroom=headroom)
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
    """CPU seconds of one balance_step (steadier than wall time on a shared machine)."""
    t0 = time.process_time()
    balance_step(sc, table, rows, dp=2, micro_batches=8)
    return time.process_time() - t0


if __name__ == "__main__":
    sys.exit(main())
