"""Streaming reader of webdataset shards for one data-parallel replica and its loader workers.

Shards (`data.path`: a brace list of files such as `data/shards/train-{000000..000007}.tar`, or
a `pipe:` command such as `pipe:cat data/shards/train-{000000..000007}.tar`, brace-expanded
into one command per shard) are split between replicas by `dp_rank` / `dp_size` (shard k goes
to replica k % dp_size) and then between a replica's loader workers (the replica's j-th shard
to worker j % num_workers), never by the RANK environment variable: every pipeline stage of a
replica runs its own reader and must see the same samples in the same order, so the order
depends only on the arguments.

A reader yields Records (checked and templated, media undecoded: `records()`) or Samples
(decoded: iterating the stream). Its position is a small JSON-able dict (`state_dict()`); a
stream given that dict (`load_state_dict`) continues with exactly the samples that would have
come next. Bad samples are counted by reason in `skips` (data.on_error=skip) or raised naming
shard and key (data.on_error=raise). See docs/data.md.
"""

from __future__ import annotations

import copy
import logging
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import braceexpand

from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits
from mmpipe.data.records import (
    TOO_LONG_MODES, Record, Sample, decode_record, make_record, meta_record,
)
from mmpipe.data.skips import CORRUPT_SHARD, SampleError, SkipCounter
from mmpipe.data.tario import Shard, ShardError, read_shard, shard_name
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import SampleMeta

__all__ = [
    "Record", "Sample", "SampleStream", "decode_record", "decode_sample", "iter_meta", "iter_samples",
    "loader", "resolve_shards", "resolve_urls", "shards_for_rank", "shards_for_reader", "check_shards",
]

log = logging.getLogger(__name__)
ON_ERROR = ("skip", "raise")
STATE_VERSION = 1


# ---------------------------------------------------------------------------- shard lists

def resolve_shards(path: str, *, root: Path | None = None) -> list[Path]:
    """Expand a brace list of shard files; relative ones resolve against cwd, then `root`.

    A `pipe:` path is expanded without any check (each entry is a command, wrapped in Path
    only so that callers can count them; use resolve_urls to read).

    Raises:
        FileNotFoundError: when no file, or only some of the files, exist.
    """
    return [Path(u) for u in resolve_urls(path, root=root)]


def resolve_urls(path: str, *, root: Path | None = None) -> list[str]:
    """Shard URLs of data.path: existing local files (checked) or `pipe:` commands."""
    if not path:
        raise ValueError("data.path is empty; give a brace list such as data/shards/train-{000000..000007}.tar")
    if path.lstrip().startswith("pipe:"):
        urls = list(braceexpand.braceexpand(path.strip()))
        if any(not u[5:].strip() for u in urls):
            raise ValueError(f"data.path={path!r}: a pipe: URL needs a command, e.g. pipe:cat shard-{{0..3}}.tar")
        return urls
    names = list(braceexpand.braceexpand(path))
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        p = Path(name)
        candidates = [p] if p.is_absolute() else [Path.cwd() / p] + ([Path(root) / p] if root else [])
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            missing.append(name)
        else:
            found.append(str(hit))
    looked = f"cwd {Path.cwd()}" + (f" and root {root}" if root else "")
    if not found:
        raise FileNotFoundError(
            f"data.path={path!r} matches no file (looked in {looked}); generate the shipped "
            f"shards with `python -m mmpipe.data.synth --out data/` or fix the path"
        )
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"data.path={path!r}: {len(missing)} of {len(names)} shards are missing ({shown}; "
            f"looked in {looked}); fix the brace range or regenerate the data"
        )
    return found


def shards_for_rank(shards: list[Any], *, dp_rank: int, dp_size: int) -> list[Any]:
    """The shards replica `dp_rank` of `dp_size` reads: every dp_size-th, starting at dp_rank."""
    return shards_for_reader(shards, dp_rank=dp_rank, dp_size=dp_size)


