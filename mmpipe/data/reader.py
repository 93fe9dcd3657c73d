"""Streaming reader of webdataset shards: decoded, templated samples for one data-parallel replica.

Shards (`data.path`, a brace list such as `data/shards/train-{000000..000007}.tar`) are split
between replicas by `dp_rank` / `dp_size` (shard k goes to replica k % dp_size), never by
the RANK environment variable: every pipeline stage of a replica runs its own reader and
must see the same samples in the same order, so the order depends only on the arguments.

Each sample's members are `KEY.json` (a LLaVA conversation plus `meta`), `KEY.0.png`,
`KEY.1.png`, ... and `KEY.0.wav`, ... (see docs/data.md). A bad sample is skipped and counted
by reason in `SampleStream.skips` (data.on_error=skip) or raised naming shard and key
(data.on_error=raise).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import braceexpand
import numpy as np
import webdataset as wds

from mmpipe.data.media import decode_audio, decode_image
from mmpipe.data.skips import (
    BAD_JSON, CORRUPT_SHARD, META_MISMATCH, MISSING_JSON, MISSING_MEDIA, MISSING_META,
    NO_ENCODER, PLACEHOLDER_MISMATCH, TOO_LONG, SampleError, SkipCounter,
)
from mmpipe.data.template import count_placeholders, parse_conversation, template_sample
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.model.spec import ModelSpec
from mmpipe.planner.features import SampleFeatures, SampleMeta, audio_frames, features, meta_from_json

ON_ERROR = ("skip", "raise")
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
AUDIO_EXTS = ("wav",)
_MEDIA = re.compile(r"^(\d+)\.([a-z0-9]+)$")
_FILE_NAME = re.compile(r"name='([^']+)'")


@dataclass(kw_only=True, slots=True)
class Sample:
    """One training sample as the model takes it."""

    key: str
    """Sample key inside its shard (member names are KEY.json, KEY.0.png, ...)."""
    input_ids: list[int]
    """Templated token ids, media placeholders expanded (length = features.llm_len)."""
    labels: list[int]
    """Same length: the id on answer tokens, -100 elsewhere (not shifted)."""
    images: list[np.ndarray]
    """uint8 [H, W, 3] per image, already resized by the vision rules."""
    audio: list[np.ndarray]
    """float32 [mel_bins, frames] log-mel features per clip."""
    meta: SampleMeta
    """What the planner sees: text tokens, original image sizes, clip durations."""
    shard: str = ""
    """File name of the shard it came from."""

    @property
    def modality(self) -> str:
        """`image`, `audio`, `image+audio` or `text`."""
        kinds = [k for k, v in (("image", self.images), ("audio", self.audio)) if v]
        return "+".join(kinds) or "text"

    @property
    def llm_len(self) -> int:
        return len(self.input_ids)


def resolve_shards(path: str, *, root: Path | None = None) -> list[Path]:
    """Expand a brace list of shard paths; relative ones resolve against cwd, then `root`.

    Raises:
        FileNotFoundError: when no file, or only some of the files, exist.
    """
    if not path:
        raise ValueError("data.path is empty; give a brace list such as data/shards/train-{000000..000007}.tar")
    names = list(braceexpand.braceexpand(path))
    found: list[Path] = []
    missing: list[str] = []
    for name in names:
        p = Path(name)
        candidates = [p] if p.is_absolute() else [Path.cwd() / p] + ([Path(root) / p] if root else [])
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            missing.append(name)
        else:
            found.append(hit)
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


def shards_for_rank(shards: list[Path], *, dp_rank: int, dp_size: int) -> list[Path]:
    """The shards replica `dp_rank` of `dp_size` reads: every dp_size-th, starting at dp_rank."""
    if dp_size < 1:
        raise ValueError(f"parallel.dp={dp_size} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1} (parallel.dp={dp_size})")
    if len(shards) < dp_size:
        raise ValueError(
            f"data.path has {len(shards)} shard(s) but parallel.dp={dp_size}; every replica needs "
            f"at least one shard: lower parallel.dp to <= {len(shards)} or write more shards"
        )
    return shards[dp_rank::dp_size]


def _check_options(on_error: str, shuffle_buffer: int, epochs: int | None) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error={on_error!r} is unknown; use skip or raise")
    if shuffle_buffer < 0:
        raise ValueError(f"data.shuffle_buffer={shuffle_buffer} must be >= 0 (0: stream order)")
    if epochs is not None and epochs < 1:
        raise ValueError(f"data.epochs={epochs} must be >= 1, or null to repeat forever")


def _shuffled(items: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A bounded-buffer shuffle (deterministic for the rng's seed)."""
    buf: list[Any] = []
    for item in items:
        buf.append(item)
        if len(buf) >= size:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


