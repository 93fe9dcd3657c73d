"""The spread encoder placement (plan.encoders): config values, pricing, shares, auto, plan JSON."""

import dataclasses
import itertools
import json
import math

import pytest

from mmpipe.config import PlanConfig
from mmpipe.model.geometry import features
from mmpipe.planner.api import DEFAULT_HEADROOM, Placement, PlanProblem, StepPlanner, choose_encoders
from mmpipe.planner.command import PlanInput, PlanOutput, encode_by_rank
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.problem import OFF_STAGE_MARGIN
from mmpipe.planner.samples import sample_table
from mmpipe.planner.spread import encode_costs, lpt_shares, spread_model
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

OMNI = model("omni-7b")
H100 = hardware("h100")
FEATS = [features(OMNI, m, where="t") for m in itertools.islice(read_trace(WORKLOADS / "omni-mix.jsonl"), 32)]
PLAN = StagePlan(stages=[(0, 76), (76, 84), (84, 92), (92, 99)])  # both towers, llm.embed..block.6 on stage 0


def _planner(encoders=None, trainable=("all",)):
    placement = Placement() if encoders is None else Placement.parse(encoders, OMNI)
    problem = PlanProblem(model=OMNI, hardware=H100, trainable=trainable, dp=2, policy="data-aware", micro_batches=4,
                          memory_headroom=0.08, placement=placement)
    return StepPlanner(problem, PLAN)


def test_default_placement_is_todays_plan_and_encodes_nothing():
    base = _planner().plan(FEATS[:16])
    same = _planner({"vision": "stages", "audio": "stages"}).plan(FEATS[:16])
    assert same.replicas == base.replicas and same.step_time == base.step_time
    assert _planner("stages").plan(FEATS[:16]) == base
    assert base.encode == (((),) * 4,) * 2 and base.encode_seconds == ()


def test_each_replica_encodes_its_own_media_samples_once_balanced_and_deterministic():
    planner = _planner("spread")
    plan = planner.plan(FEATS[:16])
    assert plan == planner.plan(FEATS[:16])  # every rank plans the same shares
    ec = encode_costs(planner.spread, sample_table(FEATS[:16]))
    for rep, shares in zip(plan.replicas, plan.encode):
        mine = sorted(i for mb in rep for i in mb if ec.media[i])
        assert sorted(i for share in shares for i in share) == mine  # once each, own replica only
        work = [sum(ec.pre[i] + ec.post[plan.encode_recompute][i] for i in share) for share in shares]
        biggest = max((ec.pre[i] + ec.post[plan.encode_recompute][i] for i in mine), default=0.0)
        assert max(work) - min(work) <= biggest + 1e-12  # LPT: within one sample of even
    assert lpt_shares([3.0, 5.0, 3.0, 1.0, 2.0, 2.0], 2) == [[1, 3, 4], [0, 2, 5]]


def test_a_trained_tower_pays_its_all_reduce_and_post_pass_a_frozen_one_does_not():
    cost = build_cost_model(model=OMNI, hardware=H100, trainable=("all",), dp=2)
    trained = spread_model(cost, {"vision": "spread", "audio": "stages"})
    n, nbytes = 8, trained.grad_bytes
    params = sum(cost.layers[i].params for i in trained.spread)
    assert nbytes == 4 * params  # summed in fp32
    assert trained.weight_bytes == 2 * params  # bf16 weights broadcast after the step
    assert trained.allreduce_s(n) == pytest.approx(2 * (n - 1) / n * nbytes / H100.link_bytes_per_s
                                                  + 2 * (n - 1) * H100.link_latency_s
                                                  + 2 * params / H100.link_bytes_per_s + (n - 1) * H100.link_latency_s)
    assert trained.static_rest < trained.static  # the optimizer state lives on stage 0 only
    frozen = spread_model(build_cost_model(model=OMNI, hardware=H100, trainable=("llm",), dp=2),
                          {"vision": "spread", "audio": "stages"})
    assert frozen.grad_bytes == 0 and frozen.allreduce_s(n) == 0 and not frozen.learns
    assert frozen.static < trained.static  # weights only, no gradient or optimizer state
    t_trained = _planner({"vision": "spread"}).plan(FEATS[:16])
    t_frozen = _planner({"vision": "spread"}, trainable=("llm",)).plan(FEATS[:16])
    assert max(max(r) for r in t_trained.encode_seconds) > max(max(r) for r in t_frozen.encode_seconds)


