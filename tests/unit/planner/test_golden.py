"""The planner's output on fixed public traces, pinned: stage ranges and recompute
(`plan_stages`), every replica's micro-batches of two steps (`plan_step`) and the predicted
step time and per-stage busy time of each replica. A change that moves any of these fails
here, so a refactor that claims "no behaviour change" is checked against what users get.

Regenerate only when a plan is meant to change (and say why in the commit):

    MMPIPE_REGEN_GOLDEN=1 python -m pytest -q tests/unit/planner/test_golden.py
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest

from mmpipe.model.geometry import features
from mmpipe.planner.api import PACKED_POLICIES, PlanProblem, StagePlan, StepPlanner, plan_stages, plan_step
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.samples import sample_table
from mmpipe.planner.stage_cost import stage_costs
from mmpipe.planner.step import evaluate_step
from mmpipe.planner.trace import read_trace

from .helpers import ROOT, WORKLOADS, hardware, model

GOLDEN = ROOT / "tests" / "unit" / "planner" / "golden" / "plans.json"
STEP = 64
"""Samples per step; the first 2 steps of each trace are planned."""
CASES = {
    # id: (model, workload, trainable, pp, dp, policy, memory_gb)
    "llava-pretrain-data-aware": ("llava-1.5-7b", "llava-pretrain", ("vision.proj", "llm"), 2, 1,
                                  "data-aware", 80),
    "vision-dynamic-data-aware-dp2": ("qwen2-vl-7b", "vision-dynamic", ("all",), 4, 2, "data-aware", 80),
    # memory binds: recompute on, in-flight windows decide the packing
    "vision-dynamic-data-aware-30gb": ("qwen2-vl-7b", "vision-dynamic", ("all",), 4, 2, "data-aware", 30),
    "audio-caption-data-aware-dp2": ("qwen2-audio-7b", "audio-caption", ("audio.proj", "llm"), 2, 2,
                                     "data-aware", 80),
    "llava-sft-ds-default": ("omni-7b", "llava-sft", ("vision.proj", "llm", "audio.proj"), 4, 2,
                             "ds-default", 80),
    "vision-dynamic-llava-grouped": ("llava-1.5-7b", "vision-dynamic", ("all",), 2, 1, "llava-grouped", 80),
    "audio-caption-packed-ffd": ("omni-7b", "audio-caption", ("all",), 4, 2, "packed-ffd", 80),
}


def _r(x: float) -> float:
    """Nine significant digits: what survives a change of summation order, not of plan."""
    return float(f"{x:.9g}")


def _plan(case: str) -> dict:
    mname, workload, trainable, pp, dp, policy, memory_gb = CASES[case]
    m = model(mname)
    hw = dataclasses.replace(hardware("h100"), memory_gb=memory_gb)
    metas = itertools.islice(read_trace(WORKLOADS / f"{workload}.jsonl"), 2 * STEP)
    feats = [features(m, meta) for meta in metas]
    problem = PlanProblem(model=m, hardware=hw, pp=pp, dp=dp, trainable=trainable, micro_batches=8, policy=policy)
    sp = plan_stages(problem, feats)
    cost = build_cost_model(model=m, hardware=hw, trainable=trainable, dp=dp)
    sc = stage_costs(cost, sp.stages, sp.recompute)
    steps = []
    for k in range(2):
        step = feats[k * STEP:(k + 1) * STEP]
        reps = plan_step(problem, sp, step)
        ev = evaluate_step(sc, sample_table(step), reps, packing=policy in PACKED_POLICIES)
        steps.append({"replicas": reps, "step_time": _r(ev.step_time),
                      "busy": [[_r(b) for b in r.busy] if r else [] for r in ev.replicas]})
    return {"stages": [list(s) for s in sp.stages], "recompute": list(sp.recompute), "steps": steps}


def test_regenerate():
    if not os.environ.get("MMPIPE_REGEN_GOLDEN"):
        pytest.skip("set MMPIPE_REGEN_GOLDEN=1 to rewrite the golden plans")
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({case: _plan(case) for case in CASES}, separators=(",", ":")) + "\n")


@pytest.mark.parametrize("case", list(CASES))
def test_plan_unchanged(case):
    want = json.loads(GOLDEN.read_text())[case]
    got = json.loads(json.dumps(_plan(case)))  # tuples -> lists, as stored
    assert got["stages"] == want["stages"] and got["recompute"] == want["recompute"]
    for k, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        assert g["replicas"] == w["replicas"], f"step {k}: micro-batches differ"
        assert g["step_time"] == w["step_time"], f"step {k}"
        assert g["busy"] == w["busy"], f"step {k}"


@pytest.mark.parametrize("case", list(CASES))
def test_step_planner_gives_the_pinned_steps(case):
    """The runtime's entry (`StepPlanner`, built once) plans and predicts the pinned steps."""
    want = json.loads(GOLDEN.read_text())[case]
    mname, workload, trainable, pp, dp, policy, memory_gb = CASES[case]
    m = model(mname)
    metas = itertools.islice(read_trace(WORKLOADS / f"{workload}.jsonl"), 2 * STEP)
    feats = [features(m, meta) for meta in metas]
    problem = PlanProblem(model=m, hardware=dataclasses.replace(hardware("h100"), memory_gb=memory_gb),
                          trainable=trainable, dp=dp, policy=policy, micro_batches=8)
    planner = StepPlanner(problem, StagePlan(stages=want["stages"], recompute=want["recompute"]))
    for k, w in enumerate(want["steps"]):
        step = planner.plan(feats[k * STEP:(k + 1) * STEP])
        assert step.replicas == w["replicas"], f"step {k}"
        assert _r(step.step_time) == w["step_time"]
        assert [[_r(b) for b in busy] for busy in step.busy] == w["busy"]
