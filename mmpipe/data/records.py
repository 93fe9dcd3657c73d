"""One sample in two steps: a Record (checked, templated, media undecoded) and a Sample (decoded).

The runtime plans a step from Records (their `meta` gives every sequence length the planner
needs), then each stage decodes what it needs: the first stage the media (`media=True`), the
last stage only `input_ids` and `labels` (`media=False`, no image or audio is touched).

Everything that can be checked without decoding pixels, waveforms or frames is checked when
the Record is made — JSON, conversation, placeholder counts, media members present, image, WAV
and video container headers (sizes, durations, frame counts and rates against the stored meta),
length — so both stages agree on which samples exist. Text tokens are counted with the run's templater when the Record is made; the
stored `meta.text_tokens` is a hint that is checked (and, reading metadata only, used) when
`meta.tokenizer` names this templater's fingerprint (see `hint_applies`). Only pixel data that
is corrupt behind a valid header is found at decode time, on the first stage alone (see
docs/data.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmpipe.data.media import (
    AUDIO_EXTS, DEFAULT_LIMITS, MediaLimits, decode_audio, decode_image, probe_audio, probe_image,
)
from mmpipe.data.shards import shard_name
from mmpipe.data.skips import (
    BAD_JSON, META_MISMATCH, MISSING_JSON, MISSING_MEDIA, MISSING_META, NO_ENCODER, PLACEHOLDER_MISMATCH, TOO_LONG,
    SampleError,
)
from mmpipe.data.template import (
    IGNORE, Templated, Templater, TinyTemplate, Turn, as_templater, count_placeholders, count_videos,
    parse_conversation, template_sample,
)
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.data.video import VIDEO_EXTS, decode_video, probe_video
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import (
    SampleMeta, audio_frames, features, meta_from_json, modality_name, resize_image, video_track,
)

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
_MEDIA = re.compile(r"^(\d+)\.([a-z0-9]+)$")


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
    """uint8 [H, W, 3] per image, already resized by the vision rules (empty if not decoded); for a
    Hugging Face model the image processor's output (mmpipe.model.hf.media.ImageInput)."""
    audio: list[np.ndarray]
    """float32 [mel_bins, frames] log-mel features per clip (empty if not decoded); for a Hugging
    Face model the feature extractor's (mmpipe.model.hf.media.AudioInput)."""
    meta: SampleMeta
    """What the planner sees: text tokens, original image sizes, clip durations, video headers."""
    shard: str = ""
    """File name of the shard it came from."""
    source: str = ""
    """Mixture source name ('' outside a mixture)."""
    media: bool = True
    """False when decoded with media=False: images and audio are left empty."""
    worker: int = 0
    """Loader worker that read it."""
    cursor: dict | None = None
    """Reader position after this sample (SampleStream.note uses it)."""
    dropped: tuple[SampleError, ...] = ()
    """Samples the reader dropped just before this one (counted by SampleStream.note)."""
    videos: list = field(default_factory=list)
    """Per video clip (empty if not decoded): mmpipe.data.video.DecodedVideo for mmpipe's tiny
    model; for a Hugging Face model its video processor's output (mmpipe.model.hf.video.VideoInput)."""

    @property
    def modality(self) -> str:
        """`image`, `audio`, `video`, `image+audio`, ... or `text` (from meta, so also with media=False)."""
        m = self.meta
        return modality_name(bool(m.images), bool(m.audio_seconds), bool(m.videos))

    @property
    def llm_len(self) -> int:
        return len(self.input_ids)


