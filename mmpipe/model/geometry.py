"""Per-sample token geometry: how many encoder positions and LLM tokens a sample becomes.

Computed from metadata alone (text tokens, image sizes, clip durations, a video's frame count,
frame rate and size from its container header; no media decoded) and the model's architecture
figures. The planner costs samples with these rules and the data layer resizes images, cuts
clips, picks video frames and expands placeholders by the same rules, so the token counts the
planner predicts are the tokens the model really sees.

Video (`VideoSpec`): the frames sampled (`video_frame_indices`, Qwen2-VL's video processor's
`sample_frames` exactly), their size (`video_frame_size`: the image rule of the model, or
`smart_resize` within the video's own pixel bounds), temporal patches of `temporal_patch`
frames (an odd count padded by repeating the last frame), then, per temporal patch, the
frame's patch grid: a video of t temporal patches on a gh x gw grid has t * gh * gw encoder
positions in t attention segments of gh * gw (one per temporal patch, as Qwen2-VL's vision
cu_seqlens cut them) and t * gh * gw / merge**2 LLM tokens. LLaVA-OneVision samples frames by
transformers' default rule (`indices: uniform`), runs each frame through the tower as an image
tile (temporal patch 1), pools each frame's features 2x2 and ends a video with one newline token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmpipe.model.spec import AudioSpec, ModelSpec, VideoSpec, VisionSpec


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What a video container's header says of a clip (no frame decoded): the figures a video
    processor's `VideoMetadata` holds, plus its audio track."""

    frames: int
    """Frames the video stream declares (transformers' total_num_frames)."""
    fps: float
    """Its average frame rate (transformers' VideoMetadata.fps)."""
    height: int
    """Frame height in pixels."""
    width: int
    """Frame width in pixels."""
    audio_seconds: float = 0.0
    """Duration of the first audio track (0: no audio track)."""
    audio_rate: int = 0
    """Sample rate of that track (0: no audio track)."""

    @property
    def seconds(self) -> float:
        """The clip's duration as a video processor computes it: frames / fps."""
        return self.frames / self.fps

    @property
    def has_audio(self) -> bool:
        return self.audio_rate > 0


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """What a trace line (or a shard's metadata) says of one sample."""

    text_tokens: int
    """Tokens of the templated conversation, placeholders not counted."""
    images: tuple[tuple[int, int], ...] = ()
    """(height, width) in pixels of each image (video frames count as images)."""
    audio_seconds: tuple[float, ...] = ()
    """Duration of each audio clip."""
    videos: tuple[VideoMeta, ...] = ()
    """Each video clip's header figures."""


@dataclass(frozen=True, slots=True)
class SampleFeatures:
    """A sample as the model sees it: encoder sequence lengths and LLM length."""

    image_positions: tuple[int, ...]
    """Vision-encoder sequence length of each tower pass: one per image, or one per tile of an
    any-resolution (`anyres`) image, each tile a pass of its own."""
    image_tokens: tuple[int, ...]
    """LLM tokens each image becomes."""
    audio_positions: tuple[int, ...]
    """Audio-encoder sequence length of each clip."""
    audio_tokens: tuple[int, ...]
    """LLM tokens each clip becomes."""
    text_tokens: int
    """Text tokens of the conversation."""
    video_segments: tuple[tuple[int, int], ...] = ()
    """Each video's vision-encoder attention segments: (count, positions each), one segment per
    temporal patch."""
    video_tokens: tuple[int, ...] = ()
    """LLM tokens each video becomes."""

    @property
    def video_positions(self) -> tuple[int, ...]:
        """Vision-encoder positions of each video (all its temporal patches)."""
        return tuple(n * length for n, length in self.video_segments)
    image_windows: tuple[int, ...] = ()
    """Vision-encoder positions of every attention window of the windowed blocks, over all
    images and then every temporal patch of every video (Qwen2.5-VL's window attention); empty
    when the tower has no windowed blocks."""
    audio_chunks: tuple[int, ...] = ()
    """Audio-encoder positions of every attention chunk, over all clips (Qwen2.5-Omni's
    `n_window` chunks); empty when each clip attends as a whole. With Qwen2.5-Omni's
    use_audio_in_video the clips (here and in audio_positions / audio_tokens) are the sample's
    own, then the audio tracks of its videos; the tracks' <audio_bos> / <audio_eos> are text."""

    @property
    def llm_len(self) -> int:
        return self.text_tokens + sum(self.image_tokens) + sum(self.audio_tokens) + sum(self.video_tokens)

    @property
    def modality(self) -> str:
        """`text`, or the media present joined by `+` in the order image, audio, video."""
        return modality_name(bool(self.image_tokens), bool(self.audio_tokens), bool(self.video_tokens))


