"""A run's stage cut for a policy (`plan_stages`), what a user's cut costs in memory
(`stage_memory_warnings`), and one step's micro-batches on a cut (`plan_step`).

The policies: data-aware (bottleneck-minimising range search on real micro-batches of the
sample, then a hill climb of the cuts on the simulated step time: planner/partition.py), and
the baselines ds-default and llava-grouped (DeepSpeed `parameters`) and packed-ffd (encoders
and the first LLM chunk on stage 0), each tuned as spec section 7 says (planner/baselines.py);
a baseline switches recompute on only if that is what its tuning picks.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import layer_names
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import BASELINES, fitting_baseline_step, tune_baseline
from mmpipe.planner.partition import StagePlan, check_pp, data_aware_stages
from mmpipe.planner.problem import PlanProblem, placement_name
from mmpipe.planner.samples import SampleTable, sample_table
from mmpipe.planner.spread import encode_costs, reserve_bytes, reserved_pipeline, spread_model
from mmpipe.planner.stage_cost import StageCosts, stage_costs
from mmpipe.planner.step import Replicas, evaluate_step

POLICIES = ("data-aware",) + BASELINES
"""Every plan.policy value."""
PACKED_POLICIES = ("data-aware", "packed-ffd")
"""Policies whose micro-batches are packed (the others pad to the longest sample)."""


def check_policy(policy: str) -> None:
    """ValueError naming plan.policy and the known policies."""
    if policy not in POLICIES:
        raise ValueError(f"plan.policy={policy!r} is unknown; use {', '.join(POLICIES)}")


def plan_stages(problem: PlanProblem, sample: Sequence[SampleFeatures]) -> StagePlan:
    """Stage ranges and recompute of `problem.pp` stages for its policy, judged on `sample`
    (features of representative samples, e.g. one step, all replicas). Under a placement
    with a spread tower (resolved: not `auto`) that tower's layers cost nothing on the stages,
    and the ranges still cover every layer (docs/spec.md section 4)."""
    check_policy(problem.policy)
    model, pp = problem.model, problem.fixed_pp
    check_pp(pp, len(layer_names(model)), model.name)
    cost = problem.cost_model()
    dp = problem.fixed_dp
    sm = spread_model(cost, problem.placement.mapping)
    table = sample_table(list(sample))
    rows = list(range(len(sample)))
    if sm.active:
        check_pp(pp, len(sm.keep), f"{model.name} with {placement_name(sm.encoders)} encoders")
        # what every rank leaves to the spread towers (stage 0's features: the step planner's
        # own per-stage reserve, where the balancer makes room with its micro-batches)
        reserve = reserve_bytes(sm, encode_costs(sm, table), rows, pp=pp, dp=dp)
        cost = reserved_pipeline(sm, float(reserve[-1]))
    if problem.policy == "data-aware":
        plan = data_aware_stages(cost, table, [rows], pp=pp, dp=dp, micro_batches=problem.micro_batches)
    else:
        plan = tune_baseline(problem.policy, cost, table, [rows], pp=pp, dp=dp,
                             micro_batches=problem.micro_batches).stage_plan
    return sm.to_full(plan) if sm.active else plan


def plan_replicas(policy: str, table: SampleTable, sc: StageCosts, replicas: int,
                  micro_batches: int) -> Replicas:
    """Every replica's micro-batches under the policy, for all samples of `table`: the
    data-aware balancer, or a baseline as a run of it plans each step (the user's setting, or
    the next that fits).

    Data-aware is never predicted slower than packing: packed-ffd's step of the same samples on
    the same stages (its default pack, or the shorter one a run of it retries when that does not
    fit) stays among its candidates and is taken where the same simulator with the same costs
    (the run's step-time fit included, once the runtime re-plans with it) prices it faster and
    it fits; ties keep the balanced plan. Where a micro-batch's fixed cost rivals the pipelining
    it buys (a tiny model on a CPU), one large pack can beat any balanced split."""
    rows = list(range(len(table)))
    if policy != "data-aware":
        return fitting_baseline_step(policy, sc, table, rows, dp=replicas, micro_batches=micro_batches)
    balanced = balance_step(sc, table, rows, dp=replicas, micro_batches=micro_batches)
    packed = fitting_baseline_step("packed-ffd", sc, table, rows, dp=replicas, micro_batches=micro_batches)
    ours, theirs = (evaluate_step(sc, table, r, packing=True) for r in (balanced, packed))
    return packed if theirs.fits and theirs.step_time < ours.step_time else balanced


def plan_step(problem: PlanProblem, stage_plan: StagePlan, features: Sequence[SampleFeatures]) -> Replicas:
    """Per replica (dp of them) the ordered micro-batches (indices into `features`) of one step
    on `stage_plan`: `StepPlanner.plan` without the prediction."""
    check_policy(problem.policy)
    sc = stage_costs(problem.cost_model(), stage_plan.stages, stage_plan.recompute)
    return plan_replicas(problem.policy, sample_table(list(features)), sc, problem.fixed_dp, problem.micro_batches)


def stage_memory_warnings(problem: PlanProblem, stage_plan: StagePlan,
                          sample: Sequence[SampleFeatures]) -> tuple[str, ...]:
    """Stages of a user's stage plan whose planned peak memory on `sample` (one step's samples,
    all replicas) exceeds the device under the cost model, one warning line each (the user's
    stages are trained anyway; the user hears which stage and by how much). A sample that
    fits on no micro-batch is one warning too."""
    check_policy(problem.policy)
    cost = problem.cost_model()
    sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
    table = sample_table(list(sample))
    try:
        reps = plan_replicas(problem.policy, table, sc, problem.fixed_dp, problem.micro_batches)
    except ValueError as err:  # e.g. a sample that fits on no micro-batch
        return (f"plan.stages: {err}",)
    ev = evaluate_step(sc, table, reps, packing=problem.policy in PACKED_POLICIES)
    names = cost.names
    out = []
    for s, (a, b) in enumerate(stage_plan.stages):
        need, usable = float(ev.peak_bytes[s]), float(ev.usable)
        if need > usable:
            out.append(f"plan.stages: stage {s} ({names[a]}..{names[b - 1]}) needs {need / 1e9:.3g} GB "
                       f"under the cost model, {(need - usable) / 1e9:.3g} GB more than the "
                       f"{cost.usable_text()} on hardware {problem.hardware.name}; it may run out of "
                       f"memory (move layers off it, or enable recompute)")
    return tuple(out)