@dataclass(kw_only=True, slots=True)
class Record:
    """A checked, templated sample whose media are still bytes."""

    key: str
    """Sample key inside its shard."""
    shard: str
    """File name of its shard."""
    meta: SampleMeta
    """Sizes the planner needs (text_tokens after any truncation: llm_len = features().llm_len)."""
    raw: dict[str, Any]
    """The tar members (suffix -> bytes) plus `__key__`, `__url__`, `__shard__`, `__ordinal__`."""
    input_ids: list[int] = field(default_factory=list)
    """Templated ids, placeholders expanded from meta."""
    labels: list[int] = field(default_factory=list)
    """Labels aligned with input_ids."""
    truncated: int = 0
    """Answer tokens cut by data.too_long=truncate."""
    source: str = ""
    """Mixture source name."""
    worker: int = 0
    """Loader worker that read it."""
    cursor: dict | None = None
    """Reader position after this record."""
    dropped: tuple[SampleError, ...] = ()
    """Samples dropped just before this one."""

    @property
    def llm_len(self) -> int:
        return len(self.input_ids)


def read_json(raw: dict[str, Any]) -> dict[str, Any]:
    if "json" not in raw:
        members = ", ".join(sorted(k for k in raw if not k.startswith("__"))) or "none"
        raise SampleError(MISSING_JSON, f"no KEY.json member (members: {members})")
    try:
        obj = json.loads(raw["json"])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SampleError(BAD_JSON, f"KEY.json is not valid JSON ({err})") from None
    except RecursionError:
        raise SampleError(BAD_JSON, "KEY.json is nested too deeply to parse") from None
    if not isinstance(obj, dict):
        raise SampleError(BAD_JSON, f"KEY.json must hold an object, got {type(obj).__name__}")
    return obj


def stored_meta(obj: dict[str, Any]) -> SampleMeta | None:
    if "meta" not in obj:
        return None
    try:
        return meta_from_json(obj["meta"], where="meta")
    except (ValueError, OverflowError) as err:  # OverflowError: Infinity where an integer belongs
        raise SampleError(BAD_JSON, str(err)) from None


def hint_applies(obj: dict[str, Any], tpl: Templater) -> bool:
    """Whether the stored meta.text_tokens was counted by this templater.

    `meta.tokenizer` holds the fingerprint of the templater that counted it. Meta without one
    predates fingerprints and was counted by an mmpipe tokenizer: it is taken as this one's
    when the run uses an mmpipe tokenizer too (and checked when the Record is made, as before).
    """
    meta = obj.get("meta")
    counted_with = meta.get("tokenizer") if isinstance(meta, dict) else None
    if counted_with is None:
        return isinstance(tpl, TinyTemplate)
    return counted_with == tpl.fingerprint


def check_counts(stored: SampleMeta | None, n_img: int, n_aud: int, n_vid: int = 0) -> None:
    if stored is not None and (len(stored.images), len(stored.audio_seconds), len(stored.videos)) != (
            n_img, n_aud, n_vid):
        vid = bool(n_vid or stored.videos)  # videos named only where there are some
        raise SampleError(
            PLACEHOLDER_MISMATCH,
            f"the text has {n_img} <image>{',' if vid else ''} and {n_aud} <audio>"
            f"{f' and {n_vid} <video>' if vid else ''} placeholders but meta lists {len(stored.images)} image(s)"
            f"{',' if vid else ''} and {len(stored.audio_seconds)} clip(s){f' and {len(stored.videos)} video(s)' if vid else ''}",
        )


def check_encoders(spec: ModelSpec, n_img: int, n_aud: int, n_vid: int = 0) -> None:
    if n_img and spec.vision is None:
        raise SampleError(NO_ENCODER, f"the sample has {n_img} image(s) but model {spec.name} has no vision encoder")
    if n_aud and spec.audio is None:
        raise SampleError(NO_ENCODER, f"the sample has {n_aud} clip(s) but model {spec.name} has no audio encoder")
    if n_vid and (spec.vision is None or spec.vision.video is None):
        raise SampleError(NO_ENCODER, f"the sample has {n_vid} video(s) but model {spec.name} takes no video")