def modality_name(image: bool, audio: bool, video: bool) -> str:
    """`image`, `audio`, `video`, `image+audio`, ... or `text` (one spelling everywhere)."""
    return "+".join(k for k, on in (("image", image), ("audio", audio), ("video", video)) if on) or "text"


def resize_image(v: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """The (height, width) an image is resized to before patching."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    if v.resize in ("fixed", "anyres", "tiles"):  # anyres, tiles: every tile is image_size square
        return v.image_size, v.image_size
    if v.resize == "smart":
        return smart_resize(height, width, factor=v.patch * v.merge, min_pixels=v.min_pixels,
                            max_pixels=v.max_pixels)
    f = v.patch * v.merge
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > v.max_pixels:
        beta = math.sqrt(height * width / v.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < v.min_pixels:
        beta = math.sqrt(v.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule, as transformers' image processor applies it (a test holds the two
    equal; written here because the planner must not import torch or transformers)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {height}x{width} has an aspect ratio over 200, which Qwen2-VL's "
                         f"image processor refuses")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(v: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """Patch grid (rows, cols) of an image after resizing."""
    h, w = resize_image(v, height, width)
    return h // v.patch, w // v.patch


def image_positions(v: VisionSpec, height: int, width: int) -> int:
    gh, gw = image_grid(v, height, width)
    return gh * gw + (1 if v.cls_token else 0)


def image_tokens(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> int:
    """LLM tokens of an image; `alone`: the only image of its sample (OneVision tiles only those)."""
    if v.resize == "anyres":
        return anyres_image(v, height, width, alone=alone).tokens
    if v.resize == "tiles":
        side = v.image_size // v.patch // v.merge
        return image_tiles(v, height, width) * side * side
    if v.select == "default":  # LLaVA drops encoder position 0 (the class token, if there is one)
        return image_positions(v, height, width) - 1
    if v.select == "full":
        return image_positions(v, height, width)
    gh, gw = image_grid(v, height, width)
    return (gh * gw) // (v.merge * v.merge)


def image_passes(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> int:
    """Tower passes of an image (of image_positions each): its tiles for `anyres` and `tiles`, else 1."""
    if v.resize == "tiles":
        return image_tiles(v, height, width)
    return anyres_image(v, height, width, alone=alone).tiles if v.resize == "anyres" else 1


def sample_image_tokens(v: VisionSpec, images: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """LLM tokens of each image of one sample (whether an image is alone matters to OneVision)."""
    return tuple(image_tokens(v, h, w, alone=len(images) == 1) for h, w in images)


def sample_image_positions(v: VisionSpec, images: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Encoder positions of each tower pass of one sample's images, in order."""
    alone = len(images) == 1
    return tuple(image_positions(v, h, w) for h, w in images for _ in range(image_passes(v, h, w, alone=alone)))


# ----------------------------------------------------------------------------- any-resolution tiles
# LLaVA-NeXT and LLaVA-OneVision, as transformers 5's processors count placeholders and its models
# pack features (LlavaNextProcessor._get_number_of_features, LlavaNextModel.pack_image_features,
# select_best_resolution, unpad_image, and OneVision's anyres_max downsampling). Written here
# rather than called because the planner imports neither torch nor transformers;
# tests/unit/model/test_hf_geometry.py holds these rules equal to transformers' own over many sizes.


@dataclass(frozen=True, slots=True)
class AnyresImage:
    """How an any-resolution image is encoded."""

    tiles: int
    """Tower passes: the whole image resized to one tile, then rows x cols grid tiles; 1 for a
    OneVision image that shares its sample (padded to a square, no grid)."""
    rows: int
    """Grid tiles down (0 without a grid)."""
    cols: int
    """Grid tiles across (0 without a grid)."""
    tokens: int
    """LLM tokens: the whole image's features, then the grid's unpadded (and, for OneVision,
    downsampled) feature rows, each followed by the image_newline embedding; without a grid,
    the whole image's features and one image_newline."""


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' `select_best_resolution`: of the (height, width) pinpoints, the one that keeps
    the most of the image's pixels when the image is scaled to fit in it, then the least padding."""
    best, most, least = pinpoints[0], 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    return best


def anyres_image(v: VisionSpec, height: int, width: int, *, alone: bool = True) -> AnyresImage:
    """Tiles and LLM tokens of a `height` x `width` image under an `anyres` tower.

    `alone`: the image is its sample's only one (with `anyres_single`, only such an image is tiled).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    side = v.image_size // v.patch  # features per tile side (one per patch)
    base = side * side
    if v.anyres_single and not alone:
        return AnyresImage(tiles=1, rows=0, cols=0, tokens=base + 1)
    best_h, best_w = best_resolution(height, width, v.grid_pinpoints)
    rows, cols = best_h // v.image_size, best_w // v.image_size
    fh, fw = rows * side, cols * side  # the grid's feature map, then cut back to the image's aspect
    if width / height > fw / fh:
        pad = (fh - int(round(height * (fw / width), 7))) // 2
        fh -= 2 * pad
    else:
        pad = (fw - int(round(width * (fh / height), 7))) // 2
        fw -= 2 * pad
    if v.anyres_max:
        ratio = math.sqrt(fh * fw / (v.anyres_max * side * side))
        if ratio > 1.1:
            fh, fw = int(fh // ratio), int(fw // ratio)
            if not fh or not fw:
                raise ValueError(f"an image of {height}x{width} shrinks to a {fh}x{fw} feature map, which the "
                                 f"model cannot interpolate to")
    return AnyresImage(tiles=1 + rows * cols, rows=rows, cols=cols, tokens=base + fh * (fw + 1))


# ----------------------------------------------------------------------------- dynamic tiles
# InternVL, as transformers 5's GotOcr2ImageProcessor cuts an image with crop_to_patches (what
# InternVLProcessor asks of it): get_all_supported_aspect_ratios, get_optimal_tiled_canvas and
# get_number_of_image_patches, written here because the planner imports no transformers;
# tests/unit/model/test_hf_geometry.py holds them equal over many sizes.


def tile_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """The (cols, rows) grids of min_tiles..max_tiles tiles, by tile count (stable: columns, then rows)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def tile_grid(v: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """(cols, rows) of the grid an image is cut into: the aspect closest to the image's; on a tie
    the later (larger) grid while the image's area exceeds half the grid's."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    aspect, area, tile = width / height, width * height, v.image_size * v.image_size
    best, best_diff = (1, 1), math.inf
    for cols, rows in tile_grids(v.min_tiles, v.max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * cols * rows:
            best = (cols, rows)
    return best


def image_tiles(v: VisionSpec, height: int, width: int) -> int:
    """Tower passes of an image under a `tiles` tower: its grid's tiles, plus the thumbnail when
    the grid has more than one (one tile when max_tiles is 1)."""
    if v.max_tiles <= 1:
        return 1
    cols, rows = tile_grid(v, height, width)
    return 1 if cols * rows == 1 else cols * rows + 1


def audio_samples(a: AudioSpec, seconds: float) -> int:
    """Waveform samples of a clip at the model's rate, cut at max_seconds."""
    if not seconds > 0:
        raise ValueError(f"audio duration {seconds} s must be positive")
    return max(1, min(round(seconds * a.sample_rate), round(a.max_seconds * a.sample_rate)))


def audio_frames(a: AudioSpec, seconds: float) -> int:
    """Mel frames of a clip (cut at max_seconds): one per started hop of samples, as Whisper's
    feature extractor marks them valid. Integer arithmetic, so 0.1 s is 10 frames, not 11."""
    return -(-audio_samples(a, seconds) * a.frames_per_s // a.sample_rate)


def audio_positions(a: AudioSpec, seconds: float) -> int:
    return -(-audio_frames(a, seconds) // a.conv_stride)


def audio_tokens(a: AudioSpec, seconds: float) -> int:
    positions = audio_positions(a, seconds)
    return -(-positions // a.pool) if a.pool_ceil else positions // a.pool


# ---------------------------------------------------------------------------- video


def video_frame_indices(vs: VideoSpec, frames: int, fps: float) -> tuple[int, ...]:
    """The frames of a clip (declaring `frames` at `fps`) that the encoder takes, in order.

    Qwen2-VL's video processor's `sample_frames` exactly (transformers 5.24): `all` takes every
    frame; `count` takes round(frames / T) * T; `fps` takes frames / native fps * fps, clamped to
    [min_frames, the largest multiple of T <= min(max_frames, frames)] and rounded down to a
    multiple of T; the indices are `torch.arange(0, total, total / n).int()` (float32 values,
    truncated), computed here without torch (a test holds them equal). ValueError when no frame
    can be taken (a clip too short for one temporal patch) or more are asked than the clip has.
    """
    if frames < 1:
        raise ValueError(f"a clip of {frames} frames has nothing to sample")
    t = vs.temporal_patch
    if vs.sample == "all":
        return tuple(range(frames))
    if vs.indices == "uniform":
        return _uniform_indices(vs, frames, fps)
    if vs.sample == "count":
        n: float = round(vs.frames / t) * t
    else:
        if not fps > 0:
            raise ValueError(f"a clip at {fps} fps cannot be sampled at {vs.fps} fps (its frame rate is unknown)")
        top = math.floor(min(vs.max_frames, frames) / t) * t
        n = min(max(frames / fps * vs.fps, vs.min_frames), top, frames)
        n = math.floor(n / t) * t
    if n > frames:
        raise ValueError(f"{int(n)} frames cannot be sampled from a clip of {frames}")
    if n < 1:
        raise ValueError(f"a clip of {frames} frames is too short for one temporal patch of {t} frames")
    step = frames / n
    count = math.ceil(frames / step)  # torch.arange's length, in double precision
    return tuple(int(x) for x in (np.arange(count, dtype=np.float64) * step).astype(np.float32))


def _uniform_indices(vs: VideoSpec, frames: int, fps: float) -> tuple[int, ...]:
    """transformers' default_sample_indices_fn (BaseVideoProcessor.sample_frames, which
    LLaVA-OneVision's video processor keeps): `count` takes `frames` frames, `fps` takes
    max(1, int(frames / native fps * fps)) (the same float operations), at indices
    arange(n) * frames // n; more frames than the clip has is an error there too."""
    if vs.sample == "count":
        n = vs.frames
    else:
        if not fps > 0:
            raise ValueError(f"a clip at {fps} fps cannot be sampled at {vs.fps} fps (its frame rate is unknown)")
        n = max(1, int(frames / fps * vs.fps))
    if n > frames:
        raise ValueError(f"{n} frames cannot be sampled from a clip of {frames}")
    return tuple(i * frames // n for i in range(n))


def video_frame_size(v: VisionSpec, height: int, width: int, sampled: int) -> tuple[int, int]:
    """The (height, width) each of `sampled` frames is resized to: the image rule of the model,
    or for a `smart` resize Qwen2-VL's video resize (smart_resize within the video's own pixel
    bounds, the per-frame cap of cap_pixels_per_frame applied first)."""
    vs = _video_spec(v)
    if v.resize != "smart":
        return resize_image(v, height, width)
    lo, hi = vs.min_pixels or v.min_pixels, vs.max_pixels or v.max_pixels
    factor = v.patch * v.merge
    if vs.cap_pixels:
        budget = int(vs.max_tokens * factor * factor * 0.9)
        hi = max(min(hi, budget * vs.temporal_patch // sampled), int(lo * 1.05))
    return smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=hi)


def video_grid(v: VisionSpec, meta: VideoMeta) -> tuple[int, int, int]:
    """(temporal patches, rows, cols) of a clip: the video processor's video_grid_thw."""
    vs = _video_spec(v)
    n = len(video_frame_indices(vs, meta.frames, meta.fps))
    h, w = video_frame_size(v, meta.height, meta.width, n)
    return -(-n // vs.temporal_patch), h // v.patch, w // v.patch


def video_segments(v: VisionSpec, meta: VideoMeta) -> tuple[int, int]:
    """(segments, positions each): one vision attention segment per temporal patch (a tower pass
    per frame for LLaVA-OneVision, with the class token of a CLIP tower)."""
    t, gh, gw = video_grid(v, meta)
    return t, gh * gw + (1 if v.cls_token else 0)


def video_tokens(v: VisionSpec, meta: VideoMeta) -> int:
    """LLM tokens of a clip: per temporal patch its merged patches, or with `pool` (OneVision)
    its features pooled to ceil(rows / pool) x ceil(cols / pool); plus a `newline` per clip."""
    vs = _video_spec(v)
    t, gh, gw = video_grid(v, meta)
    if vs.pool:
        per = -(-gh // vs.pool) * -(-gw // vs.pool)
    else:
        per = (gh // v.merge) * (gw // v.merge)
    return t * per + int(vs.newline)


def _video_spec(v: VisionSpec) -> VideoSpec:
    if v.video is None:
        raise ValueError("the vision encoder takes no video (model.vision.video is not set)")
    return v.video


# ----------------------------------------------------------------------------- windowed attention
# Qwen2.5-VL's vision tower attends within windows in most blocks, and Qwen2.5-Omni's audio tower
# within chunks of a clip in every block. The planner prices those blocks' attention over these
# segments (sum of squared lengths), and the layers attend over the same segments.


def _pieces(n: int, size: int) -> list[int]:
    """n cut into consecutive pieces of `size`, the last one shorter."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def image_windows(v: VisionSpec, height: int, width: int) -> tuple[int, ...]:
    """Patches of each attention window of an image's windowed blocks, row by row of windows
    (transformers' `get_vision_window_index`: windows of window // merge // patch merged tokens a
    side, the last row and column of windows shorter); () when the tower has no windowed blocks."""
    return _grid_windows(v, *image_grid(v, height, width))


def video_windows(v: VisionSpec, meta: VideoMeta) -> tuple[int, ...]:
    """The windows of a clip's windowed blocks: each temporal patch (frame pair) is cut into
    windows on its own, as `get_vision_window_index` cuts every temporal patch of a grid."""
    if not v.window:
        return ()
    t, gh, gw = video_grid(v, meta)
    return _grid_windows(v, gh, gw) * t


def _grid_windows(v: VisionSpec, gh: int, gw: int) -> tuple[int, ...]:
    if not v.window:
        return ()
    side = v.window // v.merge // v.patch * v.merge  # in patches: whole merge units
    return tuple(r * c for r in _pieces(gh, side) for c in _pieces(gw, side))


def chunk_positions(frames: int, *, window: int, conv_stride: int) -> list[int]:
    """Encoder positions of each attention chunk of a clip of `frames` valid mel frames:
    chunks of window * conv_stride frames (the last shorter), each convolved on its own, so a
    chunk of c frames has ceil(c / conv_stride) positions (transformers' Qwen2.5-Omni
    `chunk_and_pad_features` / `get_audio_cu_seqlens`); one chunk, the whole clip, for window 0."""
    if not window:
        return [-(-frames // conv_stride)]
    return [-(-c // conv_stride) for c in _pieces(frames, window * conv_stride)]


def audio_chunks(a: AudioSpec, seconds: float) -> tuple[int, ...]:
    """Encoder positions of each attention chunk of a clip; () when a clip attends as a whole."""
    if not a.window:
        return ()
    return tuple(chunk_positions(audio_frames(a, seconds), window=a.window, conv_stride=a.conv_stride))


# ----------------------------------------------------------------------------- a video's audio track
# Qwen2.5-Omni with use_audio_in_video: a clip's audio track is a clip of the audio tower, and its
# processor replaces the clip's video placeholder with <audio_bos>, the video tokens and the track's
# audio tokens interleaved chunk by chunk, <audio_eos> (Qwen2_5OmniProcessor.replace_video_with_audio_token,
# written here because the planner imports no transformers; tests/unit/model/test_video_geometry.py
# holds the two equal). A clip without an audio track keeps its plain video tokens.

TRACK_MARKERS = 2
"""Text tokens an interleaved clip adds to its sample (its <audio_bos> and <audio_eos>)."""


def video_track(v: VisionSpec | None, meta: VideoMeta) -> float:
    """Seconds of a clip's audio track that the model encodes (0: none; only with audio_in_video)."""
    return meta.audio_seconds if v is not None and v.video is not None and v.video.audio_in_video \
        and meta.has_audio else 0.0


def _chunks(values: list[float], per_chunk: int) -> list[int]:
    """Run lengths of the processor's `get_chunked_index`: a run ends at the first value that
    reaches the next multiple of `per_chunk` (one multiple per value, as it counts)."""
    out, start, chunk = [], 0, 1
    for i, x in enumerate(values):
        if x >= chunk * per_chunk:
            out.append(i - start)
            start, chunk = i, chunk + 1
    out.append(len(values) - start)
    return out


def interleaved_runs(spec: ModelSpec, meta: VideoMeta) -> tuple[tuple[str, int], ...]:
    """The runs of `video` and `audio` tokens between an interleaved clip's <audio_bos> and
    <audio_eos>: chunk j's video tokens, then chunk j's audio tokens, for every chunk."""
    v, a = spec.vision, spec.audio
    vs = _video_spec(v)
    t, gh, gw = video_grid(v, meta)
    per = (gh // v.merge) * (gw // v.merge)
    per_chunk = int(vs.positions_per_second * vs.chunk_seconds)
    frames = [k * vs.grid_seconds * vs.positions_per_second for k in range(t) for _ in range(per)]
    video = _chunks(frames, per_chunk)
    audio = _chunks(list(range(audio_tokens(a, meta.audio_seconds))), per_chunk)
    runs: list[tuple[str, int]] = []
    for j in range(max(len(video), len(audio))):
        runs += [("video", video[j])] if j < len(video) else []
        runs += [("audio", audio[j])] if j < len(audio) else []
    return tuple(runs)


def features(spec: ModelSpec, meta: SampleMeta, *, where: str = "sample") -> SampleFeatures:
    """Features of one sample under a model; `where` names it in errors (e.g. 'trace line 7')."""
    if meta.images and spec.vision is None:
        raise ValueError(f"{where} has images but model {spec.name} has no vision encoder")
    if meta.audio_seconds and spec.audio is None:
        raise ValueError(f"{where} has audio but model {spec.name} has no audio encoder")
    if meta.videos and (spec.vision is None or spec.vision.video is None):
        raise ValueError(f"{where} has videos but model {spec.name} takes no video")
    v, a = spec.vision, spec.audio
    try:
        vids = [(video_segments(v, m), video_tokens(v, m), video_windows(v, m)) for m in meta.videos]
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    tracks = tuple(s for s in (video_track(v, m) for m in meta.videos) if s)  # audio tower clips too
    markers = v.image_markers * len(meta.images) if v else 0  # InternVL's <img> / </img>: text
    clips = meta.audio_seconds + tracks
    return SampleFeatures(
        image_positions=sample_image_positions(v, meta.images) if v else (),
        image_tokens=sample_image_tokens(v, meta.images) if v else (),
        audio_positions=tuple(audio_positions(a, s) for s in clips) if a else (),
        audio_tokens=tuple(audio_tokens(a, s) for s in clips) if a else (),
        text_tokens=meta.text_tokens + TRACK_MARKERS * len(tracks) + markers,
        video_segments=tuple(seg for seg, _, _ in vids),
        video_tokens=tuple(tok for _, tok, _ in vids),
        image_windows=(tuple(n for h, w in meta.images for n in image_windows(v, h, w))
                       + tuple(n for _, _, win in vids for n in win)) if v else (),
        audio_chunks=tuple(n for s in clips for n in audio_chunks(a, s)) if a else (),
    )


def meta_from_json(obj: Any, *, where: str) -> SampleMeta:
    """Parse one trace object; errors name `where` (e.g. 'trace.jsonl line 12')."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        text = obj.get("text_tokens", 0)
        if not isinstance(text, int) or isinstance(text, bool) or text < 0:
            raise ValueError(f"text_tokens={text!r} must be a non-negative integer")
        images = []
        for img in obj.get("images") or []:
            if (not isinstance(img, (list, tuple)) or len(img) != 2
                    or not all(isinstance(x, (int, float)) and x > 0 for x in img)):
                raise ValueError(f"image {img!r} must be [height, width] with positive sides")
            images.append((int(img[0]), int(img[1])))
        clips = []
        for sec in obj.get("audio_seconds") or []:
            if not isinstance(sec, (int, float)) or isinstance(sec, bool) or not sec > 0:
                raise ValueError(f"audio_seconds entry {sec!r} must be a positive number")
            clips.append(float(sec))
        videos = [video_meta_from_json(v) for v in obj.get("videos") or []]
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return SampleMeta(text_tokens=text, images=tuple(images), audio_seconds=tuple(clips), videos=tuple(videos))


def video_meta_from_json(obj: Any) -> VideoMeta:
    """A clip's entry of a trace line's (or a shard's meta's) `videos` list:
    `{"frames": 48, "fps": 24.0, "height": 360, "width": 640}` plus optionally `"seconds"`
    (informative: frames / fps) and `"audio": {"seconds": 2.0, "rate": 16000}` (or null)."""
    if not isinstance(obj, dict):
        raise ValueError(f"video {obj!r:.80} must be an object with frames, fps, height and width")
    frames, fps, h, w = (obj.get(k) for k in ("frames", "fps", "height", "width"))
    if not all(_whole(x) and x > 0 for x in (frames, h, w)):
        raise ValueError(f"video {obj!r:.80} needs positive integer frames, height and width")
    if not _number(fps) or not 0 < fps < float("inf"):
        raise ValueError(f"video {obj!r:.80} needs a positive frame rate fps")
    audio = obj.get("audio")
    a_sec, a_rate = 0.0, 0
    if audio is not None:
        if not isinstance(audio, dict) or not _number(audio.get("seconds")) or not audio["seconds"] > 0 \
                or not _whole(audio.get("rate")) or not audio["rate"] > 0:
            raise ValueError(f"video audio {audio!r:.80} must be {{'seconds': > 0, 'rate': Hz}} or null")
        a_sec, a_rate = float(audio["seconds"]), int(audio["rate"])
    return VideoMeta(frames=int(frames), fps=float(fps), height=int(h), width=int(w), audio_seconds=a_sec,
                     audio_rate=a_rate)


def video_meta_json(m: VideoMeta) -> dict[str, Any]:
    """A clip's `videos` entry as shards and traces store it (video_meta_from_json reads it)."""
    audio = {"seconds": round(m.audio_seconds, 6), "rate": m.audio_rate} if m.has_audio else None
    return {"frames": m.frames, "fps": m.fps, "seconds": round(m.seconds, 6), "height": m.height, "width": m.width,
            "audio": audio}


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
