"""Encoder placement (plan.encoders): stages, spread, nested and auto on every public trace x 7B preset.

    python benchmarks/bench_placement.py [--jobs 8] [--traces video-mix,omni-mix] [--presets omni-7b] [--frozen-towers]

For each trace in data/workloads and each 7B preset of docs/spec.md section 5: parallel.pp=4
parallel.dp=2, train.global_batch=128 x plan.steps=2 (256 samples), hardware=h100, the default
trainable set (all) and memory settings, policy data-aware. `mmpipe plan plan.encoders=auto`
plans the best plan of every candidate placement (planner.spread) and keeps the fastest; the table
prints each placement's mean simulated step time and efficiency (the spec's lower bound / the
simulated step), what auto picked, and the idle-free ceiling of the stages plan (the lower bound
over its mean predicted compute per rank, `predicted.busy_s`: the efficiency its work would reach
if no rank ever waited, so what filling bubbles can at most achieve). A markdown table on stdout
(pasted in docs/planner.md, Encoder placement).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmpipe.model.group import model_from_group  # noqa: E402
from mmpipe.model.spec import is_trainable, layer_names  # noqa: E402
from mmpipe.paths import model_folder  # noqa: E402
from mmpipe.planner.api import DEFAULT_HEADROOM, Placement, PlanProblem  # noqa: E402
from mmpipe.planner.command import PlanInput, PlanOutput, run_plan  # noqa: E402
from mmpipe.planner.hardware import hardware_from_dict  # noqa: E402

TRACES = ("llava-pretrain", "llava-sft", "vision-dynamic", "video-mix", "audio-caption", "omni-mix")
PRESETS = ("llava-1.5-7b", "llava-next-mistral-7b", "llava-onevision-qwen2-7b", "qwen2-vl-7b",
           "qwen3-vl-8b", "qwen2-audio-7b", "omni-7b")
PP, DP, BATCH, STEPS = 4, 2, 128, 2


def one(trace: str, preset: str, frozen_towers: bool = False) -> dict:
    model = model_from_group(yaml.safe_load((ROOT / "conf" / "model" / f"{preset}.yaml").read_text()),
                             resolve=model_folder).spec
    names = layer_names(model)
    trainable = (tuple(p for p in ("vision.proj", "audio.proj") if any(is_trainable(n, (p,)) for n in names))
                 + ("llm",) if frozen_towers else ("all",))
    hw = hardware_from_dict(yaml.safe_load((ROOT / "conf" / "hardware" / "h100.yaml").read_text()))
    try:
        problem = PlanProblem(model=model, hardware=hw, pp=PP, dp=DP, global_batch=BATCH, micro_batches=8,
                              trainable=trainable, policy="data-aware", memory_headroom=DEFAULT_HEADROOM,
                              placement=Placement.parse("auto", model))
        data = PlanInput(trace_path=str(ROOT / "data" / "workloads" / f"{trace}.jsonl"), steps=STEPS)
        plan = run_plan(problem, data, output=PlanOutput(quiet=True))
    except ValueError as err:
        return {"trace": trace, "preset": preset, "error": str(err).splitlines()[0]}
    pred = plan["predicted"]
    lower = sum(pred["lower_bound_s"]) / len(pred["lower_bound_s"])
    enc = pred.get("encoders", {})
    if "busy_s" not in pred:  # auto chose a placement off the stages: the stages' own plan
        staged = run_plan(dataclasses.replace(problem, placement=Placement.parse("stages", model)), data,
                          output=PlanOutput(quiet=True))
        pred["busy_s"] = staged["predicted"]["busy_s"]
    busy = sum(sum(map(sum, step)) / sum(map(len, step)) for step in pred["busy_s"]) / len(pred["busy_s"])
    return {"trace": trace, "preset": preset, "lower": lower, "times": enc.get("step_time_s", {}),
            "chosen": enc.get("chosen", "stages"), "ceiling": lower / busy}


def cell(t: float | None, lower: float) -> str:
    return "does not fit" if t is None else f"{t:.3f} s ({lower / t:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--frozen-towers", action="store_true",
                    help="train.trainable=[vision.proj, audio.proj, llm] (the towers frozen: nothing to reduce "
                         "or broadcast for a tower off the stages) instead of all")
    a = ap.parse_args()
    jobs = [(t, p, a.frozen_towers) for t in a.traces.split(",") for p in a.presets.split(",")]
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(one, *zip(*jobs)))
    print("| trace | preset | stages s (eff.) | spread s (eff.) | nested s (eff.) | auto s (eff.) | auto picked "
          "| idle-free ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    skipped = []
    for r in rows:
        if "error" in r:
            if " but model " in r["error"]:  # a medium the model has no tower for
                skipped.append(f"{r['trace']} x {r['preset']}")
            else:
                print(f"| {r['trace']} | {r['preset']} | n/a: {r['error'][:80]} | | | | | |")
            continue
        times, lower = r["times"], r["lower"]
        best = times.get(r["chosen"])
        print(f"| {r['trace']} | {r['preset']} | {cell(times.get('stages'), lower)} | "
              f"{cell(times.get('spread'), lower)} | {cell(times.get('nested'), lower)} | {cell(best, lower)} | "
              f"{r['chosen']} | {r['ceiling']:.2f} |")
    trained = "the projectors and the LLM (towers frozen)" if a.frozen_towers else "all"
    print(f"\npp={PP} dp={DP}, {BATCH * STEPS} samples ({STEPS} steps of {BATCH}), h100, trainable {trained}, "
          f"data-aware; efficiency = lower bound / simulated step time. Models with two towers also "
          f"compare the mixed placements (auto's pick may be one). Idle-free ceiling = lower bound / the "
          f"stages plan's mean compute per rank (predicted busy_s): the efficiency its work would reach "
          f"with no rank ever idle, which no placement of that work in the bubbles can pass.")
    if skipped:
        print(f"Not applicable (the trace has media the model has no tower for): {len(skipped)} pairs.")


if __name__ == "__main__":
    main()
