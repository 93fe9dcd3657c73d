"""The runtime's entry to the planner: a user's stages checked against memory, and steps planned
without the memory limit when the user's stages are trained anyway."""

import dataclasses
import itertools
import re

import pytest

from mmpipe.model.geometry import features
from mmpipe.planner.api import StagePlan, StepPlanner, stage_memory_warnings
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

STAGES = StagePlan(stages=[(0, 33), (33, 45), (45, 55), (55, 65)])  # qwen2-vl-7b: 32 vision blocks on stage 0


def _setup(memory_gb):
    m = model("qwen2-vl-7b")
    feats = [features(m, meta) for meta in itertools.islice(read_trace(WORKLOADS / "vision-dynamic.jsonl"), 64)]
    common = dict(model=m, hardware=dataclasses.replace(hardware("h100"), memory_gb=memory_gb),
                  trainable=("all",), dp=1, stage_plan=STAGES, policy="data-aware", micro_batches=4)
    return feats, common


def test_stages_over_memory_get_one_warning_each_naming_stage_and_excess():
    feats, common = _setup(80)
    assert stage_memory_warnings(sample=feats, **common) == ()
    feats, common = _setup(60)
    warnings = stage_memory_warnings(sample=feats, **common)
    assert len(warnings) == 2
    for w, (s, span) in zip(warnings, [(0, "vision.embed..vision.block.31"), (1, "vision.proj..llm.block.9")]):
        assert re.fullmatch(rf"plan\.stages: stage {s} \({re.escape(span)}\) needs [\d.]+ GB under the cost model, "
                            r"[\d.]+ GB more than the 54 GB usable on hardware h100; it may run out of memory "
                            r"\(move layers off it, or enable recompute\)", w), w


def test_stages_whose_weights_alone_do_not_fit_are_one_warning():
    feats, common = _setup(40)
    assert stage_memory_warnings(sample=feats, **common) == (
        "plan.stages: stage 1 (vision.proj..llm.block.9) needs 46.7 GB for weights, gradients and optimizer "
        "states alone, more than the 36 GB usable (hardware.memory_gb=40); raise parallel.pp or parallel.dp, "
        "or train fewer layers (train.trainable)",)


def test_without_the_memory_limit_the_user_stages_still_get_every_sample_planned():
    feats, common = _setup(40)
    with pytest.raises(ValueError, match="for weights, gradients and optimizer states alone"):
        StepPlanner(**common).plan(feats)
    step = StepPlanner(memory_limit=False, **common).plan(feats)
    assert sorted(i for rep in step.replicas for mb in rep for i in mb) == list(range(64))
    assert step.step_time > 0 and len(step.busy[0]) == 4
