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
    out: Replicas = []
    for local in per_replica:
        if not local:
            out.append([])
            continue
        idx = np.asarray(local, dtype=np.int64)
        planner = _ReplicaPlanner(sc, sub.tokens[idx], sub.squares[idx], work[idx], act[idx],
                                  tr[idx], budget)
        bins = planner.plan(micro_batches, search)
        out.append([[rows[local[i]] for i in b] for b in bins])
    return out


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


def _lpt(order: list[int], work: list[list[float]], mem: np.ndarray, budget: np.ndarray,
         inv_share: list[float], probe: int = 4) -> tuple[list[list[int]], bool]:
    """Largest first, each sample into the bin whose busiest stage, relative to the bin's
    target share, stays lowest; bins over the memory budget are skipped. Only the `probe`
    bins with the lowest relative busiest stage are examined per sample (a heap), so a pack
    costs O(n log m) rather than O(n m).

    Returns the bins (in target order, possibly some empty) and whether memory held."""
    m = len(inv_share)
    P = len(work[0]) if work else 0
    loads = [[0.0] * P for _ in range(m)]
    bins: list[list[int]] = [[] for _ in range(m)]
    heap = [(0.0, j) for j in range(m)]  # (relative busiest stage, bin); empty bins first
    # memory is tracked only when all samples together could break it on some stage
    tight = bool(np.any(mem.sum(axis=0) > budget))
    used = [[0.0] * P for _ in range(m)]
    ml = mem.tolist() if tight else []
    bl = budget.tolist()
    ok = True
    for i in order:
        w = work[i]
        cands = [heapq.heappop(heap) for _ in range(min(probe, len(heap)))]
        best_k, best_v = -1, float("inf")
        for k, (_, j) in enumerate(cands):
            if tight and any(used[j][s] + ml[i][s] > bl[s] for s in range(P)):
                continue
            ld = loads[j]
            v = max(ld[s] + w[s] for s in range(P)) * inv_share[j]
            if v < best_v:
                best_k, best_v = k, v
        if best_k < 0:
            for c in cands:
                heapq.heappush(heap, c)
            ua = np.asarray(used)
            fits = np.all(ua + mem[i] <= budget, axis=1)
            if fits.any():
                lv = np.array([max(l) for l in loads]) * np.asarray(inv_share)
                j = int(np.argmin(np.where(fits, lv, np.inf)))
            else:
                ok = False
                j = int(np.argmin(ua.max(axis=1)))
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
            u, mi = used[j], ml[i]
            for s in range(P):
                u[s] += mi[s]
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
        inv = 1.0 / share
        P = self.P
        in_flight = np.minimum(np.arange(P, 0, -1), m).astype(float)
        mem = self.act * in_flight[None, :] + self.tr
        bins, ok = _lpt(self.order.tolist(), self.work.tolist(), mem, self.budget, inv.tolist())
        loads = np.array([self.work[bn].sum(axis=0) if bn else np.zeros(P) for bn in bins])
        counts = np.array([len(bn) for bn in bins])
        bins = [b for b in bins if b]
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
            if ta < t:
                t, bins = ta, alt
        self.cache[key] = (t, ok, bins)
        return self.cache[key]

    def _best(self) -> tuple[int, float]:
        return min(self.cache, key=lambda k: (not self.cache[k][1], self.cache[k][0]))

    # ---------------------------------------------------------------- search
    def fluid(self, m: int, ramp: float, share: np.ndarray | None = None) -> float:
        """Simulated makespan if the replica's streams split exactly by the target shares (no
        packing): a cheap stand-in that ranks micro-batch counts and profiles."""
        share = (ramp_shares(m, ramp) if share is None else share)[:, None]
        P = self.P
        in_flight = np.minimum(np.arange(P, 0, -1), m)
        need = share.max() * (self.act.sum(axis=0) * in_flight + self.tr.sum(axis=0))
        if np.any(need > 0.95 * self.budget):
            return np.inf  # the largest micro-batch would not fit in memory
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
        in_flight = np.minimum(np.arange(P, 0, -1), m).astype(float)
        mem = self.act * in_flight[None, :] + self.tr
        tight = bool(np.any(mem.sum(axis=0) > self.budget))
        T, S2 = self._streams(bins)
        f, b, sf, sb = self._times(T, S2)
        sched = make_schedule("1f1b", P, m)
        used = np.array([mem[bn].sum(axis=0) for bn in bins]) if tight else None
        wsum = self.work.sum(axis=1)
        best = t0
        for _ in range(rounds):
            improved = False
            for j in self._positions(m):
                for k in (j - 1, j + 1):
                    # repeat a move that helped: a ramp edge often wants several samples out
                    while 0 <= k < m and len(bins[j]) >= 2:
                        x = min(bins[j], key=lambda i: wsum[i])
                        if tight and np.any(used[k] + mem[x] > self.budget):
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
                            used[j] -= mem[x]
                            used[k] += mem[x]
                        improved = True
            if not improved:
                break
        return bins
