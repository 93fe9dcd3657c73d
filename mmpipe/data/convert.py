"""Convert a LLaVA-style JSON dataset into webdataset shards the reader reads.

    mmpipe shards convert --json llava.json --out data/llava/ --tokenizer data/tokenizer.json|CHECKPOINT_DIR
        [--image-root DIR] [--audio-root DIR] [--maxcount 1000] [--maxsize-mb 512] [--strict]

Input: a JSON list of {"id", "image" | "images", "audio" (a path or a list),
"conversations": [{"from": "human" | "gpt", "value": "<image>\\n..."}]}; media paths are
relative to --image-root / --audio-root, else to the JSON file's folder.

Output in OUT/: `train-000000.tar ...` (KEY.json with the conversation and `meta`, KEY.0.png /
.jpg, KEY.0.wav) and `index.json` (samples per shard, totals by modality, what was skipped).
`meta.text_tokens` is counted with the given templater and `meta.tokenizer` names it by its
fingerprint: a run with another tokenizer counts again (records.hint_applies).
Shards close at `maxcount` samples or before passing `maxsize` bytes. The same input always
gives byte-identical shards (input order; members json, images, clips; tar mtime 0, uid/gid
0, no owner names, mode 0644).

Conventions:
- LLaVA puts `<image>` in the first human turn; a sample whose human turns hold no `<image>`
  (or no `<audio>`) although it has images (clips) gets one placeholder per medium prepended
  to its first human turn, images first ("<image>\\n<audio>\\n..."). Some placeholders but
  not one per medium is a `placeholder mismatch`.
- PNG and JPEG bytes are stored as they are (.png / .jpg); other image formats are re-encoded
  as PNG. WAV clips are stored as they are; FLAC and other formats need the optional
  `soundfile` package and are stored as 16-bit WAV.
- Keys are the ids with every character outside [A-Za-z0-9_-] replaced by `_` (the reader
  splits member names at the first dot); a repeated key gets `-1`, `-2`, ... appended. The
  original id stays in KEY.json.
- A sample with a missing or unreadable medium, or a conversation without an answer, is
  left out and reported by id (or stops the conversion with on_error=raise).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from mmpipe.data.media import FLAC_NEEDS_SOUNDFILE, probe_audio, read_wav, soundfile_available
from mmpipe.data.skips import (
    BAD_CONVERSATION, MISSING_MEDIA, PLACEHOLDER_MISMATCH, UNDECODABLE_AUDIO, UNDECODABLE_IMAGE, SampleError,
    SkipCounter,
)
from mmpipe.data.template import HUMAN, Templater, as_templater, count_placeholders, parse_conversation
from mmpipe.data.tokenizer import AUDIO, IMAGE, Tokenizer
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import SampleMeta, features

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<n>\d{6})\.tar$")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo:
    """One written shard."""

    file: str
    """File name inside OUT."""
    samples: int
    """Samples in it."""
    bytes: int
    """Size on disk."""
    by_modality: dict[str, int]
    """Samples per modality."""


@dataclass(kw_only=True, slots=True)
class ConvertReport:
    """What a conversion wrote and left out."""

    out: Path
    """Output folder."""
    path: str
    """data.path of the result (brace list)."""
    samples_in: int = 0
    """Entries in the JSON."""
    shards: list[ShardInfo] = field(default_factory=list)
    """Written shards, in order."""
    skips: SkipCounter = field(default_factory=SkipCounter)
    """Left-out samples by reason."""
    skipped_ids: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> ids of the samples left out."""
    prepended: int = 0
    """Samples whose first human turn got placeholders prepended."""
    index: dict = field(default_factory=dict)
    """The index.json content."""

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def summary(self) -> str:
        lines = [f"wrote {self.samples} of {self.samples_in} samples in {len(self.shards)} shard(s) to {self.out} "
                 f"(data.path={self.path})"]
        if self.prepended:
            lines.append(f"  {self.prepended} sample(s) got media placeholders prepended to the first human turn")
        lines.append(f"  {self.skips.summary()}")
        for reason, ids in sorted(self.skipped_ids.items()):
            shown = ", ".join(ids[:10]) + (f", ... ({len(ids)} in all)" if len(ids) > 10 else "")
            lines.append(f"    {reason}: {shown}")
        return "\n".join(lines)