def shards_for_reader(shards: list[Any], *, dp_rank: int, dp_size: int, worker_id: int = 0,
                      num_workers: int = 1, key: str = "data.path") -> list[Any]:
    """The shards of loader worker `worker_id` of replica `dp_rank`.

    Replica r reads shards r, r + dp, r + 2dp, ...; its worker j the j-th, (j+W)-th, ... of
    those. Every reader needs at least one shard: fewer shards than dp x workers is an error
    (a reader without shards would hang its replica's pipeline).
    """
    if dp_size < 1:
        raise ValueError(f"parallel.dp={dp_size} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1} (parallel.dp={dp_size})")
    if num_workers < 1:
        raise ValueError(f"data.num_workers={num_workers} must be >= 1")
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id={worker_id} is outside 0..{num_workers - 1} (data.num_workers={num_workers})")
    readers = dp_size * num_workers
    if len(shards) < readers:
        if num_workers == 1:
            raise ValueError(
                f"{key} has {len(shards)} shard(s) but parallel.dp={dp_size}; every replica needs "
                f"at least one shard: lower parallel.dp to <= {len(shards)} or write more shards"
            )
        raise ValueError(
            f"{key} has {len(shards)} shard(s) but parallel.dp x data.num_workers = {dp_size} x {num_workers} "
            f"= {readers} readers; every reader needs at least one shard: lower data.num_workers to "
            f"<= {max(1, len(shards) // dp_size)} or write more shards"
        )
    return shards[dp_rank::dp_size][worker_id::num_workers]


def check_shards(path: str, *, root: Path | None = None, dp_size: int = 1, num_workers: int = 1) -> list[str]:
    """Preflight: the shard list resolves and gives every reader a shard. Returns the URLs."""
    urls = resolve_urls(path, root=root)
    shards_for_reader(urls, dp_rank=0, dp_size=dp_size, num_workers=num_workers)
    return urls


def _check_options(on_error: str, shuffle_buffer: int, epochs: int | None, too_long: str = "drop") -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error={on_error!r} is unknown; use skip or raise")
    if shuffle_buffer < 0:
        raise ValueError(f"data.shuffle_buffer={shuffle_buffer} must be >= 0 (0: stream order)")
    if epochs is not None and epochs < 1:
        raise ValueError(f"data.epochs={epochs} must be >= 1, or null to repeat forever")
    if too_long not in TOO_LONG_MODES:
        raise ValueError(f"data.too_long={too_long!r} is unknown; use drop or truncate")