def media_members(raw: dict[str, Any], exts: tuple[str, ...], count: int, kind: str) -> list[tuple[str, bytes]]:
    """(ext, bytes) of members `0.ext .. count-1.ext`; a gap is `missing media`, extras a mismatch."""
    by_index: dict[int, tuple[str, bytes]] = {}
    for name, value in raw.items():
        m = _MEDIA.match(name)
        if m and m.group(2) in exts:
            by_index[int(m.group(1))] = (m.group(2), value)
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


def check_meta(stored: SampleMeta, true: SampleMeta, spec: ModelSpec, *, text: bool = True) -> None:
    """The stored meta must give the planner the counts the model will see (`text`: the text
    count too, when it was counted by the run's templater)."""
    problems = []
    if text and stored.text_tokens != true.text_tokens:
        problems.append(f"text_tokens {stored.text_tokens} stored, {true.text_tokens} with this tokenizer")
    if stored.images != true.images:
        problems.append(f"images {list(stored.images)} stored, {list(true.images)} decoded")
    if spec.audio is not None:
        fs = [audio_frames(spec.audio, s) for s in stored.audio_seconds]
        ft = [audio_frames(spec.audio, s) for s in true.audio_seconds]
        if fs != ft:
            problems.append(f"audio_seconds {list(stored.audio_seconds)} stored, {list(true.audio_seconds)} decoded")
    header = [(m.frames, m.fps, m.height, m.width) for m in true.videos]
    if [(m.frames, m.fps, m.height, m.width) for m in stored.videos] != header:
        problems.append(f"videos (frames, fps, height, width) {[(m.frames, m.fps, m.height, m.width) for m in stored.videos]} "
                        f"stored, {header} in the containers")
    if spec.audio is not None and len(stored.videos) == len(true.videos):  # interleaved tracks (Omni)
        tracks = [[audio_frames(spec.audio, s) if (s := video_track(spec.vision, m)) else 0 for m in x.videos]
                  for x in (stored, true)]
        if tracks[0] != tracks[1]:
            problems.append(f"video audio tracks {[m.audio_seconds for m in stored.videos]} s stored, "
                            f"{[m.audio_seconds for m in true.videos]} s in the containers")
    if problems:
        raise SampleError(META_MISMATCH, "; ".join(problems) + " (regenerate the shards or the meta)")


def fit_length(t: Templated, tok: Templater | Tokenizer, spec: ModelSpec,
               too_long: str) -> tuple[list[int], list[int], int]:
    """(input_ids, labels, tokens cut) within model.llm.max_seq_len.

    `truncate` cuts the tail (answer text, or whole later turns) as long as every media token
    and at least one answer token stay; otherwise, and always with `drop`, the sample is
    `too long`.
    """
    limit, n = spec.llm.max_seq_len, len(t.input_ids)
    if n <= limit:
        return t.input_ids, t.labels, 0
    if too_long == "drop":
        raise SampleError(TOO_LONG, f"{n} tokens > model.llm.max_seq_len={limit} (data.too_long=drop)")
    media_ids = (tok.image_id, tok.audio_id, getattr(tok, "video_id", None))
    last_media = max((i for i, x in enumerate(t.input_ids) if x in media_ids), default=-1)
    first_answer = next((i for i, y in enumerate(t.labels) if y != IGNORE), n)
    if last_media >= limit or first_answer >= limit:
        need = max(last_media, first_answer) + 2
        raise SampleError(
            TOO_LONG, f"{n} tokens > model.llm.max_seq_len={limit}, and prompt plus media alone need {need}; "
            f"truncating would cut them (dropped)")
    return t.input_ids[:limit], t.labels[:limit], n - limit


def _turns(obj: dict[str, Any], tpl: Templater | None) -> list[Turn]:
    return parse_conversation(obj.get("conversations"), system=tpl is not None and tpl.system)