@dataclass(kw_only=True, slots=True)
class _Converted:
    key: str
    members: list[tuple[str, bytes]]
    meta: SampleMeta
    modality: str
    prepended: bool


def _paths(item: dict, *names: str) -> list[str]:
    for n in names:
        v = item.get(n)
        if v is None:
            continue
        vals = [v] if isinstance(v, str) else v
        if not isinstance(vals, list) or not all(isinstance(x, str) and x for x in vals):
            raise SampleError(BAD_CONVERSATION, f"'{n}' must be a path or a list of paths, got {v!r:.60}")
        return vals
    return []


def _find(rel: str, root: Path, kind: str) -> bytes:
    p = Path(rel) if Path(rel).is_absolute() else root / rel
    try:
        return p.read_bytes()
    except OSError:
        raise SampleError(MISSING_MEDIA, f"{kind} file {rel!r} not found under {root}") from None


def _image_member(data: bytes, rel: str) -> tuple[str, bytes, tuple[int, int]]:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            fmt = img.format
            w, h = img.size
            if fmt not in ("PNG", "JPEG"):
                buf = io.BytesIO()
                (img if img.mode in ("RGB", "RGBA", "L", "LA", "P") else img.convert("RGB")).save(buf, format="PNG")
                data = buf.getvalue()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise SampleError(UNDECODABLE_IMAGE, f"{rel!r} is not a readable image ({err})") from None
    if w <= 0 or h <= 0:
        raise SampleError(UNDECODABLE_IMAGE, f"{rel!r} has size {h}x{w}")
    return ("jpg" if fmt == "JPEG" else "png"), data, (h, w)


def _audio_member(data: bytes, rel: str) -> tuple[bytes, float]:
    if rel.lower().endswith(".wav"):
        try:
            read_wav(data)
            return data, probe_audio(data, "wav")
        except SampleError as err:
            raise SampleError(UNDECODABLE_AUDIO, f"{rel!r}: {err.detail}") from None
    if not soundfile_available():
        raise SampleError(UNDECODABLE_AUDIO, f"{rel!r}: {FLAC_NEEDS_SOUNDFILE.replace('FLAC', 'non-WAV audio')}")
    import soundfile

    try:
        x, rate = soundfile.read(io.BytesIO(data), dtype="int16", always_2d=True)
    except Exception as err:  # soundfile's LibsndfileError
        raise SampleError(UNDECODABLE_AUDIO, f"{rel!r} is not readable audio ({err})") from None
    if len(x) == 0:
        raise SampleError(UNDECODABLE_AUDIO, f"{rel!r} holds no samples")
    buf = io.BytesIO()
    soundfile.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue(), len(x) / rate


def sample_key(raw_id: Any, index: int) -> str:
    """A member-safe key for an id (None: the position in the JSON)."""
    if raw_id is None or str(raw_id) == "":
        return f"s{index:08d}"
    key = _UNSAFE.sub("_", str(raw_id))
    return key[:80]