def _shuffled(items: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A bounded-buffer shuffle (deterministic for the rng's seed); errors pass straight through."""
    buf: list[Any] = []
    for item in items:
        if isinstance(item, SampleError):
            yield item
            continue
        buf.append(item)
        if len(buf) >= size:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def _read(order: list[Shard], select: Callable[[str], bool] | None) -> Iterator[dict | SampleError]:
    for shard in order:
        try:
            yield from read_shard(shard, select=select)
        except ShardError as err:
            yield SampleError(CORRUPT_SHARD, f"{err} (samples after this point are lost)", shard=shard.name)


# ---------------------------------------------------------------------------- readers

@dataclass(kw_only=True, slots=True)
class _Reader:
    """Options, workers, positions and counting shared by SampleStream and Mixture.

    Subclasses provide `_worker_items(w, start, make, select)` (the items of worker w from
    cursor `start`, each with .worker, .cursor and .dropped set) and `_layout()`.
    """

    tokenizer: Tokenizer | None = None
    """The tokenizer the shards' meta was counted with (needed for records and samples)."""
    spec: ModelSpec | None = None
    """The model (resize rules, audio features, max_seq_len)."""
    dp_rank: int = 0
    """This replica's index."""
    dp_size: int = 1
    """parallel.dp: replicas sharing the data."""
    seed: int = 0
    """Seeds the shard order, buffer shuffles and random mixture limits."""
    epochs: int | None = None
    """Passes over the data; None repeats forever (reshuffled each pass)."""
    shuffle_buffer: int = 0
    """0 keeps stream order; N shuffles shard order and samples within an N-sample buffer."""
    on_error: str = "skip"
    """skip (count in `skips`) or raise."""
    too_long: str = "drop"
    """Samples over model.llm.max_seq_len: drop, or truncate the answer tail."""
    num_workers: int = 1
    """Loader workers of this replica (data.num_workers); each reads its own shards."""
    worker_id: int | None = None
    """Read only this worker's share; None: the DataLoader worker we run in, or all workers
    interleaved round-robin (the order a DataLoader with batch_size=None gives)."""
    root: Path | None = None
    """Second base for relative shard paths (e.g. the project root)."""
    skips: SkipCounter = field(default_factory=SkipCounter)
    """Samples dropped so far, by reason."""
    limits: MediaLimits = DEFAULT_LIMITS
    """Media sizes refused before decoding (data.max_image_pixels, max_member_mb, max_audio_seconds)."""
    resume_mode: str = field(default="start", init=False)
    """start | exact | approximate (...): how the last load_state_dict resumed."""
    _start: list = field(default_factory=list, init=False, repr=False)
    _start_next: int = field(default=0, init=False, repr=False)
    _start_consumed: int = field(default=0, init=False, repr=False)
    _cursors: list = field(default_factory=list, init=False, repr=False)
    _next_worker: int = field(default=0, init=False, repr=False)
    _consumed: int = field(default=0, init=False, repr=False)

    def _check(self) -> None:
        _check_options(self.on_error, self.shuffle_buffer, self.epochs, self.too_long)

    def _begin(self) -> None:
        self._cursors = copy.deepcopy(self._start)
        self._next_worker = self._start_next
        self._consumed = self._start_consumed

    def _iterate(self, make: Callable[[dict], Any], select: Callable[[str], bool] | None = None) -> Iterator[Any]:
        self._begin()
        if self.worker_id is not None:
            workers = [self.worker_id]
        else:
            workers = list(range(self.num_workers))
            if self.num_workers > 1:
                from torch.utils.data import get_worker_info

                info = get_worker_info()
                if info is not None:
                    if info.num_workers != self.num_workers:
                        raise ValueError(
                            f"the DataLoader has num_workers={info.num_workers} but the stream was made with "
                            f"num_workers={self.num_workers} (data.num_workers); use the same value")
                    workers = [info.id]
        gens = {w: self._worker_items(w, self._start[w], make, select) for w in workers}
        ring = list(workers)
        i = ring.index(self._next_worker) if self._next_worker in ring else 0
        while ring:
            w = ring[i]
            try:
                item = next(gens[w])
            except StopIteration:
                ring.pop(i)
                i = i % len(ring) if ring else 0
                continue
            i = (i + 1) % len(ring)
            self.note(item)
            self._next_worker = ring[i]
            yield item

    def note(self, item: Any) -> None:
        """Account for an item handed to the trainer: its position and the drops before it.

        Iterating a stream in-process calls this itself; call it only for items that came
        through a torch DataLoader (`loader()` does).
        """
        for err in item.dropped:
            self.skips.add(err)
        self._cursors[item.worker] = item.cursor
        self._next_worker = (item.worker + 1) % len(self._cursors)
        self._consumed += 1

    def records(self) -> Iterator[Record]:
        """Checked, templated Records with media undecoded, in the stream order."""
        return self._iterate(self._make_record)

    def __iter__(self) -> Iterator[Sample]:
        return self._iterate(self._make_sample)

    def decode(self, rec: Record, *, media: bool = True) -> Sample | None:
        """decode_record for this stream; an undecodable medium is counted (or raised) and
        gives None."""
        try:
            return decode_record(rec, self.tokenizer, self.spec, media=media, limits=self.limits)
        except SampleError as err:
            if self.on_error == "raise":
                raise
            self.skips.add(err)
            return None

    def _make_record(self, raw: dict) -> Record:
        return make_record(raw, self.tokenizer, self.spec, too_long=self.too_long, limits=self.limits)

    def _make_sample(self, raw: dict) -> Sample:
        return decode_record(self._make_record(raw), self.tokenizer, self.spec, limits=self.limits)

    @property
    def consumed(self) -> int:
        """Items handed out (noted) since the start of training, across resumes."""
        return self._consumed

    def state_dict(self) -> dict:
        """The position after the last noted item, as plain JSON-able values."""
        return {"version": STATE_VERSION, "layout": self._layout(), "workers": copy.deepcopy(self._cursors),
                "next_worker": self._next_worker, "consumed": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iteration: exactly when the layout (dp size and
        rank, workers, seed, shuffle, shard list) is the same, else approximately (see
        `resume_mode` and docs/data.md)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"reader state must be a dict with version {STATE_VERSION}, got {str(state)[:80]}")
        saved, mine = state["layout"], self._layout()
        if saved.get("dp_size") == mine["dp_size"] and saved.get("dp_rank") != mine["dp_rank"]:
            raise ValueError(
                f"reader state of replica {saved.get('dp_rank')} loaded into replica {mine['dp_rank']} "
                f"(parallel.dp={mine['dp_size']} both times); restore each replica its own state")
        self._start_consumed = int(state.get("consumed", 0))
        if saved == mine:
            self._start = copy.deepcopy(state["workers"])
            self._start_next = int(state.get("next_worker", 0))
            self.resume_mode = "exact"
        else:
            self._start = [self._approximate(state["workers"]) for _ in range(self.num_workers)]
            self._start_next = 0
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in mine.items() if saved.get(k) != v)
            self.resume_mode = f"approximate ({changed})"
            log.warning("data reader resumes approximately: %s; see docs/data.md", changed)
        self._begin()

    def _epoch_of(self, cursors: list) -> int:
        return min((c["epoch"] for c in cursors if c), default=0)


def _no_usable(shards: list[Shard], errors: list[SampleError]) -> ValueError:
    counter = SkipCounter()
    for e in errors:
        counter.add(e)
    names = ", ".join(s.name for s in shards)
    return ValueError(f"no usable sample in shard(s) {names}: {counter.summary()}")


@dataclass(kw_only=True, slots=True)
class SampleStream(_Reader):
    """The samples one data-parallel replica (or one of its loader workers) trains on, in a
    reproducible order.

    Iterating twice gives the same sequence (from the start, or from a loaded state); drops
    are counted in `skips` across all iterations.
    """

    path: str
    """data.path: brace list of shard files, or a pipe: command brace list."""
    keep: Callable[[int, int], bool] | None = None
    """Sample filter by (shard index in the full list, position in the shard): mixture limits."""
    name: str = ""
    """Source name in a mixture (set on every record)."""
    key: str = "data.path"
    """How errors name the path setting."""
    shards: list[Shard] = field(default_factory=list, init=False)
    """This replica's shards."""
    all_shards: list[Shard] = field(default_factory=list, init=False)
    """The full, expanded shard list."""

    def __post_init__(self) -> None:
        self._check()
        self.all_shards = [Shard(u, i) for i, u in enumerate(resolve_urls(self.path, root=self.root))]
        self.shards = shards_for_reader(self.all_shards, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                        num_workers=1, key=self.key)
        for w in range(self.num_workers):  # validates the worker split too
            shards_for_reader(self.all_shards, dp_rank=self.dp_rank, dp_size=self.dp_size, worker_id=w,
                              num_workers=self.num_workers, key=self.key)
        if self.worker_id is not None and not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id={self.worker_id} is outside 0..{self.num_workers - 1}")
        self._start = [None] * self.num_workers
        self._begin()

    def worker_shards(self, w: int) -> list[Shard]:
        return self.shards[w::self.num_workers]

    def _layout(self) -> dict:
        urls = "\n".join(s.url for s in self.all_shards)
        return {"kind": "stream", "dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers,
                "seed": self.seed, "shuffle_buffer": self.shuffle_buffer, "shards": len(self.all_shards),
                "shard_crc": zlib.crc32(urls.encode())}

    def _approximate(self, cursors: list) -> dict:
        return {"epoch": self._epoch_of(cursors), "offset": 0}

    def _rng(self, epoch: int, w: int) -> random.Random:
        if self.num_workers == 1:
            return random.Random(f"{self.seed}:{epoch}:{self.dp_rank}")
        return random.Random(f"{self.seed}:{epoch}:{self.dp_rank}:{w}:{self.num_workers}")

    def events(self, w: int, epoch: int, select: Callable[[str], bool] | None = None) -> Iterator[dict | SampleError]:
        """Raw samples and corrupt-shard errors of worker w in one epoch (offsets count these)."""
        order = list(self.worker_shards(w))
        rng = self._rng(epoch, w)
        if self.shuffle_buffer:
            rng.shuffle(order)
        evs: Iterable[dict | SampleError] = _read(order, select)
        if self.keep is not None:
            keep = self.keep
            evs = (e for e in evs if isinstance(e, SampleError) or keep(e["__shard__"], e["__ordinal__"]))
        if self.shuffle_buffer:
            evs = _shuffled(evs, self.shuffle_buffer, rng)
        return iter(evs)

    def _worker_items(self, w: int, start: dict | None, make: Callable[[dict], Any],
                      select: Callable[[str], bool] | None) -> Iterator[Any]:
        epoch, skip = (int(start["epoch"]), int(start["offset"])) if start else (0, 0)
        pending: list[SampleError] = []
        while self.epochs is None or epoch < self.epochs:
            made, resumed, errors, i = 0, skip > 0, [], -1
            for i, ev in enumerate(self.events(w, epoch, select)):
                if i < skip:
                    continue  # replayed to restore the position; counted before the interruption
                if isinstance(ev, SampleError):
                    err = ev
                else:
                    try:
                        item = make(ev)
                    except SampleError as e:
                        err = e.at(shard=shard_name(ev["__url__"]), key=str(ev["__key__"]))
                    else:
                        made += 1
                        item.worker, item.cursor, item.dropped = w, {"epoch": epoch, "offset": i + 1}, tuple(pending)
                        if self.name:
                            item.source = self.name
                        pending = []
                        yield item
                        continue
                if self.on_error == "raise":
                    raise err from None
                pending.append(err)
                if len(errors) < 1000:
                    errors.append(err)
            if i < 0 and self.keep is not None and not resumed:
                return  # a mixture limit left this reader nothing of this source
            if made == 0 and not resumed:
                raise _no_usable(self.worker_shards(w), errors)
            skip = 0
            epoch += 1
        for err in pending:  # drops after the last sample: nothing follows to carry them
            self.skips.add(err)


@dataclass(slots=True)
class _MetaItem:
    key: str
    meta: SampleMeta
    worker: int = 0
    cursor: dict | None = None
    dropped: tuple = ()
    source: str = ""


def _json_only(name: str) -> bool:
    return name.endswith(".json")


# ---------------------------------------------------------------------------- functions

def decode_sample(raw: dict[str, Any], tok: Tokenizer, spec: ModelSpec, *, too_long: str = "drop") -> Sample:
    """Check, template and decode one raw webdataset sample (member suffix -> bytes).

    Raises:
        SampleError: any reason in mmpipe.data.skips; the caller adds shard and key.
    """
    return decode_record(make_record(raw, tok, spec, too_long=too_long), tok, spec)


def iter_samples(
    *,
    path: str,
    tokenizer: Tokenizer,
    spec: ModelSpec,
    dp_rank: int,
    dp_size: int,
    seed: int = 0,
    epochs: int | None = None,
    shuffle_buffer: int = 0,
    on_error: str = "skip",
    root: Path | None = None,
    skips: SkipCounter | None = None,
    too_long: str = "drop",
    num_workers: int = 1,
    worker_id: int | None = None,
) -> Iterator[Sample]:
    """Stream decoded samples of replica `dp_rank`; pass `skips` to read the drop counts."""
    stream = SampleStream(path=path, tokenizer=tokenizer, spec=spec, dp_rank=dp_rank, dp_size=dp_size,
                          seed=seed, epochs=epochs, shuffle_buffer=shuffle_buffer, on_error=on_error,
                          root=root, skips=skips if skips is not None else SkipCounter(), too_long=too_long,
                          num_workers=num_workers, worker_id=worker_id)
    return iter(stream)


def iter_meta(
    *,
    path: str,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    epochs: int | None = 1,
    shuffle_buffer: int = 0,
    on_error: str = "skip",
    root: Path | None = None,
    spec: ModelSpec | None = None,
    skips: SkipCounter | None = None,
    too_long: str = "drop",
    tokenizer: Tokenizer | None = None,
    num_workers: int = 1,
    worker_id: int | None = None,
) -> Iterator[tuple[str, SampleMeta]]:
    """(key, SampleMeta) of each sample from the .json members only (media bytes are skipped).

    Same order as iter_samples with the same arguments. Checks that need no media are
    applied (conversation, placeholder counts, too long when `spec` is given), so only
    samples with broken media are yielded here yet dropped by iter_samples. With
    too_long=truncate give `tokenizer` too: the meta is then the truncated one.
    """
    if too_long == "truncate" and spec is not None and tokenizer is None:
        raise ValueError("iter_meta(too_long='truncate') needs the tokenizer to find where to cut")
    stream = SampleStream(path=path, spec=spec, tokenizer=tokenizer, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                          epochs=epochs, shuffle_buffer=shuffle_buffer, on_error=on_error, root=root,
                          skips=skips if skips is not None else SkipCounter(), too_long=too_long,
                          num_workers=num_workers, worker_id=worker_id)

    def make(raw: dict[str, Any]) -> _MetaItem:
        return _MetaItem(str(raw["__key__"]), meta_record(raw, spec=spec, tok=tokenizer, too_long=too_long))

    return ((m.key, m.meta) for m in stream._iterate(make, _json_only))


class _LoaderView:
    """The stream as a torch IterableDataset (built lazily: torch is imported only here)."""

    def __new__(cls, stream: _Reader, records: bool):
        from torch.utils.data import IterableDataset

        class View(IterableDataset):
            def __iter__(self):
                return stream.records() if records else iter(stream)

        return View()


def _identity(x: Any) -> Any:
    return x


def loader(stream: _Reader, *, records: bool = False, prefetch_factor: int = 2) -> Iterator[Any]:
    """Iterate `stream` through a torch DataLoader with `stream.num_workers` processes.

    Each worker reads its own shards, so every sample is read once; items come round-robin
    by worker, the same order as iterating the stream in-process. Positions and drops are
    noted on `stream` here in the main process, so `stream.state_dict()` is the position of
    the last item handed out (not of what the workers prefetched).
    """
    if stream.num_workers <= 1 or stream.worker_id is not None:
        yield from (stream.records() if records else iter(stream))
        return
    from torch.utils.data import DataLoader

    stream._begin()
    dl = DataLoader(_LoaderView(stream, records), batch_size=None, num_workers=stream.num_workers,
                    collate_fn=_identity, prefetch_factor=prefetch_factor)
    for item in dl:
        stream.note(item)
        yield item
