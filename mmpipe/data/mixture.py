"""Mixtures: several shard sets read as one stream, interleaved by weight.

    data.sources:
      - {name: synth, path: data/shards/train-{000000..000003}.tar, weight: 3}
      - {name: small, path: data/shards/train-{000004..000007}.tar, weight: 1, limit: 100, limit_mode: random}

Interleaving is smooth weighted round-robin (as nginx balances upstreams): every pick adds
each active source's weight to its credit, takes the source with the most credit (ties: the
earlier source) and subtracts the total weight from it. No randomness: with weights 3:1 the
picks are a a b a | a a b a ..., and after n picks every source is within one pick of
n * weight / total. A source that runs out (finite data.epochs) leaves the rotation.

A `limit` keeps N samples of a source, counted over its whole shard list (not per replica):
`first` the first N in shard order, `random` N drawn with the seed. Per-shard sample counts
come from the shards' index.json when it lists them, else from the tar headers.
`realised()` says how many samples each source has given so far (for the run log).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from mmpipe.data.reader import Reader, SampleStream
from mmpipe.data.shards import Shard, count_samples, listed_samples

LIMIT_MODES = ("first", "random")
_SOURCE_KEYS = ("name", "path", "weight", "limit", "limit_mode", "schedule")


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureSource:
    """One dataset of a mixture (an entry of data.sources)."""

    name: str
    """Label in logs and realised counts."""
    path: str
    """Shard URL list, as data.path (brace lists, `::`, pipe:, http(s)://, ...)."""
    weight: float = 1.0
    """Share of the picks, relative to the other sources."""
    limit: int | None = None
    """Keep only this many samples of the source (None: all)."""
    limit_mode: str = "first"
    """first: the first `limit` samples in shard order; random: `limit` samples drawn with the seed."""
    schedule: tuple[tuple[int, float], ...] = ()
    """(step, weight) pairs, steps increasing from 1: the source's weight from that training step
    on (before the first pair: `weight`). Steps are counted in samples the replica has read
    (`Mixture.samples_per_step` a step), so the weights change at the same step on every rank
    and across a resume."""

    def weight_at(self, step: int) -> float:
        """The source's weight at training step `step` (1-based)."""
        weight = self.weight
        for start, w in self.schedule:
            if step >= start:
                weight = w
        return weight


def mixture_from_dicts(sources: Sequence[Mapping[str, Any]]) -> list[MixtureSource]:
    """Validate data.sources; every message names `data.sources[i].key` and the fix."""
    if not isinstance(sources, Sequence) or isinstance(sources, str) or not sources:
        raise ValueError("data.sources must be a non-empty list of {name, path, weight, limit, limit_mode}")
    out: list[MixtureSource] = []
    names: set[str] = set()
    for i, src in enumerate(sources):
        where = f"data.sources[{i}]"
        if not isinstance(src, Mapping):
            raise ValueError(f"{where} must be a mapping with name, path and weight, got {src!r:.60}")
        for k in src:
            if k not in _SOURCE_KEYS:
                raise ValueError(f"{where}.{k} is not a setting; known: {', '.join(_SOURCE_KEYS)}")
        name = src.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name={name!r} must be a non-empty string")
        if name in names:
            raise ValueError(f"{where}.name={name!r} is used twice; give every source its own name")
        names.add(name)
        path = src.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}.path={path!r} must be a shard brace list such as data/x-{{0..3}}.tar")
        weight = src.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}.weight={weight!r} must be a positive number")
        limit = src.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{where}.limit={limit!r} must be a positive integer or null (all samples)")
        mode = src.get("limit_mode", "first")
        if mode not in LIMIT_MODES:
            raise ValueError(f"{where}.limit_mode={mode!r} is unknown; use first or random")
        out.append(MixtureSource(name=name, path=path, weight=float(weight), limit=limit, limit_mode=mode,
                                 schedule=_schedule(src.get("schedule"), where)))
    return out


def _schedule(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    """A source's weight schedule, checked: [[step, weight], ...], steps increasing from 1."""
    if value is None:
        return ()
    example = f"{where}.schedule=[[1,4],[200,1]] (weight 4 from step 1, 1 from step 200 on)"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{where}.schedule={value!r:.60} must be a list of [step, weight] pairs, e.g. {example}")
    out: list[tuple[int, float]] = []
    for pair in value:
        ok = (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
              and isinstance(pair[0], int) and not isinstance(pair[0], bool) and pair[0] >= 1
              and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool) and pair[1] > 0)
        if not ok:
            raise ValueError(f"{where}.schedule entry {pair!r:.40} must be [step >= 1, weight > 0], e.g. {example}")
        if out and pair[0] <= out[-1][0]:
            raise ValueError(f"{where}.schedule steps must increase ({out[-1][0]} then {pair[0]}), e.g. {example}")
        out.append((int(pair[0]), float(pair[1])))
    return tuple(out)


def shard_sizes(shards: Sequence[Shard]) -> list[int]:
    """Samples per shard: from an index.json next to local shards when it lists them all, else
    counted from the tar headers."""
    listed = listed_samples(list(shards))
    if shards and len(listed) == len(shards):
        return [listed[s.url] for s in shards]
    return [count_samples(s) for s in shards]


@dataclass(frozen=True, slots=True)
class _Limit:
    """Keeps (shard index, ordinal) pairs: a picklable filter for SampleStream.keep."""

    first: tuple[int, ...] | None
    """Mode first: samples kept in each shard (a prefix of it)."""
    chosen: frozenset[tuple[int, int]] | None
    """Mode random: the kept pairs."""

    def __call__(self, shard: int, ordinal: int) -> bool:
        if self.first is not None:
            return ordinal < self.first[shard]
        return (shard, ordinal) in self.chosen  # type: ignore[operator]


