"""Stage partitioning: contiguous layer ranges per pipeline stage, and recompute per stage.

- `parameters_partition`: DeepSpeed's `partition_method="parameters"` (what ds-default and
  llava-grouped get): contiguous stages that minimise the largest parameter count.
- `packed_ffd_partition`: Megatron/NeMo style: encoders with the first LLM chunk on stage 0,
  LLM blocks split evenly over the stages.
- `data_aware_stages`: the data-aware one: `balanced_partition` minimises the bottleneck of
  per-stage time on a sample of real micro-batches, each stage within memory (recompute
  switched on for a stage only where it does not fit otherwise), then `hill_climb` moves the
  cuts on the simulated step time, each candidate judged with re-planned micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.balancer import balance_step
from mmpipe.planner.cost import CostModel
from mmpipe.planner.memory import window_peaks
from mmpipe.planner.packing import deal
from mmpipe.planner.replica import ReplicaPlanner
from mmpipe.planner.samples import SampleTable, mb_streams
from mmpipe.planner.schedules import make_schedule
from mmpipe.planner.simulator import makespan
from mmpipe.planner.stage_cost import StageCosts, micro_batch_costs, sample_work, send_seconds, stage_costs, stage_times
from mmpipe.planner.step import evaluate_step

SAMPLE_REPLICAS = 2
"""Replicas per step the partition search plans (the heaviest ones) when dp is larger."""
FIRST_STAGE_REACH = 8
"""Layers past the current end of the first stage that `first_stage_candidates` tries."""
FIRST_STAGE_REPLANS = 2
"""Of those, how many (best fluid estimate first) the search re-plans."""
FINALISTS = 3
"""Partitions with the best trial plans that the search compares with full plans at the end
(where memory binds on the first stage)..."""
FINAL_SPREAD = 0.01
"""...those within this share of the best trial plan (the trial plans' own noise: on
vision-dynamic x qwen2.5-vl-7b `[all]` they ranked third, 0.6% behind, the partition whose
full plans were 0.7% faster than the first's)."""
FIRST_STAGE_GAIN = 0.01
"""How much faster a re-planned candidate must be to replace the search's choice: the trial
plans are lighter than a step's own plan (`balance_step(thorough=False)`), and a gain within
their noise does not survive the step's own plans (the golden vision-dynamic case: a first
stage 0.3% faster on trial plans was 0.8% slower once each step was planned in full)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """Which layers each pipeline stage runs, and whether it recomputes activations."""

    stages: tuple[tuple[int, int], ...]
    """[start, end) indices into layer_names(model), one per stage, tiling all layers."""
    recompute: tuple[bool, ...] = ()
    """Activation recomputation per stage (default all off)."""

    def __post_init__(self) -> None:
        stages = tuple((int(a), int(b)) for a, b in self.stages)
        recompute = tuple(bool(r) for r in self.recompute) or (False,) * len(stages)
        object.__setattr__(self, "stages", stages)  # frozen: normalise once, here
        object.__setattr__(self, "recompute", recompute)
        if len(self.recompute) != len(self.stages):
            raise ValueError(f"recompute has {len(self.recompute)} entries for "
                             f"{len(self.stages)} stages; give one per stage")
        pos = 0
        for s, (a, b) in enumerate(self.stages):
            if a != pos or b <= a:
                raise ValueError(f"stage {s} covers [{a}, {b}); stages must tile the layers "
                                 f"contiguously from 0, each non-empty")
            pos = b

    @property
    def pp(self) -> int:
        return len(self.stages)


def check_pp(pp: int, n_layers: int, model_name: str) -> None:
    """parallel.pp must be between 1 and the number of layers."""
    if pp < 1:
        raise ValueError(f"parallel.pp={pp} must be >= 1")
    if pp > n_layers:
        raise ValueError(f"parallel.pp={pp} is larger than the {n_layers} layers of model "
                         f"{model_name}; use parallel.pp <= {n_layers}")


def stages_from_names(pairs: Sequence[tuple[str, str]], names: Sequence[str]) -> list[tuple[int, int]]:
    """Turn plan.stages=[[first, last], ...] layer names into [start, end) ranges."""
    index = {n: i for i, n in enumerate(names)}
    out = []
    for s, (first, last) in enumerate(pairs):
        for n in (first, last):
            if n not in index:
                raise ValueError(f"plan.stages[{s}] names layer {n!r}, which the model does not "
                                 f"have; layers run {names[0]} .. {names[-1]}")
        out.append((index[first], index[last] + 1))
    if not out or out[0][0] != 0 or out[-1][1] != len(names) or any(
            out[i][1] != out[i + 1][0] for i in range(len(out) - 1)):
        raise ValueError(f"plan.stages={[list(p) for p in pairs]} must cover every layer from "
                         f"{names[0]} to {names[-1]} in order, each stage starting right after "
                         f"the previous one")
    return out


def parameters_partition(params: Sequence[int], pp: int) -> list[tuple[int, int]]:
    """DeepSpeed `parameters`: contiguous parts minimising the largest parameter count.

    Binary search on the bottleneck; each part greedily takes layers while under it, as
    DeepSpeed's `partition_balanced` does; every part keeps at least one layer.
    """
    w = np.asarray(params, dtype=float)
    check_pp(pp, len(w), "(layers)")
    lo, hi = float(w.max()), float(w.sum())
    best = _greedy_cuts(w, pp, hi)
    for _ in range(60):
        if hi - lo <= max(1.0, 1e-9 * hi):
            break
        mid = (lo + hi) / 2
        cuts = _greedy_cuts(w, pp, mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    assert best is not None
    return best


def _greedy_cuts(w: np.ndarray, pp: int, limit: float) -> list[tuple[int, int]] | None:
    n = len(w)
    out = []
    a = 0
    for s in range(pp):
        left = pp - s - 1
        b, load = a, 0.0
        while b < n - left and (b == a or load + w[b] <= limit):
            load += w[b]
            b += 1
        if load > limit:
            return None
        out.append((a, b))
        a = b
    return out if a == n else None


def packed_ffd_partition(kinds: Sequence[str], pp: int) -> list[tuple[int, int]]:
    """Encoders and the first LLM chunk on stage 0; LLM blocks split evenly over stages."""
    n = len(kinds)
    check_pp(pp, n, "(layers)")
    blocks = [i for i, k in enumerate(kinds) if k == "llm.block"]
    if pp == 1:
        return [(0, n)]
    if len(blocks) < pp:
        return _even(n, pp)
    per = np.array_split(np.array(blocks), pp)
    cuts = [0] + [int(chunk[0]) for chunk in per[1:]] + [n]
    return [(cuts[s], cuts[s + 1]) for s in range(pp)]


def _even(n: int, pp: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n, pp + 1).round().astype(int)
    return [(int(bounds[s]), int(bounds[s + 1])) for s in range(pp)]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerLoads:
    """Per-layer figures summed over a sample of micro-batches, for the range search."""

    time: np.ndarray
    """[L] forward + backward time over the sample, recompute off."""
    recompute_time: np.ndarray
    """[L] extra time with recompute on."""
    act: np.ndarray
    """[L] activation bytes of the largest micro-batch, recompute off."""
    act_rc: np.ndarray
    """[L] same with recompute on."""
    transient: np.ndarray
    """[L] a recomputed layer's full activations for the largest micro-batch."""
    send: np.ndarray
    """[L+1] transfer time (both directions) over the sample at the cut before layer c."""
    static: np.ndarray
    """[L] static bytes per layer."""


def layer_loads(cost: CostModel, T: np.ndarray, S2: np.ndarray) -> LayerLoads:
    """Cost each layer alone on micro-batches with stream figures T, S2 ([n_mb, K])."""
    L = len(cost.layers)
    single = [(i, i + 1) for i in range(L)]
    off = micro_batch_costs(stage_costs(cost, single, [False] * L), T, S2)
    on = micro_batch_costs(stage_costs(cost, single, [True] * L), T, S2)
    big = int(np.argmax(off.act.sum(axis=0))) if T.shape[0] else 0
    hw = cost.hardware
    send = (send_seconds(hw, cost.cut_fwd_bytes @ T.T).sum(axis=1)  # [L+1]
            + send_seconds(hw, cost.cut_bwd_bytes @ T.T).sum(axis=1))
    return LayerLoads(time=(off.fwd + off.bwd).sum(axis=1),
                      recompute_time=(on.bwd - off.bwd).sum(axis=1),
                      act=off.act[:, big], act_rc=on.act[:, big], transient=on.transient[:, big],
                      send=send, static=np.array([cost.static_bytes(i, i + 1) for i in range(L)]))


def balanced_partition(loads: LayerLoads, pp: int, usable: float) -> StagePlan | None:
    """Minimise the largest stage time (layer time + the sends at its cuts) with every stage in
    memory, stage s holding pp - s micro-batches in flight (1F1B); a stage recomputes only
    where it does not fit otherwise. None if nothing fits."""
    L = len(loads.time)
    check_pp(pp, L, "(layers)")
    ct = np.concatenate([[0.0], np.cumsum(loads.time)])
    cr = np.concatenate([[0.0], np.cumsum(loads.recompute_time)])
    ca = np.concatenate([[0.0], np.cumsum(loads.act)])
    crc = np.concatenate([[0.0], np.cumsum(loads.act_rc)])
    cs = np.concatenate([[0.0], np.cumsum(loads.static)])

    def stage(s: int, a: int, b: int) -> tuple[float, bool] | None:
        base = ct[b] - ct[a] + (loads.send[a] if a > 0 else 0.0) + (loads.send[b] if b < L else 0.0)
        static = cs[b] - cs[a]
        k = pp - s
        if static + k * (ca[b] - ca[a]) <= usable:
            return base, False
        tr = float(loads.transient[a:b].max()) if b > a else 0.0
        if static + k * (crc[b] - crc[a]) + tr <= usable:
            return base + cr[b] - cr[a], True
        return None

    def probe(limit: float) -> StagePlan | None:
        out, rc, a = [], [], 0
        for s in range(pp):
            left = pp - s - 1
            best = None
            b = a + 1
            while b <= L - left:
                r = stage(s, a, b)
                if r is None or r[0] > limit:
                    if b == a + 1:
                        return None
                    break
                best = (b, r[1])
                b += 1
            if best is None:
                return None
            out.append((a, best[0]))
            rc.append(best[1])
            a = best[0]
        return StagePlan(stages=out, recompute=rc) if a == L else None

    lo, hi = 0.0, float(ct[-1] + cr[-1] + loads.send.sum()) + 1.0
    best = probe(hi)
    if best is None:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        plan = probe(mid)
        if plan is None:
            lo = mid
        else:
            hi, best = mid, plan
    return best


def shift_cuts(plan: StagePlan, first: int, last: int, d: int) -> StagePlan | None:
    """The plan with cuts first..last (cut c starts stage c) moved by d layers together, or
    None when a stage would become empty."""
    cuts = [a for a, _ in plan.stages] + [plan.stages[-1][1]]
    for c in range(first, last + 1):
        cuts[c] += d
    if any(cuts[i] >= cuts[i + 1] for i in range(len(cuts) - 1)):
        return None
    return StagePlan(stages=[(cuts[i], cuts[i + 1]) for i in range(plan.pp)],
                     recompute=plan.recompute)


def hill_climb(plan: StagePlan, score: Callable[[StagePlan], float], *, rounds: int = 3,
               steps: Sequence[int] = (1, 2, 4), blocks: bool = False) -> tuple[StagePlan, float]:
    """Move single cuts by a few layers (and toggle recompute) while the score improves;
    `blocks`: also move runs of neighbouring cuts together by one layer. A single move cannot
    shift every stage by one block at once (each step through is worse when the layers are
    coarse: a 7B LLM block is 1/8 of a stage at pp=4), and that is often what balances the
    stages or moves load off the last ones, which wait for every earlier stage's first
    forward and last backward."""
    best, best_s = plan, score(plan)
    for _ in range(rounds):
        improved = False
        moves = [(c, c, sign * d) for c in range(1, best.pp) for d in steps for sign in (-1, 1)]
        if blocks:
            moves += [(c0, c1, sign) for c0 in range(1, best.pp) for c1 in range(c0 + 1, best.pp)
                      for sign in (-1, 1)]
        for c0, c1, d in moves:
            cand = shift_cuts(best, c0, c1, d)
            if cand is None:
                continue
            s = score(cand)
            if s < best_s:
                best, best_s, improved = cand, s, True
        for s_i in range(best.pp):
            rc = list(best.recompute)
            rc[s_i] = not rc[s_i]
            cand = StagePlan(stages=best.stages, recompute=rc)
            s = score(cand)
            if s < best_s:
                best, best_s, improved = cand, s, True
        if not improved:
            break
    return best, best_s


def representative_steps(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                         pp: int, dp: int, keep: int = SAMPLE_REPLICAS
                         ) -> tuple[list[list[int]], int]:
    """What the partition search plans: the steps themselves when dp <= keep, else, per step,
    the `keep` replicas with the heaviest busiest stage (the step ends with its slowest
    replica) after dealing the step as the balancer does on a parameter-balanced partition,
    each planned as a replica of its own. Returns the row lists and the replicas each one is
    dealt to. Planning `keep` replicas instead of dp keeps the search's cost flat in dp."""
    if dp <= keep:
        return [list(rows) for rows in steps], dp
    sc = stage_costs(cost, parameters_partition([l.params for l in cost.layers], pp), [False] * pp)
    out = []
    for rows in steps:
        rows = list(rows)
        work, _, _ = sample_work(sc, table.rows(rows))
        reps = [r for r in deal(work, dp) if r]
        heavy = sorted(reps, key=lambda r: -float(work[r].sum(axis=0).max()))[:keep]
        out += [[rows[i] for i in r] for r in heavy]
    return out, 1


def data_aware_stages(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]], *,
                      pp: int, dp: int, micro_batches: int,
                      labels: Sequence[str] | None = None) -> StagePlan:
    """Partition on real micro-batches: balance the sample steps on a provisional partition,
    range-search the bottleneck on those micro-batches, hill-climb the cuts and recompute flags
    on the simulated step time of the same micro-batches, and keep whichever candidate is
    fastest once its own micro-batches are re-planned (the best micro-batch count and sizes
    depend on the partition). A last hill climb moves single cuts by one layer, each candidate
    judged with its re-planned micro-batches. Above SAMPLE_REPLICAS replicas, the search
    plans the heaviest replicas of each step only (`representative_steps`)."""
    L = len(cost.layers)
    check_pp(pp, L, cost.model.name)
    steps, dp = representative_steps(cost, table, steps, pp=pp, dp=dp)
    replanned: dict[tuple, float] = {}
    costed: dict[tuple, StageCosts] = {}

    def replan(p: StagePlan) -> float:
        key = (p.stages, p.recompute)
        if key not in replanned:
            replanned[key] = planned_steps_time(cost, table, steps, p, dp=dp, micro_batches=micro_batches,
                                                labels=labels, thorough=False)
        return replanned[key]

    plan = StagePlan(stages=parameters_partition([l.params for l in cost.layers], pp),
                     recompute=[True] * pp)
    best_plan, best_t = plan, replan(plan)
    for it in range(3):
        sc = stage_costs(cost, plan.stages, plan.recompute)
        # equal micro-batches on the first round, the policy's own (ramped) ones after
        reps = [balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches,
                             labels=labels, search=it > 0, thorough=False) for rows in steps]
        mbs = [mb for rep in reps for r in rep for mb in r]
        T, S2 = mb_streams(table, mbs, packing=True)
        loads = layer_loads(cost, T, S2)
        cand = balanced_partition(loads, pp, cost.usable_bytes) or plan

        score = _fixed_batches_time(cost, costed, pp, [[mb_streams(table, r, packing=True) for r in rep if r]
                                                       for rep in reps])
        for start in (cand, plan):
            p, _ = hill_climb(start, score, blocks=True)
            t = replan(p)
            if t < best_t:
                best_plan, best_t = p, t
        if it > 0 and best_plan.stages == plan.stages and best_plan.recompute == plan.recompute:
            break
        plan = best_plan
    for cand in first_stage_candidates(cost, table, steps, best_plan, loads, dp=dp,
                                       micro_batches=micro_batches):
        t = replan(cand)
        if t < (1.0 - FIRST_STAGE_GAIN) * best_t:
            best_plan, best_t = cand, t
    best_plan, _ = hill_climb(best_plan, replan, rounds=2, steps=(1,), blocks=True)
    first_free = StagePlan(stages=best_plan.stages, recompute=(False,) + best_plan.recompute[1:])
    if _first_stage_tight(cost, table, steps, first_free, dp):
        best_plan = _final_choice(cost, table, steps, replanned, best_plan, dp=dp, micro_batches=micro_batches,
                                  labels=labels)
    return recompute_only_where_needed(best_plan, replan)


