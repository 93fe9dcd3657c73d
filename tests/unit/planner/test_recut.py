"""plan.recut=auto's decision (planner/recut.py): a cut that piles the vision tower on one stage
is re-cut, the planner's own cut is kept, and the threshold holds a small gain back."""

import dataclasses
import itertools

from mmpipe.model.geometry import features
from mmpipe.planner.api import StagePlan, StepPlanner
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.recut import consider_recut
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

PILED = StagePlan(stages=[(0, 33), (33, 45), (45, 55), (55, 65)])  # qwen2-vl-7b: 32 vision blocks on stage 0


def _args(current: StagePlan, threshold: float = 0.05) -> dict:
    m = model("qwen2-vl-7b")
    feats = [features(m, meta) for meta in itertools.islice(read_trace(WORKLOADS / "vision-dynamic.jsonl"), 64)]
    return dict(model=m, hardware=hardware("h100"), trainable=("all",), pp=4, dp=1, current=current,
                steps=[feats[:32], feats[32:]], policy="data-aware", micro_batches=4, replicas=1,
                threshold=threshold, precision=TrainingPrecision(), memory_headroom=0.08)


def test_a_piled_up_cut_is_recut_and_the_planners_own_is_kept():
    choice = consider_recut(**_args(PILED))
    assert choice.recut and choice.candidate != PILED and choice.steps == 2
    args = _args(PILED)
    planner = StepPlanner(**{k: args[k] for k in ("model", "hardware", "trainable", "dp", "policy", "micro_batches",
                                                  "replicas", "precision", "memory_headroom")},
                          stage_plan=choice.candidate)
    assert choice.candidate_s == sum(planner.plan(s).step_time for s in args["steps"])  # what it says it priced
    assert choice.gain == choice.current_s / choice.candidate_s - 1 > 0.05
    record = choice.record()
    assert record["old"][0] == [0, 33] and record["new"] == [list(s) for s in choice.candidate.stages]
    kept = consider_recut(**_args(choice.candidate))
    assert not kept.recut and kept.gain == 0.0 and kept.candidate == choice.candidate
    held = consider_recut(**_args(PILED, threshold=choice.gain + 0.01))
    assert not held.recut and held.candidate == choice.candidate
    assert dataclasses.replace(held, threshold=choice.gain - 0.01).recut
