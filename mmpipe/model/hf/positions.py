"""3-D M-RoPE positions of one sample, as each Qwen class's `get_rope_index` makes them.

Collate computes them per sample (so packing restarts them per sample) from the sample's token
ids and its processed media; every decoder block reads them from the carrier. Three rules:

- Qwen2-VL (and Qwen3-VL's images): text counts on from the current position on all three axes;
  a run of image tokens (one image) or video tokens (one video) takes (t, row, col) of its merged
  grid offset by the current position, which then advances by max(rows, cols) / merge.
- Qwen2.5-VL: the same, but a video's temporal index k is trunc(k x tokens_per_second x
  second_per_grid_ts) (its `time_interval`, in float32 as torch computes it).
- Qwen2.5-Omni's thinker: a text, audio or marker token takes 1 + the largest position of the
  segment before it; an image or video takes its grid offset by that, a video's temporal index
  being trunc(k x video_second_per_grid x position_id_per_seconds); with use_audio_in_video, a
  clip that has an audio track is <vision_bos><audio_bos> (one position for both), its video and
  audio positions from the same start, laid out chunk by chunk as its tokens are, then
  <audio_eos><vision_eos> (one position for both), exactly as that get_rope_index lays them.

transformers' own functions cannot be called here: they are methods of the model (it must
exist, with its config) and take a padded batch; tests compare these with them on many layouts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpipe.model.spec import ModelSpec

MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "qwen3_vl")
"""Decoders that take 3-D M-RoPE positions."""


def uses_mrope(spec: ModelSpec) -> bool:
    """Whether the decoder takes 3-D M-RoPE positions [3, B, T]."""
    return spec.hf is not None and json.loads(spec.hf.config).get("model_type") in MROPE_TYPES


def _temporal(t: int, step: float | None) -> np.ndarray:
    """Temporal indices of t temporal patches: 0..t-1, or trunc(k * step) in float32 (torch's
    `arange(t) * time_interval` on a float32 interval)."""
    if step is None:
        return np.arange(t, dtype=np.int64)
    return (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)


def _grid(t_index: np.ndarray, h: int, w: int, merge: int) -> np.ndarray:
    """[3, t * h/merge * w/merge] (temporal, row, col) of a merged grid, temporal indices given."""
    tt, hh, ww = np.meshgrid(t_index, np.arange(h // merge), np.arange(w // merge), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1)


def mrope_positions(input_ids: Sequence[int], grids: Sequence[Sequence[int]], *, image_token: int,
                    merge: int, video_token: int = -1, video_grids: Sequence[Sequence[int]] = (),
                    video_steps: Sequence[float] = ()) -> np.ndarray:
    """Qwen2-VL's positions [3, n] (Qwen2.5-VL's with `video_steps`: each video's float32
    time_interval, tokens_per_second x second_per_grid_ts); see the module docstring."""
    ids = np.asarray(input_ids)
    kind = np.where(ids == image_token, 1, np.where((ids == video_token) & (video_token >= 0), 2, 0))
    parts, pos = [], 0
    items = {1: iter(grids), 2: iter(video_grids)}
    steps = iter(video_steps)
    for k, run in itertools.groupby(kind.tolist()):
        n = len(list(run))
        if not k:
            parts.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        what = "image" if k == 1 else "video"
        t, h, w = next(items[k], (0, 0, 0))
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(f"a run of {n} {what} tokens does not match an {what} of {t * gh * gw} tokens; "
                             f"images and videos must be separated by text (Qwen2-VL's "
                             f"<|vision_start|>/<|vision_end|>)")
        parts.append(_grid(_temporal(t, next(steps, None) if k == 2 else None), h, w, merge) + pos)
        pos += max(h, w) // merge
    for k, what in ((1, "images"), (2, "videos")):
        if next(items[k], None) is not None:
            raise ValueError(f"more {what} than {what[:-1]}-token runs in a sample")
    return np.concatenate(parts, axis=1).astype(np.int64) if parts else np.zeros((3, 0), dtype=np.int64)


def chunk_runs(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of ascending `values`, as transformers' Omni `get_chunked_index`
    cuts them: a chunk ends at the first value reaching the next multiple of per_chunk (one
    multiple per value)."""
    out, start, chunk = [], 0, 1
    for i, x in enumerate(values.tolist()):
        if x >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(values)))
    return out


