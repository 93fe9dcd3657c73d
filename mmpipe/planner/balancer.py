"""Data-aware micro-batch balancer: samples -> replicas -> packed micro-batches, ordered.

For one step it:

1. costs every sample on every stage (marginal forward+backward time at the top of the
   efficiency curve, kept activation bytes); a sample that cannot fit on some stage even
   alone is an error naming the sample and the limit;
2. deals samples to replicas, largest first, each to the replica whose busiest stage stays
   lowest (a vector load: encoder and LLM stages are balanced at once, not tokens alone);
3. per replica, ranks micro-batch counts `m` (a geometric grid) and size profiles with a
   *fluid* simulation: the replica's streams split exactly by each micro-batch's target
   share, costed and run through the 1F1B simulator (no packing, microseconds each; where
   memory binds, shares are capped so that the micro-batches in flight fit and the excess
   goes to the others, as packing within memory would do). Profiles: equal
   sizes and *ramped* ones, small at both ends of the step and large in the middle. Under
   1F1B the warm-up waits on the first micro-batches' forwards through the pipeline and the
   cool-down on the last ones' backwards, so small edge micro-batches shrink the bubble while
   the large middle ones keep the per-op overhead and the small-batch efficiency loss low.
   The best ramp is then reshaped freely near the ends (coordinate descent on the shares);
4. packs the best few candidates for real (largest first, each sample into the micro-batch
   whose busiest stage is lowest relative to its share, within memory) and simulates them.
   Memory is the exact 1F1B in-flight peak for the execution order (`memory.window_peaks`):
   stage s holds micro-batches q..q+K-1 (K = min(P - s, m)) while the backward of q runs, so
   the kept activations of those K plus q's transient must fit in `memory - static`; it is
   the figure the simulator reports, not `K x` each micro-batch's own activations;
5. runs a local search that moves single samples between neighbouring micro-batches near
   both ends while the simulated makespan drops, then a targeted one that moves samples out
   of the bottleneck stage's largest micro-batches into any other (a fixed simulation
   budget);
6. evens the replicas: swaps samples between the slowest and the fastest replica (a sample
   against a lighter one) while the slower of the two drops (a fixed simulation budget).

Steps 1, 2 and 6 are here; 3 to 5 are `replica.ReplicaPlanner` (packing in `packing`, the
memory windows in `memory`, trial edits in `bins`). Everything is judged by the same simulator
that scores the baselines (`makespan` is the exact makespan of `simulate` for 1F1B).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmpipe.planner.bins import BinCosts, CostedBins, edge_positions, edit_bins
from mmpipe.planner.packing import deal
from mmpipe.planner.replica import ReplicaPlanner
from mmpipe.planner.samples import SampleTable
from mmpipe.planner.stage_cost import StageCosts, sample_work
from mmpipe.planner.step import Replicas

GB = 1e9


def balance_step(sc: StageCosts, table: SampleTable, rows: Sequence[int], *, dp: int,
                 micro_batches: int, labels: Sequence[str] | None = None,
                 search: bool = True, thorough: bool = True) -> Replicas:
    """Plan one step of the data-aware policy.

    Args:
        sc: stage costs of the chosen partition and recompute.
        table: stream figures of (at least) the step's samples.
        rows: the step's samples as rows of `table`.
        dp: data-parallel replicas.
        micro_batches: the configured count (one of the candidates tried).
        labels: how to name each row in errors (e.g. `trace line 17`), indexed like `table`.
        search: try ramped profiles and run the local search (off = equal micro-batches only).
        thorough: shape the profiles, run the targeted search and search from two starts (off:
            ramps and the neighbour search only, for the partition search's many trial plans,
            where a fair comparison matters more than the last percent).
    Returns:
        per replica, its micro-batches in execution order, lists of rows of `table`.
    """
    rows = list(rows)
    if not rows:
        return [[] for _ in range(dp)]
    sub = table.rows(rows)
    work, act, tr = sample_work(sc, sub)
    budget = sc.cost.usable_bytes - sc.static
    check_static(sc, budget)
    check_alone(sc, rows, act + tr, budget, labels)
    per_replica = deal(work, dp)
    plans: Replicas = []
    for local in per_replica:
        if not local:
            plans.append([])
            continue
        idx = np.asarray(local, dtype=np.int64)
        planner = ReplicaPlanner(sc, sub.tokens[idx], sub.squares[idx], work[idx], act[idx],
                                 tr[idx], budget)
        bins = planner.plan(micro_batches, search, thorough)
        plans.append([[local[i] for i in b] for b in bins])
    if search and dp > 1:
        plans = _even_replicas(BinCosts(sc, sub.tokens, sub.squares, work, act, tr, budget), plans,
                               thorough=thorough)
    return [[[rows[i] for i in b] for b in bins] for bins in plans]


def _even_replicas(whole: BinCosts, plans: Replicas, *, thorough: bool) -> Replicas:
    """The step ends with the slowest replica. One sample is a sizeable step against the gap
    between replicas, so single moves rarely help; swap instead: out of the slow replica's
    edge micro-batches, the two whose loss of their lightest sample helps it most; their
    heaviest and median samples x, each against the sample y of an edge micro-batch of the
    fastest replica that is closest below x in work. A swap is kept when the slower of the
    two replicas drops and memory holds. `thorough` (the step's own plan, not the partition
    search's trial plans) also takes samples out of the two micro-batches heaviest on the slow
    replica's busiest stage (an indivisible long sample stalls the pipeline there, and the
    replica with it is the one to lighten), tries the lightest sample too, moves a sample
    outright where the fast replica's micro-batch holds none lighter, and may spend 128 trial
    simulations instead of 32 (a fixed count, not a clock, so every rank plans the same step).
    The partition search keeps the lighter evening, which is what its candidates were judged
    with."""
    budget = 128 if thorough else 32
    reps = [CostedBins(whole, [list(b) for b in bins]) if bins else None for bins in plans]
    if sum(r is not None for r in reps) < 2:
        return plans
    wsum = whole.work.sum(axis=1)
    left = budget
    while left > 0:
        live = [q for q, r in enumerate(reps) if r is not None]
        hi = max(live, key=lambda q: reps[q].t)
        lo = min(live, key=lambda q: reps[q].t)
        src, dst = reps[hi], reps[lo]
        if src.t <= dst.t * 1.0005:
            break
        gains = []
        # the edges, where a sample changes the bubble, and the micro-batches heaviest on the
        # slow replica's busiest stage, where it changes a stall
        sources = edge_positions(len(src.bins), edge=4)
        if thorough:
            busy = (src.ts[0] + src.ts[1]).sum(axis=1)
            sources += [int(q) for q in np.argsort(-(src.ts[0] + src.ts[1])[int(np.argmax(busy))], kind="stable")[:2]]
        for j in dict.fromkeys(sources):
            if len(src.bins[j]) < 2 or left <= 0:
                continue
            x = min(src.bins[j], key=lambda i: wsum[i])
            t, _ = src.trial({j: ([x], [])})
            left -= 1
            gains.append((t, j))
        gains.sort()
        best = None
        dpos = edge_positions(len(dst.bins), edge=4)
        for t_rm, j in gains[:2]:
            if t_rm >= src.t - 1e-12:
                break
            by = sorted(src.bins[j], key=lambda i: wsum[i])
            for x in dict.fromkeys((by[-1], by[len(by) // 2]) + ((by[0],) if thorough else ())):
                for k in dpos:
                    if left <= 0:
                        break
                    lighter = [i for i in dst.bins[k] if wsum[i] < wsum[x]]
                    if not lighter and not thorough:
                        continue
                    # a swap against the closest lighter sample, or (none lighter) a plain move
                    y = [max(lighter, key=lambda i: wsum[i])] if lighter else []
                    es = {j: ([x], y)}
                    t_s, st_s = src.trial(es)
                    left -= 1
                    if t_s >= src.t - 1e-12 or (best is not None and t_s >= best[0]):
                        continue
                    ed = {k: (y, [x])}
                    t_d, st_d = dst.trial(ed)
                    left -= 1
                    v = max(t_s, t_d)
                    if v < src.t - 1e-12 and (best is None or v < best[0]):
                        best = (v, es, t_s, st_s, ed, t_d, st_d)
        if best is None:
            break
        _, es, t_s, st_s, ed, t_d, st_d = best
        if not (whole.fits(edit_bins(src.bins, es)) and whole.fits(edit_bins(dst.bins, ed))):
            break
        src.apply(es, t_s, st_s)
        dst.apply(ed, t_d, st_d)
    return [r.bins if r is not None else [] for r in reps]


def check_static(sc: StageCosts, budget: np.ndarray) -> None:
    """ValueError naming the first stage whose weights, gradients and optimizer states alone
    leave no room (`budget`: bytes left per stage for activations)."""
    if np.all(budget > 0):
        return
    s = int(np.argmin(budget))
    a, b = sc.stages[s]
    names = sc.cost.names
    raise ValueError(
        f"stage {s} ({names[a]}..{names[b - 1]}) needs {sc.static[s] / GB:.3g} GB for weights, "
        f"gradients and optimizer states alone, more than the {sc.cost.usable_text()} "
        f"({sc.cost.memory_text()}); raise parallel.pp or parallel.dp, or train fewer "
        f"layers (train.trainable)")


def check_alone(sc: StageCosts, rows: list[int], need: np.ndarray, budget: np.ndarray,
                labels: Sequence[str] | None) -> None:
    """ValueError naming the first sample that does not fit on some stage even alone (`need`:
    its kept + transient bytes per stage)."""
    over = need > budget[None, :]
    if not over.any():
        return
    i, s = map(int, np.argwhere(over)[0])
    names = sc.cost.names
    a, b = sc.stages[s]
    who = labels[rows[i]] if labels is not None else f"sample {rows[i]}"
    raise ValueError(
        f"{who} needs {need[i, s] / GB:.3g} GB of activations on stage {s} "
        f"({names[a]}..{names[b - 1]}) even alone, but only {max(budget[s], 0) / GB:.3g} GB "
        f"are left there (the {sc.cost.usable_text()} of hardware.memory_gb="
        f"{sc.cost.hardware.memory_gb:g} less {sc.static[s] / GB:.3g} GB of "
        f"weights and optimizer states); raise parallel.pp, recompute that stage or drop the sample")