def _fixed_batches_time(cost: CostModel, costed: dict[tuple, StageCosts], pp: int,
                        streams: list) -> Callable[[StagePlan], float]:
    """The simulated time of fixed micro-batches (`streams`: per step, per replica, the packed
    token and square matrices) on a partition: what evaluate_step gives for them, on the fast
    paths (1F1B makespan, exact in-flight windows); inf where memory does not hold. This is the
    partition search's inner loop; `costed` caches each partition's stage costs across calls."""
    hw = cost.hardware

    def score(p: StagePlan) -> float:
        key = (p.stages, p.recompute)
        s = costed.get(key)
        if s is None:
            s = costed[key] = stage_costs(cost, p.stages, p.recompute)
        total = 0.0
        for step in streams:
            slowest = 0.0
            for T, S2 in step:
                m = T.shape[0]
                span = makespan(make_schedule("1f1b", pp, m), *stage_times(s, T, S2))
                tr = (s.transient[:, None, :] * T[None, :, :]).max(axis=2)
                if np.any(window_peaks(s.act @ T.T, tr) + s.static > cost.usable_bytes * (1 + 1e-9)):
                    return np.inf
                slowest = max(slowest, hw.replica_seconds(span, m))
            total += hw.step_seconds(slowest)
        return total

    return score


