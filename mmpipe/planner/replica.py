"""One replica's micro-batches: count, size profile, packing and local searches.

`ReplicaPlanner.plan` ranks micro-batch counts `m` (a geometric grid) and size profiles with a
*fluid* simulation (the replica's streams split exactly by each micro-batch's target share,
costed and run through the 1F1B simulator, no packing; where memory binds the shares are
capped, `clip`), packs the best few candidates for real (`packing.lpt_pack` within the exact
in-flight memory) and simulates them, then improves the best one: single samples moved
between neighbouring micro-batches near both ends (`_local_search`), then samples moved out
of the bottleneck stage's largest micro-batches into any other (`_targeted`). Every search has
a fixed evaluation budget, not a clock, so every rank that plans a step gets the same plan.
"""

from __future__ import annotations

import numpy as np

from mmpipe.planner.bins import BinCosts, Bins, CostedBins, edge_positions, edit_bins
from mmpipe.planner.memory import in_flight_counts, window_peaks
from mmpipe.planner.packing import edge_shares, lpt_pack, ramp_shares
from mmpipe.planner.refine import refine_bins
from mmpipe.planner.schedules import make_schedule
from mmpipe.planner.simulator import makespan, simulate
from mmpipe.planner.stage_cost import StageCosts, stage_times

TARGETED_BUDGET = 1000
"""Micro-batch simulations (a trial of m micro-batches counts m) the targeted move search of
one replica may spend: a fixed count rather than a clock, so every rank plans alike."""
REFINE_GAIN = 0.01
"""A refined packing replaces the largest-first one only when it is this much faster."""
REFINED_PROFILES = 2
"""Of the ramped profiles packed, how many (best fluid estimate first) are refined; the shaped
ones always are. Refining costs about a packing's own time again."""
BIND_SHARE = 0.9
"""Memory binds on a stage when a packing's in-flight peak there reaches this share of it."""
RAMPS = (1.35, 1.8)
"""Growth factors of the ramped size profiles tried (1 = equal micro-batches)."""
SHAPE_START = (0.35, 1.4, 0.35, 1.4)
"""Where the profile search starts: (head start, head growth, tail start, tail growth) of
`packing.edge_shares`."""
SHAPE_STEP = (0.12, 0.2, 0.12, 0.2)
"""Its first step per parameter."""
SHAPE_LOW = (0.05, 1.0, 0.05, 1.0)
"""Its lower limits (growth 1: a flat end)."""
SHAPE_HIGH = (1.0, 3.0, 1.0, 3.0)
"""Its upper limits (start 1: no ramp at that end)."""
SHAPE_ROUNDS = 6
"""Rounds of the profile search (8 trials each)."""


