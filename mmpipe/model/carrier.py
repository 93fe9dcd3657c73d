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

from mmpipe.model.layout import host_list

# Slot positions in the carrier tuple. What a media slot holds depends on the architecture:
#
# slot          | mmpipe tiny                | LLaVA (CLIP / SigLIP)       | Qwen2-VL                      | Qwen2-Audio
# --------------|----------------------------|-----------------------------|-------------------------------|------------------------------
# POSITION_IDS  | [B, T] long                | [B, T] long                 | [3, B, T] long (M-RoPE)       | [B, T] long
# IMAGE  input  | pixels [R, C, p, p] u8     | pixel_values [N, C, S, S]   | pixel_values [P, C*2*p*p]     | (empty)
#        tower  | states [1, P, Dv]          | states [N, positions, Dv]   | states [P, Dv]                |
#        proj   | embeddings [N_tok, D]      | embeddings [N_tok, D]       | embeddings [P / 4, D]         |
# IMAGE_GRID    | [items, 3] t, rows, cols   | [images, 2] rows, cols      | [items, 3] grid_thw           | (empty)
# AUDIO  input  | log-mel [clips, mel, F]    | (empty)                     | (empty)                       | features [clips, mel, F]: each
#        tower  | states [1, A, Da]          |                             |                               |   clip's frames 0..2P, 0-filled
#        proj   | embeddings [N_tok, D]      |                             |                               | states [1, sum P, Da] -> [N_tok, D]
# AUDIO_FRAMES  | [clips] mel frames         | (empty)                     | (empty)                       | [clips] valid mel frames L
# LAYOUT        | int32 segment counts and cu_seqlens of the LLM row, the images and the clips (model/layout.py)
# DEEPSTACK     | empty (long) for every model but Qwen3-VL (mmpipe/model/hf/families/qwen3_vl.py), where it carries
#               |   tower    states [j, P, Dv] of the first j DeepStack blocks run so far (their inputs to the
#               |            DeepStack mergers, which vision.proj holds)
#               |   proj     merged features [k, N_tok, D]: the k DeepStack features
#               |   LLM      [k - j, N_tok, D] entering llm.block.j (j < k), which adds the first at the image
#               |            tokens and passes the rest on; empty once llm.block.(k-1) has run
#               | a float that requires grad travels as such and gets its gradient back from the LLM block
#               | that adds it (text-only micro-batches carry [j, 0, D], kept in the graph); without grad
#               | (a frozen tower) it travels as bits like any other float
# VIDEOS        | [1] long: how many of the IMAGE_GRID items (the last ones) are videos; [0] without any
#
# Videos ride in the image slots ("visual items"): a micro-batch's images come first, in sample
# order, then its videos, in sample order. IMAGE holds the images' inputs followed by the
# videos', IMAGE_GRID one row per item (a video's row is its video_grid_thw: temporal patches,
# rows, cols), and VIDEOS says how many trailing rows are videos. One tower pass encodes both
# (Qwen2-VL's processor lays a video's patches out exactly as an image's: an image is one
# temporal patch of a repeated frame), the LAYOUT's image stream gives every temporal patch its
# own attention segment (transformers' get_vision_cu_seqlens), and llm.embed puts the first
# embeddings on the image tokens and the rest on the video tokens, each in order: what
# transformers' masked_scatter of image and video features does. An architecture whose video
# items need other handling in its tower (per-frame pooling) reads VIDEOS to find them.
# mmpipe tiny carries every image patch as one row [C, p, p] (rows, cols of grid (1, rows, cols))
# and every video temporal patch as T consecutive rows, one per frame (T = model.vision.video.
# temporal_patch), in the order (temporal patch, row, col, frame).
#
# LLaVA-NeXT / OneVision (any-resolution tiles) are LLaVA's column, with tiles for images: IMAGE holds
# every tile of the micro-batch, pixel_values [T, C, S, S] (per image the whole image at S x S, then its
# grid row by row; a OneVision image that shares its sample is one padded tile), then the tower's states
# [T, positions, Dv], then vision.proj's packed tokens of every image [N_tok, D] (the whole image's
# features, then the grid's unpadded rows, each ending in image_newline); IMAGE_GRID is [images, 5] long:
# (tiles, grid rows, grid cols, height, width), the last two the image's own size, which the model unpads
# to (transformers' image_sizes); LAYOUT's image stream has one segment per tile.
#
# Qwen2.5-VL / Qwen2.5-Omni vision: as Qwen2-VL, the tower states in window order (model/hf/families/qwen2_5_vl.py).
# Qwen2.5-Omni audio: features [clips, mel, F] holding each clip's valid frames, frames [clips];
# states [A, D] over every n_window chunk's positions; the layout's audio segments are the chunks
# (model/hf/families/qwen2_5_omni.py). Both towers' slots travel side by side until llm.embed.
#
# Float inputs (pixel_values, features) carry no gradient, so they travel as integer bit views
# (to_wire); P = (L - 1) // 2 + 1 audio positions per clip (layout.audio_segments, mmpipe/model/hf/layers.py).
INPUT_IDS = 0  # [B, T] long: LLM tokens (image/audio/video placeholders expanded)
POSITION_IDS = 1  # [B, T] long (or [3, B, T] for M-RoPE): positions, restarting at 0 for each packed sample
SEGMENT_IDS = 2  # [B, T] long: 1.. per sample in a row, 0 on padding
IMAGE = 3  # image (then video) inputs -> vision states -> image (then video) embeddings [N, D] (see the table)
IMAGE_GRID = 4  # [items, 2, 3 or 5] long: patch grid (or tiles and size) of each image, then of each video
AUDIO = 5  # audio features (bits) -> audio states [1, A, Da] -> audio embeddings [N, D]
AUDIO_FRAMES = 6  # [clips] long: mel frames of each clip
HIDDEN = 7  # [B, T, D] LLM hidden states (empty until llm.embed)
LAYOUT = 8  # int32 [3 + segments + 3]: each stream's segments, made once by collate (model/layout.py)
VIDEOS = 9  # [1] long: the number of video items at the end of IMAGE_GRID (0 without video)
DEEPSTACK = 10  # Qwen3-VL DeepStack features on their way to the LLM blocks that add them (see the table)
NUM_SLOTS = 11

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def empty(like: torch.Tensor | None = None) -> torch.Tensor:
    """The value of a slot that holds nothing (yet, or any more), on `like`'s device."""
    return torch.zeros(0, dtype=torch.long, device=like.device if like is not None else None)


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A float that will get no gradient travels as the integer view of its bits; every slot is
    contiguous, as torch.distributed's send needs (a SigLIP tower's states keep the transposed
    layout of its patch embedding through every residual add)."""
    if t.is_floating_point() and not t.requires_grad:
        return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])
    return t.contiguous()


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


def video_count(n: int) -> torch.Tensor:
    """The VIDEOS slot of a micro-batch with `n` video items."""
    return torch.tensor([n], dtype=torch.long)


def videos_in(slots: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> int:
    """How many of the IMAGE_GRID items are videos (a host value, read once per micro-batch and
    stage)."""
    t = slots[VIDEOS]
    return int(host_list(t)[0]) if t.numel() else 0


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
