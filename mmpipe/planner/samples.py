"""Samples as the cost model sees them: per-stream token counts and squared lengths.

A micro-batch feeds each layer one *stream* (vision patches, vision LLM tokens, audio
positions, audio LLM tokens, LLM tokens). For a stream it has `T` tokens and `S2`, the sum of
squared sequence lengths (attention is quadratic per sequence). Packed micro-batches add up
their samples' figures; padded ones pay every sequence at the longest one's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.model.geometry import SampleFeatures

STREAMS = ("vpos", "vtok", "apos", "atok", "llm", "vwin")
"""Per-micro-batch token streams: vision positions, vision LLM tokens, audio positions,
audio LLM tokens, LLM sequence, and the vision positions again as the windowed blocks of a
Qwen2.5-VL-style tower see them (the same tokens, attention per window)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleTable:
    """Per-sample stream figures of a list of samples, as arrays over (sample, stream)."""

    tokens: np.ndarray
    """[n, K] tokens of each stream."""
    squares: np.ndarray
    """[n, K] sum of squared sequence lengths of each stream."""
    seqs: np.ndarray
    """[n, K] number of sequences (images, clips, 1 for the LLM)."""
    longest: np.ndarray
    """[n, K] longest sequence of each stream."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, rows: Sequence[int]) -> SampleTable:
        """The table of the given rows only, in that order."""
        return SampleTable(tokens=self.tokens[rows], squares=self.squares[rows],
                           seqs=self.seqs[rows], longest=self.longest[rows])


def vision_sequences(f: SampleFeatures) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The vision encoder's attention segments and the vision LLM token runs of a sample: each
    image one segment; each video one segment per temporal patch (Qwen2-VL's vision cu_seqlens),
    so a clip costs its patches linearly and each temporal patch's length squared; images' and
    videos' LLM tokens."""
    segments = f.image_positions + tuple(length for n, length in f.video_segments for _ in range(n))
    return segments, f.image_tokens + f.video_tokens


def sample_table(samples: Sequence[SampleFeatures]) -> SampleTable:
    """Stream figures of samples (their token geometry from `mmpipe.model.geometry`)."""
    n = len(samples)
    tok = np.zeros((n, len(STREAMS)))
    sq = np.zeros_like(tok)
    cnt = np.zeros_like(tok)
    mx = np.zeros_like(tok)
    for i, f in enumerate(samples):
        vpos, vtok = vision_sequences(f) if f.video_segments else (f.image_positions, f.image_tokens)
        for k, seqs in enumerate((vpos, vtok, f.audio_positions, f.audio_tokens, (f.llm_len,), f.image_windows)):
            if seqs:
                tok[i, k] = sum(seqs)
                sq[i, k] = sum(s * s for s in seqs)
                cnt[i, k] = len(seqs)
                mx[i, k] = max(seqs)
        if f.audio_chunks:  # every audio block attends per chunk (Qwen2.5-Omni), not per clip
            sq[i, 2] = sum(s * s for s in f.audio_chunks)
    return SampleTable(tokens=tok, squares=sq, seqs=cnt, longest=mx)


def bin_sums(values: np.ndarray, bins: Sequence[Sequence[int]]) -> np.ndarray:
    """Per bin, the sum of `values` rows (one row per sample) over the bin's samples: [n_bins,
    ...]. Every bin must hold at least one sample."""
    idx, starts = _flat(bins)
    return np.add.reduceat(values[idx], starts, axis=0)


def mb_streams(table: SampleTable, mbs: Sequence[Sequence[int]], *,
               packing: bool) -> tuple[np.ndarray, np.ndarray]:
    """Stream tokens and squared lengths [n_mb, K] of micro-batches (lists of row indices)."""
    n = len(mbs)
    K = len(STREAMS)
    if n == 0:
        return np.zeros((0, K)), np.zeros((0, K))
    if any(len(mb) == 0 for mb in mbs):
        raise ValueError("a micro-batch is empty; every micro-batch needs at least one sample")
    if packing:
        return bin_sums(table.tokens, mbs), bin_sums(table.squares, mbs)
    idx, starts = _flat(mbs)
    cnt = np.add.reduceat(table.seqs[idx], starts, axis=0)
    mx = np.maximum.reduceat(table.longest[idx], starts, axis=0)
    return cnt * mx, cnt * mx * mx


def _flat(bins: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """All bins' samples in one index array, and where each bin starts in it."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    idx = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
    return idx, np.concatenate([[0], np.cumsum(sizes)[:-1]])


def packed_streams(features: Sequence[SampleFeatures]) -> tuple[np.ndarray, np.ndarray]:
    """[K] tokens and [K] sums of squared sequence lengths of each stream (STREAMS) of one
    packed micro-batch of these samples: what the cost model prices a layer on (`mmpipe
    profile` times layers on them)."""
    T, S2 = mb_streams(sample_table(list(features)), [list(range(len(features)))], packing=True)
    return T[0], S2[0]
