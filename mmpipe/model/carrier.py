"""The tuple of tensors that flows through the pipeline layers, and the masks built from it.

DeepSpeed passes a tuple of tensors between stages and needs every floating tensor it sends to
come back with a gradient. So the carrier has fixed slots, media travel as integers (pixels
as uint8, processed pixel values, log-mel features and frozen activations as the bits of their
floats, viewed as an integer type of the same width), and only activations that really require
grad are floats.
A stage boundary may therefore fall between any two layers.
"""

from __future__ import annotations

import torch

# Slot positions in the carrier tuple. What a media slot holds depends on the architecture:
#
# slot          | mmpipe tiny            | LLaVA (CLIP / SigLIP)       | Qwen2-VL                      | Qwen2-Audio
# --------------|------------------------|-----------------------------|-------------------------------|------------------------------
# POSITION_IDS  | [B, T] long            | [B, T] long                 | [3, B, T] long (M-RoPE)       | [B, T] long
# IMAGE  input  | pixels [P, C, p, p] u8 | pixel_values [N, C, S, S]   | pixel_values [P, C*2*p*p]     | (empty)
#        tower  | states [1, P, Dv]      | states [N, positions, Dv]   | states [P, Dv]                |
#        proj   | embeddings [N_tok, D]  | embeddings [N_tok, D]       | embeddings [P / 4, D]         |
# IMAGE_GRID    | [images, 2] rows, cols | [images, 2] rows, cols      | [images, 3] grid_thw          | (empty)
# AUDIO  input  | log-mel [clips, mel, F]| (empty)                     | (empty)                       | features [clips, mel, F]: each
#        tower  | states [1, A, Da]      |                             |                               |   clip's frames 0..2P, 0-filled
#        proj   | embeddings [N_tok, D]  |                             |                               | states [1, sum P, Da] -> [N_tok, D]
# AUDIO_FRAMES  | [clips] mel frames     | (empty)                     | (empty)                       | [clips] valid mel frames L
# LAYOUT        | int32 segment counts and cu_seqlens of the LLM row, the images and the clips (model/layout.py)
#
# Qwen2.5-VL / Qwen2.5-Omni vision: as Qwen2-VL, the tower states in window order (model/hf/qwen25.py).
# Qwen2.5-Omni audio: features [clips, mel, F] holding each clip's valid frames, frames [clips];
# states [A, D] over every n_window chunk's positions; the layout's audio segments are the chunks
# (model/hf/omni.py). Both towers' slots travel side by side until llm.embed.
#
# Float inputs (pixel_values, features) carry no gradient, so they travel as integer bit views
# (to_wire); P = (L - 1) // 2 + 1 audio positions per clip (layout.audio_segments, mmpipe/model/hf/layers.py).
INPUT_IDS = 0  # [B, T] long: LLM tokens (image/audio placeholders expanded)
POSITION_IDS = 1  # [B, T] long (or [3, B, T] for M-RoPE): positions, restarting at 0 for each packed sample
SEGMENT_IDS = 2  # [B, T] long: 1.. per sample in a row, 0 on padding
IMAGE = 3  # image inputs -> vision states -> image embeddings [N, D] (see the table)
IMAGE_GRID = 4  # [num_images, 2 or 3] long: patch grid of each image
AUDIO = 5  # audio features (bits) -> audio states [1, A, Da] -> audio embeddings [N, D]
AUDIO_FRAMES = 6  # [clips] long: mel frames of each clip
HIDDEN = 7  # [B, T, D] LLM hidden states (empty until llm.embed)
LAYOUT = 8  # int32 [3 + segments + 3]: each stream's segments, made once by collate (model/layout.py)
NUM_SLOTS = 9

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def empty(like: torch.Tensor | None = None) -> torch.Tensor:
    """The value of a slot that holds nothing (yet, or any more), on `like`'s device."""
    return torch.zeros(0, dtype=torch.long, device=like.device if like is not None else None)


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A float that will get no gradient travels as the integer view of its bits."""
    if t.is_floating_point() and not t.requires_grad:
        return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])
    return t


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of to_wire for a slot known to hold floats of `dtype`."""
    if t.is_floating_point():
        return t.to(dtype)
    if t.dtype == torch.uint8:  # pixels, not bits
        return t
    if t.element_size() == torch.finfo(dtype).bits // 8:
        return t.view(dtype)
    return t.view(_float_of_width(t.element_size())).to(dtype)


def _float_of_width(width: int) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[width]


def pack(slots: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    assert len(slots) == NUM_SLOTS
    return tuple(to_wire(t) for t in slots)


def causal_segment_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, T, T] block-diagonal causal mask; padding attends to itself only."""
    b, t = segment_ids.shape
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal & (segment_ids[:, :, None] > 0)
    allowed |= torch.eye(t, dtype=torch.bool, device=segment_ids.device)
    mask = torch.zeros((b, t, t), dtype=dtype, device=segment_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