@dataclass(kw_only=True, slots=True)
class _Source:
    """Raw member dicts of one replica's shards, epoch after epoch."""

    shards: list[Path]
    """This replica's shard files, in stream order."""
    seed: int
    """With dp_rank and the epoch, seeds the shuffles."""
    dp_rank: int
    """The replica (only seeds the shuffles; `shards` is already its share)."""
    epochs: int | None
    """Passes; None repeats forever."""
    shuffle_buffer: int
    """0: stream order; N: shard order and an N-sample buffer shuffled."""
    on_error: str
    """skip or raise."""
    skips: SkipCounter
    """Where drops are counted."""
    select: Callable[[str], bool] | None = None
    """Member-name filter (iter_meta reads only .json members)."""
    broken: set[str] = field(default_factory=set)
    """Shards already counted as corrupt in the current epoch."""

    def _handler(self, exn: Exception) -> bool:
        """webdataset's hook for unreadable tar data; may fire twice for one broken shard."""
        if isinstance(exn, SampleError):  # our own raise, passed through webdataset's handler
            raise SampleError(exn.reason, exn.detail, shard=exn.shard, key=exn.key) from None
        shard = next((a for a in exn.args if isinstance(a, str) and a.endswith(".tar")), "")
        if not shard:
            m = _FILE_NAME.search(str(exn.args[0]) if exn.args else "")
            shard = m.group(1) if m else "?"
        detail = str(exn.args[0]).split(" @ ")[0] if exn.args else repr(exn)
        err = SampleError(CORRUPT_SHARD, f"{detail} (samples after this point are lost)",
                          shard=Path(shard).name)
        if self.on_error == "raise":
            raise err from None
        if err.shard not in self.broken:
            self.broken.add(err.shard)
            self.skips.add(err)
        return True

    def epoch(self, e: int) -> Iterator[dict[str, Any]]:
        order = list(self.shards)
        self.broken.clear()
        rng = random.Random(f"{self.seed}:{e}:{self.dp_rank}")
        if self.shuffle_buffer:
            rng.shuffle(order)
        pipe = wds.DataPipeline(
            wds.SimpleShardList([str(p) for p in order]),
            wds.tarfile_to_samples(handler=self._handler, select_files=self.select),
        )
        raw: Iterable[dict[str, Any]] = iter(pipe)
        if self.shuffle_buffer:
            raw = _shuffled(raw, self.shuffle_buffer, rng)
        yield from raw

    def loop(self, make: Callable[[dict[str, Any]], Any]) -> Iterator[Any]:
        """Apply `make` to every raw sample; SampleErrors are counted or raised."""
        e = 0
        while self.epochs is None or e < self.epochs:
            made = 0
            for raw in self.epoch(e):
                try:
                    out = make(raw)
                except SampleError as err:
                    err = err.at(shard=Path(raw.get("__url__", "?")).name, key=raw.get("__key__", "?"))
                    if self.on_error == "raise":
                        raise err from None
                    self.skips.add(err)
                    continue
                made += 1
                yield out
            if made == 0:
                names = ", ".join(p.name for p in self.shards)
                raise ValueError(f"no usable sample in shard(s) {names}: {self.skips.summary()}")
            e += 1


