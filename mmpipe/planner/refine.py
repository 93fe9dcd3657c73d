"""Refining a packing so that every micro-batch holds its target share of every stage's work,
within the exact 1F1B in-flight memory.

`packing.lpt_pack` places samples largest first, each into the micro-batch whose *busiest*
stage is lowest relative to its share; where samples differ in how their work splits over the
stages (an audio clip loads the encoder stage, a long text the LLM stages, an image both), a
micro-batch ends up heavy on one stage and light on another, while the fluid model that chose
the count and the sizes assumed each micro-batch holds the same share of every stage. Under
1F1B such mismatches stall the pipeline, and they matter most when no stage has slack: when
memory on the encoder stage is what keeps LLM blocks off it, the stage that takes them is as
busy as the others (audio-mix x omni-7b with everything trainable, the LLM embedding and two
blocks on the encoder stage, 26 micro-batches: 2.204 s packed largest first, 2.066 s the fluid
plan, 2.065 s refined; tests/unit/planner/test_refine.py).

`refine_bins` is a steepest descent on the squared deviation of every micro-batch's stage loads
from its target (share x the replica's load, per stage, each stage scaled by its load):
moving sample i from micro-batch j to k, or swapping it with sample i' of k, changes it by a
closed form (below), so every move and every swap is priced at once by a few matrix products.
Each sample's best edit is taken, best first, several per pricing where they touch disjoint
micro-batches, each only if every stage's exact 1F1B windows (what `memory.window_peaks`
maximises) stay within memory. The caller (`replica.ReplicaPlanner.pack`) keeps the refined
packing only where the simulator finds it faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmpipe.planner.memory import in_flight_counts

MAX_SAMPLES = 320
"""Replicas of more samples are left as packed: the swaps price an n x n matrix per step (a
4096-sample step took 3x as long to plan), and moves alone, without swaps, left the audio
mix's packings 5% slower than with them; a replica that large holds many samples per
micro-batch, where single samples matter less."""


def refine_bins(work: np.ndarray, act: np.ndarray, tr: np.ndarray, budget: np.ndarray,
                bins: list[list[int]], share: np.ndarray, *, tight: bool,
                max_steps: int | None = None) -> list[list[int]]:
    """The packing after moves and swaps of single samples that bring every micro-batch's
    per-stage load closer to `share` x the replica's per-stage load, keeping every stage's
    exact 1F1B peak within `budget` (checked only when `tight`). No micro-batch is emptied.

    Args:
        work, act, tr: per sample and stage [n, P]: marginal work, kept and transient bytes.
        budget: per stage [P], bytes left for activations.
        bins: the packing (micro-batches in execution order, every one non-empty).
        share: [m] target share of each micro-batch (sums to 1).
        tight: whether memory can bind (else no window is checked).
        max_steps: edits at most (default 2n).
    """
    n, P = work.shape
    m = len(bins)
    if m < 2 or n < 3 or n > MAX_SAMPLES:
        return [list(b) for b in bins]
    bins = [list(b) for b in bins]
    tot = np.maximum(work.sum(axis=0), 1e-30)
    w = work / tot  # each stage in units of the replica's load on it
    where = np.empty(n, dtype=np.int64)
    for j, b in enumerate(bins):
        where[b] = j
    sizes = np.array([len(b) for b in bins])
    e = np.array([w[b].sum(axis=0) for b in bins]) - share[:, None]  # deviation [m, P]
    if tight:
        win, member = _windows(act, tr, bins)
        room = budget[:, None]
        eye = np.eye(m)
    ww = (w * w).sum(axis=1)
    pair = ww[:, None] + ww[None, :] - 2.0 * (w @ w.T)  # |w_i - w_i'|^2
    G = w @ e.T  # [n, m]: w_i . e_k
    rows = np.arange(n)
    left = max_steps if max_steps is not None else 2 * n
    while left > 0:
        best, best_k, partner = _best_edits(G, pair, ww, where, sizes, rows)
        # each sample's best edit, best first; edits on disjoint pairs of micro-batches change
        # disjoint terms of the objective, so several are applied per pricing
        good = np.flatnonzero(best < -1e-12)
        if good.size == 0:
            break
        good = good[np.argsort(best[good], kind="stable")]
        deltas = None
        if tight:
            # every candidate's change of every window at once; those that break memory
            # against the windows as they stand are dropped before the loop
            deltas = _window_deltas(act, tr, member, eye, good, where[good], best_k[good],
                                    partner[good])
            ok = ~(win[None] + deltas > room[None]).any(axis=(1, 2))
            good, deltas = good[ok], deltas[ok]
        edits = _Edits(bins, where, sizes, e, w, win if tight else None, room if tight else None, deltas)
        touched, done = edits.apply(good, best_k, partner)
        left -= done
        if not touched:
            break
        cols = sorted(touched)
        G[:, cols] = w @ e[cols].T
    return bins


def _best_edits(G: np.ndarray, pair: np.ndarray, ww: np.ndarray, where: np.ndarray, sizes: np.ndarray,
                rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's best single edit, priced in one pass: (change of the objective, the
    micro-batch it goes to, the sample it swaps with or -1 for a move)."""
    own = G[rows, where]
    # half the change of the objective sum |e|^2 for i: j -> k is
    # w_i.(e_k - e_j) + |w_i|^2 (e_j loses w_i, e_k gains it)
    mv = G - own[:, None] + ww[:, None]
    mv[rows, where] = np.inf
    mv[sizes[where] < 2] = np.inf
    best_k = np.argmin(mv, axis=1)
    best = mv[rows, best_k]
    # i: j -> k and i': k -> j with d = w_i - w_i': d.(e_k - e_j) + |d|^2, and
    # d.e_k = G[i, k] - G[i', k], d.e_j = G[i, j] - G[i', j]
    sw = G[:, where]
    sw += sw.T
    sw += pair
    sw -= own[None, :]  # own[i] is the same along a row: taken off after the argmin
    sw[where[:, None] == where[None, :]] = np.inf
    best_i2 = np.argmin(sw, axis=1)
    best_sw = sw[rows, best_i2] - own
    use = best_sw < best
    best = np.where(use, best_sw, best)
    partner = np.where(use, best_i2, -1)
    best_k = np.where(use, where[best_i2], best_k)
    return best, best_k, partner


