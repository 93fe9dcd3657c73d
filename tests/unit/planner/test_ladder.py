"""plan.ladder: packed micro-batches padded to a few lengths, and the padding priced."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from mmpipe.model.geometry import features
from mmpipe.planner.api import Ladder, PlanProblem, StagePlan, StepPlanner, resolve_ladder
from mmpipe.planner.bins import BinCosts
from mmpipe.planner.ladder import FLEX_BLOCK, MAX_RUNGS, choose_ladder, padded_streams, parse_ladder
from mmpipe.planner.samples import sample_table
from mmpipe.planner.stage_cost import sample_work, stage_costs
from mmpipe.planner.step import evaluate_step, mb_costs
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

STAGES = StagePlan(stages=[(0, 40), (40, 70), (70, 85), (85, 99)])  # omni-7b: the towers on stages 0-1
PER_STEP = 32


@pytest.fixture(scope="module")
def run():
    m = model("omni-7b")
    feats = [features(m, meta) for meta in itertools.islice(read_trace(WORKLOADS / "omni-mix.jsonl"), 4 * PER_STEP)]
    steps = [feats[i:i + PER_STEP] for i in range(0, len(feats), PER_STEP)]
    problem = PlanProblem(model=m, hardware=hardware("h100"), trainable=("vision.proj", "llm", "audio.proj"), dp=1,
                          policy="data-aware", micro_batches=4)
    return steps, problem


def _llm_lengths(step, plan) -> list[int]:
    return [sum(step[i].llm_len for i in mb) for rep in plan.replicas for mb in rep]


def test_auto_rungs_are_the_block_multiples_that_pad_the_rows_least():
    rows = [130, 200, 250, 700, 760, 1000, 2900, 3000]
    ladder = choose_ladder(rows, count=3)
    assert all(r % FLEX_BLOCK == 0 for r in ladder.rungs) and ladder.rungs[-1] == 3072  # the longest, rounded up

    def padding(rungs):
        return sum(min(r for r in rungs if r >= n) - n for n in rows)

    blocks = range(FLEX_BLOCK, 3073, FLEX_BLOCK)
    least = min(padding(c + (3072,)) for k in range(3) for c in itertools.combinations(blocks, k))
    assert padding(ladder.rungs) == least
    assert len(choose_ladder(range(100, 20000, 37)).rungs) == MAX_RUNGS
    assert ladder.pad_to(1) == ladder.rungs[0] and ladder.pad_to(3073) == 3840  # past the top: x1.25, in blocks


def test_a_run_of_planned_steps_uses_at_most_the_ladders_lengths(run):
    """Without a ladder nearly every micro-batch has its own length; with the auto ladder
    (chosen, as a run does, on its first steps) the steps' packed rows take at most its rungs."""
    steps, problem = run
    ladder = resolve_ladder(problem, STAGES, "auto", compiles=True, steps=steps)
    assert ladder is not None and len(ladder.rungs) <= MAX_RUNGS
    plain, padded = StepPlanner(problem, STAGES), StepPlanner(problem, STAGES, ladder=ladder)
    unladdered, laddered = set(), set()
    for step in steps:
        p, q = plain.plan(step), padded.plan(step)
        unladdered |= set(_llm_lengths(step, p))
        laddered |= set(q.padded[0])
        assert all(n <= r for n, r in zip(_llm_lengths(step, q), q.padded[0]))
        assert q.pad_tokens[0] == sum(q.padded[0]) - sum(_llm_lengths(step, q)) > 0  # the step counts its padding
    print(f"\ndistinct packed lengths over {len(steps)} steps: {len(unladdered)} without a ladder, "
          f"{len(laddered)} with rungs {ladder.text()}")
    assert laddered <= set(ladder.rungs) and len(unladdered) > 3 * len(laddered)


