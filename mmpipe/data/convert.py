"""Convert a LLaVA-style JSON dataset into webdataset shards the reader reads.

    mmpipe shards shards.json=llava.json shards.out=data/llava/ shards.image_root=DIR [shards.audio_root=DIR]
        [shards.video_root=DIR] [shards.maxcount=1000] [shards.maxsize_mb=512] [shards.allow_outside_roots=true]
        [data.on_error=raise]

Input: a JSON list of entries in one of the shapes LLaVA, LLaVA-OneVision and ShareGPT-style
sets use (docs/data.md lists them):
- media: `"image"` (a path or a list of paths), `"images"`, `"audio"` / `"audios"`, `"video"` /
  `"videos"` (LLaVA-Video: a container file, `<video>` in the text);
- the conversation: `"conversations": [{"from": "human" | "user" | "gpt" | "assistant",
  "value": "<image>\n..."}]`, or `"messages": [{"role": "user" | "assistant", "content": str
  or [{"type": "text", "text": ...}, {"type": "image"}, {"type": "audio"}, {"type": "video"}, ...]}]`
  (a media part is a placeholder; with a "path" it also names the file).
Media paths are relative to image_root / audio_root / video_root, else to the JSON file's folder, and must
stay inside them: `..`, absolute paths and symlinks that lead out, and anything that is not a
regular file (a device such as /dev/zero, a FIFO) are refused as `unsafe path` unless
`allow_outside_roots` (then only non-regular files are refused). No more than
`limits.max_member_bytes` are read of any file (`media too large`).

Output in OUT/: `train-000000.tar ...` (KEY.json with the conversation and `meta`, KEY.0.png /
.jpg, KEY.0.wav / .flac / .ogg, KEY.0.mp4 / .mkv / .avi) and `index.json` (samples per shard,
totals by modality, what was skipped). A video is stored as its container bytes; its `meta`
entry (frames, frame rate, size, audio track) is read from the container header with PyAV, no
frame decoded. `meta.text_tokens` is counted with the given templater and `meta.tokenizer` names
it by its fingerprint: a run with another tokenizer counts again (records.hint_applies). Shards
close at `maxcount` samples or before passing `maxsize` bytes. The same input always gives
byte-identical shards (input order; members json, images, clips; tar mtime 0, uid/gid 0, no
owner names, mode 0644).

Conventions:
- LLaVA puts `<image>` in the first human turn; a sample whose human turns hold no `<image>`
  (or no `<audio>`, no `<video>`) although it has images (clips, videos) gets one placeholder per
  medium prepended to its first human turn, images first ("<image>\n<audio>\n<video>\n...").
  Some placeholders but not one per medium is a `placeholder mismatch`.
- PNG and JPEG bytes are stored as they are (.png / .jpg); other image formats are re-encoded
  as PNG. WAV, FLAC and OGG clips are stored as they are; other formats libsndfile reads are
  stored as 16-bit WAV.
- Keys are the ids with every character outside [A-Za-z0-9_-] replaced by `_` (the reader
  splits member names at the first dot); a repeated key gets `-1`, `-2`, ... appended. The
  original id stays in KEY.json.
- A sample with a missing, unreadable, oversized or unsafe medium, or a conversation without
  an answer, is left out and reported by id (or stops the conversion with on_error=raise).
"""
from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits, open_image, read_audio
from mmpipe.data.skips import (
    BAD_CONVERSATION, MEDIA_TOO_LARGE, MISSING_MEDIA, PLACEHOLDER_MISMATCH, UNDECODABLE_IMAGE,
    UNDECODABLE_VIDEO, UNSAFE_PATH, SampleError, SkipCounter,
)
from mmpipe.data.template import (
    GPT, HUMAN, SYSTEM, Templater, as_templater, count_placeholders, count_videos, parse_conversation,
)
from mmpipe.data.tokenizer import AUDIO, IMAGE, VIDEO, Tokenizer
from mmpipe.data.video import probe_container
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import SampleMeta, VideoMeta, features, modality_name, video_meta_json

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


ROLES = {"human": HUMAN, "user": HUMAN, "gpt": GPT, "assistant": GPT}
"""Speaker names the converter takes, and what the template calls them."""
PART_PLACEHOLDERS = {"image": IMAGE, "audio": AUDIO, "video": VIDEO}


