"""Streaming readers of webdataset shards for one data-parallel replica and its loader workers.

A reader yields Records (checked and templated, media undecoded: `records()`) or Samples
(decoded: iterating the stream). Which shards a replica and each of its loader workers read
is decided in mmpipe.data.shards (by `dp_rank` / `dp_size` / `num_workers`, never by the
RANK environment variable). A reader's position is a small JSON-able dict (`state_dict()`); a
stream given that dict (`load_state_dict`) continues with exactly the samples that would have
come next. Bad samples are counted by reason in `skips` (data.on_error=skip) or raised naming
shard and key (data.on_error=raise). `loader()` (mmpipe.data.loader) runs a reader's workers
in a torch DataLoader. See docs/data.md.
"""

from __future__ import annotations

import copy
import logging
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from mmpipe.data.captions import as_conversation, metadata_member
from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits
from mmpipe.data.options import CAPTION_PROMPT, check_options
from mmpipe.data.records import Record, Sample, decode_record, make_record, meta_record
from mmpipe.data.shards import Shard, listed_samples, read_shard, resolve_urls, shard_name, shards_for_reader
from mmpipe.data.skips import CORRUPT_SHARD, SampleError, SkipCounter
from mmpipe.data.tario import ShardError
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.model.geometry import SampleMeta
from mmpipe.model.spec import ModelSpec

__all__ = ["Reader", "SampleStream", "iter_meta", "iter_samples"]

log = logging.getLogger(__name__)
STATE_VERSION = 1


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
    listed: dict[str, int] | None = None  # read on the first damaged shard only
    for shard in order:
        read = 0
        try:
            for item in read_shard(shard, select=select):
                read += not isinstance(item, SampleError)
                yield item
        except ShardError as err:
            listed = listed_samples(order) if listed is None else listed
            yield _corrupt(shard, err, read, listed.get(shard.url))


def _corrupt(shard: Shard, err: ShardError, read: int, listed: int | None) -> SampleError:
    """A damaged shard as one drop that counts the samples it lost: all its samples after the
    `read` complete ones, as its index.json lists them; at least 1 (the sample the damage cut)
    when no index lists the shard, since data after a cut or garbage cannot be counted."""
    if listed is not None and listed >= read:
        return SampleError(CORRUPT_SHARD, f"{err} ({listed - read} of its {listed} samples lost, "
                           f"{read} read before the damage)", shard=shard.name, lost=listed - read)
    return SampleError(CORRUPT_SHARD, f"{err} (samples after this point are lost: {read} read before the damage, "
                       "how many followed is unknown because no index.json lists the shard; counted as 1)",
                       shard=shard.name)


# ---------------------------------------------------------------------------- readers

