"""The planner's entry points for the runtime and the CLI.

    plan_stages(*, model, hardware, pp, dp, trainable, sample, micro_batches, policy) -> StagePlan
        Partition the layers into pp contiguous stages (and choose recompute per stage) for
        a policy, judged on `sample` (features of representative samples, e.g. one step).
        data-aware: bottleneck-minimising range search on real micro-batches of the sample,
        then a hill climb of the cuts on the simulated step time; ds-default and
        llava-grouped: DeepSpeed `parameters`; packed-ffd: encoders + first LLM chunk on
        stage 0. Baselines switch recompute on only if that is what their tuning picks.

    plan_step(*, policy, features, stage_plan, cost, dp, micro_batches) -> list[list[list[int]]]
        One step's samples (`features`, in stream order) -> per replica the ordered
        micro-batches as lists of indices into `features`. `cost` is a CostModel
        (build_cost_model(model=..., hardware=..., trainable=..., dp=...)).

    validate_trainable(trainable, model) -> tuple[str, ...]
        ValueError for a name matching no layer, e.g. "train.trainable=[visoin] names
        'visoin', which matches no layer of model qwen2-vl-7b; use all, vision, ...".

Policies: data-aware, ds-default, llava-grouped, packed-ffd.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import (BASELINES, PACK_TOKENS, ds_default_step,
                                      llava_grouped_step, packed_ffd_step, tune_baseline)
from mmpipe.planner.cost import (CostModel, SampleTable, build_cost_model, mb_streams,
                                 sample_table, stage_costs, validate_trainable)
from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.partition import (StagePlan, balanced_partition, check_pp, hill_climb,
                                      layer_loads, parameters_partition)
from mmpipe.planner.step import evaluate_step

POLICIES = ("data-aware",) + BASELINES
"""Every plan.policy value."""
PACKED_POLICIES = ("data-aware", "packed-ffd")
"""Policies whose micro-batches are packed (the others pad to the longest sample)."""

__all__ = ["POLICIES", "StagePlan", "plan_stages", "plan_step", "validate_trainable",
           "check_policy", "data_aware_stages"]


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"plan.policy={policy!r} is unknown; use {', '.join(POLICIES)}")


def plan_stages(*, model: ModelSpec, hardware: HardwareSpec, pp: int, dp: int,
                trainable: tuple[str, ...], sample: list[SampleFeatures], micro_batches: int,
                policy: str) -> StagePlan:
    """Stage ranges and recompute for a policy (see module docstring)."""
    check_policy(policy)
    check_pp(pp, len(layer_names(model)), model.name)
    cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp)
    table = sample_table(sample)
    rows = list(range(len(sample)))
    if policy == "data-aware":
        return data_aware_stages(cost, table, [rows], pp=pp, dp=dp, micro_batches=micro_batches)
    return tune_baseline(policy, cost, table, [rows], pp=pp, dp=dp,
                         micro_batches=micro_batches).stage_plan


def plan_step(*, policy: str, features: list[SampleFeatures], stage_plan: StagePlan,
              cost: CostModel, dp: int, micro_batches: int) -> list[list[list[int]]]:
    """Per replica the ordered micro-batches (indices into `features`) of one step."""
    check_policy(policy)
    table = sample_table(features)
    rows = list(range(len(features)))
    if policy == "data-aware":
        sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
        return balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches)
    if policy == "ds-default":
        return ds_default_step(rows, dp=dp, m=micro_batches)
    if policy == "llava-grouped":
        return llava_grouped_step(table, rows, dp=dp, m=micro_batches)
    longest = int(table.tokens[:, 4].max()) if len(table) else 1
    return packed_ffd_step(table, rows, dp=dp, pack_len=max(longest, PACK_TOKENS))


def data_aware_stages(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                      pp: int, dp: int, micro_batches: int,
                      labels: Sequence[str] | None = None) -> StagePlan:
    """Partition on real micro-batches: balance the sample steps on a provisional partition,
    range-search the bottleneck on those micro-batches, hill-climb the cuts and recompute flags
    on the simulated step time of the same micro-batches, and keep whichever candidate is
    fastest once its own micro-batches are re-planned (the best micro-batch count and sizes
    depend on the partition). A last hill climb moves single cuts by one layer, each candidate
    judged with its re-planned micro-batches."""
    L = len(cost.layers)
    check_pp(pp, L, cost.model.name)
    hw = cost.hardware
    replanned: dict[tuple, float] = {}

    def replan(p: StagePlan) -> float:
        key = (tuple(p.stages), tuple(p.recompute))
        if key not in replanned:
            s = stage_costs(cost, p.stages, p.recompute)
            total = 0.0
            try:
                for rows in steps:
                    rep = balance_step(s, table, rows, dp=dp, micro_batches=micro_batches,
                                       labels=labels)
                    ev = evaluate_step(s, table, rep, packing=True)
                    if not ev.fits:
                        total = np.inf
                        break
                    total += ev.step_time
            except ValueError:  # a stage or a sample does not fit under this partition
                total = np.inf
            replanned[key] = total
        return replanned[key]

    plan = StagePlan(stages=parameters_partition([l.params for l in cost.layers], pp),
                     recompute=[True] * pp)
    best_plan, best_t = plan, replan(plan)
    for it in range(3):
        sc = stage_costs(cost, plan.stages, plan.recompute)
        # equal micro-batches on the first round, the policy's own (ramped) ones after
        reps = [balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches,
                             labels=labels, search=it > 0) for rows in steps]
        mbs = [mb for rep in reps for r in rep for mb in r]
        T, S2 = mb_streams(table, mbs, packing=True)
        loads = layer_loads(cost, T, S2)
        cand = balanced_partition(loads, pp, hw.usable_bytes) or plan

        def score(p: StagePlan) -> float:
            s = stage_costs(cost, p.stages, p.recompute)
            total = 0.0
            for rep in reps:
                ev = evaluate_step(s, table, rep, packing=True)
                if not ev.fits:
                    return np.inf
                total += ev.step_time
            return total

        for start in (cand, plan):
            p, _ = hill_climb(start, score)
            t = replan(p)
            if t < best_t:
                best_plan, best_t = p, t
        if it > 0 and best_plan.stages == plan.stages and best_plan.recompute == plan.recompute:
            break
        plan = best_plan
    best_plan, _ = hill_climb(best_plan, replan, rounds=2, steps=(1,))
    return best_plan