def convert_sample(item: Any, key: str, tok: Templater | Tokenizer, *, image_root: Path,
                   audio_root: Path) -> _Converted:
    """One JSON entry as tar members and meta.

    Raises:
        SampleError: bad conversation, no/empty answer, placeholder mismatch, missing media,
            undecodable image/audio.
    """
    if not isinstance(item, dict):
        raise SampleError(BAD_CONVERSATION, f"entry must be an object, got {type(item).__name__}")
    images = _paths(item, "image", "images")
    clips = _paths(item, "audio", "audios")
    tpl = as_templater(tok)
    conv = item.get("conversations")
    turns = parse_conversation(conv, system=tpl.system)
    n_img, n_aud = count_placeholders(turns)
    conv = [{"from": t["from"], "value": t["value"]} for t in conv]
    prepend = (f"{IMAGE}\n" * len(images) if images and n_img == 0 else "") + \
              (f"{AUDIO}\n" * len(clips) if clips and n_aud == 0 else "")
    if prepend:
        first = next(i for i, t in enumerate(conv) if t["from"] == HUMAN) if any(
            t["from"] == HUMAN for t in conv) else None
        if first is None:
            raise SampleError(BAD_CONVERSATION, "media but no human turn to put the placeholders in")
        conv[first]["value"] = prepend + conv[first]["value"]
        turns = parse_conversation(conv, system=tpl.system)
        n_img, n_aud = count_placeholders(turns)
    if (n_img, n_aud) != (len(images), len(clips)):
        raise SampleError(PLACEHOLDER_MISMATCH, f"the text has {n_img} {IMAGE} and {n_aud} {AUDIO} placeholders "
                                                f"but the entry lists {len(images)} image(s) and {len(clips)} clip(s)")
    members: list[tuple[str, bytes]] = []
    sizes, seconds = [], []
    for i, rel in enumerate(images):
        ext, data, hw = _image_member(_find(rel, image_root, "image"), rel)
        members.append((f"{key}.{i}.{ext}", data))
        sizes.append(hw)
    for i, rel in enumerate(clips):
        data, sec = _audio_member(_find(rel, audio_root, "audio"), rel)
        members.append((f"{key}.{i}.wav", data))
        seconds.append(sec)
    meta = SampleMeta(text_tokens=tpl.text_tokens(turns), images=tuple(sizes), audio_seconds=tuple(seconds))
    obj = {"id": str(item.get("id", key)), "conversations": conv,
           "meta": {"text_tokens": meta.text_tokens, "tokenizer": tpl.fingerprint, "images": [list(s) for s in sizes],
                    "audio_seconds": seconds}}
    js = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    kinds = [k for k, v in (("image", sizes), ("audio", seconds)) if v]
    return _Converted(key=key, members=[(f"{key}.json", js)] + members, meta=meta,
                      modality="+".join(kinds) or "text", prepended=bool(prepend))