def omni_positions(input_ids: Sequence[int], *, tokens: dict[str, int], merge: int,
                   image_grids: Sequence[Sequence[int]], videos: Sequence[tuple[Sequence[int], float, int]],
                   per_second: float, chunk_seconds: float) -> np.ndarray:
    """Qwen2.5-Omni's thinker positions [3, n] (see the module docstring).

    Args:
        tokens: the config's ids: `image`, `video`, `audio`, `vision_bos`, `audio_bos`.
        videos: per video, (grid, video_second_per_grid, audio tokens of its interleaved track or 0).
        per_second: the config's position_id_per_seconds; chunk_seconds: its seconds_per_chunk.
    """
    ids = list(input_ids)
    image, video, audio, vbos, abos = (tokens[k] for k in ("image", "video", "audio", "vision_bos", "audio_bos"))
    imgs, vids = iter(image_grids), iter(videos)
    parts: list[np.ndarray] = []
    last = -1  # the largest position of the segment before (what the next segment counts on from)
    i = 0

    def visual(grid: Sequence[int], seconds: float | None, start: int) -> np.ndarray:
        t, h, w = (int(x) for x in grid)
        if seconds is None:  # an image: (arange(1) * 1 * per_second).long() = 0
            t_index = np.zeros(t, dtype=np.int64)
        else:  # (arange(t) * float32 seconds) * per_second, in float32, then truncated
            t_index = ((np.arange(t, dtype=np.float32) * np.float32(seconds)).astype(np.float32)
                       * np.float32(per_second)).astype(np.int64)
        return _grid(t_index, h, w, merge) + start

    def take(block: np.ndarray, what: str) -> None:
        nonlocal i, last
        n = block.shape[1]
        if i + n > len(ids):
            raise ValueError(f"an {what} of {n} tokens runs past the end of the sample ({len(ids) - i} tokens left)")
        parts.append(block)
        last = int(block.max()) if n else last
        i += n

    while i < len(ids):
        x = ids[i]
        if x == vbos and i + 1 < len(ids) and ids[i + 1] == abos:  # a clip with its audio track interleaved
            grid, seconds, track = next(vids, ((0, 0, 0), 0.0, 0))
            if not track:
                raise ValueError("<vision_bos><audio_bos> opens a clip whose audio track is not interleaved; "
                                 "make the sample with model.use_audio_in_video and that clip's track")
            p = last + 1
            parts.append(np.full((3, 2), p, dtype=np.int64))  # both openers take one position
            i += 2
            base = p + 1
            vpos = visual(grid, seconds, base)
            apos = np.broadcast_to(np.arange(track, dtype=np.int64) + base, (3, track))
            per_chunk = int(per_second * chunk_seconds)
            vchunks = chunk_runs(vpos[0] - base, per_chunk)
            achunks = chunk_runs(apos[0] - base, per_chunk)
            for j in range(max(len(vchunks), len(achunks))):
                if j < len(vchunks):
                    take(vpos[:, vchunks[j][0]:vchunks[j][1]], "interleaved clip")
                if j < len(achunks):
                    take(apos[:, achunks[j][0]:achunks[j][1]], "interleaved clip")
            e = last + 1
            closers = min(2, len(ids) - i)  # <audio_eos><vision_eos>: one position for both
            parts.append(np.full((3, closers), e, dtype=np.int64))
            last, i = e, i + closers
        elif x == image:
            take(visual(next(imgs, (0, 0, 0)), None, last + 1), "image")
        elif x == video:
            grid, seconds, track = next(vids, ((0, 0, 0), 0.0, 0))
            if track:
                raise ValueError("a clip whose audio track is interleaved must open with <vision_bos><audio_bos>")
            take(visual(grid, seconds, last + 1), "video")
        else:  # text, markers and audio tokens: one position each, counting on
            j = i
            while j < len(ids) and ids[j] not in (image, video) and not (ids[j] == vbos and j + 1 < len(ids)
                                                                             and ids[j + 1] == abos):
                j += 1
            parts.append(np.broadcast_to(np.arange(last + 1, last + 1 + j - i, dtype=np.int64), (3, j - i)))
            last, i = last + j - i, j
    for rest, what in ((imgs, "images"), (vids, "videos")):
        if next(rest, None) is not None:
            raise ValueError(f"more {what} than the sample's tokens hold")
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)


def clip_tokens(spec: ModelSpec, frames: int) -> int:
    """LLM tokens of a clip of `frames` valid mel frames (the audio tower's conv and pooling)."""
    a = spec.audio
    positions = -(-frames // a.conv_stride)
    return -(-positions // a.pool) if a.pool_ceil else positions // a.pool


def sample_positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[Any],
                     videos: Sequence[Any] = ()) -> np.ndarray:
    """A sample's M-RoPE positions [3, n] from its tokens, processed images (ImageInput) and
    videos (mmpipe.model.hf.video.VideoInput), by its class's rule."""
    from mmpipe.model.hf.configs import hf_config

    config = hf_config(spec.hf)
    image_token = config.image_token_id  # Omni's config names it image_token_index
    merge = spec.vision.merge
    if config.model_type == "qwen2_5_omni_thinker":
        tokens = dict(image=image_token, video=config.video_token_id, audio=config.audio_token_id,
                      vision_bos=config.vision_start_token_id, audio_bos=config.audio_start_token_id)
        vids = [(v.grid, v.second_per_grid, clip_tokens(spec, v.audio.frames) if v.audio is not None else 0)
                for v in videos]
        return omni_positions(input_ids, tokens=tokens, merge=merge, image_grids=[img.grid for img in images],
                              videos=vids, per_second=config.position_id_per_seconds,
                              chunk_seconds=config.seconds_per_chunk)
    video_token = getattr(config, "video_token_id", None) if videos else None
    steps: list[float] = []
    if config.model_type == "qwen2_5_vl":  # time_interval = tokens_per_second * second_per_grid_ts (float32)
        tps = np.float32(config.vision_config.tokens_per_second)
        steps = [float(tps * np.float32(v.second_per_grid)) for v in videos]
    return mrope_positions(input_ids, [img.grid for img in images], image_token=image_token, merge=merge,
                           video_token=-1 if video_token is None else video_token,
                           video_grids=[vid.grid for vid in videos], video_steps=steps)
