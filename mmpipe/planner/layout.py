"""Choosing the layout: how `parallel.devices=N` devices split into pipeline stages x
data-parallel replicas (`parallel.pp=auto` and/or `parallel.dp=auto`).

The candidates are every pp x dp = N with pp no larger than the model's layer count, the
global batch divisible by dp and at least `train.micro_batches` samples per replica (the
runtime's own rules). Each one is priced on the probe steps with its own cost model (ZeRO-1
shards the optimizer side over dp, so static memory depends on the layout):

1. *estimate* (every candidate, milliseconds): deal each probe step to the dp replicas as
   the balancer does; on the heaviest replica, range-search a partition that fits memory
   (recompute where it must) on fluid micro-batches, then rank micro-batch counts and size
   profiles with the fluid 1F1B simulation the balancer uses (`ReplicaPlanner.rank_profiles`).
   A fluid plan splits samples exactly, so it is about what packing reaches, a little better.
2. *plan* (the best estimates): the data-aware partition search and the balancer in full on
   the probe steps, every replica, judged by `step.evaluate_step` like every plan. Layouts
   are planned best estimate first until the best planned one is at least as fast as every
   remaining estimate (at most FULL_PLANS), so no layout left at its estimate looks faster
   than the choice.

A layout whose replicas get fewer than SMALL_STEP x pp samples per step is a *small step*:
1F1B with m equal micro-batches idles (pp-1)/(m+pp-1) of the step, so such a replica idles at
least (pp-1)/(n+pp-1) with equal micro-batches even at one sample each (n samples), and one-
sample micro-batches run far below peak. Such layouts are chosen only when no other fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.balancer import balance_step, check_alone, check_static
from mmpipe.planner.cost import CostModel, lower_bound_s
from mmpipe.planner.packing import deal
from mmpipe.planner.partition import StagePlan, balanced_partition, data_aware_stages, layer_loads, parameters_partition
from mmpipe.planner.problem import PlanProblem
from mmpipe.planner.replica import ReplicaPlanner
from mmpipe.planner.samples import SampleTable, sample_table
from mmpipe.planner.stage_cost import StageCosts, sample_work, stage_costs
from mmpipe.planner.step import evaluate_step

FULL_PLANS = 3
"""At most this many layouts are planned in full after the estimates."""
SMALL_STEP = 2
"""A replica with fewer than SMALL_STEP x pp samples per step makes a small step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One pp x dp split of the devices and what the planner predicts for it."""

    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel replicas."""
    how: str
    """`planned` (in full), `estimated` (fluid), or `excluded` (not a valid layout)."""
    step_time: float
    """Mean predicted step time over the probe steps, s (inf when it does not fit)."""
    lower_bound: float
    """Mean lower bound of the probe steps (docs/spec.md section 7), s."""
    samples_per_s: float
    """Samples of a step per predicted second."""
    peak_bytes: tuple[float, ...]
    """Per stage, predicted peak memory (static + in-flight activations), bytes."""
    bubble: float
    """Idle share of the slowest replica's stages, averaged over stages and steps."""
    fits: bool
    """Within usable memory less the headroom."""
    small_step: bool
    """Replicas get fewer than SMALL_STEP x pp samples per step."""
    note: str = ""
    """Why it is excluded or does not fit, or what makes the step small."""
    stage_plan: StagePlan | None = None
    """The partition it was priced with."""

    @property
    def efficiency(self) -> float:
        """Lower bound / predicted step time (1 is the bound itself)."""
        return self.lower_bound / self.step_time if self.step_time > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutChoice:
    """Every candidate layout, ranked (the chosen one first), for `parallel.devices`."""

    devices: int
    """parallel.devices."""
    layouts: tuple[Layout, ...]
    """Ranked: layouts that fit before those that do not, small steps after the others,
    then by predicted step time; excluded ones last."""

    @property
    def best(self) -> Layout:
        return self.layouts[0]


def costs_by_dp(problem: PlanProblem) -> dict[int, CostModel]:
    """A cost model for each data-parallel degree a layout of `problem.devices` may take (each
    divisor, or the user's fixed dp): ZeRO-1 shards optimizer states over dp, so memory
    depends on it."""
    devices, dp = problem.devices or 0, problem.dp
    costs = {d: problem.cost_model(dp=d) for d in range(1, devices + 1) if devices % d == 0 and (dp is None or d == dp)}
    if not costs:
        raise ValueError(f"parallel.dp={dp} does not divide parallel.devices={devices}; use a divisor or auto")
    return costs


