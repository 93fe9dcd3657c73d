"""Media preprocessing with the checkpoint's own processors, and Qwen2-VL's 3-D positions.

Images go through transformers' image processor of the checkpoint (its preprocessor config),
audio through its Whisper feature extractor, so the arrays are exactly what the transformers
model would be given. The processor classes are the PIL / NumPy backends, chosen on purpose
(they need no torchvision); with torchvision installed, transformers' auto classes pick the
torchvision backend, whose resize differs by about one pixel level (docs/hf.md, Processors).
Placeholder expansion and tokens are the text side's; these functions give each sample's arrays
and the counts the placeholders must match (equal to `mmpipe.model.geometry` by construction,
and checked).
"""

from __future__ import annotations

import functools
import io
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpipe.model.geometry import audio_frames, image_grid
from mmpipe.model.spec import HFSource, ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageInput:
    """One image as the vision tower's first layer takes it."""

    pixels: np.ndarray
    """float32: [C, S, S] (LLaVA towers) or [patches, C * T * p * p] (Qwen2-VL)."""
    grid: tuple[int, ...]
    """Patch grid: (rows, cols) for LLaVA towers, (t, rows, cols) for Qwen2-VL."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioInput:
    """One clip as the audio tower's first layer takes it."""

    features: np.ndarray
    """float32 [mel, F]: the feature extractor's log-mel frames the valid positions need
    (F = min(2P + 1, all frames) for P = (frames - 1) // 2 + 1 positions; see AudioEmbed); a
    chunked tower (Qwen2.5-Omni) convolves its valid frames only: F = frames."""
    frames: int
    """Valid mel frames (the feature extractor's attention mask), cut at 30 s."""


_IMAGE_CLASSES = {
    "CLIPImageProcessor": "transformers.models.clip.image_processing_pil_clip.CLIPImageProcessorPil",
    "SiglipImageProcessor": "transformers.models.siglip.image_processing_pil_siglip.SiglipImageProcessorPil",
    "Qwen2VLImageProcessor": "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil",
}


