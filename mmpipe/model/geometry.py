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
    """Vision-encoder sequence length of each image."""
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
    if v.resize == "fixed":
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


def image_tokens(v: VisionSpec, height: int, width: int) -> int:
    if v.select == "default":  # LLaVA drops encoder position 0 (the class token, if there is one)
        return image_positions(v, height, width) - 1
    if v.select == "full":
        return image_positions(v, height, width)
    gh, gw = image_grid(v, height, width)
    return (gh * gw) // (v.merge * v.merge)


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
        image_positions=tuple(image_positions(v, h, w) for h, w in meta.images) if v else (),
        image_tokens=tuple(image_tokens(v, h, w) for h, w in meta.images) if v else (),
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
