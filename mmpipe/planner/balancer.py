"""Data-aware micro-batch balancer: samples -> replicas -> packed micro-batches, ordered.

For one step it:

1. costs every sample on every stage (marginal forward+backward time at the top of the
   efficiency curve, kept activation bytes); a sample that cannot fit on some stage even
   alone is an error naming the sample and the limit;
2. deals samples to replicas, largest first, each to the replica whose busiest stage stays
   lowest (a vector load: encoder and LLM stages are balanced at once, not tokens alone);
3. per replica, ranks micro-batch counts `m` (a geometric grid) and size profiles with a
   *fluid* simulation: the replica's streams split exactly by each micro-batch's target
   share, costed and run through the 1F1B simulator (no packing, microseconds each; a
   profile whose largest micro-batch cannot fit in memory is skipped). Profiles: equal
   sizes and *ramped* ones, small at both ends of the step and large in the middle. Under
   1F1B the warm-up waits on the first micro-batches' forwards through the pipeline and the
   cool-down on the last ones' backwards, so small edge micro-batches shrink the bubble while
   the large middle ones keep the per-op overhead and the small-batch efficiency loss low.
   The best ramp is then reshaped freely near the ends (coordinate descent on the shares);
4. packs the best few candidates for real (largest first, each sample into the micro-batch
   whose busiest stage is lowest relative to its share, within memory: `in_flight x
   activations + transient <= memory - static` on every stage) and simulates them;
5. runs a local search that moves single samples between neighbouring micro-batches near
   both ends while the simulated makespan drops.

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


def _even_replicas(whole: "_ReplicaPlanner", plans: list[list[list[int]]],
                   rounds: int = 4, tries: int = 3) -> list[list[list[int]]]:
    """The step ends with the slowest replica. One sample is a sizeable step against the gap
    between replicas, so single moves rarely help; swap instead: out of the slow replica's
    micro-batches whose loss of their lightest sample helps it most (the `tries` best), a
    sample x against the sample y of each micro-batch of the fastest replica closest below x
    in work, kept when the slower of the two replicas drops and memory holds. A round costs
    about m + 2 * tries * m simulations; at most `rounds` rounds."""
    times = [whole.simulate(b) if b else 0.0 for b in plans]
    wsum = whole.work.sum(axis=1)
    for _ in range(rounds):
        hi = int(np.argmax(times))
        lo = int(np.argmin(times))
        if hi == lo or not plans[lo] or times[hi] <= times[lo] * 1.0005:
            break
        src, dst = plans[hi], plans[lo]
        gains = []
        for j, bj in enumerate(src):
            if len(bj) < 2:
                continue
            x = min(bj, key=lambda i: wsum[i])
            trial = [b if q != j else [i for i in b if i != x] for q, b in enumerate(src)]
            gains.append((whole.simulate(trial), j))
        gains.sort()
        best = None
        for t_rm, j in gains[:tries]:
            if t_rm >= times[hi] - 1e-12:
                break
            for x in (max(src[j], key=lambda i: wsum[i]), sorted(src[j], key=lambda i: wsum[i])[len(src[j]) // 2]):
                for k, bk in enumerate(dst):
                    lighter = [i for i in bk if wsum[i] < wsum[x]]
                    if not lighter:
                        continue
                    y = max(lighter, key=lambda i: wsum[i])
                    s2 = [b if q != j else [i for i in b if i != x] + [y] for q, b in enumerate(src)]
                    t_s = whole.simulate(s2)
                    if t_s >= times[hi] - 1e-12 or (best is not None and t_s >= best[0]):
                        continue
                    d2 = [b if q != k else [i for i in b if i != y] + [x] for q, b in enumerate(dst)]
                    t_d = whole.simulate(d2)
                    v = max(t_s, t_d)
                    if v < times[hi] - 1e-12 and (best is None or v < best[0]) \
                            and whole.fits(s2) and whole.fits(d2):
                        best = (v, s2, d2, t_s, t_d)
        if best is None:
            break
        _, plans[hi], plans[lo], times[hi], times[lo] = best
    return plans


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
            for q in range(max(0, j - self.K[s] + 1), j + 1):
                sl[q] -= x
            sl[j] -= t[s]


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
        for k, (_, j) in enumerate(cands):
            if tight and not mem.fits(j, al[i], tl[i]):
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
        A = np.array([self.act[b].sum(axis=0) for b in bins]).T
        R = np.array([self.tr[b].sum(axis=0) for b in bins]).T
        return bool(np.all(window_peaks(A, R) <= self.budget))

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
        if self.tight:
            # exact 1F1B in-flight peak of the fluid split (windows of consecutive shares)
            sh = share[:, 0]
            need = window_peaks(np.outer(self.act.sum(axis=0), sh),
                                np.outer(self.tr.sum(axis=0), sh))
            if np.any(need > 0.95 * self.budget):
                return np.inf  # the micro-batches in flight would not fit in memory
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
            # the runner-up profile (another m or ramp) often ends lower after the search
            ranked = sorted(self.cache, key=self._rank)
            if len(ranked) > 1:
                t2, ok2, b2 = self.cache[ranked[1]]
                if ok2 and len(b2) > 1 and t2 < t * 1.02:
                    b2 = self._local_search([list(x) for x in b2], t2)
                    if self.simulate(b2) < self.simulate(bins):
                        bins = b2
        return bins

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
            A = np.array([self.act[bn].sum(axis=0) for bn in bins]).T
            R = np.array([self.tr[bn].sum(axis=0) for bn in bins]).T
        wsum = self.work.sum(axis=1)
        best = t0
        for _ in range(rounds):
            improved = False
            # besides its neighbours, a micro-batch may give to the lightest ones on the
            # busiest stage (where a sample is least felt)
            busy = int(np.argmax((f + b).sum(axis=1)))
            light = [int(q) for q in np.argsort((f + b)[busy], kind="stable")[:2]]
            for j in self._positions(m):
                for k in dict.fromkeys((j - 1, j + 1, *light)):
                    if k == j:
                        continue
                    # repeat a move that helped: a ramp edge often wants several samples out
                    while 0 <= k < m and len(bins[j]) >= 2:
                        x = min(bins[j], key=lambda i: wsum[i])
                        if tight:
                            A2, R2 = A.copy(), R.copy()
                            A2[:, j] -= self.act[x]
                            A2[:, k] += self.act[x]
                            R2[:, j] -= self.tr[x]
                            R2[:, k] += self.tr[x]
                            if np.any(window_peaks(A2, R2) > self.budget):
                                break
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
                        improved = True
            if not improved:
                break
        return bins