@dataclass
class _Edits:
    """The packing's state that one round of edits changes in place: the bins, each sample's
    micro-batch, the micro-batch sizes, the deviations from the shares and (memory bound) the
    in-flight windows with each candidate's change of them."""

    bins: list[list[int]]
    where: np.ndarray
    sizes: np.ndarray
    e: np.ndarray
    w: np.ndarray
    win: np.ndarray | None
    room: np.ndarray | None
    deltas: np.ndarray | None

    def apply(self, good: np.ndarray, best_k: np.ndarray, partner: np.ndarray) -> tuple[set[int], int]:
        """Apply the candidates in order, at most one edit per micro-batch pair a round.
        Returns the micro-batches touched and the number of edits made."""
        bins, where, sizes, e, w = self.bins, self.where, self.sizes, self.e, self.w
        touched: set[int] = set()
        done = 0
        for c, i in enumerate(good.tolist()):
            dst, i2 = int(best_k[i]), int(partner[i])
            src = int(where[i])
            if src in touched or dst in touched or (i2 < 0 and sizes[src] < 2):
                continue
            if self.deltas is not None:
                d = self.deltas[c]
                if touched and (self.win + d > self.room).any():  # windows moved by this round's edits
                    continue
                self.win += d
            bins[src].remove(i)
            bins[dst].append(i)
            where[i] = dst
            e[src] -= w[i]
            e[dst] += w[i]
            if i2 >= 0:
                bins[dst].remove(i2)
                bins[src].append(i2)
                where[i2] = src
                e[dst] -= w[i2]
                e[src] += w[i2]
            else:
                sizes[src] -= 1
                sizes[dst] += 1
            touched.update((src, dst))
            done += 1
        return touched, done


def _window_deltas(act: np.ndarray, tr: np.ndarray, member: np.ndarray, eye: np.ndarray,
                   samples: np.ndarray, src: np.ndarray, dst: np.ndarray, partner: np.ndarray
                   ) -> np.ndarray:
    """[C, P, m]: how each candidate edit (sample -> dst, and partner -> src where >= 0)
    changes every stage's windows (kept bytes of the micro-batches each holds, transient of
    its first)."""
    swap = partner >= 0
    p = np.where(swap, partner, 0)
    a = act[samples] - np.where(swap[:, None], act[p], 0.0)
    t = tr[samples] - np.where(swap[:, None], tr[p], 0.0)
    hold = (member[:, :, dst] - member[:, :, src]).transpose(2, 0, 1)  # [C, P, m]
    first = eye[dst] - eye[src]  # [C, m]
    return a[:, :, None] * hold + t[:, :, None] * first[:, None, :]


def _windows(act: np.ndarray, tr: np.ndarray, bins: list[list[int]]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per stage and window q [P, m]: the kept bytes of micro-batches q..q+K-1 plus q's
    transient (what `memory.window_peaks` maximises), and which micro-batches each window holds
    [P, m (window), m (micro-batch)], so that an edit's effect on every window is one product."""
    P = act.shape[1]
    m = len(bins)
    A = np.array([act[b].sum(axis=0) for b in bins]).T
    R = np.array([tr[b].sum(axis=0) for b in bins]).T
    member = np.zeros((P, m, m))
    q = np.arange(m)
    for s, K in enumerate(in_flight_counts(P, m)):
        member[s] = (q[None, :] >= q[:, None]) & (q[None, :] < q[:, None] + K)
    win = np.einsum("sqj,sj->sq", member, A) + R
    return win, member