def _import(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def make_image_processor(config: Mapping[str, Any]) -> Any:
    """An image processor from its config (transformers' PIL backend of the class it names)."""
    kind = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    if kind not in _IMAGE_CLASSES:
        raise ValueError(f"image processor {config.get('image_processor_type')!r} is not supported; use "
                         f"{', '.join(_IMAGE_CLASSES)}")
    values = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    return _import(_IMAGE_CLASSES[kind])(**values)


def make_feature_extractor(config: Mapping[str, Any]) -> Any:
    """A Whisper feature extractor from its config."""
    from transformers import WhisperFeatureExtractor

    if config.get("feature_extractor_type", "WhisperFeatureExtractor") != "WhisperFeatureExtractor":
        raise ValueError(f"feature extractor {config['feature_extractor_type']!r} is not supported; "
                         f"use WhisperFeatureExtractor")
    values = {k: v for k, v in config.items() if k not in ("feature_extractor_type", "processor_class")}
    return WhisperFeatureExtractor(**values)


@functools.lru_cache(maxsize=8)
def image_processor(src: HFSource) -> Any:
    """The spec's image processor (one per process)."""
    return make_image_processor(json.loads(src.image_processor or "{}"))


@functools.lru_cache(maxsize=8)
def feature_extractor(src: HFSource) -> Any:
    """The spec's feature extractor (one per process)."""
    return make_feature_extractor(json.loads(src.feature_extractor or "{}"))


def _pil(image: bytes | Image.Image | np.ndarray) -> Image.Image:
    if isinstance(image, (bytes, bytearray)):
        with Image.open(io.BytesIO(image)) as img:
            img.load()
            return img.convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    return image


def preprocess_image(spec: ModelSpec, image: bytes | Image.Image | np.ndarray) -> ImageInput:
    """An image (encoded bytes, PIL image, or uint8 [H, W, 3]) through the checkpoint's image
    processor. Raises ValueError if its patch grid is not the one the planner counted."""
    if spec.hf is None or spec.vision is None:
        raise ValueError(f"model {spec.name} has no Hugging Face vision tower")
    img = _pil(image)
    out = image_processor(spec.hf)(images=[img], return_tensors="np")
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    if "image_grid_thw" in out:  # Qwen2-VL: flattened patches of all frames, grid (t, rows, cols)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        got = grid[1:]
    else:  # LLaVA towers: one [C, S, S] image
        pixels = pixels[0]
        grid = got = (pixels.shape[1] // spec.vision.patch, pixels.shape[2] // spec.vision.patch)
    planned = image_grid(spec.vision, img.height, img.width)
    if tuple(got) != tuple(planned):
        raise ValueError(f"the image processor made a {got} patch grid of a {img.height}x{img.width} image but "
                         f"the model's geometry says {planned}; the processor config and the spec disagree")
    return ImageInput(pixels=pixels, grid=grid)


def preprocess_audio(spec: ModelSpec, waveform: np.ndarray, sample_rate: int) -> AudioInput:
    """A mono waveform through the checkpoint's feature extractor, as Qwen2-Audio's processor
    calls it (padded to 30 s, attention mask), keeping only the frames the valid positions read.

    The extractor is run on the clip padded with zeros to just past those frames rather than to
    30 s: its frames there are the same numbers (each frame's window covers only zeros beyond
    the clip either way, and the log-mel floor is the maximum over frames holding the signal);
    a test compares both.
    """
    if spec.hf is None or spec.audio is None:
        raise ValueError(f"model {spec.name} has no Hugging Face audio tower")
    fe = feature_extractor(spec.hf)
    if sample_rate != fe.sampling_rate:
        raise ValueError(f"audio at {sample_rate} Hz; the feature extractor takes {fe.sampling_rate} Hz "
                         f"(resample first)")
    x = np.asarray(waveform, dtype=np.float32).reshape(-1)
    frames = audio_frames(spec.audio, max(len(x), 1) / sample_rate)
    length = min(fe.n_samples, fe.hop_length * (frames + 4) + fe.n_fft)
    out = fe(x, sampling_rate=sample_rate, padding="max_length", max_length=length, truncation=True,
             return_attention_mask=True, return_tensors="np")
    valid = int(out["attention_mask"][0].sum())
    if valid != frames:
        raise ValueError(f"the feature extractor marked {valid} valid frames of a {len(x)}-sample clip but the "
                         f"model's geometry says {frames}")
    positions = (valid - 1) // 2 + 1
    # a chunked tower (Qwen2.5-Omni) convolves each chunk of the valid frames on its own, zeros past
    # the chunk's end: it reads the valid frames and nothing else
    keep = valid if spec.audio.window else min(2 * positions + 1, fe.nb_max_frames)
    return AudioInput(features=np.ascontiguousarray(out["input_features"][0][:, :keep], dtype=np.float32),
                      frames=valid)


def mrope_positions(input_ids: Sequence[int], grids: Sequence[Sequence[int]], *, image_token: int,
                    merge: int) -> np.ndarray:
    """Qwen2-VL's 3-D positions [3, n] of one sample, as transformers' `get_rope_index` makes
    them: text runs count on from the current position on all three axes; a run of image
    tokens (one image) takes (t, row, col) of its merged grid offset by the current position,
    which then advances by max(rows, cols) / merge."""
    ids = np.asarray(input_ids)
    parts, pos, images = [], 0, iter(grids)
    for is_image, run in itertools.groupby(ids == image_token):
        n = len(list(run))
        if not is_image:
            parts.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        t, h, w = next(images, (0, 0, 0))
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(f"a run of {n} image tokens does not match an image of {t * gh * gw} tokens; "
                             f"images must be separated by text (Qwen2-VL's <|vision_start|>/<|vision_end|>)")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        parts.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
    if next(images, None) is not None:
        raise ValueError("more images than image-token runs in a sample")
    return np.concatenate(parts, axis=1).astype(np.int64) if parts else np.zeros((3, 0), dtype=np.int64)


MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker")
"""Decoders that take 3-D M-RoPE positions. For images (and text, and Qwen2.5-Omni's audio tokens,
which advance one position each like text) all three compute them as Qwen2-VL does: the
Qwen2.5-VL and Omni rules differ only for video (time-scaled temporal axis), which mmpipe does not
train yet; tests compare each with its class's own get_rope_index."""


def uses_mrope(spec: ModelSpec) -> bool:
    """Whether the decoder takes 3-D M-RoPE positions [3, B, T]."""
    return spec.hf is not None and json.loads(spec.hf.config).get("model_type") in MROPE_TYPES


def sample_positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[ImageInput]) -> np.ndarray:
    """A sample's M-RoPE positions [3, n] from its tokens and processed images."""
    from mmpipe.model.hf.configs import hf_config

    image_token = hf_config(spec.hf).image_token_id  # Omni's config names it image_token_index
    return mrope_positions(input_ids, [img.grid for img in images], image_token=image_token, merge=spec.vision.merge)


def carrier_media(spec: ModelSpec, images: Sequence[ImageInput],
                  clips: Sequence[AudioInput]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The carrier's media slots of a micro-batch: (pixels, grid, features, frames).

    LLaVA: pixels [N, C, S, S], grid [N, 2]; Qwen2-VL: pixels [patches, C*T*p*p] of all images
    in order, grid_thw [N, 3]; Qwen2-Audio: features [clips, mel, F] zero-filled past each
    clip's own frames, frames [clips] (valid mel frames).
    """
    v, a = spec.vision, spec.audio
    if images:
        if v is not None and v.resize == "fixed":
            pixels = torch.from_numpy(np.stack([img.pixels for img in images]))
        else:
            pixels = torch.from_numpy(np.concatenate([img.pixels for img in images]))
        grid = torch.tensor([img.grid for img in images], dtype=torch.long)
    elif v is not None and v.resize == "fixed":
        pixels = torch.zeros((0, v.channels, v.image_size, v.image_size))
        grid = torch.zeros((0, 2), dtype=torch.long)
    else:
        width = v.channels * v.temporal_patch * v.patch ** 2 if v is not None else 0
        pixels, grid = torch.zeros((0, width)), torch.zeros((0, 3), dtype=torch.long)
    longest = max((c.features.shape[1] for c in clips), default=0)
    feats = torch.zeros((len(clips), a.mel_bins if a is not None else 0, longest))
    for i, c in enumerate(clips):
        feats[i, :, :c.features.shape[1]] = torch.from_numpy(c.features)
    frames = torch.tensor([c.frames for c in clips], dtype=torch.long)
    return pixels, grid, feats, frames
