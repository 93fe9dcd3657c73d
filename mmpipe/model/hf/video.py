"""A checkpoint's video processor (transformers' own class), the figures the geometry plans
frames with, and a clip's frames through it.

The processor is the one transformers builds for the checkpoint: its class the one its family
pairs with it (`Family.video_processor`), its configuration found in a folder as transformers
finds it (`BaseVideoProcessor.get_video_processor_dict`: processor_config.json's
`video_processor`, else video_preprocessor_config.json, else preprocessor_config.json, the image
processor's own file), or for an inline preset the `video_processor` mapping, else its
`image_processor` (the same fallback). `video_spec` (Qwen2-VL's processor; LLaVA-OneVision's is
in its family file) turns its settings into the `VideoSpec` that `mmpipe.model.geometry` plans
with, so the planner's frames, patches and tokens are the processor's
(tests/unit/model/test_video_geometry.py compares them over many clips).

The data layer decodes only the frames the geometry picks (`mmpipe.data.video.decode_frames`)
and hands them to `preprocess_video`, which calls the processor with `do_sample_frames=False`
(the frames are already the sampled ones) and the clip's `VideoMetadata`, `frames_indices`
included, as transformers' own decoding would have filled it: resize, rescale, normalize,
temporal padding and patch layout are the processor's. For the time-aligned positions of
Qwen2.5-VL and Qwen2.5-Omni, `VideoInput.second_per_grid` is what their processors compute:
Qwen2.5-VL's `second_per_grid_ts` (temporal patch / that metadata's `sampled_fps`), Omni's
`video_second_per_grid` (temporal patch / the fps of the processor call, 2.0 unless the video
processor samples frames by fps: `VideoSpec.grid_seconds`).

Qwen2.5-Omni's processor passes its own `videos_kwargs` to the video processor on every call
(frames resized within 128 to 768 x 28^2 pixels, whatever the video processor's config says):
its family gives them to `video_spec` (`call`), whose VideoSpec bounds `preprocess_video` uses.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmpipe.model.geometry import VideoMeta, video_grid
from mmpipe.model.hf.family import family_of
from mmpipe.model.spec import HFSource, ModelSpec, VideoSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoInput:
    """One clip as the vision tower's first layer takes it."""

    pixels: np.ndarray
    """float32 [t * rows * cols, C * T * p * p]: the processor's pixel_values_videos of the clip
    (LLaVA-OneVision: [frames, C, S, S], every frame one tile)."""
    grid: tuple[int, int, int]
    """(t, rows, cols): its video_grid_thw (LLaVA-OneVision: frames, and each frame's patch grid)."""
    sampled_fps: float
    """Frames per second of the sampled frames (transformers' VideoMetadata.sampled_fps)."""
    second_per_grid: float = 0.0
    """Seconds per temporal patch in the 3-D positions (Qwen2.5-VL's second_per_grid_ts, Omni's
    video_second_per_grid); unused by Qwen2-VL."""
    audio: Any = None
    """The clip's audio track as the audio tower takes it (an mmpipe.model.hf.media.AudioInput),
    with Qwen2.5-Omni's use_audio_in_video and a track; else None."""


