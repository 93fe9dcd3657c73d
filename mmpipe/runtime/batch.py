"""Micro-batch tensors: samples packed into one sequence, or padded to their longest.

A micro-batch is what DeepSpeed's data iterator yields: `(carrier, (targets, scale))`. The
first stage takes the carrier, the last stage the labels.

A packed row may be padded up to a length the planner chose (`pad_to`, plan.ladder): the
padding is one more segment of `pad_id` tokens after the samples, its own attention segment
(it sees only itself, and no real token sees it), positions 0.. like a sample of its own, no
media and no labels (targets -100). The loss, its per-token mean (over label tokens) and the
gradients are therefore those of the unpadded row; `tokens` stays the samples' count and
`pad_tokens` says how many were added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.spec import ModelSpec


class SampleLike(Protocol):
    key: str
    input_ids: list[int]
    labels: list[int]
    images: list[np.ndarray]
    audio: list[np.ndarray]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch ready for the pipeline, with the keys of its samples."""

    keys: tuple[str, ...]
    """Sample keys in order (what the stages saw)."""
    carrier: tuple[torch.Tensor, ...]
    """Input tuple of the first stage."""
    targets: torch.Tensor
    """[B, T] next-token targets, -100 where no label."""
    label_tokens: int
    """Tokens that carry a label."""
    tokens: int
    """LLM tokens of real samples (no padding)."""
    pad_tokens: int = 0
    """Padding tokens a packed row got to reach its ladder rung (plan.ladder; 0 without one)."""

    def for_engine(self, scale: float) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        return self.carrier, (self.targets, torch.tensor([scale], dtype=torch.float32))


def shifted_targets(labels: Sequence[int]) -> list[int]:
    """Position t predicts token t+1 of the same sample; the last position predicts nothing."""
    return list(labels[1:]) + [-100]


def _padding(samples: Sequence[SampleLike], pad_to: int | None, packed: bool) -> int:
    """Tokens to add after the samples of a packed row to reach `pad_to` (0: none)."""
    if pad_to is None:
        return 0
    if not packed:
        raise ValueError("pad_to pads a packed row; padded micro-batches (one row per sample) pad to their longest")
    total = sum(len(s.input_ids) for s in samples)
    if pad_to < total:
        raise ValueError(f"cannot pad a packed row of {total} LLM tokens to {pad_to}")
    return pad_to - total


