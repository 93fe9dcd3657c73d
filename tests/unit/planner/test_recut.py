"""plan.recut=auto's decision (planner/api.py: consider_recut): a cut that piles the vision tower on one stage
is re-cut, the planner's own cut is kept, the threshold holds a small gain back, and a cut planned
on images is re-cut when the steps move to video or audio."""

import dataclasses
import itertools

from mmpipe.model.geometry import features
from mmpipe.planner.api import PlanProblem, StagePlan, StepPlanner, consider_recut, describe_gain, plan_stages
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

PILED = StagePlan(stages=[(0, 33), (33, 45), (45, 55), (55, 65)])  # qwen2-vl-7b: 32 vision blocks on stage 0


def _args(current: StagePlan, threshold: float = 0.05) -> dict:
    m = model("qwen2-vl-7b")
    feats = [features(m, meta) for meta in itertools.islice(read_trace(WORKLOADS / "vision-dynamic.jsonl"), 64)]
    problem = PlanProblem(model=m, hardware=hardware("h100"), trainable=("all",), pp=4, dp=1, policy="data-aware",
                          micro_batches=4, replicas=1, precision=TrainingPrecision(), memory_headroom=0.08)
    return dict(problem=problem, current=current, steps=[feats[:32], feats[32:]], threshold=threshold)


def test_a_piled_up_cut_is_recut_and_the_planners_own_is_kept():
    choice = consider_recut(**_args(PILED))
    assert choice.recut and choice.candidate != PILED and choice.steps == 2
    args = _args(PILED)
    planner = StepPlanner(args["problem"], choice.candidate)
    assert choice.candidate_s == sum(planner.plan(s).step_time for s in args["steps"])  # what it says it priced
    assert choice.gain == choice.current_s / choice.candidate_s - 1 > 0.05
    record = choice.record()
    assert record["old"][0] == [0, 33] and record["new"] == [list(s) for s in choice.candidate.stages]
    kept = consider_recut(**_args(choice.candidate))
    assert not kept.recut and kept.gain == 0.0 and kept.candidate == choice.candidate
    held = consider_recut(**_args(PILED, threshold=choice.gain + 0.01))
    assert not held.recut and held.candidate == choice.candidate
    assert dataclasses.replace(held, threshold=choice.gain - 0.01).recut


def _steps(m, trace: str) -> list:
    feats = [features(m, meta) for meta in itertools.islice(read_trace(WORKLOADS / trace), 64)]
    return [feats[:32], feats[32:]]


def test_a_mixture_moving_from_images_to_video_or_audio_is_recut():
    """The cut planned on image steps, then steps of another mix: Qwen2.5-Omni moving to the omni mix
    (audio and video) is predicted faster on another cut by more than 5%; Qwen2-VL moving to video
    cannot hold the video samples on its image cut at all, and the re-cut says so."""
    for name, later, fits in (("qwen2.5-omni-7b", "omni-mix.jsonl", True), ("qwen2-vl-7b", "video-mix.jsonl", False)):
        m = model(name)
        problem = PlanProblem(model=m, hardware=hardware("h100"), trainable=("all",), pp=4, dp=1, policy="data-aware",
                              micro_batches=8, precision=TrainingPrecision(), memory_headroom=0.08)
        images = plan_stages(problem, [f for s in _steps(m, "llava-sft.jsonl") for f in s])
        choice = consider_recut(dataclasses.replace(problem, replicas=1), images, _steps(m, later), 0.05)
        record = choice.record()
        assert choice.recut and record["current_fits"] is fits, (name, record)
        assert (record["predicted_gain"] > 0.05) if fits else record["predicted_gain"] is None
        assert describe_gain(record).startswith("predicted +" if fits else "the current cut cannot hold")