@dataclass(kw_only=True, slots=True)
class Reader:
    """Options, workers, positions and counting shared by SampleStream and Mixture.

    A subclass provides three methods:

    - `worker_items(w, start, make, select)`: the items of loader worker `w`, from its cursor
      `start` (None: the beginning), each made from a raw sample by `make` (`select` picks
      the tar members to read), with `.worker`, `.cursor` (a JSON-able dict) and `.dropped`
      (the errors just before it) set;
    - `layout()`: a JSON-able dict of everything that decides the order (a saved state is
      resumed exactly only into an equal layout);
    - `approximate(cursors)`: a worker's start cursor for resuming from the saved cursors of
      another layout.

    Its `__post_init__` starts with `check()` and ends with `reset()`.
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
    caption_prompt: str = CAPTION_PROMPT
    """The human turn given to image-caption samples (img2dataset shards; see mmpipe.data.captions)."""
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
    _after: list = field(default_factory=list, init=False, repr=False)
    """The saved states of the readers of another layout this one continues (see `continues`)."""
    _seen: dict = field(default_factory=dict, init=False, repr=False)
    """Epoch -> raw samples (shard index, ordinal) those readers had taken: skipped here."""
    _start: list = field(default_factory=list, init=False, repr=False)
    _start_next: int = field(default=0, init=False, repr=False)
    _start_consumed: int = field(default=0, init=False, repr=False)
    _cursors: list = field(default_factory=list, init=False, repr=False)
    _next_worker: int = field(default=0, init=False, repr=False)
    _consumed: int = field(default=0, init=False, repr=False)

    def check(self) -> None:
        """Validate the options (the same messages as the config)."""
        check_options(on_error=self.on_error, too_long=self.too_long, shuffle_buffer=self.shuffle_buffer,
                      epochs=self.epochs, num_workers=self.num_workers, caption_prompt=self.caption_prompt)

    def reset(self) -> None:
        """Start from the beginning: every worker at its first sample, nothing consumed."""
        self._start = [None] * self.num_workers
        self._start_next = 0
        self._start_consumed = 0
        self._after, self._seen = [], {}
        self.rewind()

    def rewind(self) -> None:
        """Go back to the start position (the beginning, or the last loaded state)."""
        self._cursors = copy.deepcopy(self._start)
        self._next_worker = self._start_next
        self._consumed = self._start_consumed

    def _iterate(self, make: Callable[[dict], Any], select: Callable[[str], bool] | None = None) -> Iterator[Any]:
        self.rewind()
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
        gens = {w: self.worker_items(w, self._start[w], make, select) for w in workers}
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
        return make_record(as_conversation(raw, self.caption_prompt), self.tokenizer, self.spec,
                           too_long=self.too_long, limits=self.limits)

    def _make_sample(self, raw: dict) -> Sample:
        return decode_record(self._make_record(raw), self.tokenizer, self.spec, limits=self.limits)

    @property
    def cursors(self) -> list:
        """Each worker's position after its last noted item (None: not started)."""
        return self._cursors

    @property
    def consumed(self) -> int:
        """Items handed out (noted) since the start of training, across resumes."""
        return self._consumed

    def state_dict(self) -> dict:
        """The position after the last noted item, as plain JSON-able values."""
        state = {"version": STATE_VERSION, "layout": self.layout(), "workers": copy.deepcopy(self._cursors),
                 "next_worker": self._next_worker, "consumed": self._consumed}
        if self._after and any(c is None or c["epoch"] <= max(self._seen, default=-1) for c in self._cursors):
            state["after"] = copy.deepcopy(self._after)  # still inside an epoch they had read part of
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iteration: exactly when the layout (dp size and
        rank, workers, seed, shuffle, shard list) is the same; when only the dp size or the
        worker count differ and `state["replicas"]` holds every saved replica's state, with
        each sample the saved readers had not taken (see `continues`); else approximately (see
        `resume_mode` and docs/data.md)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"reader state must be a dict with version {STATE_VERSION}, got {str(state)[:80]}")
        saved, mine = state["layout"], self.layout()
        if saved.get("dp_size") == mine["dp_size"] and saved.get("dp_rank") != mine["dp_rank"]:
            raise ValueError(
                f"reader state of replica {saved.get('dp_rank')} loaded into replica {mine['dp_rank']} "
                f"(parallel.dp={mine['dp_size']} both times); restore each replica its own state")
        self._start_consumed = int(state.get("consumed", 0))
        self._after, self._seen = [], {}
        if saved == mine:
            self._start = copy.deepcopy(state["workers"])
            self._start_next = int(state.get("next_worker", 0))
            self.resume_mode = "exact"
            if state.get("after"):
                self._after, self._seen = state["after"], self.taken(state["after"])
        elif state.get("replicas") and self.continues(state["replicas"]):
            self._after = copy.deepcopy(state["replicas"])
            self._seen = self.taken(self._after)
            self._start = [{"epoch": min(self._seen), "offset": 0} for _ in range(self.num_workers)]
            self._start_next = 0
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in mine.items() if saved.get(k) != v)
            self.resume_mode = f"continued ({changed})"
            log.warning("data reader continues another layout (%s): from epoch %d, without the %d samples its "
                        "readers had taken", changed, min(self._seen), sum(map(len, self._seen.values())))
        else:
            self._start = [self.approximate(state["workers"]) for _ in range(self.num_workers)]
            self._start_next = 0
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in mine.items() if saved.get(k) != v)
            self.resume_mode = f"approximate ({changed})"
            log.warning("data reader resumes approximately: %s; see docs/data.md", changed)
        self.rewind()

    def _epoch_of(self, cursors: list) -> int:
        return min((c["epoch"] for c in cursors if c), default=0)

    def continues(self, states: list[dict]) -> bool:
        """Whether this reader can continue the saved readers `states` (every replica's, of
        another dp size or worker count) sample for sample: the same kind of reader, seed,
        shuffle and shards. Mixtures cannot (their sources' readers are not replayed)."""
        return False

    def taken(self, states: list[dict]) -> dict[int, set[tuple[int, int]]]:
        """Epoch -> the raw samples (shard index, ordinal) the readers of `states` had taken,
        from the earliest epoch any of them was in (that epoch present even when empty)."""
        raise NotImplementedError