def _content_text(content: Any, i: int, found: dict[str, list[str]]) -> str:
    """A `messages` content (a string, or typed parts) as text with placeholders; the paths of
    media parts that name a file are appended to `found`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SampleError(BAD_CONVERSATION, f"message {i} content must be a string or a list of parts, "
                                            f"got {content!r:.60}")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in PART_PLACEHOLDERS:
            pieces.append(PART_PLACEHOLDERS[kind])
            path = part.get("path", part.get(kind))
            if isinstance(path, str) and path:
                found[kind].append(path)
            elif path is not None:
                raise SampleError(BAD_CONVERSATION, f"message {i}: a {kind} part's path must be a string, "
                                                    f"got {path!r:.60}")
        else:
            raise SampleError(BAD_CONVERSATION, f"message {i}: part {part!r:.60} is not "
                                                f"{{'type': 'text', 'text': ...}}, 'image', 'audio' or 'video'")
    return "\n".join(pieces)


def conversation_of(item: dict, *, system: bool = False) -> tuple[list[dict], list[str], list[str], list[str]]:
    """The entry's conversation as [{"from": "human" | "gpt", "value": str}], its image paths,
    its clip paths and its video paths, from any accepted shape (see the module docstring). With
    `system` (a templater that has a system role) a `system` turn is kept as {"from": "system", ...}.

    Raises:
        SampleError: `bad conversation` (an unknown shape or speaker, or media given twice).
    """
    images, clips = _paths(item, "image", "images"), _paths(item, "audio", "audios")
    videos = _paths(item, "video", "videos")
    if "conversations" in item:
        turns, speaker, text = item["conversations"], "from", "value"
    elif "messages" in item:
        turns, speaker, text = item["messages"], "role", "content"
    else:
        raise SampleError(BAD_CONVERSATION, "the entry has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise SampleError(BAD_CONVERSATION, f"'{speaker == 'from' and 'conversations' or 'messages'}' must be a "
                                            f"non-empty list, got {turns!r:.60}")
    found: dict[str, list[str]] = {"image": [], "audio": [], "video": []}
    conv = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise SampleError(BAD_CONVERSATION, f"turn {i} must be an object, got {t!r:.60}")
        role = t.get(speaker)
        if role not in ROLES and not (system and role == SYSTEM):
            raise SampleError(BAD_CONVERSATION, f"turn {i} has {speaker}={role!r}; use human/user or gpt/assistant "
                                                f"(system turns need a checkpoint's chat template)")
        value = _content_text(t.get(text), i, found) if speaker == "role" else t.get(text)
        if not isinstance(value, str):
            raise SampleError(BAD_CONVERSATION, f"turn {i} must have a string '{text}', got {value!r:.60}")
        conv.append({"from": ROLES.get(role, role), "value": value})
    for kind, listed in (("image", images), ("audio", clips), ("video", videos)):
        if found[kind] and listed:
            raise SampleError(BAD_CONVERSATION, f"{kind} paths are given both in content parts and in the entry")
        listed.extend(found[kind])
    return conv, images, clips, videos


def _inside(path: str, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, base]) == base


def read_media(rel: str, root: Path, kind: str, *, limits: MediaLimits = DEFAULT_LIMITS,
               allow_outside: bool = False) -> bytes:
    """The bytes of media file `rel` under `root`, read safely.

    The path, symlinks resolved, must stay inside `root` (unless `allow_outside`) and name a
    regular file; at most limits.max_member_bytes are read (a device such as /dev/zero is never
    read, and a larger file is refused rather than read to its end).

    Raises:
        SampleError: `missing media`, `unsafe path` or `media too large`.
    """
    joined = os.path.join(root, rel)  # an absolute rel stays absolute
    if not allow_outside and not _inside(joined, root):
        how = ("is an absolute path outside" if os.path.isabs(rel) else
               "leads out of" if ".." in Path(rel).parts else "leads through a symlink out of")
        raise SampleError(UNSAFE_PATH, f"{kind} file {rel!r} {how} {kind}_root {root}; keep media inside it, "
                                       f"or set shards.allow_outside_roots=true")
    real = os.path.realpath(joined)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the file checked is the file read
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SampleError(MISSING_MEDIA, f"{kind} file {rel!r} not found under {root}") from None
    except OSError as err:
        raise SampleError(MISSING_MEDIA, f"{kind} file {rel!r} cannot be opened ({err.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SampleError(UNSAFE_PATH, f"{kind} file {rel!r} is not a regular file ({real})")
        limit = limits.max_member_bytes
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise SampleError(MEDIA_TOO_LARGE, f"{kind} file {rel!r} is larger than data.max_member_mb={limit / 2**20:g}")
    return data


def _image_member(data: bytes, rel: str, limits: MediaLimits) -> tuple[str, bytes, tuple[int, int]]:
    try:
        img = open_image(data, limits, formats=None)  # any format PIL reads; sizes checked before decoding
        with img:
            img.load()
            fmt = img.format
            w, h = img.size
            if fmt not in ("PNG", "JPEG"):
                buf = io.BytesIO()
                (img if img.mode in ("RGB", "RGBA", "L", "LA", "P") else img.convert("RGB")).save(buf, format="PNG")
                data = buf.getvalue()
    except SampleError as err:
        raise SampleError(err.reason, f"{rel!r}: {err.detail}") from None
    except Exception as err:  # noqa: BLE001 - whatever PIL raises on hostile bytes
        raise SampleError(UNDECODABLE_IMAGE, f"{rel!r} is not a readable image ({type(err).__name__}: {err})") from None
    return ("jpg" if fmt == "JPEG" else "png"), data, (h, w)


def _audio_member(data: bytes, rel: str, limits: MediaLimits) -> tuple[str, bytes, float]:
    """(suffix, bytes, seconds): WAV, FLAC and OGG as they are, other formats as 16-bit WAV."""
    try:
        # libsndfile finds the format from the bytes; "wav" only satisfies read_audio's suffix check.
        # The whole clip is decoded: one that fails is left out now, not found at training time.
        x, rate, head = read_audio(data, "wav", limits)
    except SampleError as err:
        raise SampleError(err.reason, f"{rel!r}: {err.detail}") from None
    stored = {"WAV": "wav", "WAVEX": "wav", "FLAC": "flac", "OGG": "ogg"}.get(head.format)
    if stored is not None:  # the suffix follows the content, whatever the file was called
        return stored, data, head.seconds
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return "wav", buf.getvalue(), head.seconds


VIDEO_FORMATS = (("mp4", "mp4"), ("mov", "mp4"), ("matroska", "mkv"), ("webm", "mkv"), ("avi", "avi"))
"""(word in FFmpeg's container format name, member suffix): a video's suffix follows its content."""


def _video_member(data: bytes, rel: str, limits: MediaLimits) -> tuple[str, bytes, VideoMeta]:
    """(suffix, bytes, header figures): the container as it is, read from its header only."""
    try:
        meta, name = probe_container(data, limits)
    except SampleError as err:
        raise SampleError(err.reason, f"{rel!r}: {err.detail}") from None
    ext = next((suffix for word, suffix in VIDEO_FORMATS if word in name.split(",")), None)
    if ext is None:
        raise SampleError(UNDECODABLE_VIDEO, f"{rel!r} is a {name} container; mmpipe stores MP4/MOV, Matroska/WebM "
                                             f"and AVI (convert it, e.g. to MP4)")
    return ext, data, meta


def sample_key(raw_id: Any, index: int) -> str:
    """A member-safe key for an id (None: the position in the JSON)."""
    if raw_id is None or str(raw_id) == "":
        return f"s{index:08d}"
    key = _UNSAFE.sub("_", str(raw_id))
    return key[:80]


def convert_sample(item: Any, key: str, tok: Templater | Tokenizer, *, image_root: Path, audio_root: Path,
                   limits: MediaLimits = DEFAULT_LIMITS, allow_outside: bool = False,
                   video_root: Path | None = None) -> _Converted:
    """One JSON entry as tar members and meta.

    Raises:
        SampleError: bad conversation, no/empty answer, placeholder mismatch, missing media,
            unsafe path, media too large, undecodable image/audio/video.
    """
    if not isinstance(item, dict):
        raise SampleError(BAD_CONVERSATION, f"entry must be an object, got {type(item).__name__}")
    tpl = as_templater(tok)
    conv, images, clips, videos = conversation_of(item, system=tpl.system)
    turns = parse_conversation(conv, system=tpl.system)
    n_img, n_aud = count_placeholders(turns)
    n_vid = count_videos(turns)
    prepend = (f"{IMAGE}\n" * len(images) if images and n_img == 0 else "") + \
              (f"{AUDIO}\n" * len(clips) if clips and n_aud == 0 else "") + \
              (f"{VIDEO}\n" * len(videos) if videos and n_vid == 0 else "")
    if prepend:
        first = next(i for i, t in enumerate(conv) if t["from"] == HUMAN) if any(
            t["from"] == HUMAN for t in conv) else None
        if first is None:
            raise SampleError(BAD_CONVERSATION, "media but no human turn to put the placeholders in")
        conv[first]["value"] = prepend + conv[first]["value"]
        turns = parse_conversation(conv, system=tpl.system)
        n_img, n_aud = count_placeholders(turns)
        n_vid = count_videos(turns)
    if (n_img, n_aud, n_vid) != (len(images), len(clips), len(videos)):
        raise SampleError(PLACEHOLDER_MISMATCH, f"the text has {n_img} {IMAGE}, {n_aud} {AUDIO} and {n_vid} {VIDEO} "
                                                f"placeholders but the entry lists {len(images)} image(s), "
                                                f"{len(clips)} clip(s) and {len(videos)} video(s)")
    members: list[tuple[str, bytes]] = []
    sizes, seconds = [], []
    safe = dict(limits=limits, allow_outside=allow_outside)
    for i, rel in enumerate(images):
        ext, data, hw = _image_member(read_media(rel, image_root, "image", **safe), rel, limits)
        members.append((f"{key}.{i}.{ext}", data))
        sizes.append(hw)
    for i, rel in enumerate(clips):
        ext, data, sec = _audio_member(read_media(rel, audio_root, "audio", **safe), rel, limits)
        members.append((f"{key}.{i}.{ext}", data))
        seconds.append(sec)
    clips_meta = []
    for i, rel in enumerate(videos):
        ext, data, vm = _video_member(read_media(rel, video_root or image_root, "video", **safe), rel, limits)
        members.append((f"{key}.{i}.{ext}", data))
        clips_meta.append(vm)
    meta = SampleMeta(text_tokens=tpl.text_tokens(turns), images=tuple(sizes), audio_seconds=tuple(seconds),
                      videos=tuple(clips_meta))
    stored = {"text_tokens": meta.text_tokens, "tokenizer": tpl.fingerprint, "images": [list(s) for s in sizes],
              "audio_seconds": seconds}
    if clips_meta:
        stored["videos"] = [video_meta_json(m) for m in clips_meta]
    obj = {"id": str(item.get("id", key)), "conversations": conv, "meta": stored}
    js = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return _Converted(key=key, members=[(f"{key}.json", js)] + members, meta=meta,
                      modality=modality_name(bool(sizes), bool(seconds), bool(clips_meta)), prepended=bool(prepend))


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
    video_root: str | Path | None = None,
    maxcount: int = 1000,
    maxsize_mb: float | None = None,
    on_error: str = "skip",
    prefix: str = "train",
    progress: bool = True,
    limits: MediaLimits = DEFAULT_LIMITS,
    allow_outside_roots: bool = False,
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
        limits: media sizes refused (data.max_image_pixels, data.max_member_mb, data.max_audio_seconds,
            data.max_video_frames, data.max_video_seconds).
        allow_outside_roots: let media paths lead out of the roots (shards.allow_outside_roots).
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
    vid_root = Path(video_root) if video_root else json_path.parent
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
            c = convert_sample(item, key, tokenizer, image_root=img_root, audio_root=aud_root, limits=limits,
                               allow_outside=allow_outside_roots, video_root=vid_root)
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
        if c.meta.videos:
            t["videos"] += len(c.meta.videos)
            t["video_frames"] += sum(m.frames for m in c.meta.videos)
            t["video_seconds"] += sum(m.seconds for m in c.meta.videos)
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
