"""Per-sample attention for packed sequences, as an attention function transformers' layers call.

A packed micro-batch holds several samples (or images, or clips) in one sequence. Attending
with a dense block-diagonal mask would cost (sum of lengths)^2 per layer; this function runs
scaled-dot-product attention on each sample's slice instead, so a sample costs its own
length^2 and packing saves exactly what varlen attention saves on GPUs. Padded micro-batches
(several rows) keep the dense masked path, paying for their padding as padded batches do.

The segment layout reaches the function through a context variable set by the calling
pipeline layer, because transformers' encoder layers do not forward extra arguments to their
attention function.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.nn import functional as F
from transformers import AttentionInterface

NAME = "mmpipe_segments"


@dataclass(frozen=True, slots=True)
class Segments:
    """How the positions of the current sequence group into samples."""

    lengths: tuple[int, ...] | None
    """Consecutive segment lengths of a single packed row, or None for the dense path."""
    causal: bool
    """Causal attention inside each segment (the LLM) or bidirectional (encoders)."""
    mask: torch.Tensor | None = None
    """Additive [B, 1, T, T] mask for the dense path."""


_CURRENT: ContextVar[Segments | None] = ContextVar("mmpipe_segments", default=None)


@contextmanager
def segments(seg: Segments) -> Iterator[None]:
    token = _CURRENT.set(seg)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _window_mask(n: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [n, n] causal mask of a sliding window: query q sees keys q-window < k <= q
    (transformers' `sliding_window_overlay` on a causal mask)."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    mask = torch.zeros((n, n), dtype=dtype, device=device)
    return mask.masked_fill_((k > q) | (k <= q - window), torch.finfo(dtype).min)


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, T, d], key/value [B, Hkv, T, d] -> ([B, T, H, d], None).

    `sliding_window` (Mistral, Qwen2 sliding layers) limits a causal query to the last
    `sliding_window` keys, as transformers' sliding-window masks do.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    seg = _CURRENT.get()
    if seg is None or seg.lengths is None:
        mask = seg.mask if seg is not None and seg.mask is not None else attention_mask
        if sliding_window and mask is not None and mask.shape[-1] > sliding_window:
            # padded rows start every sample at index 0, so index distance is position distance
            mask = mask + _window_mask(mask.shape[-1], sliding_window, mask.dtype, mask.device)
        causal = bool(is_causal) and mask is None
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                             is_causal=causal, scale=scaling)
    else:
        parts, start = [], 0
        for n in seg.lengths:
            sl = slice(start, start + n)
            window = seg.causal and sliding_window is not None and n > sliding_window
            parts.append(F.scaled_dot_product_attention(
                query[:, :, sl], key[:, :, sl], value[:, :, sl], dropout_p=dropout,
                attn_mask=_window_mask(n, sliding_window, query.dtype, query.device) if window else None,
                is_causal=seg.causal and n > 1 and not window, scale=scaling))
            start += n
        out = torch.cat(parts, dim=2) if parts else query
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, segment_attention)


def run_lengths(ids: torch.Tensor) -> tuple[int, ...]:
    """[1, 1, 1, 2, 2, 3] -> (3, 2, 1)."""
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    return tuple(counts.tolist())