def _no_usable(shards: list[Shard], errors: list[SampleError]) -> ValueError:
    counter = SkipCounter()
    for e in errors:
        counter.add(e)
    names = ", ".join(s.name for s in shards)
    first = f"; first: {counter.examples[0]}" if counter.examples else ""
    return ValueError(f"no usable sample in shard(s) {names}: {counter.summary()}{first}")


@dataclass(kw_only=True, slots=True)
class SampleStream(Reader):
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
        self.check()
        self.all_shards = [Shard(u, i) for i, u in enumerate(resolve_urls(self.path, root=self.root, key=self.key))]
        self.shards = shards_for_reader(self.all_shards, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                        num_workers=1, key=self.key)
        for w in range(self.num_workers):  # validates the worker split too
            shards_for_reader(self.all_shards, dp_rank=self.dp_rank, dp_size=self.dp_size, worker_id=w,
                              num_workers=self.num_workers, key=self.key)
        if self.worker_id is not None and not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id={self.worker_id} is outside 0..{self.num_workers - 1}")
        self.reset()

    def worker_shards(self, w: int) -> list[Shard]:
        return self.shards[w::self.num_workers]

    def layout(self) -> dict:
        urls = "\n".join(s.url for s in self.all_shards)
        return {"kind": "stream", "dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers,
                "seed": self.seed, "shuffle_buffer": self.shuffle_buffer, "shards": len(self.all_shards),
                "shard_crc": zlib.crc32(urls.encode())}

    def approximate(self, cursors: list) -> dict:
        return {"epoch": self._epoch_of(cursors), "offset": 0}

    def continues(self, states: list[dict]) -> bool:
        same = ("kind", "seed", "shuffle_buffer", "shards", "shard_crc")
        mine = self.layout()
        layouts = [st.get("layout", {}) for st in states]
        return (all(all(lay.get(k) == mine[k] for k in same) for lay in layouts)
                and sorted(lay.get("dp_rank") for lay in layouts) == list(range(len(states)))
                and all(lay.get("dp_size") == len(states) for lay in layouts)
                and all(not st.get("after") or self.continues(st["after"]) for st in states))

    def taken(self, states: list[dict]) -> dict[int, set[tuple[int, int]]]:
        # Replays each saved reader's order (its own dp rank, dp size and worker split; shard
        # headers only, no member is read) up to its saved position; what an earlier layout's
        # readers had taken before that one continued them is added from its "after".
        first = min((c["epoch"] for st in states for c in st["workers"] if c), default=0)
        seen: dict[int, set[tuple[int, int]]] = {first: set()}
        for st in states:
            lay = st["layout"]
            twin = SampleStream(path=self.path, keep=self.keep, name=self.name, key=self.key, root=self.root,
                                dp_rank=lay["dp_rank"], dp_size=lay["dp_size"], num_workers=lay["num_workers"],
                                seed=self.seed, shuffle_buffer=self.shuffle_buffer, epochs=self.epochs)
            for w, cursor in enumerate(st["workers"]):
                if not cursor:
                    continue
                for epoch in range(first, int(cursor["epoch"]) + 1):
                    upto = int(cursor["offset"]) if epoch == int(cursor["epoch"]) else None
                    got = seen.setdefault(epoch, set())
                    for i, ev in enumerate(twin.events(w, epoch, select=lambda name: False)):
                        if upto is not None and i >= upto:
                            break
                        if not isinstance(ev, SampleError):
                            got.add((ev["__shard__"], ev["__ordinal__"]))
            if st.get("after"):  # epochs before `first` every saved reader had finished: no exclusions needed
                for epoch, got in self.taken(st["after"]).items():
                    if epoch >= first:
                        seen.setdefault(epoch, set()).update(got)
        return seen

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

    def worker_items(self, w: int, start: dict | None, make: Callable[[dict], Any],
                      select: Callable[[str], bool] | None) -> Iterator[Any]:
        epoch, skip = (int(start["epoch"]), int(start["offset"])) if start else (0, 0)
        pending: list[SampleError] = []
        while self.epochs is None or epoch < self.epochs:
            seen = self._seen.get(epoch, ())
            made, resumed, errors, i = 0, skip > 0 or bool(seen), [], -1
            for i, ev in enumerate(self.events(w, epoch, select)):
                if i < skip:
                    continue  # replayed to restore the position; counted before the interruption
                if seen and not isinstance(ev, SampleError) and (ev["__shard__"], ev["__ordinal__"]) in seen:
                    continue  # taken by the readers of the layout this one continues
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


