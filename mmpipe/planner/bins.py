"""What a grouping of samples into micro-batches (bins, in execution order) costs, and trial
edits of a grouping that re-cost only the bins they touch.

`BinCosts` holds a set of samples' figures (rows 0..n-1) and prices any grouping of them:
stream sums, stage times, the 1F1B makespan and the exact in-flight memory check.
`CostedBins` keeps one grouping costed so that a search can try moving or swapping samples
(`Edits`) for the price of the bins touched; `edit_bins` is the one way a grouping changes.
"""

from __future__ import annotations

import numpy as np

from mmpipe.planner.ladder import LLM_STREAM, pad_tokens, padded_streams
from mmpipe.planner.memory import window_peaks
from mmpipe.planner.samples import bin_sums
from mmpipe.planner.schedules import make_schedule
from mmpipe.planner.simulator import makespan
from mmpipe.planner.stage_cost import StageCosts, stage_times

Bins = list[list[int]]
"""Micro-batches in execution order, each a list of sample rows."""
Edits = dict[int, tuple[list[int], list[int]]]
"""Per bin index: the samples taken out of it and the samples appended to it."""


def edit_bins(bins: Bins, edits: Edits) -> Bins:
    """The grouping after the edits (a new outer list; bins not edited are shared)."""
    out = list(bins)
    for j, (gone, new) in edits.items():
        out[j] = [i for i in out[j] if i not in gone] + list(new)
    return out


def edge_positions(m: int, edge: int = 8) -> list[int]:
    """Micro-batches the searches move samples out of: the warm-up and cool-down ends, where a
    sample moved changes the bubble; a bounded count keeps the searches linear in m."""
    if m <= 2 * edge:
        return list(range(m))
    return list(range(edge)) + list(range(m - edge, m))


class BinCosts:
    """A set of samples on a partition's stages, and the cost of grouping them into bins."""

    def __init__(self, sc: StageCosts, tokens: np.ndarray, squares: np.ndarray,
                 work: np.ndarray, act: np.ndarray, tr: np.ndarray, budget: np.ndarray) -> None:
        """Args: stage costs; per sample [n, K] stream tokens and squared lengths; per sample
        and stage [n, P] marginal work, kept and transient activation bytes; per stage [P]
        bytes left for activations."""
        self.sc = sc
        self.tokens, self.squares = tokens, squares
        self.work, self.act, self.tr = work, act, tr
        self.budget = budget
        self.n, self.P = work.shape
        # memory can bind only where all samples together could overfill a stage
        self.tight = bool(np.any(act.sum(axis=0) + tr.sum(axis=0) > budget))

    def streams(self, bins: Bins) -> tuple[np.ndarray, np.ndarray]:
        """Stream tokens and squared lengths [m, K] of the bins (packed)."""
        return bin_sums(self.tokens, bins), bin_sums(self.squares, bins)

    def times(self, T: np.ndarray, S2: np.ndarray) -> tuple[np.ndarray, ...]:
        """[P, m] forward, backward, forward send and backward send times of bins with the
        samples' stream sums T, S2 (priced at the length the stage costs' ladder pads them to)."""
        return stage_times(self.sc, *padded_streams(self.sc.ladder, T, S2))

    def bytes(self, bins: Bins) -> tuple[np.ndarray, np.ndarray]:
        """Kept and transient bytes per stage and bin, [P, m] each (a ladder's padding tokens
        keep activations like any LLM token)."""
        A, R = bin_sums(self.act, bins).T, bin_sums(self.tr, bins).T
        if self.sc.ladder is not None:
            pad = pad_tokens(self.sc.ladder, bin_sums(self.tokens[:, LLM_STREAM], bins))
            A = A + np.outer(self.sc.act[:, LLM_STREAM], pad)
            R = R + np.outer(self.sc.transient[:, LLM_STREAM], pad)
        return A, R

    def fits(self, bins: Bins) -> bool:
        """Whether the bins, in this order, keep every stage's exact 1F1B in-flight peak (kept
        activations of the bins in flight plus the transient of the one in backward;
        transients summed over samples, an upper bound) within memory."""
        if not self.tight:
            return True
        A, R = self.bytes(bins)
        return bool(np.all(window_peaks(A, R) <= self.budget))

    def replica_time(self, span: float, m: int) -> float:
        """A replica's time from its 1F1B makespan over m micro-batches (the runtime's fixed
        cost per micro-batch on top), what every search compares."""
        return self.sc.cost.hardware.replica_seconds(span, m)

    def makespan(self, bins: Bins) -> float:
        """Simulated 1F1B makespan of the bins, plus the per-micro-batch overhead."""
        T, S2 = self.streams(bins)
        f, b, sf, sb = self.times(T, S2)
        return self.replica_time(makespan(make_schedule("1f1b", self.P, len(bins)), f, b, sf, sb),
                                 len(bins))


class CostedBins:
    """One grouping with its streams, times and makespan, for trial edits that re-cost only the
    bins they touch."""

    def __init__(self, costs: BinCosts, bins: Bins) -> None:
        self.costs = costs
        self.bins = bins
        self.T, self.S2 = costs.streams(bins)
        self.ts = costs.times(self.T, self.S2)
        self.sched = make_schedule("1f1b", costs.P, len(bins))
        self.t = costs.replica_time(makespan(self.sched, *self.ts), len(bins))

    def trial(self, edits: Edits) -> tuple[float, tuple]:
        """Makespan after the edits, and the state `apply` takes to keep them."""
        pl = self.costs
        cols = list(edits)
        T, S2 = self.T[cols].copy(), self.S2[cols].copy()
        for c, (out, inn) in enumerate(edits.values()):
            for i in out:
                T[c] -= pl.tokens[i]
                S2[c] -= pl.squares[i]
            for i in inn:
                T[c] += pl.tokens[i]
                S2[c] += pl.squares[i]
        new = pl.times(T, S2)
        ts = tuple(x.copy() for x in self.ts)
        for x, y in zip(ts, new):
            x[:, cols] = y
        span = makespan(self.sched, *ts)
        return pl.replica_time(span, len(self.bins)), (cols, T, S2, ts)

    def apply(self, edits: Edits, t: float, state: tuple) -> None:
        """Keep the edits of a trial (its makespan `t` and `state`)."""
        cols, T, S2, ts = state
        self.bins = edit_bins(self.bins, edits)
        self.T[cols], self.S2[cols] = T, S2
        self.ts, self.t = ts, t