def make_record(raw: dict[str, Any], tok: Templater | Tokenizer, spec: ModelSpec, *, too_long: str = "drop",
                limits: MediaLimits = DEFAULT_LIMITS) -> Record:
    """Check and template one raw sample without decoding its media.

    Args:
        tok: the run's templater (an mmpipe Tokenizer stands for its tiny template).
    Raises:
        SampleError: any reason in mmpipe.data.skips that needs no pixels; the caller adds
            shard and key.
    """
    tpl = as_templater(tok)
    obj = read_json(raw)
    turns = _turns(obj, tpl)
    n_img, n_aud = count_placeholders(turns)
    n_vid = count_videos(turns)
    stored = stored_meta(obj)
    check_counts(stored, n_img, n_aud, n_vid)
    check_encoders(spec, n_img, n_aud, n_vid)
    imgs = media_members(raw, IMAGE_EXTS, n_img, "image")
    clips = media_members(raw, AUDIO_EXTS, n_aud, "audio")
    vids = media_members(raw, VIDEO_EXTS, n_vid, "video")
    sized = SampleMeta(text_tokens=0, images=tuple(probe_image(b, limits) for _, b in imgs),
                       audio_seconds=tuple(probe_audio(b, ext, limits) for ext, b in clips),
                       videos=tuple(probe_video(b, limits) for _, b in vids))
    templ = template_sample(turns, tpl, spec, sized)
    meta = dataclasses.replace(sized, text_tokens=templ.text_tokens)
    if stored is not None:
        check_meta(stored, meta, spec, text=hint_applies(obj, tpl))
        meta = dataclasses.replace(stored, text_tokens=templ.text_tokens)
    ids, labels, cut = fit_length(templ, tpl, spec, too_long)
    if cut:
        meta = dataclasses.replace(meta, text_tokens=meta.text_tokens - cut)
    return Record(key=str(raw.get("__key__", "")), shard=shard_name(str(raw.get("__url__", ""))), meta=meta, raw=raw, input_ids=ids, labels=labels, truncated=cut)


def meta_record(raw: dict[str, Any], *, spec: ModelSpec | None, tok: Templater | Tokenizer | None,
                too_long: str = "drop") -> SampleMeta:
    """SampleMeta of a sample from its .json member alone (iter_meta's checks).

    With `tok`, text_tokens is the stored count when it was counted by this templater
    (hint_applies), else counted now (the conversation is templated, the media are not
    read). Without `tok` the stored count is taken as it is.

    Raises:
        SampleError: the checks that need no media; `too long` when `spec` is given.
    """
    tpl = as_templater(tok) if tok is not None else None
    obj = read_json(raw)
    turns = _turns(obj, tpl)
    stored = stored_meta(obj)
    if stored is None:
        raise SampleError(MISSING_META, "KEY.json has no 'meta' (text_tokens, images, audio_seconds)")
    n_img, n_aud = count_placeholders(turns)
    check_counts(stored, n_img, n_aud, count_videos(turns))
    if tpl is not None and not hint_applies(obj, tpl):
        stored = dataclasses.replace(stored, text_tokens=tpl.text_tokens(turns))
    if spec is None:
        return stored
    try:
        llm_len = features(spec, stored).llm_len
    except ValueError as err:
        raise SampleError(NO_ENCODER, str(err)) from None
    if llm_len <= spec.llm.max_seq_len:
        return stored
    if too_long == "drop" or tpl is None:
        raise SampleError(TOO_LONG, f"{llm_len} tokens > model.llm.max_seq_len={spec.llm.max_seq_len}")
    _, _, cut = fit_length(template_sample(turns, tpl, spec, stored), tpl, spec, too_long)
    return dataclasses.replace(stored, text_tokens=stored.text_tokens - cut)


def blank_media(meta: SampleMeta, spec: ModelSpec) -> tuple[list, list, list]:
    """Zero images, features and video frames of the planned shapes (decode_record(..., blank=True))."""
    if spec.hf is not None:
        from mmpipe.data.hf_media import blank_hf_media

        return blank_hf_media(meta, spec)
    from mmpipe.data.video import DecodedVideo
    from mmpipe.model.geometry import video_grid

    v, a = spec.vision, spec.audio
    images = [np.zeros((*resize_image(v, h, w), 3), np.uint8) for h, w in meta.images] if v else []
    audio = [np.zeros((a.mel_bins, audio_frames(a, s)), np.float32) for s in meta.audio_seconds] if a else []
    videos = []
    for m in meta.videos:
        t, gh, gw = video_grid(v, m)
        frames = np.zeros((t * v.video.temporal_patch, gh * v.patch, gw * v.patch, 3), np.uint8)
        videos.append(DecodedVideo(frames=frames, meta=m))
    return images, audio, videos