def _final_choice(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                  replanned: dict[tuple, float], best: StagePlan, *, dp: int, micro_batches: int,
                  labels: Sequence[str] | None) -> StagePlan:
    """Where memory binds on the first stage, the trial plans rank partitions within a fraction
    of a percent of each other (their single start, no shaping, no targeted search): the last
    choice among the best few trial partitions (`replanned`: partition -> trial time) is made
    with each step's own plan."""
    ranked = sorted(replanned.items(), key=lambda kv: kv[1])
    finalists = [StagePlan(stages=k[0], recompute=k[1]) for k, t in ranked[:FINALISTS]
                 if np.isfinite(t) and t <= (1.0 + FINAL_SPREAD) * ranked[0][1]]
    if len(finalists) < 2:
        return best
    return min(finalists, key=lambda p: planned_steps_time(
        cost, table, steps, p, dp=dp, micro_batches=micro_batches, labels=labels, thorough=True))


def recompute_only_where_needed(plan: StagePlan, time: Callable[[StagePlan], float]) -> StagePlan:
    """`plan` with recompute off on every stage where that costs no simulated time. The search
    starts with recompute everywhere and turns it off only where that is faster, so a stage
    off the critical path (often the last, which has little to wait for) kept a recompute that
    the simulated step does not see and a real one pays: a second forward of its layers."""
    best_t = time(plan)
    for s in range(plan.pp):
        if plan.recompute[s]:
            cand = StagePlan(stages=plan.stages, recompute=[r and i != s for i, r in enumerate(plan.recompute)])
            t = time(cand)
            if np.isfinite(t) and t <= best_t:
                plan, best_t = cand, t
    return plan