class _ShardWriter:
    """Tar shards with fixed member metadata, cut by count and size."""

    def __init__(self, out: Path, prefix: str, maxcount: int, maxsize: int | None) -> None:
        self.out, self.prefix, self.maxcount, self.maxsize = out, prefix, maxcount, maxsize
        self.shards: list[ShardInfo] = []
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._count = 0
        self._bytes = 0
        self._mods: Counter[str] = Counter()

    @staticmethod
    def _size(members: list[tuple[str, bytes]]) -> int:
        return sum(512 + -(-len(d) // 512) * 512 for _, d in members)

    def add(self, c: _Converted) -> None:
        size = self._size(c.members)
        if self._tar is not None and (self._count >= self.maxcount or
                                      (self.maxsize is not None and self._bytes + size + 1024 > self.maxsize)):
            self.close()
        if self._tar is None:
            name = f"{self.prefix}-{len(self.shards):06d}.tar"
            self._tmp = self.out / (name + ".tmp")
            self._tar = tarfile.open(self._tmp, mode="w", format=tarfile.USTAR_FORMAT)
        for name, data in c.members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(data))
        self._count += 1
        self._bytes += size
        self._mods[c.modality] += 1

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        final = self._tmp.with_suffix("")  # drop .tmp
        self._tmp.replace(final)
        self.shards.append(ShardInfo(file=final.name, samples=self._count, bytes=final.stat().st_size,
                                     by_modality=dict(sorted(self._mods.items()))))
        self._tar, self._tmp, self._count, self._bytes, self._mods = None, None, 0, 0, Counter()


def convert(
    *,
    json_path: str | Path,
    out: str | Path,
    tokenizer: Templater | Tokenizer,
    spec: ModelSpec | None = None,
    image_root: str | Path | None = None,
    audio_root: str | Path | None = None,
    maxcount: int = 1000,
    maxsize_mb: float | None = None,
    on_error: str = "skip",
    prefix: str = "train",
    progress: bool = True,
) -> ConvertReport:
    """Convert a LLaVA-style JSON file into shards in `out` (see the module docstring).

    Args:
        tokenizer: counts meta.text_tokens (a Templater, or an mmpipe Tokenizer for its tiny
            template); its fingerprint goes into meta.tokenizer and index.json.
        spec: when given, index.json also counts LLM tokens under this model and samples
            longer than its max_seq_len (they are kept: data.too_long decides at read time).
        maxcount: samples per shard at most; maxsize_mb: megabytes per shard at most (a
            single larger sample still gets its own shard).
        on_error: skip (leave bad samples out, report them) or raise (stop at the first).
    Returns:
        The report; `report.summary()` is what the command prints.
    """
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error={on_error!r} is unknown; use skip or raise (--strict)")
    if maxcount < 1:
        raise ValueError(f"--maxcount={maxcount} must be >= 1")
    if maxsize_mb is not None and not maxsize_mb > 0:
        raise ValueError(f"--maxsize-mb={maxsize_mb} must be > 0")
    json_path, out = Path(json_path), Path(out)
    try:
        items = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--json={str(json_path)!r}: no such file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--json={str(json_path)!r} is not valid JSON ({err})") from None
    if not isinstance(items, list):
        raise ValueError(f"--json={str(json_path)!r} must hold a list of samples, got {type(items).__name__}")
    img_root = Path(image_root) if image_root else json_path.parent
    aud_root = Path(audio_root) if audio_root else json_path.parent
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, prefix, maxcount, int(maxsize_mb * 2**20) if maxsize_mb else None)
    report = ConvertReport(out=out, path="", samples_in=len(items))
    skipped: dict[str, list[str]] = defaultdict(list)
    used: Counter[str] = Counter()
    totals: dict[str, Counter] = defaultdict(Counter)
    lens: list[int] = []
    over = 0
    for i, item in enumerate(tqdm(items, desc="convert", unit="sample", disable=not progress)):
        raw_id = item.get("id") if isinstance(item, dict) else None
        shown = str(raw_id) if raw_id is not None else f"#{i}"
        key = sample_key(raw_id, i)
        used[key] += 1
        if used[key] > 1:
            key = f"{key}-{used[key] - 1}"
        try:
            c = convert_sample(item, key, tokenizer, image_root=img_root, audio_root=aud_root)
        except SampleError as err:
            err = err.at(shard=json_path.name, key=shown)
            if on_error == "raise":
                writer.close()
                raise err from None
            report.skips.add(err)
            skipped[err.reason].append(shown)
            continue
        writer.add(c)
        report.prepended += c.prepended
        t = totals[c.modality]
        t["samples"] += 1
        t["images"] += len(c.meta.images)
        t["audio_clips"] += len(c.meta.audio_seconds)
        t["audio_seconds"] += sum(c.meta.audio_seconds)
        t["text_tokens"] += c.meta.text_tokens
        if spec is not None:
            try:
                n = features(spec, c.meta).llm_len
            except ValueError:
                n = 0
            t["llm_tokens"] += n
            lens.append(n)
            over += n > spec.llm.max_seq_len
    writer.close()
    n_shards = len(writer.shards)
    for stale in out.glob(f"{prefix}-*.tar"):  # an earlier, longer conversion into the same folder
        m = _SHARD.match(stale.name)
        if m and m.group("prefix") == prefix and int(m.group("n")) >= n_shards:
            stale.unlink()
    report.shards = writer.shards
    report.skipped_ids = dict(skipped)
    report.path = str(out / (f"{prefix}-{{000000..{n_shards - 1:06d}}}.tar" if n_shards > 1 else
                             f"{prefix}-000000.tar"))
    by_mod = {m: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sorted(c.items())}
              for m, c in sorted(totals.items())}
    report.index = {
        "version": 1,
        "generator": "mmpipe shards convert",
        "source": json_path.name,
        "path": Path(report.path).name,
        "samples": report.samples,
        "shards": [{"file": s.file, "samples": s.samples, "bytes": s.bytes, "by_modality": s.by_modality}
                   for s in writer.shards],
        "by_modality": by_mod,
        "skipped": report.skips.as_dict(),
        "prepended_placeholders": report.prepended,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "fingerprint": as_templater(tokenizer).fingerprint},
    }
    if spec is not None and lens:
        report.index["model"] = {"name": spec.name, "llm_tokens": {"min": min(lens), "max": max(lens),
                                                                   "mean": round(sum(lens) / len(lens), 1)},
                                 "over_max_seq_len": over}
    (out / "index.json").write_text(json.dumps(report.index, indent=2) + "\n")
    return report