def test_a_micro_batchs_predicted_cost_rises_with_its_padding(run):
    steps, problem = run
    table = sample_table(steps[0])
    mb = [list(range(8))]
    n = int(table.tokens[mb[0], 4].sum())
    sc = stage_costs(StepPlanner(problem, STAGES).cost, STAGES.stages)
    costs = [mb_costs(dataclasses.replace(sc, ladder=None if rung is None else Ladder((rung,))), table, mb,
                      packing=True) for rung in (None, -(-n // 128) * 128, 2 * n // 128 * 128 + 128)]
    llm = slice(2, 4)  # the stages that run LLM blocks
    fwd = [float(c.fwd[llm].sum()) for c in costs]
    act = [float(c.act[llm].sum()) for c in costs]
    assert fwd[0] < fwd[1] < fwd[2] and act[0] < act[1] < act[2]
    assert float(costs[2].fwd[0].sum()) == pytest.approx(float(costs[0].fwd[0].sum()))  # the tower: no padding
    # the balancer's searches price a grouping the same way (its makespan and its memory)
    spans, peaks = [], []
    for rung in (None, -(-n // 128) * 128, 2 * n // 128 * 128 + 128):
        padded = dataclasses.replace(sc, ladder=None if rung is None else Ladder((rung,)))
        bins = BinCosts(padded, table.tokens, table.squares, *sample_work(padded, table), padded.static * 0 + 1e15)
        spans.append(bins.makespan(mb))
        peaks.append(float(bins.bytes(mb)[0][llm].sum()))
    assert spans[0] < spans[1] < spans[2] and peaks[0] < peaks[1] < peaks[2]


def test_the_planned_step_time_includes_the_padding(run):
    steps, problem = run
    plain = StepPlanner(problem, STAGES).plan(steps[0])
    coarse = StepPlanner(problem, STAGES, ladder=Ladder((6400,)))  # every row padded to 6400 tokens
    same = coarse.plan(steps[0])
    assert same.step_time > plain.step_time and set(same.padded[0]) == {6400}
    unpadded = evaluate_step(stage_costs(coarse.cost, STAGES.stages), sample_table(steps[0]), same.replicas,
                             packing=True)  # the same micro-batches priced without their padding
    assert same.step_time > unpadded.step_time * 1.05


def test_the_padding_is_one_more_attention_segment_of_the_llm_stream():
    T = np.array([[50.0, 10.0, 0.0, 0.0, 700.0, 50.0]])
    S2 = np.array([[2500.0, 100.0, 0.0, 0.0, 300.0 ** 2 + 400.0 ** 2, 2500.0]])
    T2, S22 = padded_streams(Ladder((1024,)), T, S2)
    assert T2.tolist() == [[50.0, 10.0, 0.0, 0.0, 1024.0, 50.0]]
    assert S22.tolist() == [[2500.0, 100.0, 0.0, 0.0, 300.0 ** 2 + 400.0 ** 2 + 324.0 ** 2, 2500.0]]


def test_auto_pads_only_where_the_kernel_compiles_and_packed_policies_only(run):
    steps, problem = run
    assert resolve_ladder(problem, STAGES, "auto", compiles=False, steps=steps) is None  # CPU SDPA, flash-attn
    assert resolve_ladder(problem, STAGES, "off", compiles=True, steps=steps) is None
    assert resolve_ladder(problem, STAGES, [512, 1024], compiles=False, steps=()) == Ladder((512, 1024))
    assert resolve_ladder(dataclasses.replace(problem, policy="ds-default"), STAGES, "auto", compiles=True,
                          steps=steps) is None
    assert StepPlanner(problem, STAGES).plan(steps[0]).padded == ()  # no ladder: plans as before


@pytest.mark.parametrize("value, says", [
    ("of", "plan.ladder='of' is unknown; use auto, off, or rising multiples of 128, e.g. plan.ladder=[512,1024,2048]"),
    ([100, 600], "plan.ladder=[100,600] has a rung that is not a positive multiple of 128 (FlexAttention's block); "
                 "use e.g. plan.ladder=[128,640]"),
    ([1024, 512], "plan.ladder=[1024,512] must rise; use plan.ladder=[512,1024]"),
    (list(range(128, 128 * 10, 128)), "plan.ladder=[128,256,384,512,640,768,896,1024,1152] has 9 rungs, more than 8 "
                                      "(each is a kernel compile); give at most 8, or plan.ladder=auto"),
])
def test_a_bad_ladder_is_one_line_naming_key_value_and_fix(value, says):
    with pytest.raises(ValueError) as err:
        parse_ladder(value)
    assert str(err.value) == says


def test_pad_array_matches_pad_to():
    ladder = Ladder((256, 640, 1536))
    n = np.array([0.0, 1.0, 256.0, 257.0, 1536.0, 1537.0, 5000.0])
    assert ladder.pad_array(n).tolist() == [0.0] + [float(ladder.pad_to(int(x))) for x in n[1:]]