def planned_steps_time(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                       plan: StagePlan, *, dp: int, micro_batches: int,
                       labels: Sequence[str] | None, thorough: bool) -> float:
    """Sum of the steps' simulated times, each step balanced on `plan` (`thorough`: the
    step's own plan; else the search's lighter trial plan); inf when a step does not fit."""
    sc = stage_costs(cost, plan.stages, plan.recompute)
    total = 0.0
    try:
        for rows in steps:
            rep = balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches, labels=labels,
                               thorough=thorough)
            ev = evaluate_step(sc, table, rep, packing=True)
            if not ev.fits:
                return np.inf
            total += ev.step_time
    except ValueError:  # a stage or a sample does not fit under this partition
        return np.inf
    return total


def first_stage_candidates(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                           plan: StagePlan, loads: LayerLoads, *, dp: int, micro_batches: int
                           ) -> list[StagePlan]:
    """Partitions that end the first stage further on, its recompute off, ranked by a fluid
    estimate, for the search to re-plan (the best FIRST_STAGE_REPLANS better than `plan`'s
    own estimate).

    The first stage holds the most micro-batches in flight (pp under 1F1B), so it is where
    memory binds when encoders train, and memory is what re-planned micro-batches change:
    taking LLM blocks onto an encoder stage needs more, smaller micro-batches (or ones that
    hold their encoder activations more evenly, `refine`). The range search and the cut moves
    judge memory with the micro-batches of the plan they start from, which such a stage
    overflows, and the final climb moves one layer at a time while an LLM block is 1/8 of a
    stage and the LLM embedding alone costs more than it brings. So: for each end of the first
    stage up to FIRST_STAGE_REACH layers past the current one, the rest split by the range
    search on time (`loads`), and each priced by the fluid 1F1B plan of every probe replica
    with its own micro-batch count (`ReplicaPlanner.rank_profiles`: milliseconds, memory
    capped as packing would)."""
    L = len(cost.layers)
    pp = plan.pp
    end = plan.stages[0][1]
    if pp < 2:
        return []
    # the first stage without recompute: what these candidates are for (an extra forward
    # over every encoder block costs more than the LLM blocks its memory would make room for)
    flags = (False,) + plan.recompute[1:]
    if not _first_stage_tight(cost, table, steps, StagePlan(stages=plan.stages, recompute=flags), dp):
        return []
    own = fluid_steps_time(cost, table, steps, plan, dp=dp, micro_batches=micro_batches)
    scored = []
    for b in range(end, min(end + FIRST_STAGE_REACH, L - (pp - 1)) + 1):
        if b == end:
            stages = list(plan.stages)
        else:
            tail = balanced_partition(_tail_loads(loads, b), pp - 1, np.inf)
            if tail is None:
                continue
            stages = [(0, b)] + [(a + b, c + b) for a, c in tail.stages]
        cand = StagePlan(stages=stages, recompute=flags)
        if cand == plan:
            continue
        t = fluid_steps_time(cost, table, steps, cand, dp=dp, micro_batches=micro_batches)
        if t < own:
            scored.append((t, b, cand))
    return [c for _, _, c in sorted(scored, key=lambda x: (x[0], x[1]))[:FIRST_STAGE_REPLANS]]


