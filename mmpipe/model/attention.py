"""Per-sample attention for packed sequences, as an attention function transformers' layers call.

A packed micro-batch holds several samples (or images, or clips) in one sequence. Attending
with a dense block-diagonal mask would cost (sum of lengths)^2 per layer; this function attends
inside each segment instead (flash-attn varlen, FlexAttention with a document mask, or SDPA per
segment: model/kernels.py), so a sample costs its own length^2, as the planner assumes.
Padded micro-batches (several rows) keep the dense masked path, paying for their padding as
padded batches do.

The segment layout reaches the function through a context variable set by the calling
pipeline layer, because transformers' encoder layers do not forward extra arguments to their
attention function. The layer takes it from the micro-batch's carried layout (model/layout.py),
read to the host once per stage, never per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from mmpipe.model import kernels
from mmpipe.model.layout import Stream

NAME = "mmpipe_segments"

VARLEN_NAME = "mmpipe_segments_flash_varlen"
"""The same function under a name with "flash" in it, for Qwen2-VL's vision attention only:
transformers hands an attention function the image cu_seqlens in one call when the
implementation's name says flash (`is_flash_attention_requested`); under any other name it
splits the patches per image itself, with a `.tolist()` host sync in every block. (The name
cannot be set on the whole model: building a model with a "flash" implementation imports
flash-attn.)"""


@dataclass(frozen=True, slots=True)
class Segments:
    """How the positions of the current sequence group into samples."""

    stream: Stream | None
    """The packed row's segments (from the micro-batch's layout), or None for the dense path."""
    causal: bool
    """Causal attention inside each segment (the LLM) or bidirectional (encoders)."""
    mask: torch.Tensor | None = None
    """Additive [B, 1, T, T] mask for the dense path."""
    blocks: torch.Tensor | None = None
    """Causal rows only: a block id of every position of the packed row [T] (int; -1 outside any
    block). Positions of one block (and one segment) also attend to each other forward: Gemma 3's
    image tokens, bidirectional inside each image (transformers' `block_sequence_ids`). A sliding
    window still bounds how far back a query sees, not how far forward inside its block. None:
    plain causal. The dense path takes blocks already folded into `mask`."""


_CURRENT: ContextVar[Segments | None] = ContextVar("mmpipe_segments", default=None)


@contextmanager
def segments(seg: Segments) -> Iterator[None]:
    token = _CURRENT.set(seg)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def segment_attention(  # module, kwargs: transformers' AttentionInterface signature
        module: torch.nn.Module,  # noqa: ARG001
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
        is_causal: bool | None = None, sliding_window: int | None = None,
        **kwargs,  # noqa: ARG001
) -> tuple[torch.Tensor, None]:
    """query [B, H, T, d], key/value [B, Hkv, T, d] -> ([B, T, H, d], None).

    `sliding_window` (Mistral, Qwen2 sliding layers) limits a causal query to the last
    `sliding_window` keys, as transformers' sliding-window masks do.
    """
    seg = _CURRENT.get()
    kernel = kernels.selected()
    if seg is None or seg.stream is None:
        return _dense(query, key, value, seg, attention_mask, kernel=kernel, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, sliding_window=sliding_window), None
    stream = seg.stream
    if query.shape[0] != 1 or query.shape[2] != stream.total:
        raise ValueError(f"attention got {query.shape[0]} row(s) of {query.shape[2]} positions, but the micro-batch "
                         f"layout packs {stream.total} positions in one row; the carrier's LAYOUT slot does not "
                         f"belong to this micro-batch")
    window = sliding_window if seg.causal else None
    blocks = seg.blocks if seg.causal else None
    out = kernels.packed(kernels.resolve(kernel, query, dropout=dropout, blocks=blocks is not None), query, key,
                         value, stream, causal=seg.causal, window=window, scale=scaling, dropout=dropout,
                         blocks=blocks)
    return out.contiguous(), None


def _dense(query, key, value, seg: Segments | None, attention_mask, *, kernel, dropout, scaling, is_causal,
           sliding_window) -> torch.Tensor:
    mask = seg.mask if seg is not None and seg.mask is not None else attention_mask
    if sliding_window and mask is not None and mask.shape[-1] > sliding_window:
        # padded rows start every sample at index 0, so index distance is position distance; the
        # window bounds keys behind a query only (the mask is causal, or causal or same-block)
        mask = mask + kernels.window_mask(mask.shape[-1], sliding_window, mask.dtype, mask.device, causal=False)
    causal = bool(is_causal) and mask is None
    if kernel == "eager":
        if causal:
            t = query.shape[2]
            mask = kernels.window_mask(t, t + 1, query.dtype, query.device)  # a window past the row: causal
        return kernels.eager(query, key, value, mask, scale=scaling, dropout=dropout).contiguous()
    out = kernels.sdpa(query, key, value, mask=mask, causal=causal, scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(NAME, segment_attention)
AttentionInterface.register(VARLEN_NAME, segment_attention)