def _text_tensors(samples: Sequence[SampleLike], *, packed: bool, pad_id: int,
                  pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions, segment ids and shifted targets: one packed row (with `pad` padding
    tokens as a segment of their own at its end), or one padded row per sample."""
    lengths = [len(s.input_ids) for s in samples]
    if packed:
        ids = torch.tensor([sum((s.input_ids for s in samples), []) + [pad_id] * pad], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lengths + [pad]])[None]
        seg = torch.repeat_interleave(torch.arange(1, len(samples) + 2), torch.tensor(lengths + [pad]))[None]
        tgt = torch.tensor([sum((shifted_targets(s.labels) for s in samples), []) + [-100] * pad], dtype=torch.long)
        return ids, pos, seg, tgt
    t = max(lengths)
    ids = torch.full((len(samples), t), pad_id, dtype=torch.long)
    pos = torch.zeros((len(samples), t), dtype=torch.long)
    seg = torch.zeros((len(samples), t), dtype=torch.long)
    tgt = torch.full((len(samples), t), -100, dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        ids[i, :n] = torch.tensor(s.input_ids)
        pos[i, :n] = torch.arange(n)
        seg[i, :n] = 1
        tgt[i, :n] = torch.tensor(shifted_targets(s.labels))
    return ids, pos, seg, tgt


def _micro_batch(samples: Sequence[SampleLike], carrier: tuple[torch.Tensor, ...], tgt: torch.Tensor,
                 pad: int = 0) -> MicroBatch:
    return MicroBatch(keys=tuple(s.key for s in samples), carrier=carrier, targets=tgt,
                      label_tokens=int((tgt != -100).sum()), tokens=sum(len(s.input_ids) for s in samples),
                      pad_tokens=pad)


def _layout(samples: Sequence[SampleLike], grid: torch.Tensor, frames: torch.Tensor, conv_stride: int,
            images: list[int] | None = None, audio_window: int = 0, pad: int = 0) -> torch.Tensor:
    """The LAYOUT slot: every stream's segments, computed here once for all stages and layers
    (`images`: the image segments, if not the grid's own; `pad`: the padding segment's length)."""
    images = layout.image_segments(grid.tolist()) if images is None else images
    return layout.encode([len(s.input_ids) for s in samples] + ([pad] if pad else []), images,
                         layout.audio_segments(frames.tolist(), conv_stride, audio_window))


def _videos(samples: Sequence[SampleLike]) -> list:
    """The micro-batch's videos in sample order (a sample type without `videos` has none)."""
    return [v for s in samples for v in getattr(s, "videos", ())]


def collate(samples: Sequence[SampleLike], *, patch: int, packed: bool, pad_id: int,
            audio_stride: int = 2, temporal_patch: int = 1, pad_to: int | None = None) -> MicroBatch:
    """Build the tensors of one micro-batch of mmpipe's own model (uint8 pixels, log-mel features).

    Args:
        samples: the micro-batch's samples, in order.
        patch: the vision encoder's patch side (images and video frames are cut into patches here).
        packed: one row holding every sample (per-sample attention and positions), or one
            padded row per sample.
        pad_id: token id used for padding.
        audio_stride: the audio encoder's conv stride (model.audio.conv_stride): mel frames per
            encoder position, for the clips' attention segments.
        temporal_patch: frames per video temporal patch (model.vision.video.temporal_patch).
        pad_to: pad the packed row to this many LLM tokens (its ladder rung; None: not padded).
    """
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    pad = _padding(samples, pad_to, packed)
    ids, pos, seg, tgt = _text_tensors(samples, packed=packed, pad_id=pad_id, pad=pad)
    images = [img for s in samples for img in s.images]
    videos = [v.frames for v in _videos(samples)]
    pixels, grid = _patchify(images, videos, patch, temporal_patch)
    clips = [clip for s in samples for clip in s.audio]
    mels, frames = _stack_clips(clips)
    lay = _layout(samples, grid, frames, audio_stride, pad=pad)
    return _micro_batch(samples, C.pack([ids, pos, seg, pixels, grid, mels, frames, C.empty(), lay,
                                         C.video_count(len(videos)), C.empty()]), tgt, pad)


def collate_hf(samples: Sequence[SampleLike], *, spec: ModelSpec, packed: bool, pad_id: int,
               media: bool = True, pad_to: int | None = None) -> MicroBatch:
    """Build the tensors of one micro-batch of a Hugging Face model (`mmpipe.model.hf`).

    Each sample's `images` are `ImageInput`s and `audio` are `AudioInput`s (made by
    `mmpipe.model.hf.media.preprocess_image` / `preprocess_audio`); the carrier slots hold what
    that architecture's first layers take (model/carrier.py). Qwen2-VL's positions are its 3-D
    M-RoPE positions [3, B, T], computed per sample, so packing restarts them per sample; the
    clips are each sample's in token order, a video's audio track included (Qwen2.5-Omni's
    use_audio_in_video: `sample_clips`).
    `media=False`: the samples were decoded without media (a last stage, which reads only the
    targets): the media slots stay empty and the positions are the plain 1-D ones.
    `pad_to`: as `collate`'s (the padding's M-RoPE positions: 0.. on all three axes).
    """
    from mmpipe.model.hf.media import carrier_media, image_segments, sample_clips
    from mmpipe.model.hf.positions import sample_positions, uses_mrope

    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    pad = _padding(samples, pad_to, packed)
    ids, pos, seg, tgt = _text_tensors(samples, packed=packed, pad_id=pad_id, pad=pad)
    if uses_mrope(spec) and media:
        per = [torch.from_numpy(sample_positions(spec, s.input_ids, s.images, getattr(s, "videos", ())))
               for s in samples]
        if pad:
            per.append(torch.arange(pad, dtype=per[0].dtype).expand(3, pad))
        if packed:
            pos = torch.cat(per, dim=1)[:, None]
        else:
            pos = torch.zeros((3, *ids.shape), dtype=torch.long)
            for i, p in enumerate(per):
                pos[:, i, :p.shape[1]] = p
    videos = _videos(samples) if media else []
    clips = [c for s in samples for c in sample_clips(spec, s.input_ids, s.audio, getattr(s, "videos", ()))]
    pixels, grid, feats, frames = carrier_media(spec, [img for s in samples for img in s.images] if media else [],
                                                clips if media else [], videos)
    a = spec.audio
    lay = _layout(samples, grid, frames, a.conv_stride if a is not None else 1, image_segments(spec, grid.tolist()),
                  a.window if a is not None else 0, pad)
    return _micro_batch(samples, C.pack([ids, pos, seg, pixels, grid, feats, frames, C.empty(), lay,
                                         C.video_count(len(videos)), C.empty()]), tgt, pad)


def _patchify(images: list[np.ndarray], videos: list[np.ndarray], patch: int,
              temporal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 patch rows [R, C, p, p] and grids [items, 3] (t, rows, cols) of the images, then the
    videos (model/carrier.py: an image is one temporal patch; a video temporal patch is T rows,
    one per frame, in the order temporal patch, row, col, frame)."""
    chunks, grid = [], []
    for img in images:
        h, w, c = img.shape
        if h % patch or w % patch:
            raise ValueError(f"image of {h}x{w} is not a multiple of the patch size {patch}")
        gh, gw = h // patch, w // patch
        x = img.reshape(gh, patch, gw, patch, c).transpose(0, 2, 4, 1, 3).reshape(-1, c, patch, patch)
        chunks.append(x)
        grid.append((1, gh, gw))
    for clip in videos:
        n, h, w, c = clip.shape
        if h % patch or w % patch or n % temporal:
            raise ValueError(f"{n} video frames of {h}x{w} are not whole temporal patches of {temporal} frames of "
                             f"{patch}x{patch} patches")
        t, gh, gw = n // temporal, h // patch, w // patch
        x = clip.reshape(t, temporal, gh, patch, gw, patch, c).transpose(0, 2, 4, 1, 6, 3, 5)
        chunks.append(x.reshape(-1, c, patch, patch))
        grid.append((t, gh, gw))
    if not chunks:
        return torch.zeros((0, 3, patch, patch), dtype=torch.uint8), torch.zeros((0, 3), dtype=torch.long)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(chunks))), torch.tensor(grid, dtype=torch.long)


def _stack_clips(clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    if not clips:
        return torch.zeros((0, 1, 1), dtype=torch.float32), torch.zeros(0, dtype=torch.long)
    bins = clips[0].shape[0]
    longest = max(c.shape[1] for c in clips)
    mels = torch.zeros((len(clips), bins, longest), dtype=torch.float32)
    for i, c in enumerate(clips):
        mels[i, :, : c.shape[1]] = torch.from_numpy(np.asarray(c, dtype=np.float32))
    return mels, torch.tensor([c.shape[1] for c in clips], dtype=torch.long)


def collate_for(spec: ModelSpec, samples: Sequence[SampleLike], *, packed: bool, pad_id: int,
                media: bool = True, pad_to: int | None = None) -> MicroBatch:
    """One micro-batch of `spec`'s model: mmpipe's own model's tensors (`collate`), or a
    Hugging Face model's (`collate_hf`, from its processors' arrays); `pad_to`: the packed row's
    ladder rung (None: not padded)."""
    if spec.hf is not None:
        return collate_hf(samples, spec=spec, packed=packed, pad_id=pad_id, media=media, pad_to=pad_to)
    v = spec.vision
    return collate(samples, patch=v.patch if v is not None else 1, packed=packed, pad_id=pad_id,
                   audio_stride=spec.audio.conv_stride if spec.audio is not None else 1,
                   temporal_patch=v.video.temporal_patch if v is not None and v.video is not None else 1,
                   pad_to=pad_to)