def _first_stage_tight(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                       plan: StagePlan, dp: int) -> bool:
    """Whether a replica's share of some probe step keeps more activations on the first stage
    than fit beside its weights (memory can bind there)."""
    sc = stage_costs(cost, plan.stages, plan.recompute)
    room = cost.usable_bytes - sc.static[0]
    for rows in steps:
        _, act, tr = sample_work(sc, table.rows(list(rows)))
        if (act[:, 0] + tr[:, 0]).sum() / dp > room:
            return True
    return False


def _tail_loads(loads: LayerLoads, b: int) -> LayerLoads:
    """The layer loads from layer b on, memory left out (re-planned micro-batches decide it)."""
    zero = np.zeros(len(loads.time) - b)
    return LayerLoads(time=loads.time[b:], recompute_time=loads.recompute_time[b:], act=zero,
                      act_rc=zero, transient=zero, send=loads.send[b:], static=zero)


def fluid_steps_time(cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                     plan: StagePlan, *, dp: int, micro_batches: int) -> float:
    """Sum over the steps of the slowest replica's best fluid plan (`rank_profiles`; inf when
    a stage or a sample does not fit)."""
    sc = stage_costs(cost, plan.stages, plan.recompute)
    budget = cost.usable_bytes - sc.static
    if np.any(budget <= 0):
        return np.inf
    total = 0.0
    for rows in steps:
        sub = table.rows(list(rows))
        work, act, tr = sample_work(sc, sub)
        if np.any(act + tr > budget[None, :]):
            return np.inf
        slowest = 0.0
        for local in deal(work, dp):
            if not local:
                continue
            idx = np.asarray(local, dtype=np.int64)
            rp = ReplicaPlanner(sc, sub.tokens[idx], sub.squares[idx], work[idx], act[idx],
                                tr[idx], budget)
            slowest = max(slowest, rp.rank_profiles(micro_batches, True)[0][0])
        total += cost.hardware.step_seconds(slowest)
    return total
