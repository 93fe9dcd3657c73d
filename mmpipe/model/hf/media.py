"""Media preprocessing with the checkpoint's own processors.

Images go through transformers' image processor of the checkpoint (its preprocessor config),
audio through its Whisper feature extractor, so the arrays are exactly what the transformers
model would be given. The image processor class is the one transformers' AutoImageProcessor
picks for the config's `image_processor_type`: torchvision where it is installed (a dependency of
mmpipe), else PIL. The two backends resize differently (bicubic pixels differ by up to 2/255),
which moves the patch embedding's gradient by about 1e-3 of itself, so mmpipe follows
transformers' choice and gives the model what a transformers user's processor gives.
Videos go through the checkpoint's video processor (model/hf/video.py, on torchvision); their
patches join the images' in the carrier (`carrier_media`); 3-D positions are model/hf/positions.py's.
Placeholder expansion and tokens are the text side's; these functions give each sample's arrays
and the counts the placeholders must match (equal to `mmpipe.model.geometry` by construction,
and checked).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpipe.model import layout
from mmpipe.model.geometry import anyres_image, audio_frames, image_grid, image_positions, image_tiles, tile_grid
from mmpipe.model.hf.family import families
from mmpipe.model.spec import HFSource, ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageInput:
    """One image as the vision tower's first layer takes it."""

    pixels: np.ndarray
    """float32: [C, S, S] (LLaVA towers), [tiles, C, S, S] (LLaVA-NeXT / OneVision: the whole
    image, then the grid row by row; InternVL: the grid row by row, then the thumbnail) or
    [patches, C * T * p * p] (Qwen2-VL)."""
    grid: tuple[int, ...]
    """Patch grid: (rows, cols) for LLaVA towers, (t, rows, cols) for Qwen2-VL; for LLaVA-NeXT /
    OneVision (tiles, grid rows, grid cols, height, width): its tower passes, its tile grid (0, 0
    without one) and the image's size, which the model unpads to (`image_sizes`); for InternVL
    (tiles, grid cols, grid rows)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioInput:
    """One clip as the audio tower's first layer takes it."""

    features: np.ndarray
    """float32 [mel, F]: the feature extractor's log-mel frames the valid positions need
    (F = min(2P + 1, all frames) for P = (frames - 1) // 2 + 1 positions; see AudioEmbed); a
    chunked tower (Qwen2.5-Omni) convolves its valid frames only: F = frames."""
    frames: int
    """Valid mel frames (the feature extractor's attention mask), cut at 30 s."""


def image_processors() -> tuple[str, ...]:
    """Image processor classes (as config files name them, without a Fast/Pil suffix) mmpipe checks
    its geometry against: every family's (`Family.image_processors`), in registry order."""
    return tuple(dict.fromkeys(name for family in families() for name in family.image_processors))


def make_image_processor(config: Mapping[str, Any]) -> Any:
    """An image processor from its config: the class it names, in the backend transformers'
    AutoImageProcessor picks by default (torchvision where installed, else PIL)."""
    kind = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    known = image_processors()
    if kind not in known:
        raise ValueError(f"image processor {config.get('image_processor_type')!r} is not supported; use "
                         f"{', '.join(known)}")
    values = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    return _backend_class(kind)(**values)


def _backend_class(kind: str) -> type:
    """transformers' default backend of an image processor class (AutoImageProcessor's rule:
    torchvision when it is installed, unless transformers keeps the class on PIL)."""
    from transformers.models.auto.image_processing_auto import (
        DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS,
        get_image_processor_class_from_name,
    )
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() and kind not in DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS:
        return get_image_processor_class_from_name(kind)
    return get_image_processor_class_from_name(kind + "Pil")


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