def _import(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def video_processor_class(path: str) -> Any:
    """transformers' video processor class at a dotted path (a family's `video_processor`)."""
    return _import(path)


def make_video_processor(path: str, config: Mapping[str, Any]) -> Any:
    """The video processor of class `path` from a configuration mapping (transformers' from_dict,
    which also reads an image processor's file: the fallback transformers itself takes)."""
    return video_processor_class(path).from_dict(dict(config))


def read_video_processor_config(folder: str | Path, path: str) -> dict[str, Any] | None:
    """A folder's configuration of the video processor of class `path`, found as transformers finds
    it (None: no file)."""
    cls = video_processor_class(path)
    try:
        config, _ = cls.get_video_processor_dict(str(folder), local_files_only=True)
    except OSError:
        return None
    return dict(config)


@functools.lru_cache(maxsize=8)
def video_processor(src: HFSource) -> Any:
    """The spec's video processor (one per process), of the class its family pairs with it."""
    family = family_of(src)
    if not src.video_processor or family.video_processor is None:
        raise ValueError(f"{src.architecture} was built without a video processor")
    return make_video_processor(family.video_processor, json.loads(src.video_processor))


def video_spec(proc: Any, *, patch: int, merge: int, temporal: int, what: str,
               call: Mapping[str, Any] | None = None, audio_in_video: bool = False,
               timing: Mapping[str, float] | None = None) -> VideoSpec:
    """The VideoSpec of a Qwen2-VL-style video processor as the model's processor calls it
    (`call`: the keyword arguments it adds on every call, e.g. Qwen2.5-Omni's frame size bounds),
    checked against the tower's figures; `timing`: VideoSpec's time fields of a processor that
    fixes them (Qwen2.5-Omni's grid_seconds, positions_per_second, chunk_seconds)."""
    for key, ours in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size", temporal)):
        if getattr(proc, key) != ours:
            raise ValueError(f"{what}: the video processor has {key}={getattr(proc, key)} but the vision tower {ours}")
    if not proc.do_resize:
        raise ValueError(f"{what}: the video processor has do_resize=false; mmpipe plans frames at the size "
                         f"smart_resize gives (set do_resize=true)")
    fps, count = proc.fps, proc.num_frames
    if proc.do_sample_frames and fps is not None and count is not None:
        raise ValueError(f"{what}: the video processor sets both fps={fps} and num_frames={count}, which "
                         f"transformers refuses as mutually exclusive; keep one")
    sample = "all"
    if proc.do_sample_frames and count is not None:
        sample = "count"
    elif proc.do_sample_frames and fps is not None:
        sample = "fps"
    size = (call or {}).get("size") or {"shortest_edge": proc.size.shortest_edge,
                                        "longest_edge": proc.size.longest_edge}
    return VideoSpec(sample=sample, fps=float(fps) if fps else 2.0, frames=int(count or 0),
                     min_frames=int(proc.min_frames), max_frames=int(proc.max_frames), temporal_patch=temporal,
                     min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
                     cap_pixels=bool(proc.cap_pixels_per_frame), max_tokens=int(proc.max_video_tokens),
                     audio_in_video=audio_in_video, **(timing or {}))


def video_metadata(meta: VideoMeta, indices: Sequence[int]) -> dict[str, Any]:
    """transformers' VideoMetadata of a clip, as its PyAV reader fills it, with the sampled frames."""
    return {"total_num_frames": meta.frames, "fps": meta.fps, "duration": meta.seconds, "height": meta.height,
            "width": meta.width, "video_backend": "pyav", "frames_indices": list(indices)}


def preprocess_video(spec: ModelSpec, frames: np.ndarray, meta: VideoMeta, indices: Sequence[int]) -> VideoInput:
    """A clip's sampled frames (uint8 [n, H, W, 3], the frames `indices` of the clip) through the
    checkpoint's video processor. Raises ValueError if its grid is not the one the planner counted."""
    if spec.hf is None or spec.vision is None or spec.vision.video is None:
        raise ValueError(f"model {spec.name} has no Hugging Face video processor")
    vs = spec.vision.video
    proc = video_processor(spec.hf)
    smart = spec.vision.resize == "smart"  # a Qwen2-VL-style processor (OneVision's has no pixel cap)
    # Omni's call overrides the config's frame size bounds (the others' are their own)
    extra = ({"cap_pixels_per_frame": vs.cap_pixels,
              "size": {"shortest_edge": vs.min_pixels, "longest_edge": vs.max_pixels}} if smart else {})
    out = proc(videos=[np.ascontiguousarray(frames)], video_metadata=[video_metadata(meta, indices)],
               do_sample_frames=False, return_tensors="pt", **extra)
    if smart:
        grid = tuple(int(x) for x in out["video_grid_thw"][0])
    else:  # OneVision: [1, frames, C, S, S], every frame a tower pass of an (S / patch)^2 grid
        out["pixel_values_videos"] = out["pixel_values_videos"][0]
        n, _, h, w = out["pixel_values_videos"].shape
        grid = (n, h // spec.vision.patch, w // spec.vision.patch)
    planned = video_grid(spec.vision, meta)
    if grid != planned:
        raise ValueError(f"the video processor made a {grid} grid of {len(indices)} {meta.height}x{meta.width} frames "
                         f"but the model's geometry says {planned}; the processor config and the spec disagree")
    pixels = out["pixel_values_videos"].numpy().astype(np.float32, copy=False)
    fps = len(indices) / meta.frames * meta.fps
    return VideoInput(pixels=pixels, grid=grid, sampled_fps=fps, second_per_grid=second_per_grid(vs, fps))


def second_per_grid(vs: VideoSpec, sampled_fps: float) -> float:
    """Seconds per temporal patch of a clip sampled at `sampled_fps`: the processor's fixed figure
    (Omni), else temporal patch / sampled fps (Qwen2.5-VL's processor: 24 fps when unknown)."""
    return vs.grid_seconds or vs.temporal_patch / (sampled_fps or 24.0)