# ---------------------------------------------------------------------------- functions

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
    caption_prompt: str = CAPTION_PROMPT,
) -> Iterator[Sample]:
    """Stream decoded samples of replica `dp_rank`; pass `skips` to read the drop counts."""
    stream = SampleStream(path=path, tokenizer=tokenizer, spec=spec, dp_rank=dp_rank, dp_size=dp_size,
                          seed=seed, epochs=epochs, shuffle_buffer=shuffle_buffer, on_error=on_error,
                          root=root, skips=skips if skips is not None else SkipCounter(), too_long=too_long,
                          num_workers=num_workers, worker_id=worker_id, caption_prompt=caption_prompt)
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
    caption_prompt: str = CAPTION_PROMPT,
) -> Iterator[tuple[str, SampleMeta]]:
    """(key, SampleMeta) of each sample from the .json members only (media bytes are skipped).

    Same order as iter_samples with the same arguments. Checks that need no media are
    applied (conversation, placeholder counts, too long when `spec` is given), so only
    samples with broken media are yielded here yet dropped by iter_samples. With
    too_long=truncate give `tokenizer` too: the meta is then the truncated one.
    img2dataset caption samples store no meta: for them the caption and the image are read
    too (the image's header gives its size) and the text tokens are counted with `tokenizer`,
    which must then be given (else each is a counted `missing meta`).
    """
    if too_long == "truncate" and spec is not None and tokenizer is None:
        raise ValueError("iter_meta(too_long='truncate') needs the tokenizer to find where to cut")
    stream = SampleStream(path=path, spec=spec, tokenizer=tokenizer, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                          epochs=epochs, shuffle_buffer=shuffle_buffer, on_error=on_error, root=root,
                          skips=skips if skips is not None else SkipCounter(), too_long=too_long,
                          num_workers=num_workers, worker_id=worker_id, caption_prompt=caption_prompt)

    def make(raw: dict[str, Any]) -> _MetaItem:
        raw = as_conversation(raw, caption_prompt, meta_with=tokenizer, need_meta=True)
        return _MetaItem(str(raw["__key__"]), meta_record(raw, spec=spec, tok=tokenizer, too_long=too_long))

    return ((m.key, m.meta) for m in stream._iterate(make, metadata_member))
