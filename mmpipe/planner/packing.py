"""Packing samples into bins, largest first: replicas of a step (`deal`) and micro-batches of
a replica (`lpt_pack`, with target shares from `ramp_shares` and the exact 1F1B memory)."""

from __future__ import annotations

import heapq

import numpy as np

from mmpipe.planner.memory import WindowMemory


def deal(work: np.ndarray, dp: int) -> list[list[int]]:
    """Largest first, each sample to the replica whose busiest stage stays lowest."""
    n, P = work.shape
    out: list[list[int]] = [[] for _ in range(dp)]
    if dp == 1:
        out[0] = list(range(n))
        return out
    order = np.argsort(-work.sum(axis=1), kind="stable")
    loads = [[0.0] * P for _ in range(dp)]
    wl = work.tolist()
    for i in order.tolist():
        w = wl[i]
        best_r, best_v = 0, np.inf
        for r in range(dp):
            ld = loads[r]
            v = max(ld[s] + w[s] for s in range(P)) + 1e-12 * sum(ld)
            if v < best_v:
                best_r, best_v = r, v
        ld = loads[best_r]
        for s in range(P):
            ld[s] += w[s]
        out[best_r].append(i)
    return out


def lpt_pack(order: list[int], work: list[list[float]], act: np.ndarray, tr: np.ndarray,
             budget: np.ndarray, inv_share: list[float],
             probe: int = 4) -> tuple[list[list[int]], bool]:
    """Largest first, each sample into the bin whose busiest stage, relative to the bin's
    target share, stays lowest; a bin is skipped when the sample would break the exact 1F1B
    in-flight memory of some stage (bins are in execution order: stage s holds bins q..q+K-1,
    K = min(P - s, m), while the backward of q runs; see `window_peaks`). Only the `probe`
    bins with the lowest relative busiest stage are examined per sample (a heap), so a pack
    costs O(n log m) rather than O(n m).

    Returns the bins (in target order, possibly some empty) and whether memory held."""
    m = len(inv_share)
    P = len(work[0]) if work else 0
    loads = [[0.0] * P for _ in range(m)]
    bins: list[list[int]] = [[] for _ in range(m)]
    heap = [(0.0, j) for j in range(m)]  # (relative busiest stage, bin); empty bins first
    # memory is tracked only on stages that all samples together could overfill
    bl = budget.tolist()
    tight_st = [s for s in range(P) if act[:, s].sum() + tr[:, s].sum() > bl[s]] if P else []
    tight = bool(tight_st)
    mem = WindowMemory(P, m, bl, tight_st) if tight else None
    al = act.tolist() if tight else []
    tl = tr.tolist() if tight else []
    ok = True
    for i in order:
        w = work[i]
        cands = [heapq.heappop(heap) for _ in range(min(probe, len(heap)))]
        best_k, best_v = -1, float("inf")
        check = tight and not mem.roomy(al[i], tl[i])
        for k, (_, j) in enumerate(cands):
            if check and not mem.fits(j, al[i], tl[i]):
                continue
            ld = loads[j]
            v = max(ld[s] + w[s] for s in range(P)) * inv_share[j]
            if v < best_v:
                best_k, best_v = k, v
        if best_k < 0:
            for c in cands:
                heapq.heappush(heap, c)
            # the fitting bin whose busiest stage is lowest relative to its share (checked in
            # that order: a memory check walks the in-flight windows, so stop at the first)
            by_load = sorted(range(m), key=lambda j: (max(loads[j]) * inv_share[j], j))
            j = next((j for j in by_load if mem.fits(j, al[i], tl[i])), -1)
            if j < 0:
                ok = False
                j = max(range(m), key=mem.room)
            heap = [c for c in heap if c[1] != j]
            heapq.heapify(heap)
            cands = [(0.0, j)]
            best_k = 0
        j = cands[best_k][1]
        ld = loads[j]
        for s in range(P):
            ld[s] += w[s]
        bins[j].append(i)
        if tight:
            mem.add(j, al[i], tl[i])
        cands[best_k] = (max(ld) * inv_share[j], j)
        for c in cands:
            heapq.heappush(heap, c)
    return bins, ok


def ramp_shares(m: int, ramp: float) -> np.ndarray:
    """Relative sizes of m micro-batches in execution order: growing by `ramp` per micro-batch
    from both ends towards a flat middle (1 = all equal); they sum to 1."""
    j = np.arange(m)
    if ramp <= 1.0 or m < 3:
        w = np.ones(m)
    else:
        edge = np.minimum(j, m - 1 - j)
        # the flat middle holds about half the micro-batches
        w = ramp ** np.minimum(edge, max(1, m // 4))
    return w / w.sum()


def edge_shares(m: int, head: float, head_growth: float, tail: float,
                tail_growth: float) -> np.ndarray:
    """Relative sizes of m micro-batches in execution order: a flat top with a geometric ramp
    at each end, each end with its own start (as a fraction of the top) and growth per
    micro-batch; they sum to 1. The two ends differ because under 1F1B the warm-up waits on the
    first micro-batches' forwards and the cool-down on the last ones' backwards (twice the
    forward where the layers train, nothing where they are frozen)."""
    j = np.arange(m)
    w = np.minimum(1.0, np.minimum(head * head_growth ** j, tail * tail_growth ** (m - 1 - j)))
    return w / w.sum()
