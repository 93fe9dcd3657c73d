"""Data-aware micro-batch balancer: samples -> replicas -> packed micro-batches, ordered.

For one step it:

1. costs every sample on every stage (marginal forward+backward time at the top of the
   efficiency curve, kept activation bytes); a sample that cannot fit on some stage even
   alone is an error naming the sample and the limit;
2. deals samples to replicas, largest first, each to the replica whose busiest stage stays
   lowest (a vector load: encoder and LLM stages are balanced at once, not tokens alone);
3. per replica, tries micro-batch counts on a geometric grid refined around the best, and
   for each packs the samples into that many micro-batches the same way (within memory:
   `in_flight x activations + transient <= memory - static` on every stage);
4. orders the micro-batches (a few candidate orders) and keeps whichever the 1F1B
   simulator says is fastest; then a short local search moves single samples off the
   bottleneck stage's heaviest micro-batch while the simulated makespan improves.

Everything is judged by the same simulator that scores the baselines.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmpipe.planner.cost import MicroBatchCosts, SampleTable, StageCosts, sample_work
from mmpipe.planner.step import Replicas, mb_costs, simulate_replica

GB = 1e9


def balance_step(sc: StageCosts, table: SampleTable, rows: Sequence[int], *, dp: int,
                 micro_batches: int, labels: Sequence[str] | None = None,
                 search: bool = True) -> Replicas:
    """Plan one step of the data-aware policy.

    Args:
        sc: stage costs of the chosen partition and recompute.
        table: stream figures of (at least) the step's samples.
        rows: the step's samples as rows of `table`.
        dp: data-parallel replicas.
        micro_batches: the configured count (one of the candidates tried).
        labels: how to name each row in errors (e.g. `trace line 17`), indexed like `table`.
        search: run the local search (off = greedy only).
    Returns:
        per replica, its micro-batches in execution order, lists of rows of `table`.
    """
    rows = list(rows)
    if not rows:
        return [[] for _ in range(dp)]
    work_all, act_all, tr_all = sample_work(sc, table)
    work, act, tr = work_all[rows], act_all[rows], tr_all[rows]
    budget = sc.cost.hardware.usable_bytes - sc.static
    _check_static(sc, budget)
    _check_alone(sc, rows, act + tr, budget, labels)
    per_replica = _deal(work, dp)
    out: Replicas = []
    for r in range(dp):
        local = per_replica[r]
        if not local:
            out.append([])
            continue
        mbs = _plan_replica(sc, table, [rows[i] for i in local], work[local], act[local],
                            tr[local], budget, micro_batches, search)
        out.append(mbs)
    return out


def _check_static(sc: StageCosts, budget: np.ndarray) -> None:
    if np.all(budget > 0):
        return
    s = int(np.argmin(budget))
    a, b = sc.stages[s]
    names = sc.cost.names
    hw = sc.cost.hardware
    raise ValueError(
        f"stage {s} ({names[a]}..{names[b - 1]}) needs {sc.static[s] / GB:.1f} GB for weights, "
        f"gradients and optimizer states alone, more than the {hw.usable_bytes / GB:.1f} GB usable "
        f"(hardware.memory_gb={hw.memory_gb:g}); raise parallel.pp or parallel.dp, or train fewer "
        f"layers (train.trainable)")


def _check_alone(sc: StageCosts, rows: list[int], need: np.ndarray, budget: np.ndarray,
                 labels: Sequence[str] | None) -> None:
    over = need > budget[None, :]
    if not over.any():
        return
    i, s = map(int, np.argwhere(over)[0])
    names = sc.cost.names
    a, b = sc.stages[s]
    who = labels[rows[i]] if labels is not None else f"sample {rows[i]}"
    raise ValueError(
        f"{who} needs {need[i, s] / GB:.1f} GB of activations on stage {s} "
        f"({names[a]}..{names[b - 1]}) even alone, but only {max(budget[s], 0) / GB:.1f} GB "
        f"are left there ({sc.cost.hardware.usable_fraction:.0%} of "
        f"hardware.memory_gb={sc.cost.hardware.memory_gb:g} less {sc.static[s] / GB:.1f} GB of "
        f"weights and optimizer states); raise parallel.pp, recompute that stage or drop the sample")


def _deal(work: np.ndarray, dp: int) -> list[list[int]]:
    """Largest first, each sample to the replica whose busiest stage stays lowest."""
    n, P = work.shape
    order = np.argsort(-work.sum(axis=1), kind="stable")
    loads = np.zeros((dp, P))
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in order:
        cand = (loads + work[i]).max(axis=1) + 1e-12 * loads.sum(axis=1)
        r = int(np.argmin(cand))
        loads[r] += work[i]
        out[r].append(int(i))
    return out


def _pack(work: np.ndarray, mem: np.ndarray, budget: np.ndarray, m: int) -> tuple[list[list[int]], bool]:
    """Largest first into m bins minimising the bin's busiest stage, within memory.
    Returns the bins (local indices) and whether every bin respects the budget."""
    n, P = work.shape
    order = np.argsort(-work.sum(axis=1), kind="stable")
    loads = np.zeros((m, P))
    used = np.zeros((m, P))
    bins: list[list[int]] = [[] for _ in range(m)]
    counts = np.zeros(m)
    ok = True
    for i in order:
        fits = np.all(used + mem[i] <= budget, axis=1)
        cand = (loads + work[i]).max(axis=1)
        if fits.any():
            cand = np.where(fits, cand, np.inf)
        else:
            ok = False
            cand = used.max(axis=1)
        # empty bins first among equals keeps every bin non-empty when n >= m
        j = int(np.argmin(cand + 1e-9 * counts))
        counts[j] += 1
        loads[j] += work[i]
        used[j] += mem[i]
        bins[j].append(int(i))
    return [b for b in bins if b], ok


def _orders(c_fwd: np.ndarray, c_tot: np.ndarray) -> list[np.ndarray]:
    """Candidate execution orders of micro-batches (indices)."""
    m = c_fwd.shape[1]
    ident = np.arange(m)
    total = c_tot.sum(axis=0)
    asc = np.argsort(total, kind="stable")
    # lightest at both ends, heaviest in the middle (short warm-up and cool-down)
    ends = np.empty(m, dtype=int)
    ends[: (m + 1) // 2] = asc[0::2]
    ends[(m + 1) // 2:] = asc[1::2][::-1]
    # light first-stage forward early, light last-stage backward late
    warm = np.argsort(c_fwd[0] - c_tot[-1], kind="stable")
    return [ident, asc, ends, warm]


def _plan_replica(sc: StageCosts, table: SampleTable, rows: list[int], work: np.ndarray,
                  act: np.ndarray, tr: np.ndarray, budget: np.ndarray, m_hint: int,
                  search: bool) -> list[list[int]]:
    n = len(rows)
    P = sc.pp
    in_flight_base = np.array([P - s for s in range(P)], dtype=float)
    cache: dict[int, tuple[float, bool, list[list[int]]]] = {}

    def attempt(m: int) -> tuple[float, bool, list[list[int]]]:
        m = max(1, min(n, m))
        if m in cache:
            return cache[m]
        mem = act * np.minimum(in_flight_base, m)[None, :] + tr
        bins, ok = _pack(work, mem, budget, m)
        mbs = [[rows[i] for i in b] for b in bins]
        c = mb_costs(sc, table, mbs, packing=True)
        best_t, best_mbs = np.inf, mbs
        for order in _orders(c.fwd, c.fwd + c.bwd):
            sub = _take(c, order)
            t = simulate_replica(sc, sub).makespan
            if t < best_t:
                best_t, best_mbs = t, [mbs[k] for k in order]
        cache[m] = (best_t, ok, best_mbs)
        return cache[m]

    def key(m: int) -> tuple[bool, float]:
        t, ok, _ = attempt(m)
        return (not ok, t)

    grid = sorted({max(1, min(n, g)) for g in [m_hint] + [int(round(P * 2 ** (k / 2)))
                                                             for k in range(-2, 40)] if g <= n}
                  | {n})
    # walk the grid upwards (every other point) and stop once two points in a row are worse
    # than the best: the makespan is close to unimodal in m (bubble vs per-op overhead), and
    # the large counts are the expensive ones to try
    worse = 0
    for m in grid[::2] + [grid[-1]]:
        before = min(cache, key=lambda k: (not cache[k][1], cache[k][0])) if cache else None
        key(m)
        if before is not None and key(m) >= key(before):
            worse += 1
            if worse >= 2 and m >= m_hint:
                break
        else:
            worse = 0
    best_m = min(cache, key=lambda m: (not cache[m][1], cache[m][0]))
    i = grid.index(best_m) if best_m in grid else 0
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            key(grid[j])
    best_m = min(cache, key=lambda m: (not cache[m][1], cache[m][0]))
    # refine between the neighbours of the best grid point
    lo = max(1, int(best_m / 1.3))
    hi = min(n, int(best_m * 1.3) + 1)
    for m in sorted({lo, (lo + best_m) // 2, (best_m + hi) // 2, hi}):
        key(m)
    best_m = min(cache, key=lambda m: (not cache[m][1], cache[m][0]))
    t, ok, mbs = cache[best_m]
    if search and len(mbs) > 1:
        mbs = _local_search(sc, table, mbs, t, work, act, tr, budget, rows)
    return mbs


def _take(c: MicroBatchCosts, order: np.ndarray) -> MicroBatchCosts:
    return MicroBatchCosts(fwd=c.fwd[:, order], bwd_in=c.bwd_in[:, order],
                           bwd_w=c.bwd_w[:, order], act=c.act[:, order],
                           transient=c.transient[:, order], send_fwd=c.send_fwd[:, order],
                           send_bwd=c.send_bwd[:, order])


def _local_search(sc: StageCosts, table: SampleTable, mbs: list[list[int]], t0: float,
                  work: np.ndarray, act: np.ndarray, tr: np.ndarray, budget: np.ndarray,
                  rows: list[int], tries: int = 12) -> list[list[int]]:
    """Move one sample from the heaviest micro-batch on the bottleneck stage to the lightest
    one there, keeping the move when the simulated makespan drops."""
    P = sc.pp
    pos = {r: k for k, r in enumerate(rows)}
    best, best_t = [list(mb) for mb in mbs], t0
    m = len(best)
    in_flight = np.minimum(np.array([P - s for s in range(P)], dtype=float), m)
    for _ in range(tries):
        c = mb_costs(sc, table, best, packing=True)
        tot = c.fwd + c.bwd
        s = int(np.argmax(tot.sum(axis=1)))
        heavy = int(np.argmax(tot[s]))
        light = int(np.argmin(tot[s]))
        if heavy == light or len(best[heavy]) < 2:
            break
        gap = tot[s, heavy] - tot[s, light]
        # the sample whose move best halves the gap on the bottleneck stage
        cands = best[heavy]
        w = np.array([work[pos[r], s] for r in cands])
        k = int(np.argmin(np.abs(w - gap / 2)))
        moved = cands[k]
        new_mem = sum(act[pos[r]] * in_flight + tr[pos[r]] for r in best[light]) + \
            act[pos[moved]] * in_flight + tr[pos[moved]]
        if np.any(new_mem > budget):
            break
        trial = [list(mb) for mb in best]
        trial[heavy].remove(moved)
        trial[light].append(moved)
        t = simulate_replica(sc, mb_costs(sc, table, trial, packing=True)).makespan
        if t < best_t - 1e-12:
            best, best_t = trial, t
        else:
            break
    return best
