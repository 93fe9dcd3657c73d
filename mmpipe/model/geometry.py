"""Per-sample token geometry: how many encoder positions and LLM tokens a sample becomes.

Computed from metadata alone (text tokens, image sizes, clip durations; no media decoded) and
the model's architecture figures. The planner costs samples with these rules and the data
layer resizes images, cuts clips and expands placeholders by the same rules, so the token
counts the planner predicts are the tokens the model really sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mmpipe.model.spec import AudioSpec, ModelSpec, VisionSpec


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """What a trace line (or a shard's metadata) says of one sample."""

    text_tokens: int
    """Tokens of the templated conversation, placeholders not counted."""
    images: tuple[tuple[int, int], ...] = ()
    """(height, width) in pixels of each image (video frames count as images)."""
    audio_seconds: tuple[float, ...] = ()
    """Duration of each audio clip."""


@dataclass(frozen=True, slots=True)
class SampleFeatures:
    """A sample as the model sees it: encoder sequence lengths and LLM length."""

    image_positions: tuple[int, ...]
    """Vision-encoder sequence length of each tower pass: one per image, or one per tile of an
    any-resolution (`anyres`) image, each tile a pass of its own."""
    image_tokens: tuple[int, ...]
    """LLM tokens each image becomes."""
    audio_positions: tuple[int, ...]
    """Audio-encoder sequence length of each clip."""
    audio_tokens: tuple[int, ...]
    """LLM tokens each clip becomes."""
    text_tokens: int
    """Text tokens of the conversation."""

    @property
    def llm_len(self) -> int:
        return self.text_tokens + sum(self.image_tokens) + sum(self.audio_tokens)

    @property
    def modality(self) -> str:
        """`image`, `audio`, `image+audio` or `text`."""
        kinds = [k for k, v in (("image", self.image_tokens), ("audio", self.audio_tokens)) if v]
        return "+".join(kinds) or "text"


def resize_image(v: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """The (height, width) an image is resized to before patching."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    if v.resize in ("fixed", "anyres"):  # anyres: every tile is image_size square
        return v.image_size, v.image_size
    if v.resize == "smart":
        return smart_resize(height, width, factor=v.patch * v.merge, min_pixels=v.min_pixels,
                            max_pixels=v.max_pixels)
    f = v.patch * v.merge
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > v.max_pixels:
        beta = math.sqrt(height * width / v.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < v.min_pixels:
        beta = math.sqrt(v.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule, as transformers' image processor applies it (a test holds the two
    equal; written here because the planner must not import torch or transformers)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {height}x{width} has an aspect ratio over 200, which Qwen2-VL's "
                         f"image processor refuses")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(v: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """Patch grid (rows, cols) of an image after resizing."""
    h, w = resize_image(v, height, width)
    return h // v.patch, w // v.patch


def image_positions(v: VisionSpec, height: int, width: int) -> int:
    gh, gw = image_grid(v, height, width)
    return gh * gw + (1 if v.cls_token else 0)


def image_tokens(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> int:
    """LLM tokens of an image; `alone`: the only image of its sample (OneVision tiles only those)."""
    if v.resize == "anyres":
        return anyres_image(v, height, width, alone=alone).tokens
    if v.select == "default":  # LLaVA drops encoder position 0 (the class token, if there is one)
        return image_positions(v, height, width) - 1
    if v.select == "full":
        return image_positions(v, height, width)
    gh, gw = image_grid(v, height, width)
    return (gh * gw) // (v.merge * v.merge)


def image_passes(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> int:
    """Tower passes of an image (of image_positions each): its tiles for `anyres`, else 1."""
    return anyres_image(v, height, width, alone=alone).tiles if v.resize == "anyres" else 1


def sample_image_tokens(v: VisionSpec, images: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """LLM tokens of each image of one sample (whether an image is alone matters to OneVision)."""
    return tuple(image_tokens(v, h, w, alone=len(images) == 1) for h, w in images)


def sample_image_positions(v: VisionSpec, images: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Encoder positions of each tower pass of one sample's images, in order."""
    alone = len(images) == 1
    return tuple(image_positions(v, h, w) for h, w in images for _ in range(image_passes(v, h, w, alone=alone)))


# ----------------------------------------------------------------------------- any-resolution tiles
# LLaVA-NeXT and LLaVA-OneVision, as transformers 5's processors count placeholders and its models
# pack features (LlavaNextProcessor._get_number_of_features, LlavaNextModel.pack_image_features,
# select_best_resolution, unpad_image, and OneVision's anyres_max downsampling). Written here
# rather than called because the planner imports neither torch nor transformers;
# tests/unit/model/test_hf_geometry.py holds these rules equal to transformers' own over many sizes.


@dataclass(frozen=True, slots=True)
class AnyresImage:
    """How an any-resolution image is encoded."""

    tiles: int
    """Tower passes: the whole image resized to one tile, then rows x cols grid tiles; 1 for a
    OneVision image that shares its sample (padded to a square, no grid)."""
    rows: int
    """Grid tiles down (0 without a grid)."""
    cols: int
    """Grid tiles across (0 without a grid)."""
    tokens: int
    """LLM tokens: the whole image's features, then the grid's unpadded (and, for OneVision,
    downsampled) feature rows, each followed by the image_newline embedding; without a grid,
    the whole image's features and one image_newline."""


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' `select_best_resolution`: of the (height, width) pinpoints, the one that keeps
    the most of the image's pixels when the image is scaled to fit in it, then the least padding."""
    best, most, least = pinpoints[0], 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    return best


def anyres_image(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> AnyresImage:
    """Tiles and LLM tokens of a `height` x `width` image under an `anyres` tower.

    `alone`: the image is its sample's only one (with `anyres_single`, only such an image is tiled).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    side = v.image_size // v.patch  # features per tile side (one per patch)
    base = side * side
    if v.anyres_single and not alone:
        return AnyresImage(tiles=1, rows=0, cols=0, tokens=base + 1)
    best_h, best_w = best_resolution(height, width, v.grid_pinpoints)
    rows, cols = best_h // v.image_size, best_w // v.image_size
    fh, fw = rows * side, cols * side  # the grid's feature map, then cut back to the image's aspect
    if width / height > fw / fh:
        pad = (fh - int(round(height * (fw / width), 7))) // 2
        fh -= 2 * pad
    else:
        pad = (fw - int(round(width * (fh / height), 7))) // 2
        fw -= 2 * pad
    if v.anyres_max:
        ratio = math.sqrt(fh * fw / (v.anyres_max * side * side))
        if ratio > 1.1:
            fh, fw = int(fh // ratio), int(fw // ratio)
            if not fh or not fw:
                raise ValueError(f"an image of {height}x{width} shrinks to a {fh}x{fw} feature map, which the "
                                 f"model cannot interpolate to")
    return AnyresImage(tiles=1 + rows * cols, rows=rows, cols=cols, tokens=base + fh * (fw + 1))


def audio_samples(a: AudioSpec, seconds: float) -> int:
    """Waveform samples of a clip at the model's rate, cut at max_seconds."""
    if not seconds > 0:
        raise ValueError(f"audio duration {seconds} s must be positive")
    return max(1, min(round(seconds * a.sample_rate), round(a.max_seconds * a.sample_rate)))


def audio_frames(a: AudioSpec, seconds: float) -> int:
    """Mel frames of a clip (cut at max_seconds): one per started hop of samples, as Whisper's
    feature extractor marks them valid. Integer arithmetic, so 0.1 s is 10 frames, not 11."""
    return -(-audio_samples(a, seconds) * a.frames_per_s // a.sample_rate)


def audio_positions(a: AudioSpec, seconds: float) -> int:
    return -(-audio_frames(a, seconds) // a.conv_stride)


def audio_tokens(a: AudioSpec, seconds: float) -> int:
    positions = audio_positions(a, seconds)
    return -(-positions // a.pool) if a.pool_ceil else positions // a.pool


def features(spec: ModelSpec, meta: SampleMeta, *, where: str = "sample") -> SampleFeatures:
    """Features of one sample under a model; `where` names it in errors (e.g. 'trace line 7')."""
    if meta.images and spec.vision is None:
        raise ValueError(f"{where} has images but model {spec.name} has no vision encoder")
    if meta.audio_seconds and spec.audio is None:
        raise ValueError(f"{where} has audio but model {spec.name} has no audio encoder")
    v, a = spec.vision, spec.audio
    return SampleFeatures(
        image_positions=sample_image_positions(v, meta.images) if v else (),
        image_tokens=sample_image_tokens(v, meta.images) if v else (),
        audio_positions=tuple(audio_positions(a, s) for s in meta.audio_seconds) if a else (),
        audio_tokens=tuple(audio_tokens(a, s) for s in meta.audio_seconds) if a else (),
        text_tokens=meta.text_tokens,
    )


def meta_from_json(obj: Any, *, where: str) -> SampleMeta:
    """Parse one trace object; errors name `where` (e.g. 'trace.jsonl line 12')."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        text = obj.get("text_tokens", 0)
        if not isinstance(text, int) or isinstance(text, bool) or text < 0:
            raise ValueError(f"text_tokens={text!r} must be a non-negative integer")
        images = []
        for img in obj.get("images") or []:
            if (not isinstance(img, (list, tuple)) or len(img) != 2
                    or not all(isinstance(x, (int, float)) and x > 0 for x in img)):
                raise ValueError(f"image {img!r} must be [height, width] with positive sides")
            images.append((int(img[0]), int(img[1])))
        clips = []
        for sec in obj.get("audio_seconds") or []:
            if not isinstance(sec, (int, float)) or isinstance(sec, bool) or not sec > 0:
                raise ValueError(f"audio_seconds entry {sec!r} must be a positive number")
            clips.append(float(sec))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return SampleMeta(text_tokens=text, images=tuple(images), audio_seconds=tuple(clips))