def test_stage_ranges_cover_every_layer_and_spread_layers_run_on_no_stage():
    sm = spread_model(build_cost_model(model=OMNI, hardware=H100, trainable=("all",)), {"vision": "spread",
                                                                                      "audio": "spread"})
    inner = sm.to_pipeline(PLAN)
    assert inner.stages[0][0] == 0 and inner.stages[-1][1] == len(sm.keep)
    assert sm.to_full(inner) == PLAN
    with pytest.raises(ValueError, match="stage 0's range must hold"):
        sm.to_pipeline(StagePlan(stages=[(0, 10), (10, 80), (80, 90), (90, 99)]))
    audio = spread_model(sm.cost, {"vision": "stages", "audio": "spread"})  # after a tower on the stages
    full = audio.to_full(StagePlan(stages=[(0, 20), (20, 50), (50, 60), (60, 65)]))
    assert full.stages[0][1] > audio.spread[-1] and full.stages[-1][1] == 99  # stage 0 holds every spread layer


def test_auto_is_never_slower_than_any_placement():
    problem = PlanProblem(model=OMNI, hardware=H100, pp=4, dp=2, trainable=("all",), policy="data-aware",
                          micro_batches=4, memory_headroom=0.08, placement=Placement.parse("auto", OMNI))
    choice = choose_encoders(problem, [FEATS[:16]], stage_plan=PLAN)
    times = [t for _, t, _ in choice.candidates]
    assert len(times) == 7 and all(math.isfinite(t) for t in times)  # stages; spread and nested: all, each tower
    assert choice.times()["stages"] == times[0]
    best = dict(zip([tuple(e.mapping.items()) for e, _, _ in choice.candidates], times))[
        tuple(choice.placement.mapping.items())]
    if choice.placement.spread:  # the fastest, by more than the margin over the stages
        assert best == min(times) and best < (1 - OFF_STAGE_MARGIN) * times[0]
    else:  # the stages unless a placement off them is predicted faster by the margin
        assert min(times) >= (1 - OFF_STAGE_MARGIN) * times[0] - 1e-12


def test_auto_moves_a_tower_off_the_stages_only_when_predicted_faster_by_the_margin():
    staged, nested = Placement.parse("stages", OMNI), Placement.parse({"audio": "nested"}, OMNI)
    assert staged.ranking_time(1.0) == 1.0
    assert nested.ranking_time(0.86) > staged.ranking_time(1.0) > nested.ranking_time(0.84)


def test_plan_json_records_the_placement_and_encode_shares_in_rank_order(tmp_path):
    from mmpipe.planner.command import run_plan

    trace = tmp_path / "t.jsonl"
    lines = (WORKLOADS / "omni-mix.jsonl").read_text().splitlines()[:16]
    trace.write_text("\n".join(lines) + "\n")
    names = [("vision.embed", "llm.block.6"), ("llm.block.7", "llm.block.14"), ("llm.block.15", "llm.block.22"),
             ("llm.block.23", "llm.head")]
    problem = PlanProblem(model=OMNI, hardware=H100, pp=4, dp=2, global_batch=16, micro_batches=2, trainable=("all",),
                          policy="data-aware", memory_headroom=DEFAULT_HEADROOM,
                          placement=Placement.parse({"audio": "spread"}, OMNI))
    plan = run_plan(problem, PlanInput(trace_path=str(trace)), stages=names, output=PlanOutput(quiet=True))
    assert plan["encoders"] == {"vision": "stages", "audio": "spread"}
    step = plan["steps"][0]
    assert len(step["encode"]) == 8
    ids = sorted(i for share in step["encode"] for i in share)
    assert ids == sorted(i for i, line in enumerate(lines) if json.loads(line).get("audio_seconds"))
    for rank, share in enumerate(step["encode"]):  # rank = stage * dp + replica
        replica = [i for mb in step["replicas"][rank % 2] for i in mb]
        assert set(share) <= set(replica)
    assert encode_by_rank([[[1], [2]], [[3], [4]]], 2, 2) == [[1], [3], [2], [4]]


@pytest.mark.parametrize("value, match", [
    ("sprad", "plan.encoders='sprad' is unknown"),
    ({"vison": "spread"}, "names 'vison', which is not an encoder tower"),
    ({"vision": "everywhere"}, "places vision at 'everywhere'"),
])
def test_bad_plan_encoders_is_one_line_naming_the_key(value, match):
    with pytest.raises(ValueError, match=match) as err:
        PlanConfig(encoders=value)
    assert "\n" not in str(err.value)


def test_a_tower_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match="names audio, which model llava-1.5-7b does not have"):
        Placement.parse({"audio": "spread"}, dataclasses.replace(OMNI, name="llava-1.5-7b", audio=None))
    assert Placement.parse({"audio": "spread"}, OMNI).mapping == {"vision": "stages", "audio": "spread"}
    with pytest.raises(ValueError, match="choose_encoders"):
        Placement.parse("auto", OMNI).mapping  # noqa: B018 - the property raises