def preprocess_images(spec: ModelSpec, images: Sequence[bytes | Image.Image | np.ndarray]) -> list[ImageInput]:
    """The images of one sample through the checkpoint's image processor, called as the model's
    processor calls it for one conversation (OneVision tiles an image only when it is its
    sample's only one). Raises ValueError if a grid or tile count is not what the planner counted."""
    if not images:
        return []
    if spec.hf is None or spec.vision is None:
        raise ValueError(f"model {spec.name} has no Hugging Face vision tower")
    if spec.vision.resize == "tiles":
        return [_preprocess_tiles(spec, image) for image in images]
    if spec.vision.resize != "anyres":
        return [preprocess_image(spec, image) for image in images]
    imgs = [_pil(image) for image in images]
    v = spec.vision
    nested = [imgs] if v.anyres_single else imgs  # one conversation's images (transformers' batch_num_images)
    out = image_processor(spec.hf)(images=nested, do_pad=False)  # unpadded: each image's own tiles
    result = []
    for img, pixels, size in zip(imgs, out["pixel_values"], out["image_sizes"]):
        plan = anyres_image(v, img.height, img.width, alone=len(imgs) == 1)
        pixels = np.asarray(pixels, dtype=np.float32)
        got = (pixels.shape[0], *(int(x) for x in size))
        if got != (plan.tiles, img.height, img.width) or pixels.shape[-2:] != (v.image_size, v.image_size):
            raise ValueError(f"the image processor made {pixels.shape[0]} tiles of {tuple(pixels.shape[-2:])} px of a "
                             f"{img.height}x{img.width} image but the model's geometry says {plan.tiles} of "
                             f"{v.image_size} px; the processor config and the spec disagree")
        result.append(ImageInput(pixels=pixels, grid=(plan.tiles, plan.rows, plan.cols, img.height, img.width)))
    return result


def _preprocess_tiles(spec: ModelSpec, image: bytes | Image.Image | np.ndarray) -> ImageInput:
    """InternVL: an image cut into its tiles (and thumbnail) as InternVLProcessor asks the image
    processor to (crop_to_patches=True, its processor-level default); checked against the geometry."""
    v, img = spec.vision, _pil(image)
    out = image_processor(spec.hf)(images=[img], crop_to_patches=True, return_tensors="np")
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    tiles = image_tiles(v, img.height, img.width)
    if pixels.shape[0] != tiles or pixels.shape[-2:] != (v.image_size, v.image_size):
        raise ValueError(f"the image processor made {pixels.shape[0]} tiles of {tuple(pixels.shape[-2:])} px of a "
                         f"{img.height}x{img.width} image but the model's geometry says {tiles} of {v.image_size} px; "
                         f"the processor config and the spec disagree")
    cols, rows = tile_grid(v, img.height, img.width) if tiles > 1 else (1, 1)
    return ImageInput(pixels=pixels, grid=(tiles, cols, rows))


def preprocess_image(spec: ModelSpec, image: bytes | Image.Image | np.ndarray) -> ImageInput:
    """An image (encoded bytes, PIL image, or uint8 [H, W, 3]) through the checkpoint's image
    processor, as its sample's only image. Raises ValueError if its patch grid is not the one the
    planner counted."""
    if spec.hf is None or spec.vision is None:
        raise ValueError(f"model {spec.name} has no Hugging Face vision tower")
    if spec.vision.resize in ("anyres", "tiles"):
        return preprocess_images(spec, [image])[0]
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


def sample_clips(spec: ModelSpec, input_ids: Sequence[int], clips: Sequence[AudioInput],
                 videos: Sequence[Any] = ()) -> list[AudioInput]:
    """A sample's audio-tower clips in the order their tokens appear: its own clips and, with
    Qwen2.5-Omni's use_audio_in_video, each video's audio track (VideoInput.audio) where that
    video's interleaved tokens are; the order in which transformers' masked_scatter places audio
    features and its get_rope_index reads their lengths."""
    if not any(getattr(v, "audio", None) is not None for v in videos):
        return list(clips)
    from mmpipe.model.hf.configs import hf_config
    from mmpipe.model.hf.positions import clip_tokens

    config = hf_config(spec.hf)
    audio, video, unit = config.audio_token_id, config.video_token_id, spec.vision.merge ** 2
    own, vids, out, ids, i = iter(clips), iter(videos), [], list(input_ids), 0
    while i < len(ids):
        if ids[i] == video:  # a clip's tokens: its frames', and its track's interleaved with them
            v = next(vids)
            i += int(np.prod(v.grid)) // unit + (clip_tokens(spec, v.audio.frames) if v.audio is not None else 0)
            out += [v.audio] if v.audio is not None else []
        elif ids[i] == audio:
            c = next(own)
            out.append(c)
            i += clip_tokens(spec, c.frames)
        else:
            i += 1
    if len(out) != len(clips) + sum(v.audio is not None for v in videos):
        raise ValueError(f"a sample's tokens hold {len(out)} clips but it has {len(clips)} and "
                         f"{sum(v.audio is not None for v in videos)} video tracks")
    return out


