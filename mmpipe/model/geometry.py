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
    image_windows: tuple[int, ...] = ()
    """Vision-encoder positions of every attention window of the windowed blocks, over all
    images (Qwen2.5-VL's window attention); empty when the tower has no windowed blocks."""
    audio_chunks: tuple[int, ...] = ()
    """Audio-encoder positions of every attention chunk, over all clips (Qwen2.5-Omni's
    `n_window` chunks); empty when each clip attends as a whole."""

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


# ----------------------------------------------------------------------------- windowed attention
# Qwen2.5-VL's vision tower attends within windows in most blocks, and Qwen2.5-Omni's audio tower
# within chunks of a clip in every block. The planner prices those blocks' attention over these
# segments (sum of squared lengths), and the layers attend over the same segments.


def _pieces(n: int, size: int) -> list[int]:
    """n cut into consecutive pieces of `size`, the last one shorter."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def image_windows(v: VisionSpec, height: int, width: int) -> tuple[int, ...]:
    """Patches of each attention window of an image's windowed blocks, row by row of windows
    (transformers' `get_vision_window_index`: windows of window // merge // patch merged tokens a
    side, the last row and column of windows shorter); () when the tower has no windowed blocks."""
    if not v.window:
        return ()
    gh, gw = image_grid(v, height, width)
    side = v.window // v.merge // v.patch * v.merge  # in patches: whole merge units
    return tuple(r * c for r in _pieces(gh, side) for c in _pieces(gw, side))


def chunk_positions(frames: int, *, window: int, conv_stride: int) -> list[int]:
    """Encoder positions of each attention chunk of a clip of `frames` valid mel frames:
    chunks of window * conv_stride frames (the last shorter), each convolved on its own, so a
    chunk of c frames has ceil(c / conv_stride) positions (transformers' Qwen2.5-Omni
    `chunk_and_pad_features` / `get_audio_cu_seqlens`); one chunk, the whole clip, for window 0."""
    if not window:
        return [-(-frames // conv_stride)]
    return [-(-c // conv_stride) for c in _pieces(frames, window * conv_stride)]


def audio_chunks(a: AudioSpec, seconds: float) -> tuple[int, ...]:
    """Encoder positions of each attention chunk of a clip; () when a clip attends as a whole."""
    if not a.window:
        return ()
    return tuple(chunk_positions(audio_frames(a, seconds), window=a.window, conv_stride=a.conv_stride))


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
        image_windows=tuple(n for h, w in meta.images for n in image_windows(v, h, w)) if v else (),
        audio_chunks=tuple(n for s in meta.audio_seconds for n in audio_chunks(a, s)) if a else (),
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