def equal_bubble(pp: int, m: int) -> float:
    """Idle share of 1F1B with m equal micro-batches on pp balanced stages."""
    return (pp - 1) / (m + pp - 1)


def is_small_step(pp: int, per_replica: int) -> bool:
    """Whether replicas of `per_replica` samples make a small step on pp stages."""
    return pp > 1 and per_replica < SMALL_STEP * pp


def small_step_note(pp: int, per_replica: int) -> str:
    """What a small step costs, for reports (empty when the step is not small)."""
    if not is_small_step(pp, per_replica):
        return ""
    return (f"{per_replica} samples per replica for {pp} stages: equal micro-batches idle "
            f"{equal_bubble(pp, per_replica):.0%} even at one sample each")


def candidates(*, devices: int, n_layers: int, global_batch: int, micro_batches: int,
               pp: int | None = None, dp: int | None = None
               ) -> tuple[list[tuple[int, int]], list[Layout]]:
    """The valid (pp, dp) splits of `devices` (pp or dp fixed when given), and the excluded
    ones with the reason, as Layouts."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"parallel.devices={devices!r} must be a positive integer")
    ok: list[tuple[int, int]] = []
    out: list[Layout] = []
    for p in range(1, devices + 1):
        if devices % p:
            continue
        d = devices // p
        if (pp is not None and p != pp) or (dp is not None and d != dp):
            continue
        why = ""
        if p > n_layers:
            why = f"parallel.pp={p} exceeds the {n_layers} layers"
        elif global_batch % d:
            why = f"train.global_batch={global_batch} is not divisible by parallel.dp={d}"
        elif global_batch // d < micro_batches:
            why = (f"train.micro_batches={micro_batches} exceeds the {global_batch // d} samples "
                   f"per replica")
        if why:
            out.append(_excluded(p, d, why, global_batch))
        else:
            ok.append((p, d))
    if pp is not None and dp is not None and pp * dp != devices:
        raise ValueError(f"parallel.pp={pp} x parallel.dp={dp} = {pp * dp} is not "
                         f"parallel.devices={devices}; set one of them to auto")
    if pp is not None and devices % pp:
        raise ValueError(f"parallel.pp={pp} does not divide parallel.devices={devices}; use one "
                         f"of {', '.join(str(x) for x in _divisors(devices))} or auto")
    if dp is not None and devices % dp:
        raise ValueError(f"parallel.dp={dp} does not divide parallel.devices={devices}; use one "
                         f"of {', '.join(str(x) for x in _divisors(devices))} or auto")
    return ok, out


def choose_layout(problem: PlanProblem, sample: Sequence[SampleFeatures], probe_steps: int = 2) -> LayoutChoice:
    """Rank the pp x dp splits of `problem.devices` for the data-aware policy: `.best` has pp,
    dp and the stage plan it was priced with, `.layouts` the ranked table.

    Args:
        problem: the run; its pp and dp are the values the user fixed, or None for auto.
        sample: features of the run's first samples in stream order, all replicas together
            (at least one whole step of `problem.global_batch`); up to `probe_steps` whole
            steps are priced.
    Raises ValueError naming the keys when no layout is valid or the sample is short.
    """
    global_batch = problem.global_batch or 0
    if global_batch < 1 or len(sample) < global_batch:
        raise ValueError(f"parallel.devices={problem.devices}: choosing a layout needs one whole step of "
                         f"train.global_batch={problem.global_batch} samples; the data gave "
                         f"{len(sample)}")
    k = max(1, min(probe_steps, len(sample) // global_batch))
    table = sample_table(list(sample[:k * global_batch]))
    steps = [list(range(i * global_batch, (i + 1) * global_batch)) for i in range(k)]
    return search_layouts(problem, table, steps)


def search_layouts(problem: PlanProblem, table: SampleTable, steps: Sequence[Sequence[int]],
                   labels: Sequence[str] | None = None) -> LayoutChoice:
    """Rank every valid layout of `problem.devices` on the probe `steps` (rows of `table`,
    each `problem.global_batch` of them), each dp with its own cost model (`costs_by_dp`);
    `problem.pp` / `problem.dp`: a fixed value when the user gave one, None for auto.
    Raises ValueError when no layout is valid (the reasons named).
    """
    costs = costs_by_dp(problem)
    devices, pp, dp = problem.devices or 0, problem.pp, problem.dp
    micro_batches = problem.micro_batches
    any_cost = next(iter(costs.values()))
    n_layers = len(any_cost.layers)
    valid, excluded = candidates(devices=devices, n_layers=n_layers, global_batch=problem.global_batch or 0,
                                 micro_batches=micro_batches, pp=pp, dp=dp)
    if not valid:
        raise ValueError(f"no layout of parallel.devices={devices} is valid: "
                         + "; ".join(f"pp={x.pp} x dp={x.dp}: {x.note}" for x in excluded))
    # estimate in order of a lower bound; a layout whose bound is above the best estimate so
    # far cannot win and is only bounded (deep pipelines of small models cost the most to
    # estimate and are the ones this skips)
    bounds = sorted((bottleneck_bound(costs[d], table, steps, pp=p, dp=d), p, d) for p, d in valid)
    estimates: list[Layout] = []
    for bound, p, d in bounds:
        best_est = min((e.step_time for e in estimates if e.fits and not e.small_step),
                       default=math.inf)
        if bound > best_est:
            estimates.append(_bounded(p, d, bound, costs[d], table, steps))
        else:
            estimates.append(estimate_layout(costs[d], table, steps, pp=p, dp=d,
                                             micro_batches=micro_batches))
    order = sorted(estimates, key=_rank)
    planned: dict[tuple[int, int], Layout] = {}
    for est in order:
        if len(planned) >= FULL_PLANS or not est.fits:
            break
        best = min(planned.values(), key=_rank, default=None)
        if best is not None and _rank(best) <= _rank(est):
            break
        planned[(est.pp, est.dp)] = plan_layout(costs[est.dp], table, steps, pp=est.pp,
                                                dp=est.dp, micro_batches=micro_batches,
                                                labels=labels)
    shown = [planned.get((e.pp, e.dp), e) for e in estimates]
    return LayoutChoice(devices=devices, layouts=tuple(rank_layouts(shown) + excluded))


def rank_layouts(layouts: Sequence[Layout]) -> list[Layout]:
    """Best first: planned layouts that fit, then the rest; within each, layouts that fit
    before those that do not, layouts that are not small steps before small steps (chosen
    only when nothing else fits, however fast their prediction: with a few samples per
    replica the plan rests on the bubble and on per-micro-batch costs the model prices least
    well), then by predicted step time, then fewer stages."""
    return sorted(layouts, key=lambda x: (x.how != "planned" or not x.fits,) + _rank(x))


def estimate_layout(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                    pp: int, dp: int, micro_batches: int) -> Layout:
    """The fluid estimate of one layout (see the module docstring)."""
    per_replica = len(steps[0]) // dp
    small = is_small_step(pp, per_replica)
    heavy = [_heaviest_replica(cost, table, rows, pp=pp, dp=dp) for rows in steps]
    lb = float(np.mean([lower_bound_s(cost, table.rows(list(rows)), pp=pp, dp=dp)
                        for rows in steps]))
    static = min_max_cut([cost.static_bytes(i, i + 1) for i in range(len(cost.layers))], pp)
    if static > cost.usable_bytes:
        return _unfit(pp, dp, lb, small, f"weights, gradients and optimizer states alone need "
                      f"{static / 1e9:.3g} GB on the fullest stage, more than the "
                      f"{cost.usable_text()}")
    plans = _fluid_partitions(cost, table, heavy, pp=pp, micro_batches=micro_batches)
    if not plans:
        return _unfit(pp, dp, lb, small, "no partition fits in memory, even with recompute")
    plan, why, best_t = None, "", math.inf
    for p in plans:  # the partition whose fluid plan of the first heavy replica is fastest
        try:
            t = _replica(stage_costs(cost, p.stages, p.recompute), table, heavy[0]) \
                .rank_profiles(micro_batches, True)[0][0]
        except ValueError as err:
            why = str(err)
            continue
        if t < best_t:
            plan, best_t = p, t
    if plan is None:
        return _unfit(pp, dp, lb, small, why, plans[0])
    sc = stage_costs(cost, plan.stages, plan.recompute)
    times, peaks, bubbles = [], [], []
    for rows in heavy:
        try:
            rp = _replica(sc, table, rows)
        except ValueError as err:
            return _unfit(pp, dp, lb, small, str(err), plan)
        t, m, ramp = rp.rank_profiles(micro_batches, True)[0]
        t, pk, idle = rp.fluid_outcome(m, ramp)
        times.append(sc.cost.hardware.step_seconds(t))
        peaks.append(sc.static + pk)
        bubbles.append(float(np.mean(idle)))
    step = float(np.mean(times))
    fits = bool(np.isfinite(step))
    return Layout(pp=pp, dp=dp, how="estimated", step_time=step if fits else math.inf,
                  lower_bound=lb, samples_per_s=len(steps[0]) / step if fits else 0.0,
                  peak_bytes=tuple(float(x) for x in np.max(peaks, axis=0)),
                  bubble=float(np.mean(bubbles)), fits=fits, small_step=small,
                  note=small_step_note(pp, per_replica) if fits else "micro-batches do not fit",
                  stage_plan=plan)


def plan_layout(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                pp: int, dp: int, micro_batches: int,
                labels: Sequence[str] | None = None) -> Layout:
    """One layout planned in full: the data-aware partition on the probe steps, every replica
    of every probe step balanced and simulated."""
    per_replica = len(steps[0]) // dp
    small = is_small_step(pp, per_replica)
    lb = float(np.mean([lower_bound_s(cost, table.rows(list(rows)), pp=pp, dp=dp)
                        for rows in steps]))
    try:
        plan = data_aware_stages(cost, table, steps, pp=pp, dp=dp, micro_batches=micro_batches,
                                 labels=labels)
        sc = stage_costs(cost, plan.stages, plan.recompute)
        evals = [evaluate_step(sc, table, balance_step(sc, table, rows, dp=dp,
                                                       micro_batches=micro_batches, labels=labels),
                               packing=True) for rows in steps]
    except ValueError as err:
        return _unfit(pp, dp, lb, small, str(err))
    fits = all(e.fits for e in evals)
    step = float(np.mean([e.step_time for e in evals]))
    bubble = float(np.mean([np.mean(e.replicas[e.slowest].bubble) for e in evals]))
    return Layout(pp=pp, dp=dp, how="planned", step_time=step if fits else math.inf,
                  lower_bound=lb, samples_per_s=len(steps[0]) / step if fits else 0.0,
                  peak_bytes=tuple(float(x) for x in np.max([e.peak_bytes for e in evals], axis=0)),
                  bubble=bubble, fits=fits, small_step=small,
                  note=small_step_note(pp, per_replica) if fits else "over memory", stage_plan=plan)


def bottleneck_bound(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                     pp: int, dp: int) -> float:
    """A lower bound of the layout's mean step time: per probe step, the heaviest replica's
    busiest stage at the top of the efficiency curve (no overhead, no bubble, no recompute)
    under the best contiguous cut of its per-layer work into pp stages."""
    L = len(cost.layers)
    single = stage_costs(cost, [(i, i + 1) for i in range(L)], [False] * L)
    out = []
    for rows in steps:
        heavy = _heaviest_replica(cost, table, rows, pp=pp, dp=dp)
        per_layer, _, _ = sample_work(single, table.rows(heavy))
        out.append(min_max_cut(per_layer.sum(axis=0).tolist(), pp))
    return cost.hardware.step_seconds(float(np.mean(out)))


def min_max_cut(w: Sequence[float], parts: int) -> float:
    """The least possible largest sum of `parts` contiguous non-empty parts of w (a lower
    bound within 1e-9 relative: the bisection's low end)."""
    lo, hi = max(w), float(sum(w))

    def fits(limit: float) -> bool:
        count, load = 1, 0.0
        for x in w:
            if load + x > limit:
                count, load = count + 1, x
            else:
                load += x
        return count <= parts

    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _bounded(pp: int, dp: int, bound: float, cost: CostModel, table: SampleTable,
             steps: Sequence[Sequence[int]]) -> Layout:
    """A layout priced by its lower bound only (it cannot beat the best estimate)."""
    per_replica = len(steps[0]) // dp
    lb = float(np.mean([lower_bound_s(cost, table.rows(list(rows)), pp=pp, dp=dp)
                        for rows in steps]))
    return Layout(pp=pp, dp=dp, how="bounded", step_time=bound, lower_bound=lb,
                  samples_per_s=len(steps[0]) / bound, peak_bytes=(), bubble=0.0, fits=True,
                  small_step=is_small_step(pp, per_replica),
                  note=f"busiest stage alone takes {bound:.3g} s: slower than the best estimate")


def _rank(x: Layout) -> tuple:
    return (not x.fits, x.small_step, x.step_time, x.pp)


def _replica(sc: StageCosts, table: SampleTable, rows: list[int]) -> ReplicaPlanner:
    """A replica planner for `rows`, after the balancer's memory checks (ValueError)."""
    sub = table.rows(rows)
    work, act, tr = sample_work(sc, sub)
    budget = sc.cost.usable_bytes - sc.static
    check_static(sc, budget)
    check_alone(sc, list(range(len(rows))), act + tr, budget, None)
    return ReplicaPlanner(sc, sub.tokens, sub.squares, work, act, tr, budget)


def _heaviest_replica(cost: CostModel, table: SampleTable, rows: Sequence[int], *, pp: int,
                      dp: int) -> list[int]:
    """The step's replica with the heaviest busiest stage, dealt as the balancer deals, on a
    parameter-balanced partition."""
    rows = list(rows)
    if dp == 1:
        return rows
    sc = stage_costs(cost, parameters_partition([l.params for l in cost.layers], pp), [False] * pp)
    work, _, _ = sample_work(sc, table.rows(rows))
    reps = [r for r in deal(work, dp) if r]
    heavy = max(reps, key=lambda r: float(work[r].sum(axis=0).max()))
    return [rows[i] for i in heavy]


def _fluid_partitions(cost: CostModel, table: SampleTable, replicas: list[list[int]], *, pp: int,
                      micro_batches: int, tries: int = 4) -> list[StagePlan]:
    """The bottleneck range search on m equal fluid micro-batches of the replicas, for m from
    what the fluid ranking wants on a parameter-balanced, recomputing partition, doubled up to
    `tries` times: smaller micro-batches need less memory, so recompute may go (distinct
    partitions, the first one that fits first)."""
    first = replicas[0]
    n = len(first)
    provisional = StagePlan(stages=parameters_partition([l.params for l in cost.layers], pp),
                            recompute=[True] * pp)
    m0 = micro_batches
    try:
        rp = _replica(stage_costs(cost, provisional.stages, provisional.recompute), table, first)
        m0 = rp.rank_profiles(micro_batches, False)[0][1]
    except ValueError:
        pass
    T = np.sum([table.tokens[r].sum(axis=0) for r in replicas], axis=0) / len(replicas)
    S2 = np.sum([table.squares[r].sum(axis=0) for r in replicas], axis=0) / len(replicas)
    m = max(1, min(n, m0))
    out: list[StagePlan] = []
    while len(out) < tries:
        loads = layer_loads(cost, np.tile(T / m, (m, 1)), np.tile(S2 / m, (m, 1)))
        plan = balanced_partition(loads, pp, cost.usable_bytes)
        if plan is not None and plan not in out:
            out.append(plan)
        if m >= n or (plan is not None and not any(plan.recompute)):
            return out
        m = min(n, 2 * m)
    return out


def _unfit(pp: int, dp: int, lb: float, small: bool, why: str,
           plan: StagePlan | None = None) -> Layout:
    return Layout(pp=pp, dp=dp, how="estimated", step_time=math.inf, lower_bound=lb,
                  samples_per_s=0.0, peak_bytes=(), bubble=1.0, fits=False, small_step=small,
                  note=why, stage_plan=plan)


def _excluded(pp: int, dp: int, why: str, global_batch: int) -> Layout:
    return Layout(pp=pp, dp=dp, how="excluded", step_time=math.inf, lower_bound=0.0,
                  samples_per_s=0.0, peak_bytes=(), bubble=1.0, fits=False,
                  small_step=is_small_step(pp, global_batch // dp), note=why)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
