"""3-D M-RoPE positions of one sample, as the Qwen classes' `get_rope_index` make them.

Collate computes them per sample (so packing restarts them per sample) from the sample's token
ids and its processed media; every decoder block reads them from the carrier. A family's
`positions` rule (`Family.positions`) gives them; a family without one takes the 1-D positions.
The rule most share is Qwen2-VL's, here (`mrope_positions`, `grid_positions`): text counts on
from the current position on all three axes; a run of image tokens (one image) or video tokens
(one video) takes (t, row, col) of its merged grid offset by the current position, which then
advances by max(rows, cols) / merge; a video's temporal index k may be scaled
(Qwen2.5-VL's trunc(k x tokens_per_second x second_per_grid_ts), in float32 as torch computes it).
Qwen2.5-Omni's own rule is in its family file.

transformers' own functions cannot be called here: they are methods of the model (it must
exist, with its config) and take a padded batch; tests compare these with them on many layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.family import family_of
from mmpipe.model.spec import ModelSpec


def uses_mrope(spec: ModelSpec) -> bool:
    """Whether the decoder takes 3-D M-RoPE positions [3, B, T] (its family has a positions rule)."""
    return spec.hf is not None and family_of(spec.hf).positions is not None


def _temporal(t: int, step: float | None) -> np.ndarray:
    """Temporal indices of t temporal patches: 0..t-1, or trunc(k * step) in float32 (torch's
    `arange(t) * time_interval` on a float32 interval)."""
    if step is None:
        return np.arange(t, dtype=np.int64)
    return (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)


def grid_indices(t_index: np.ndarray, h: int, w: int, merge: int) -> np.ndarray:
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
        parts.append(grid_indices(_temporal(t, next(steps, None) if k == 2 else None), h, w, merge) + pos)
        pos += max(h, w) // merge
    for k, what in ((1, "images"), (2, "videos")):
        if next(items[k], None) is not None:
            raise ValueError(f"more {what} than {what[:-1]}-token runs in a sample")
    return np.concatenate(parts, axis=1).astype(np.int64) if parts else np.zeros((3, 0), dtype=np.int64)


def clip_tokens(spec: ModelSpec, frames: int) -> int:
    """LLM tokens of a clip of `frames` valid mel frames (the audio tower's conv and pooling)."""
    a = spec.audio
    positions = -(-frames // a.conv_stride)
    return -(-positions // a.pool) if a.pool_ceil else positions // a.pool


def sample_positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[Any],
                     videos: Sequence[Any] = ()) -> np.ndarray:
    """A sample's M-RoPE positions [3, n] from its tokens, processed images (ImageInput) and
    videos (mmpipe.model.hf.video.VideoInput), by its family's rule."""
    rule = family_of(spec.hf).positions
    if rule is None:
        raise ValueError(f"model {spec.name} takes 1-D positions, not M-RoPE ones")
    return rule(spec, input_ids, images, videos)


def grid_positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[Any], videos: Sequence[Any] = (),
                   video_steps: Sequence[float] = ()) -> np.ndarray:
    """Qwen2-VL's rule (`mrope_positions`) with the config's image and video tokens and the tower's
    merge; `video_steps`: each video's temporal scale, if the family has one."""
    config = hf_config(spec.hf)
    video_token = getattr(config, "video_token_id", None) if videos else None
    return mrope_positions(input_ids, [img.grid for img in images], image_token=config.image_token_id,
                           merge=spec.vision.merge, video_token=-1 if video_token is None else video_token,
                           video_grids=[vid.grid for vid in videos], video_steps=video_steps)