class ReplicaPlanner(BinCosts):
    """Packs one replica's samples into micro-batches and judges them with the simulator."""

    def __init__(self, sc: StageCosts, tokens: np.ndarray, squares: np.ndarray,
                 work: np.ndarray, act: np.ndarray, tr: np.ndarray, budget: np.ndarray) -> None:
        super().__init__(sc, tokens, squares, work, act, tr, budget)
        self.order = np.argsort(-work.sum(axis=1), kind="stable")
        self._affine: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._caps: dict[int, float] = {}  # m -> the share cap of `clip`
        # (m, ramp) -> (simulated makespan, memory held, bins): the packing kept (refined or
        # not), and the largest-first one
        self.cache: dict[tuple[int, float], tuple[float, bool, Bins]] = {}
        self.plain: dict[tuple[int, float], tuple[float, bool, Bins]] = {}

    # ---------------------------------------------------------------- packing
    def pack(self, m: int, ramp: float, share: np.ndarray | None = None,
             refine: bool = True) -> tuple[float, bool, Bins]:
        """Largest first into m micro-batches with ramped target shares (or the given ones),
        then (`refine`, where memory binds across the micro-batches in flight) refined
        towards every stage's share; simulated time."""
        m = max(1, min(self.n, m))
        key = (m, ramp)
        if key in self.cache:
            return self.cache[key]
        if share is None or len(share) != m:
            share = ramp_shares(m, ramp)
        share = self.clip(share)
        if share is None:
            share = np.full(m, 1.0 / m)  # nothing fits: pack evenly, memory will say no
        inv = 1.0 / share
        bins, ok = lpt_pack(self.order.tolist(), self.work.tolist(), self.act, self.tr,
                            self.budget, inv.tolist())
        plain = self._ordered(bins, ok, ramp)
        self.plain[key] = self.cache[key] = plain
        if refine and all(bins) and self.windows_bind(bins):
            # where memory binds across micro-batches in flight, largest-first packing leaves
            # micro-batches heavy on one stage and light on another; bring each to its share
            # on every stage (`refine`)
            ref = refine_bins(self.work, self.act, self.tr, self.budget, bins, share, tight=True)
            done = self._ordered(ref, self.fits(ref), ramp)
            if (done[1] and not ok) or (done[1] == ok and done[0] < (1.0 - REFINE_GAIN) * plain[0]):
                self.cache[key] = done
        return self.cache[key]

    def windows_bind(self, bins: Bins) -> bool:
        """Whether memory shaped this packing on a stage that holds more than one micro-batch
        in flight: its exact 1F1B peak there is within BIND_SHARE of the budget. There (the
        encoder stage when encoders train) the in-flight windows, not single micro-batches,
        decide where samples may go, largest-first packing falls back to wherever they fit,
        and `refine_bins` pays for itself; elsewhere (the LM head's last stage holds one) it
        costs time and its gains are within what the local searches find."""
        if not self.tight:
            return False
        A, R = self.bytes(bins)
        peak = window_peaks(A, R)
        return any(k > 1 and peak[s] >= BIND_SHARE * self.budget[s]
                   for s, k in enumerate(in_flight_counts(self.P, len(bins))))

    def _ordered(self, bins: Bins, ok: bool, ramp: float) -> tuple[float, bool, Bins]:
        """A packing without its empty micro-batches, simulated; equal shares (`ramp` 1) also
        try heaviest in the middle, light ones at the ends."""
        P = self.P
        loads = np.array([self.work[bn].sum(axis=0) if bn else np.zeros(P) for bn in bins])
        counts = np.array([len(bn) for bn in bins])
        if not all(counts):
            bins = [b for b in bins if b]
            ok = ok and self.fits(bins)  # dropping empty bins regroups the windows
        t = self.makespan(bins)
        if ramp == 1.0:
            tot = loads[counts > 0].sum(axis=1)
            asc = np.argsort(tot, kind="stable")
            k = len(bins)
            ends = np.empty(k, dtype=int)
            ends[: (k + 1) // 2] = asc[0::2]
            ends[(k + 1) // 2:] = asc[1::2][::-1]
            alt = [bins[x] for x in ends]
            ta = self.makespan(alt)
            if ta < t and (not ok or self.fits(alt)):
                t, bins = ta, alt
        return t, ok, bins

    def _best(self) -> tuple[int, float]:
        """The cache key of the fastest packing that fits (the fastest of all if none fits)."""
        return min(self.cache, key=lambda k: (not self.cache[k][1], self.cache[k][0]))

    # ---------------------------------------------------------------- search
    def clip(self, share: np.ndarray) -> np.ndarray | None:
        """Cap the shares where memory binds: no micro-batch above the share c at which K_s
        such micro-batches in flight (plus one's transient) fill 95% of stage s's memory, the
        excess spread over the others in proportion (water-filling). A ramp keeps its small
        edges and gets a flat top. None when even m micro-batches at c cannot hold the step."""
        if not self.tight:
            return share
        m = len(share)
        c = self._caps.get(m)
        if c is None:
            K = np.asarray(in_flight_counts(self.P, m), dtype=float)
            A, R = self.act.sum(axis=0), self.tr.sum(axis=0)
            c = self._caps[m] = float(np.min(0.95 * self.budget / np.maximum(K * A + R, 1e-30)))
        if share.max() <= c:
            return share
        if m * c < 1.0:
            return None
        out = share.copy()
        capped = np.zeros(m, dtype=bool)
        for _ in range(m):
            capped |= out > c
            out[capped] = c
            free = ~capped
            rest = 1.0 - c * capped.sum()
            out[free] = share[free] * rest / share[free].sum()
            if out.max() <= c * (1 + 1e-12):
                break
        return out

    def fluid(self, m: int, ramp: float, share: np.ndarray | None = None) -> float:
        """Simulated makespan if the replica's streams split exactly by the target shares (no
        packing): a cheap stand-in that ranks micro-batch counts and profiles. Shares that
        would overfill memory are first capped (`clip`), as packing within memory would."""
        share = self.clip(ramp_shares(m, ramp) if share is None else share)
        if share is None:
            return np.inf
        if self._affine is None:
            # a micro-batch holding share s of every stream costs, per stage, overhead +
            # (lin + attn * S2/T) * (s * T + half_tokens) / speed, and its sends latency +
            # s * bytes / bandwidth: affine in s, so two evaluations give every fluid profile
            T = np.array([[1.0], [0.5]]) * self.tokens.sum(axis=0)[None, :]
            S2 = np.array([[1.0], [0.5]]) * self.squares.sum(axis=0)[None, :]
            # unpadded: a ladder's step would break the affinity, and the real packings that
            # these profiles only rank are priced padded
            one, half = zip(*(x.T for x in stage_times(self.sc, T, S2)))
            self._affine = [(2.0 * (a - h), 2.0 * h - a) for a, h in zip(one, half)]
        f, b, sf, sb = (np.outer(slope, share) + base[:, None] for slope, base in self._affine)
        return self.replica_time(makespan(make_schedule("1f1b", self.P, m), f, b, sf, sb), m)

    def rank_profiles(self, m_hint: int, search: bool) -> list[tuple[float, int, float]]:
        """(fluid time, m, ramp) of the best micro-batch counts per size profile, best first:
        counts on a geometric grid (with `m_hint`), equal sizes and (`search`) ramps."""
        n = self.n
        grid = sorted({int(round(x)) for x in np.geomspace(1, n, max(2, int(np.log(n) / 0.12)))}
                      | {max(1, min(n, m_hint)), n})
        ramps = (1.0,) + (RAMPS if search and n >= 3 else ())
        scored = []
        for ramp in ramps:
            ts = []
            for m in grid:
                ts.append(self.fluid(m, ramp))
                # unimodal in m (bubble against per-op overhead): stop well past the minimum
                if len(ts) > 4 and min(ts[-3:]) > 1.02 * min(ts):
                    break
            k = int(np.argmin(ts))
            scored.append((ts[k], grid[k], ramp))
            if ramp != 1.0 and k + 1 < len(grid):
                # a ramp wants a few more micro-batches: its edges are small
                scored.append((ts[k + 1], grid[k + 1], ramp))
        scored.sort()
        return scored

    def fluid_outcome(self, m: int, ramp: float) -> tuple[float, np.ndarray, np.ndarray]:
        """The fluid profile's replica time, per-stage in-flight activation peak (bytes; the
        replica's transients spread like its tokens) and per-stage idle share (for layout
        estimates, where packing every candidate would cost too much)."""
        share = self.clip(ramp_shares(m, ramp))
        if share is None:
            return np.inf, np.full(self.P, np.inf), np.ones(self.P)
        T = share[:, None] * self.tokens.sum(axis=0)[None, :]
        S2 = share[:, None] * self.squares.sum(axis=0)[None, :]
        f, b, sf, sb = stage_times(self.sc, T, S2)  # fluid: unpadded, as in `fluid`
        sim = simulate(make_schedule("1f1b", self.P, m), fwd=f, bwd=b, send_fwd=sf, send_bwd=sb)
        act = np.outer(self.act.sum(axis=0), share)
        tr = np.outer(self.tr.sum(axis=0), share)
        return (self.replica_time(sim.makespan, m), window_peaks(act, tr),
                np.asarray(sim.bubble))

    def plan(self, m_hint: int, search: bool, thorough: bool = True) -> Bins:
        """The replica's micro-batches in execution order (rows of its samples); `m_hint` (the
        configured count) is among the counts tried; `search` off: equal sizes, no search;
        `thorough` off: ramped profiles and the neighbour search only (no shaping, no
        targeted search, one start)."""
        n = self.n
        scored = self.rank_profiles(m_hint, search)
        for i, (_, m, ramp) in enumerate(scored[:4 if search else 2]):
            self.pack(m, ramp, refine=i < REFINED_PROFILES)
        if search and thorough and scored[0][1] >= 3:
            # shape the sizes freely around the best profile, still on the fluid model, at
            # the best count and its neighbours (a shaped profile may want one more or less)
            _, m, ramp = scored[0]
            counts = {max(3, m - 1), m, min(n, m + 1)}
            shaped = sorted(self._shape(k, ramp) for k in sorted(counts) if k <= n)
            for key, (_, k, share) in enumerate(shaped[:2]):
                self.pack(k, -1.0 - key, share)
        m_best = self._best()[0]
        while not self.cache[self._best()][1] and m_best < n:
            m_best = min(n, 2 * m_best)  # memory binds: more, smaller micro-batches
            self.pack(m_best, 1.0)
        if not search:
            return [list(b) for b in self.cache[self._best()][2]]
        # the searches below move samples one at a time, so where they end depends on where
        # they start: start from the best packing and from the best of a different count
        # or profile family, and keep the faster end
        fits = sorted((v[0], k) for k, v in self.cache.items() if v[1])
        first = fits[0][1] if fits else self._best()
        starts = [self.cache[first][2]]
        if thorough:
            # the other start: among the packings as largest first left them (unrefined), the
            # best of another count or profile family than the best of them
            plain = sorted((v[0], k) for k, v in self.plain.items() if v[1])
            top = plain[0][1] if plain else first
            if self.cache[first] is not self.plain[first]:
                starts.append(self.plain[top][2])  # where refining won: the old first start too
            starts += [self.plain[k][2] for _, k in plain[1:]
                       if k[0] != top[0] or (k[1] < 0) != (top[1] < 0)][:1]
        best_bins, best_t = None, np.inf
        for start in starts:
            bins = [list(b) for b in start]
            if len(bins) > 1:
                bins = self._local_search(bins)
                if thorough:
                    bins = self._targeted(bins, TARGETED_BUDGET)
            t = self.makespan(bins)
            if t < best_t:
                best_bins, best_t = bins, t
        return best_bins

    def _targeted(self, bins: Bins, budget: int, givers: int = 3) -> Bins:
        """Move samples out of the bottleneck stage's largest micro-batches (the `givers`
        heaviest on the busiest stage; their lightest and median sample) into any other
        micro-batch, the best move per pass, while the simulated makespan drops and memory
        holds; at most `budget` micro-batch simulations."""
        c = CostedBins(self, [list(b) for b in bins])
        m = len(bins)
        left = budget
        wsum = self.work.sum(axis=1)
        while left > 0:
            f, b = c.ts[0], c.ts[1]
            busy = int(np.argmax((f + b).sum(axis=1)))
            best = None
            for j in [int(q) for q in np.argsort(-(f + b)[busy], kind="stable")[:givers]]:
                if len(c.bins[j]) < 2:
                    continue
                by = sorted(c.bins[j], key=lambda i: wsum[i])
                for x in dict.fromkeys((by[0], by[len(by) // 2])):
                    for k in range(m):
                        if k == j or left <= 0:
                            continue
                        e = {j: ([x], []), k: ([], [x])}
                        t, st = c.trial(e)
                        left -= m
                        if t < c.t - 1e-12 and (best is None or t < best[0]):
                            best = (t, e, st)
            if best is None:
                break
            t, e, st = best
            if not self.fits(edit_bins(c.bins, e)):
                break
            c.apply(e, t, st)
        return c.bins

    def _shape(self, m: int, ramp: float) -> tuple[float, int, np.ndarray]:
        """The best fluid profile of m micro-batches found by a pattern search on the two ends
        of `edge_shares` (start and growth of each ramp; SHAPE_ROUNDS rounds, step halved when
        no move helps), started from the symmetric ramp and kept only if better than the
        ramped profile itself, then coordinate descent that scales single micro-batches near
        either end. Returns (fluid time, m, shares)."""
        share = ramp_shares(m, ramp)
        best = self.fluid(m, ramp, share)
        p, step = list(SHAPE_START), list(SHAPE_STEP)
        cur = self.fluid(m, -1.0, edge_shares(m, *p))
        for _ in range(SHAPE_ROUNDS):
            improved = False
            for i in range(4):
                for sign in (-1.0, 1.0):
                    q = list(p)
                    q[i] = min(SHAPE_HIGH[i], max(SHAPE_LOW[i], q[i] + sign * step[i]))
                    t = self.fluid(m, -1.0, edge_shares(m, *q))
                    if t < cur - 1e-12:
                        p, cur, improved = q, t, True
            if not improved:
                step = [s / 2 for s in step]
        if cur < best:
            share, best = edge_shares(m, *p), cur
        for _ in range(2):
            improved = False
            for j in edge_positions(m, edge=6):
                for f in (0.9, 1.1):
                    trial = share.copy()
                    trial[j] *= f
                    trial /= trial.sum()
                    t = self.fluid(m, -1.0, trial)
                    if t < best - 1e-12:
                        share, best, improved = trial, t, True
            if not improved:
                break
        return best, m, share

    def _local_search(self, bins: Bins, rounds: int = 3) -> Bins:
        """Move one sample at a time between neighbouring micro-batches (the lightest sample
        of the giver), keeping a move when the simulated makespan drops and memory holds."""
        c = CostedBins(self, bins)
        m = len(bins)
        tight = self.tight
        if tight:  # per stage and micro-batch: kept and transient bytes (exact 1F1B check)
            A, R = self.bytes(bins)
            peaks = window_peaks(A, R)
        wsum = self.work.sum(axis=1)
        for _ in range(rounds):
            improved = False
            for j in edge_positions(m):
                for k in (j - 1, j + 1):
                    # repeat a move that helped: a ramp edge often wants several samples out
                    while 0 <= k < m and len(c.bins[j]) >= 2:
                        x = min(c.bins[j], key=lambda i: wsum[i])
                        if tight:
                            A2, R2 = A.copy(), R.copy()
                            A2[:, j] -= self.act[x]
                            A2[:, k] += self.act[x]
                            R2[:, j] -= self.tr[x]
                            R2[:, k] += self.tr[x]
                            # a peak grows by at most the sample's bytes: check exactly only
                            # when that could break memory
                            if np.any(peaks + self.act[x] + self.tr[x] > self.budget):
                                pk2 = window_peaks(A2, R2)
                                if np.any(pk2 > self.budget):
                                    break
                            else:
                                pk2 = None
                        e = {j: ([x], []), k: ([], [x])}
                        t, st = c.trial(e)
                        if t >= c.t - 1e-12:
                            break
                        c.apply(e, t, st)
                        if tight:
                            A, R = A2, R2
                            peaks = window_peaks(A, R) if pk2 is None else pk2
                        improved = True
            if not improved:
                break
        return c.bins
