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
   Memory is the exact 1F1B in-flight peak for the execution order (`window_peaks`): stage s
   holds micro-batches q..q+K-1 (K = min(P - s, m)) while the backward of q runs, so the
   kept activations of those K plus q's transient must fit in `memory - static`; it is the
   figure the simulator reports, not `K x` each micro-batch's own activations;
5. runs a local search that moves single samples between neighbouring micro-batches near
   both ends while the simulated makespan drops, then a targeted one that moves samples out
   of the bottleneck stage's largest micro-batches into any other (a fixed simulation
   budget);
6. evens the replicas: swaps samples between the slowest and the fastest replica (a sample
   against a lighter one) while the slower of the two drops (a fixed simulation budget).

Everything is judged by the same simulator that scores the baselines (`makespan` is the exact
makespan of `simulate` for 1F1B).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from mmpipe.planner.cost import SampleTable, StageCosts, _features, sample_work
from mmpipe.planner.schedules import make_schedule
from mmpipe.planner.simulator import makespan
from mmpipe.planner.step import Replicas

GB = 1e9
TARGETED_BUDGET = 1000
"""Micro-batch simulations (a trial of m micro-batches counts m) the targeted move search of
one replica may spend: a fixed count rather than a clock, so every rank plans alike."""
RAMPS = (1.35, 1.8)
"""Growth factors of the ramped size profiles tried (1 = equal micro-batches)."""


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
        search: try ramped profiles and run the local search (off = equal micro-batches only).
    Returns:
        per replica, its micro-batches in execution order, lists of rows of `table`.
    """
    rows = list(rows)
    if not rows:
        return [[] for _ in range(dp)]
    sub = SampleTable(tokens=table.tokens[rows], squares=table.squares[rows],
                      seqs=table.seqs[rows], longest=table.longest[rows])
    work, act, tr = sample_work(sc, sub)
    budget = sc.cost.hardware.usable_bytes - sc.static
    _check_static(sc, budget)
    _check_alone(sc, rows, act + tr, budget, labels)
    per_replica = _deal(work, dp)
    plans: list[list[list[int]]] = []
    for local in per_replica:
        if not local:
            plans.append([])
            continue
        idx = np.asarray(local, dtype=np.int64)
        planner = _ReplicaPlanner(sc, sub.tokens[idx], sub.squares[idx], work[idx], act[idx],
                                  tr[idx], budget)
        bins = planner.plan(micro_batches, search)
        plans.append([[local[i] for i in b] for b in bins])
    if search and dp > 1:
        plans = _even_replicas(_ReplicaPlanner(sc, sub.tokens, sub.squares, work, act, tr, budget),
                               plans)
    return [[[rows[i] for i in b] for b in bins] for bins in plans]


class _Costed:
    """One replica's micro-batches with their streams and times, for trial edits that
    re-cost only the micro-batches they touch."""

    def __init__(self, pl: "_ReplicaPlanner", bins: list[list[int]]) -> None:
        self.pl = pl
        self.bins = bins
        self.T, self.S2 = pl._streams(bins)
        self.ts = pl._times(self.T, self.S2)
        self.sched = make_schedule("1f1b", pl.P, len(bins))
        self.t = makespan(self.sched, *self.ts)

    def trial(self, edits: dict[int, tuple[list[int], list[int]]]) -> tuple[float, tuple]:
        """Makespan after removing/adding samples (`{bin: (out, in)}`), and the new state."""
        pl = self.pl
        cols = list(edits)
        T, S2 = self.T[cols].copy(), self.S2[cols].copy()
        for c, (out, inn) in enumerate(edits.values()):
            for i in out:
                T[c] -= pl.tokens[i]
                S2[c] -= pl.squares[i]
            for i in inn:
                T[c] += pl.tokens[i]
                S2[c] += pl.squares[i]
        new = pl._times(T, S2)
        ts = tuple(x.copy() for x in self.ts)
        for x, y in zip(ts, new):
            x[:, cols] = y
        return makespan(self.sched, *ts), (cols, T, S2, ts)

    def apply(self, edits: dict[int, tuple[list[int], list[int]]], t: float, state: tuple) -> None:
        cols, T, S2, ts = state
        for j, (out, inn) in edits.items():
            self.bins[j] = [i for i in self.bins[j] if i not in out] + list(inn)
        self.T[cols], self.S2[cols] = T, S2
        self.ts, self.t = ts, t


def _even_replicas(whole: "_ReplicaPlanner", plans: list[list[list[int]]],
                   budget: int = 32) -> list[list[list[int]]]:
    """The step ends with the slowest replica. One sample is a sizeable step against the gap
    between replicas, so single moves rarely help; swap instead: out of the slow replica's
    edge micro-batches, the two whose loss of their lightest sample helps it most; their
    heaviest and median samples x, each against the sample y of an edge micro-batch of the
    fastest replica that is closest below x in work. A swap is kept when the slower of the
    two replicas drops and memory holds. At most `budget` trial simulations (a fixed count,
    not a clock, so every rank plans the same step)."""
    reps = [_Costed(whole, [list(b) for b in bins]) if bins else None for bins in plans]
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
        for j in _ReplicaPlanner._positions(len(src.bins), edge=4):
            if len(src.bins[j]) < 2 or left <= 0:
                continue
            x = min(src.bins[j], key=lambda i: wsum[i])
            t, _ = src.trial({j: ([x], [])})
            left -= 1
            gains.append((t, j))
        gains.sort()
        best = None
        dpos = _ReplicaPlanner._positions(len(dst.bins), edge=4)
        for t_rm, j in gains[:2]:
            if t_rm >= src.t - 1e-12:
                break
            by = sorted(src.bins[j], key=lambda i: wsum[i])
            for x in dict.fromkeys((by[-1], by[len(by) // 2])):
                for k in dpos:
                    if left <= 0:
                        break
                    lighter = [i for i in dst.bins[k] if wsum[i] < wsum[x]]
                    if not lighter:
                        continue
                    y = max(lighter, key=lambda i: wsum[i])
                    es = {j: ([x], [y])}
                    t_s, st_s = src.trial(es)
                    left -= 1
                    if t_s >= src.t - 1e-12 or (best is not None and t_s >= best[0]):
                        continue
                    ed = {k: ([y], [x])}
                    t_d, st_d = dst.trial(ed)
                    left -= 1
                    v = max(t_s, t_d)
                    if v < src.t - 1e-12 and (best is None or v < best[0]):
                        best = (v, es, t_s, st_s, ed, t_d, st_d)
        if best is None:
            break
        _, es, t_s, st_s, ed, t_d, st_d = best
        s_bins = [list(b) for b in src.bins]
        d_bins = [list(b) for b in dst.bins]
        for bins, e in ((s_bins, es), (d_bins, ed)):
            for j, (out, inn) in e.items():
                bins[j] = [i for i in bins[j] if i not in out] + list(inn)
        if not (whole.fits(s_bins) and whole.fits(d_bins)):
            break
        src.apply(es, t_s, st_s)
        dst.apply(ed, t_d, st_d)
    return [r.bins if r is not None else [] for r in reps]


def _check_static(sc: StageCosts, budget: np.ndarray) -> None:
    if np.all(budget > 0):
        return
    s = int(np.argmin(budget))
    a, b = sc.stages[s]
    names = sc.cost.names
    hw = sc.cost.hardware
    raise ValueError(
        f"stage {s} ({names[a]}..{names[b - 1]}) needs {sc.static[s] / GB:.3g} GB for weights, "
        f"gradients and optimizer states alone, more than the {hw.usable_bytes / GB:.3g} GB usable "
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
        f"{who} needs {need[i, s] / GB:.3g} GB of activations on stage {s} "
        f"({names[a]}..{names[b - 1]}) even alone, but only {max(budget[s], 0) / GB:.3g} GB "
        f"are left there ({sc.cost.hardware.usable_fraction:.0%} of "
        f"hardware.memory_gb={sc.cost.hardware.memory_gb:g} less {sc.static[s] / GB:.3g} GB of "
        f"weights and optimizer states); raise parallel.pp, recompute that stage or drop the sample")


def _deal(work: np.ndarray, dp: int) -> list[list[int]]:
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


def in_flight_counts(P: int, m: int) -> list[int]:
    """Micro-batches stage s holds at once under 1F1B: min(P - s, m)."""
    return [min(P - s, m) for s in range(P)]


def window_peaks(act: np.ndarray, tr: np.ndarray) -> np.ndarray:
    """Exact 1F1B activation peak per stage, given per-micro-batch kept bytes `act` [P, m] and
    transient bytes `tr` [P, m] in execution order. Stage s of P runs F0..F(K-1) then, for
    each q, B(q) then F(q+K) (K = min(P - s, m)), so while B(q) runs it holds micro-batches
    q..q+K-1 plus q's transient: peak_s = max_q sum(act[s, q:q+K]) + tr[s, q]. This is the
    figure `simulator._peak_memory` computes for the `1f1b` schedule."""
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


class _WindowMemory:
    """Incremental exact 1F1B memory check while packing m micro-batches in execution order.

    Per stage s and micro-batch q it keeps the slack of the window B(q) runs in:
    budget_s - (act of micro-batches q..q+K-1 + transient of q). Adding a sample (kept bytes
    a, transient t) to micro-batch j lowers the slack of windows j-K+1..j by a, and of window
    j also by t. Only stages that all the samples together could overfill are tracked."""

    def __init__(self, P: int, m: int, budget: list[float], stages: list[int]) -> None:
        self.m = m
        self.K = in_flight_counts(P, m)
        self.stages = stages
        self.slack = {s: [budget[s]] * m for s in stages}
        self.low = {s: budget[s] for s in stages}  # least slack of any window of stage s

    def roomy(self, a: list[float], t: list[float]) -> bool:
        """Whether the sample fits in every micro-batch (no window is that close to full)."""
        low = self.low
        return all(low[s] >= a[s] + t[s] for s in self.stages)

    def fits(self, j: int, a: list[float], t: list[float]) -> bool:
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


def _lpt(order: list[int], work: list[list[float]], act: np.ndarray, tr: np.ndarray,
         budget: np.ndarray, inv_share: list[float], probe: int = 4) -> tuple[list[list[int]], bool]:
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
    mem = _WindowMemory(P, m, bl, tight_st) if tight else None
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
            fits = [mem.fits(j, al[i], tl[i]) for j in range(m)]
            if any(fits):
                j = min((j for j in range(m) if fits[j]),
                        key=lambda j: max(loads[j]) * inv_share[j])
            else:
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


class _ReplicaPlanner:
    """Packs one replica's samples into micro-batches and judges them with the simulator."""

    def __init__(self, sc: StageCosts, tokens: np.ndarray, squares: np.ndarray,
                 work: np.ndarray, act: np.ndarray, tr: np.ndarray, budget: np.ndarray) -> None:
        self.sc = sc
        self.hw = sc.cost.hardware
        self.tokens, self.squares = tokens, squares
        self.work, self.act, self.tr = work, act, tr
        self.budget = budget
        self.n, self.P = work.shape
        self.order = np.argsort(-work.sum(axis=1), kind="stable")
        # memory can bind only where all samples together could overfill a stage
        self.tight = bool(np.any(act.sum(axis=0) + tr.sum(axis=0) > budget))
        self.fits_all_stages = True
        self.cache: dict[tuple[int, float], tuple[float, bool, list[list[int]]]] = {}
        # coefficient blocks for time of a micro-batch from its feature column
        self.c_fwd = sc.fwd
        self.c_bwd = sc.bwd_in + sc.recomp + sc.bwd_w

    # ---------------------------------------------------------------- costing
    def _times(self, T: np.ndarray, S2: np.ndarray) -> tuple[np.ndarray, ...]:
        X = _features(self.hw, T, S2)
        hw = self.hw
        bf = self.sc.xfer_fwd @ T.T
        bb = self.sc.xfer_bwd @ T.T
        lat, bps = hw.link_latency_s, hw.link_bytes_per_s
        sf = np.where(bf > 0, lat + bf / bps, 0.0)
        sb = np.where(bb > 0, lat + bb / bps, 0.0)
        return self.c_fwd @ X, self.c_bwd @ X, sf, sb

    def _streams(self, bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        idx = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return (np.add.reduceat(self.tokens[idx], starts, axis=0),
                np.add.reduceat(self.squares[idx], starts, axis=0))

    def fits(self, bins: list[list[int]]) -> bool:
        """Whether the micro-batches, in this order, keep every stage's exact 1F1B in-flight
        peak (kept activations of the micro-batches in flight plus the transient of the one
        in backward; transients summed over samples, an upper bound) within memory."""
        if not self.tight:
            return True
        A, R = self._bytes(bins)
        return bool(np.all(window_peaks(A, R) <= self.budget))

    def _bytes(self, bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Kept and transient bytes per stage and micro-batch, [P, m] each."""
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        idx = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return (np.add.reduceat(self.act[idx], starts, axis=0).T,
                np.add.reduceat(self.tr[idx], starts, axis=0).T)

    def simulate(self, bins: list[list[int]]) -> float:
        T, S2 = self._streams(bins)
        f, b, sf, sb = self._times(T, S2)
        return makespan(make_schedule("1f1b", self.P, len(bins)), f, b, sf, sb)

    # ---------------------------------------------------------------- packing
    def pack(self, m: int, ramp: float,
             share: np.ndarray | None = None) -> tuple[float, bool, list[list[int]]]:
        """Largest first into m micro-batches with ramped target shares (or the given ones);
        simulated time."""
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
        P = self.P
        bins, ok = _lpt(self.order.tolist(), self.work.tolist(), self.act, self.tr, self.budget,
                        inv.tolist())
        loads = np.array([self.work[bn].sum(axis=0) if bn else np.zeros(P) for bn in bins])
        counts = np.array([len(bn) for bn in bins])
        if not all(counts):
            bins = [b for b in bins if b]
            ok = ok and self.fits(bins)  # dropping empty bins regroups the windows
        t = self.simulate(bins)
        if ramp == 1.0:
            # equal shares: also try heaviest in the middle, light ones at the ends
            tot = loads[counts > 0].sum(axis=1)
            asc = np.argsort(tot, kind="stable")
            k = len(bins)
            ends = np.empty(k, dtype=int)
            ends[: (k + 1) // 2] = asc[0::2]
            ends[(k + 1) // 2:] = asc[1::2][::-1]
            alt = [bins[x] for x in ends]
            ta = self.simulate(alt)
            if ta < t and (not ok or self.fits(alt)):
                t, bins = ta, alt
        self.cache[key] = (t, ok, bins)
        return self.cache[key]

    def _best(self) -> tuple[int, float]:
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
        K = np.asarray(in_flight_counts(self.P, m), dtype=float)
        A, R = self.act.sum(axis=0), self.tr.sum(axis=0)
        c = float(np.min(0.95 * self.budget / np.maximum(K * A + R, 1e-30)))
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
        share = share[:, None]
        T = share * self.tokens.sum(axis=0)[None, :]
        S2 = share * self.squares.sum(axis=0)[None, :]
        f, b, sf, sb = self._times(T, S2)
        return makespan(make_schedule("1f1b", self.P, m), f, b, sf, sb)

    def plan(self, m_hint: int, search: bool) -> list[list[int]]:
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
        for _, m, ramp in scored[:4 if search else 2]:
            self.pack(m, ramp)
        if search and scored[0][1] >= 3:
            # shape the sizes freely around the best profile, still on the fluid model
            _, m, ramp = scored[0]
            share = self._shape(m, ramp)
            self.pack(m, -1.0, share)
        m_best = self._best()[0]
        while not self.cache[self._best()][1] and m_best < n:
            m_best = min(n, 2 * m_best)  # memory binds: more, smaller micro-batches
            self.pack(m_best, 1.0)
        t, ok, bins = self.cache[self._best()]
        bins = [list(b) for b in bins]
        if search and len(bins) > 1:
            bins = self._local_search(bins, t)
            bins = self._targeted(bins, TARGETED_BUDGET)
        return bins

    def _targeted(self, bins: list[list[int]], budget: int, givers: int = 3) -> list[list[int]]:
        """Move samples out of the bottleneck stage's largest micro-batches (the `givers`
        heaviest on the busiest stage; their lightest and median sample) into any other
        micro-batch, the best move per pass, while the simulated makespan drops and memory
        holds; at most `budget` micro-batch simulations."""
        c = _Costed(self, [list(b) for b in bins])
        m = len(bins)
        left = budget
        wsum = self.work.sum(axis=1)
        mem_ok = (lambda b: self.fits(b)) if self.tight else (lambda b: True)
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
            nb = [list(q) for q in c.bins]
            for j, (out, inn) in e.items():
                nb[j] = [i for i in nb[j] if i not in out] + list(inn)
            if not mem_ok(nb):
                break
            c.apply(e, t, st)
        return c.bins

    def _shape(self, m: int, ramp: float, sweeps: int = 2) -> np.ndarray:
        """Coordinate descent on the micro-batch shares under the fluid model: scale one
        micro-batch near either end (where the bubble is decided) up or down while the
        simulated makespan drops."""
        share = ramp_shares(m, ramp)
        best = self.fluid(m, ramp, share)
        for _ in range(sweeps):
            improved = False
            for j in self._positions(m, edge=4):
                for f in (0.6, 1.4):
                    trial = share.copy()
                    trial[j] *= f
                    trial /= trial.sum()
                    t = self.fluid(m, ramp, trial)
                    if t < best - 1e-12:
                        share, best, improved = trial, t, True
            if not improved:
                break
        return share

    @staticmethod
    def _positions(m: int, edge: int = 8) -> list[int]:
        """Micro-batches the local search moves samples out of: the warm-up and cool-down
        ends, where a sample moved changes the bubble; a bounded count keeps the search
        linear in the number of micro-batches."""
        if m <= 2 * edge:
            return list(range(m))
        return list(range(edge)) + list(range(m - edge, m))

    def _rank(self, key: tuple[int, float]) -> tuple[bool, float]:
        t, ok, _ = self.cache[key]
        return (not ok, t)

    def _local_search(self, bins: list[list[int]], t0: float, rounds: int = 3) -> list[list[int]]:
        """Move one sample at a time between neighbouring micro-batches (the lightest sample
        of the giver), keeping a move when the simulated makespan drops and memory holds."""
        P = self.P
        m = len(bins)
        tight = self.tight
        T, S2 = self._streams(bins)
        f, b, sf, sb = self._times(T, S2)
        sched = make_schedule("1f1b", P, m)
        if tight:  # per stage and micro-batch: kept and transient bytes (exact 1F1B check)
            A, R = self._bytes(bins)
            peaks = window_peaks(A, R)
        wsum = self.work.sum(axis=1)
        best = t0
        for _ in range(rounds):
            improved = False
            for j in self._positions(m):
                for k in (j - 1, j + 1):
                    # repeat a move that helped: a ramp edge often wants several samples out
                    while 0 <= k < m and len(bins[j]) >= 2:
                        x = min(bins[j], key=lambda i: wsum[i])
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
                        Tn = T[[j, k]].copy()
                        Sn = S2[[j, k]].copy()
                        Tn[0] -= self.tokens[x]
                        Tn[1] += self.tokens[x]
                        Sn[0] -= self.squares[x]
                        Sn[1] += self.squares[x]
                        fn, bn_, sfn, sbn = self._times(Tn, Sn)
                        f2, b2, sf2, sb2 = f.copy(), b.copy(), sf.copy(), sb.copy()
                        f2[:, [j, k]], b2[:, [j, k]] = fn, bn_
                        sf2[:, [j, k]], sb2[:, [j, k]] = sfn, sbn
                        t = makespan(sched, f2, b2, sf2, sb2)
                        if t >= best - 1e-12:
                            break
                        best = t
                        bins[j].remove(x)
                        bins[k].append(x)
                        T[[j, k]], S2[[j, k]] = Tn, Sn
                        f, b, sf, sb = f2, b2, sf2, sb2
                        if tight:
                            A, R = A2, R2
                            peaks = window_peaks(A, R) if pk2 is None else pk2
                        improved = True
            if not improved:
                break
        return bins