def decode_record(rec: Record, tokenizer: Templater | Tokenizer, spec: ModelSpec, *, media: bool = True,
                  blank: bool = False, limits: MediaLimits = DEFAULT_LIMITS) -> Sample:
    """The Sample of a Record; with media=False no image or clip is decoded.

    input_ids and labels are the Record's (templated from meta when it was made), so both
    modes give the same ids. `tokenizer` templates Records built by hand (empty input_ids).
    With `blank=True` an image or clip that fails to decode becomes zeros of its planned
    shape instead of an error (the error is then returned in `dropped` for counting), which
    keeps the first and the last stage in step.

    Raises:
        SampleError: `undecodable image` / `undecodable audio`, located at shard and key.
    """
    ids, labels = rec.input_ids, rec.labels
    if not ids:
        obj = read_json(rec.raw)
        tpl = as_templater(tokenizer)
        templ = template_sample(_turns(obj, tpl), tpl, spec, rec.meta)
        ids, labels = templ.input_ids, templ.labels
    images: list = []
    audio: list = []
    videos: list = []
    dropped = rec.dropped
    m = rec.meta
    if media and (m.images or m.audio_seconds or m.videos):
        try:
            images = _images([b for _, b in media_members(rec.raw, IMAGE_EXTS, len(m.images), "image")], spec, limits)
            for (ext, b), s in zip(media_members(rec.raw, AUDIO_EXTS, len(m.audio_seconds), "audio"), m.audio_seconds):
                audio.append(_clip(b, ext, s, spec, limits))
            for (_, b), vm in zip(media_members(rec.raw, VIDEO_EXTS, len(m.videos), "video"), m.videos):
                videos.append(_video(b, vm, spec, limits))
        except SampleError as err:
            err = err.at(shard=rec.shard, key=rec.key)
            if not blank:
                raise err from None
            images, audio, videos = blank_media(rec.meta, spec)
            dropped = dropped + (err,)
    return Sample(key=rec.key, input_ids=ids, labels=labels, images=images, audio=audio, meta=rec.meta,
                  shard=rec.shard, source=rec.source, media=media, worker=rec.worker, cursor=rec.cursor,
                  dropped=dropped, videos=videos)


def _images(datas: list[bytes], spec: ModelSpec, limits: MediaLimits) -> list:
    """A sample's images: mmpipe's resized pixels, or a Hugging Face model's processor output
    (mmpipe.data.hf_media; one call for the sample, as its processor makes one conversation's)."""
    if spec.hf is not None:
        from mmpipe.data.hf_media import hf_images

        return hf_images(datas, spec, limits)
    return [decode_image(data, spec.vision, limits).pixels for data in datas]


def _clip(data: bytes, ext: str, seconds: float, spec: ModelSpec, limits: MediaLimits):
    """mmpipe's log-mel features, or a Hugging Face model's feature extractor output."""
    if spec.hf is not None:
        from mmpipe.data.hf_media import hf_audio

        return hf_audio(data, spec, ext, limits, seconds=seconds)
    return decode_audio(data, spec.audio, ext, limits, seconds=seconds).features


def _video(data: bytes, meta, spec: ModelSpec, limits: MediaLimits):
    """mmpipe's resized frames (mmpipe.data.video), or a Hugging Face model's video processor output."""
    if spec.hf is not None:
        from mmpipe.data.hf_media import hf_video

        return hf_video(data, spec, meta, limits)
    return decode_video(data, spec.vision, meta, limits)