def make_limit(sizes: Sequence[int], limit: int, mode: str, seed: int, name: str) -> _Limit:
    """The filter keeping `limit` of the samples (global order: shard by shard)."""
    total = sum(sizes)
    if mode == "first":
        left, first = limit, []
        for n in sizes:
            first.append(min(n, max(left, 0)))
            left -= n
        return _Limit(tuple(first), None)
    picks = sorted(random.Random(f"limit:{seed}:{name}").sample(range(total), min(limit, total)))
    chosen, shard, base = set(), 0, 0
    for g in picks:
        while g >= base + sizes[shard]:
            base += sizes[shard]
            shard += 1
        chosen.add((shard, g - base))
    return _Limit(None, frozenset(chosen))


@dataclass(kw_only=True, slots=True)
class Mixture(Reader):
    """Records or samples of several sources for one replica, interleaved by weight.

    Same interface as SampleStream: iterate for Samples, `records()`, `decode()`,
    `state_dict()` / `load_state_dict()`, `skips`; plus `realised()`.
    """

    sources: list[MixtureSource]
    """The datasets (from mixture_from_dicts); the other options apply to each of them."""
    samples_per_step: int = 0
    """Samples this replica reads per training step: what a source's `schedule` counts steps in
    (needed only when a source has one)."""
    streams: list[SampleStream] = field(default_factory=list, init=False)
    """One stream per source."""
    sizes: list[int] = field(default_factory=list, init=False)
    """Samples each source offers in one pass (after its limit, all replicas together)."""
    _realised_base: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.check()
        if not self.sources:
            raise ValueError("data.sources is empty")
        if any(src.schedule for src in self.sources) and self.samples_per_step < 1:
            raise ValueError("a data.sources schedule counts training steps: give the mixture samples_per_step")
        for i, src in enumerate(self.sources):
            s = SampleStream(path=src.path, tokenizer=self.tokenizer, spec=self.spec, dp_rank=self.dp_rank,
                             dp_size=self.dp_size, seed=self.seed, epochs=self.epochs,
                             shuffle_buffer=self.shuffle_buffer, on_error=self.on_error, too_long=self.too_long,
                             caption_prompt=self.caption_prompt,
                             num_workers=self.num_workers, worker_id=self.worker_id, root=self.root,
                             name=src.name, key=f"data.sources[{i}].path", skips=self.skips, limits=self.limits)
            sizes = shard_sizes(s.all_shards) if src.limit is not None else []
            if src.limit is not None:
                s.keep = make_limit(sizes, src.limit, src.limit_mode, self.seed, src.name)
                self.sizes.append(min(src.limit, sum(sizes)))
            else:
                self.sizes.append(-1)
            self.streams.append(s)
        self._realised_base = [0] * len(self.sources)
        self.reset()

    def layout(self) -> dict:
        return {"kind": "mixture", "dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers,
                "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
                "sources": [[s.name, s.weight, s.limit, s.limit_mode, st.layout()["shard_crc"]]
                            + ([[list(p) for p in s.schedule], self.samples_per_step] if s.schedule else [])
                            for s, st in zip(self.sources, self.streams)]}

    def approximate(self, cursors: list) -> dict:
        n = len(self.sources)
        starts = []
        for i in range(n):
            epochs = [c["sources"][i]["epoch"] for c in cursors
                      if c and len(c.get("sources", ())) == n and c["sources"][i]]
            starts.append({"epoch": min(epochs, default=0), "offset": 0})
        return {"sources": starts, "credit": [0.0] * n, "active": [True] * n, "realised": [0] * n}

    def load_state_dict(self, state: dict) -> None:
        Reader.load_state_dict(self, state)
        if self.resume_mode != "exact":  # keep the counts for the log
            totals = [0] * len(self.sources)
            for c in state["workers"]:
                if c and len(c["realised"]) == len(totals):
                    totals = [a + b for a, b in zip(totals, c["realised"])]
            self._realised_base = totals

    def realised(self) -> dict[str, int]:
        """Samples handed out so far per source name (all workers of this replica)."""
        counts = list(self._realised_base)
        for c in self.cursors:
            if c:
                counts = [a + b for a, b in zip(counts, c["realised"])]
        return {s.name: n for s, n in zip(self.sources, counts)}

    def worker_items(self, w: int, start: dict | None, make: Callable[[dict], Any],
                      select: Callable[[str], bool] | None) -> Iterator[Any]:
        n = len(self.sources)
        weights = [s.weight for s in self.sources]
        src_cursors = list(start["sources"]) if start else [None] * n
        credit = list(start["credit"]) if start else [0.0] * n
        active = list(start["active"]) if start else [True] * n
        realised = list(start["realised"]) if start else [0] * n
        gens = [st.worker_items(w, src_cursors[i], make, select) for i, st in enumerate(self.streams)]
        scheduled = any(src.schedule for src in self.sources)
        while any(active):
            if scheduled:  # this worker's next item is the replica's (drawn * workers + w)-th (round-robin)
                step = (sum(realised) * self.num_workers + w) // self.samples_per_step + 1
                weights = [src.weight_at(step) for src in self.sources]
            total = sum(wt for wt, a in zip(weights, active) if a)
            for i in range(n):
                if active[i]:
                    credit[i] += weights[i]
            pick = max((i for i in range(n) if active[i]), key=lambda i: (credit[i], -i))
            credit[pick] -= total
            try:
                item = next(gens[pick])
            except StopIteration:
                active[pick] = False
                continue
            realised[pick] += 1
            src_cursors[pick] = item.cursor
            item.cursor = {"sources": list(src_cursors), "credit": list(credit), "active": list(active),
                           "realised": list(realised)}
            yield item