def _read_json(raw: dict[str, Any]) -> dict[str, Any]:
    if "json" not in raw:
        members = ", ".join(sorted(k for k in raw if not k.startswith("__"))) or "none"
        raise SampleError(MISSING_JSON, f"no KEY.json member (members: {members})")
    try:
        obj = json.loads(raw["json"])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SampleError(BAD_JSON, f"KEY.json is not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise SampleError(BAD_JSON, f"KEY.json must hold an object, got {type(obj).__name__}")
    return obj


def _stored_meta(obj: dict[str, Any]) -> SampleMeta | None:
    if "meta" not in obj:
        return None
    try:
        return meta_from_json(obj["meta"], where="meta")
    except ValueError as err:
        raise SampleError(BAD_JSON, str(err)) from None


def _media_members(raw: dict[str, Any], exts: tuple[str, ...], count: int, kind: str) -> list[bytes]:
    """Members `0.ext .. count-1.ext` in order; a gap is `missing media`, extras a mismatch."""
    by_index: dict[int, bytes] = {}
    for name, value in raw.items():
        m = _MEDIA.match(name)
        if m and m.group(2) in exts:
            by_index[int(m.group(1))] = value
    for i in range(count):
        if i not in by_index:
            raise SampleError(MISSING_MEDIA, f"member KEY.{i}.{exts[0]} ({kind} {i} of {count}) is missing")
    extra = sorted(i for i in by_index if i >= count)
    if extra:
        raise SampleError(
            PLACEHOLDER_MISMATCH,
            f"the text has {count} {kind} placeholder(s) but members up to KEY.{extra[-1]}.{exts[0]} exist",
        )
    return [by_index[i] for i in range(count)]


def _check_counts(stored: SampleMeta | None, n_img: int, n_aud: int) -> None:
    if stored is not None and (len(stored.images), len(stored.audio_seconds)) != (n_img, n_aud):
        raise SampleError(
            PLACEHOLDER_MISMATCH,
            f"the text has {n_img} <image> and {n_aud} <audio> placeholders but meta lists "
            f"{len(stored.images)} image(s) and {len(stored.audio_seconds)} clip(s)",
        )


def decode_sample(raw: dict[str, Any], tok: Tokenizer, spec: ModelSpec) -> Sample:
    """Decode and template one raw webdataset sample (member suffix -> bytes).

    Raises:
        SampleError: any reason in mmpipe.data.skips; the caller adds shard and key.
    """
    obj = _read_json(raw)
    turns = parse_conversation(obj.get("conversations"))
    n_img, n_aud = count_placeholders(turns)
    stored = _stored_meta(obj)
    _check_counts(stored, n_img, n_aud)
    if n_img and spec.vision is None:
        raise SampleError(NO_ENCODER, f"the sample has {n_img} image(s) but model {spec.name} has no vision encoder")
    if n_aud and spec.audio is None:
        raise SampleError(NO_ENCODER, f"the sample has {n_aud} clip(s) but model {spec.name} has no audio encoder")
    img_bytes = _media_members(raw, IMAGE_EXTS, n_img, "image")
    aud_bytes = _media_members(raw, AUDIO_EXTS, n_aud, "audio")
    images = [decode_image(b, spec.vision) for b in img_bytes] if spec.vision else []
    clips = [decode_audio(b, spec.audio) for b in aud_bytes] if spec.audio else []
    sized = SampleMeta(text_tokens=0, images=tuple(i.size for i in images),
                       audio_seconds=tuple(c.seconds for c in clips))
    templ = template_sample(turns, tok, spec, sized)
    meta = SampleMeta(text_tokens=templ.text_tokens, images=sized.images, audio_seconds=sized.audio_seconds)
    if stored is not None:
        _check_meta(stored, meta, spec)
    if len(templ.input_ids) > spec.llm.max_seq_len:
        raise SampleError(
            TOO_LONG, f"{len(templ.input_ids)} tokens > model.llm.max_seq_len={spec.llm.max_seq_len}"
        )
    return Sample(
        key=str(raw.get("__key__", "")), input_ids=templ.input_ids, labels=templ.labels,
        images=[i.pixels for i in images], audio=[c.features for c in clips], meta=meta,
        shard=Path(str(raw.get("__url__", ""))).name,
    )


def _check_meta(stored: SampleMeta, true: SampleMeta, spec: ModelSpec) -> None:
    """The stored meta must give the planner the counts the model will see."""
    problems = []
    if stored.text_tokens != true.text_tokens:
        problems.append(f"text_tokens {stored.text_tokens} stored, {true.text_tokens} with this tokenizer")
    if stored.images != true.images:
        problems.append(f"images {list(stored.images)} stored, {list(true.images)} decoded")
    if spec.audio is not None:
        fs = [audio_frames(spec.audio, s) for s in stored.audio_seconds]
        ft = [audio_frames(spec.audio, s) for s in true.audio_seconds]
        if fs != ft:
            problems.append(f"audio_seconds {list(stored.audio_seconds)} stored, {list(true.audio_seconds)} decoded")
    if problems:
        raise SampleError(META_MISMATCH, "; ".join(problems) + " (regenerate the shards or the meta)")


@dataclass(kw_only=True, slots=True)
class SampleStream:
    """The samples one data-parallel replica trains on, in a reproducible order.

    Iterating twice with the same arguments gives the same sequence; drops are counted in
    `skips` across all iterations.
    """

    path: str
    """data.path: brace list of shard files."""
    tokenizer: Tokenizer
    """The tokenizer the shards' meta was counted with."""
    spec: ModelSpec
    """The model (resize rules, audio features, max_seq_len)."""
    dp_rank: int = 0
    """This replica's index."""
    dp_size: int = 1
    """parallel.dp: replicas sharing the shards."""
    seed: int = 0
    """Seeds the shard order and buffer shuffle when shuffle_buffer > 0."""
    epochs: int | None = None
    """Passes over the shards; None repeats forever."""
    shuffle_buffer: int = 0
    """0 keeps stream order; N shuffles shard order and samples within an N-sample buffer."""
    on_error: str = "skip"
    """skip (count in `skips`) or raise."""
    root: Path | None = None
    """Second base for relative shard paths (e.g. the project root)."""
    skips: SkipCounter = field(default_factory=SkipCounter)
    """Samples dropped so far, by reason."""
    shards: list[Path] = field(default_factory=list, init=False)
    """This replica's shard files."""

    def __post_init__(self) -> None:
        _check_options(self.on_error, self.shuffle_buffer, self.epochs)
        all_shards = resolve_shards(self.path, root=self.root)
        self.shards = shards_for_rank(all_shards, dp_rank=self.dp_rank, dp_size=self.dp_size)

    def _source(self, select: Callable[[str], bool] | None = None) -> _Source:
        return _Source(shards=self.shards, seed=self.seed, dp_rank=self.dp_rank, epochs=self.epochs,
                       shuffle_buffer=self.shuffle_buffer, on_error=self.on_error, skips=self.skips,
                       select=select)

    def __iter__(self) -> Iterator[Sample]:
        tok, spec = self.tokenizer, self.spec
        return self._source().loop(lambda raw: decode_sample(raw, tok, spec))


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
) -> Iterator[Sample]:
    """Stream decoded samples of replica `dp_rank`; pass `skips` to read the drop counts."""
    stream = SampleStream(path=path, tokenizer=tokenizer, spec=spec, dp_rank=dp_rank, dp_size=dp_size,
                          seed=seed, epochs=epochs, shuffle_buffer=shuffle_buffer, on_error=on_error,
                          root=root, skips=skips if skips is not None else SkipCounter())
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
) -> Iterator[tuple[str, SampleMeta]]:
    """(key, SampleMeta) of each sample from the .json members only (no media decoded).

    Same order as iter_samples with the same arguments. Checks that need no media are
    applied (conversation, placeholder counts, too long when `spec` is given), so only
    samples with broken media are yielded here yet dropped by iter_samples.
    """
    _check_options(on_error, shuffle_buffer, epochs)
    shards = shards_for_rank(resolve_shards(path, root=root), dp_rank=dp_rank, dp_size=dp_size)
    source = _Source(shards=shards, seed=seed, dp_rank=dp_rank, epochs=epochs, shuffle_buffer=shuffle_buffer,
                     on_error=on_error, skips=skips if skips is not None else SkipCounter(),
                     select=lambda name: name.endswith(".json"))

    def make(raw: dict[str, Any]) -> tuple[str, SampleMeta]:
        obj = _read_json(raw)
        turns = parse_conversation(obj.get("conversations"))
        stored = _stored_meta(obj)
        if stored is None:
            raise SampleError(MISSING_META, "KEY.json has no 'meta' (text_tokens, images, audio_seconds)")
        _check_counts(stored, *count_placeholders(turns))
        if spec is not None:
            try:
                feats: SampleFeatures = features(spec, stored)
            except ValueError as err:
                raise SampleError(NO_ENCODER, str(err)) from None
            if feats.llm_len > spec.llm.max_seq_len:
                raise SampleError(TOO_LONG, f"{feats.llm_len} tokens > model.llm.max_seq_len={spec.llm.max_seq_len}")
        return str(raw["__key__"]), stored

    return source.loop(make)
