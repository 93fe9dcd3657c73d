"""Exact 1F1B in-flight activation memory of micro-batches in execution order.

Stage s of P runs F0..F(K-1), then B(q), F(q+K) for each q (K = min(P - s, m)), so while B(q)
runs it holds the kept activations of micro-batches q..q+K-1 plus q's transient (a recomputed
block's full activations). `window_peaks` gives the peak of a finished packing;
`WindowMemory` checks it incrementally while samples are packed one by one.
"""

from __future__ import annotations

import numpy as np


def in_flight_counts(P: int, m: int) -> list[int]:
    """Micro-batches stage s holds at once under 1F1B: min(P - s, m)."""
    return [min(P - s, m) for s in range(P)]


def window_peaks(act: np.ndarray, tr: np.ndarray) -> np.ndarray:
    """Exact 1F1B activation peak per stage, given per-micro-batch kept bytes `act` [P, m] and
    transient bytes `tr` [P, m] in execution order. Stage s of P runs F0..F(K-1) then, for
    each q, B(q) then F(q+K) (K = min(P - s, m)), so while B(q) runs it holds micro-batches
    q..q+K-1 plus q's transient: peak_s = max_q sum(act[s, q:q+K]) + tr[s, q]. This is the
    figure `simulator.peak_memory` computes for the `1f1b` schedule."""
    P, m = act.shape
    out = np.zeros(P)
    if m == 0:
        return out
    c = np.concatenate([np.zeros((P, 1)), np.cumsum(act, axis=1)], axis=1)
    q = np.arange(m)
    for s, K in enumerate(in_flight_counts(P, m)):
        hi = np.minimum(q + K, m)
        out[s] = float(np.max(c[s, hi] - c[s, q] + tr[s]))
    return out


class WindowMemory:
    """Incremental exact 1F1B memory check while packing m micro-batches in execution order.

    Per stage s and micro-batch q it keeps the slack of the window B(q) runs in:
    budget_s - (act of micro-batches q..q+K-1 + transient of q). Adding a sample (kept bytes
    a, transient t) to micro-batch j lowers the slack of windows j-K+1..j by a, and of window
    j also by t. Only stages that all the samples together could overfill are tracked."""

    def __init__(self, P: int, m: int, budget: list[float], stages: list[int]) -> None:
        self.K = in_flight_counts(P, m)
        self.stages = stages
        self.slack = {s: [budget[s]] * m for s in stages}
        self.low = {s: budget[s] for s in stages}  # least slack of any window of stage s

    def roomy(self, a: list[float], t: list[float]) -> bool:
        """Whether the sample fits in every micro-batch (no window is that close to full)."""
        low = self.low
        return all(low[s] >= a[s] + t[s] for s in self.stages)

    def fits(self, j: int, a: list[float], t: list[float]) -> bool:
        """Whether the sample fits in micro-batch j: every window that holds j keeps room."""
        for s in self.stages:
            sl = self.slack[s]
            if sl[j] < a[s] + t[s]:
                return False
            need = a[s]
            for q in range(max(0, j - self.K[s] + 1), j):
                if sl[q] < need:
                    return False
        return True

    def room(self, j: int) -> float:
        """Least slack of any window that holds micro-batch j (for the fallback choice)."""
        v = float("inf")
        for s in self.stages:
            sl = self.slack[s]
            v = min(v, min(sl[max(0, j - self.K[s] + 1): j + 1]))
        return v

    def add(self, j: int, a: list[float], t: list[float]) -> None:
        """Put the sample into micro-batch j."""
        for s in self.stages:
            sl = self.slack[s]
            x = a[s]
            lw = self.low[s]
            for q in range(max(0, j - self.K[s] + 1), j):
                v = sl[q] - x
                sl[q] = v
                if v < lw:
                    lw = v
            v = sl[j] - x - t[s]
            sl[j] = v
            self.low[s] = v if v < lw else lw