def image_segments(spec: ModelSpec, grid: Sequence[Sequence[int]]) -> list[int]:
    """The attention segments (tower passes) of a micro-batch's images from the IMAGE_GRID slot:
    every tile of a LLaVA-NeXT / OneVision / InternVL image is one, of image_positions each."""
    v = spec.vision
    if v is None or v.resize not in ("anyres", "tiles"):
        return layout.image_segments(grid)
    return [image_positions(v, v.image_size, v.image_size)] * sum(int(g[0]) for g in grid)


def carrier_media(spec: ModelSpec, images: Sequence[ImageInput], clips: Sequence[AudioInput],
                  videos: Sequence[Any] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The carrier's media slots of a micro-batch: (pixels, grid, features, frames).

    LLaVA: pixels [N, C, S, S], grid [N, 2]; InternVL: every tile [T, C, S, S], grid [N, 3] (tiles,
    cols, rows); LLaVA-NeXT / OneVision: every tile [T, C, S, S],
    grid [N, 5] (tiles, rows, cols, height, width), then OneVision's videos, every frame a tile,
    a row (frames, 0, 0, S, S) each; Qwen2-VL: pixels [patches, C*T*p*p] of all
    images in order and then of all videos (VideoInput) in order, grid_thw [images + videos, 3]
    (the carrier's VIDEOS slot says how many trailing rows are videos); Qwen2-Audio: features
    [clips, mel, F] zero-filled past each clip's own frames, frames [clips] (valid mel frames).
    """
    v, a = spec.vision, spec.audio
    if videos:
        if v is None or v.resize == "fixed":
            raise ValueError(f"model {spec.name} takes no video in its image slots")
        if v.resize == "anyres":  # OneVision: every frame one tile [frames, C, S, S], row (frames, 0, 0, S, S)
            videos = [ImageInput(pixels=vid.pixels, grid=(vid.grid[0], 0, 0, v.image_size, v.image_size))
                      for vid in videos]
        images = [*images, *videos]  # same patch layout: [t*rows*cols, C*T*p*p] with grid (t, rows, cols)
    if images and v is not None and v.resize in ("anyres", "tiles"):  # every tile of every image, in order
        pixels = torch.from_numpy(np.concatenate([img.pixels for img in images]))
        grid = torch.tensor([img.grid for img in images], dtype=torch.long)
    elif images:
        if v is not None and v.resize == "fixed":
            pixels = torch.from_numpy(np.stack([img.pixels for img in images]))
        else:
            pixels = torch.from_numpy(np.concatenate([img.pixels for img in images]))
        grid = torch.tensor([img.grid for img in images], dtype=torch.long)
    elif v is not None and v.resize in ("fixed", "anyres", "tiles"):
        pixels = torch.zeros((0, v.channels, v.image_size, v.image_size))
        grid = torch.zeros((0, {"anyres": 5, "tiles": 3}.get(v.resize, 2)), dtype=torch.long)
    else:
        width = v.channels * v.temporal_patch * v.patch ** 2 if v is not None else 0
        pixels, grid = torch.zeros((0, width)), torch.zeros((0, 3), dtype=torch.long)
    longest = max((c.features.shape[1] for c in clips), default=0)
    feats = torch.zeros((len(clips), a.mel_bins if a is not None else 0, longest))
    for i, c in enumerate(clips):
        feats[i, :, :c.features.shape[1]] = torch.from_numpy(c.features)
    frames = torch.tensor([c.frames for c in clips], dtype=torch.long)
    return pixels, grid, feats, frames
