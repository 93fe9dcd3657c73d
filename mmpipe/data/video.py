"""Video clips: the container header read with PyAV (no frame decoded), and the planned frames
decoded.

PyAV (`av`, FFmpeg in its wheel) opens the container. What the planner needs comes from the
header alone (`probe_video`): the video stream's declared frame count and average frame rate
(the figures transformers' `read_video_pyav` puts in a video processor's `VideoMetadata`), the
frame size, and the first audio track's duration and rate. The limits are checked there, before
any frame is decoded (`media too large` for a clip declaring more than data.max_video_frames
frames or data.max_video_seconds seconds, or frames over data.max_image_pixels).

`decode_frames` decodes only up to the last frame the model's frame rule picks
(`mmpipe.model.geometry.video_frame_indices`) and converts only the picked frames to RGB:
sequentially from the start, as `read_video_pyav` does, not by seeking, because a frame index
maps to a timestamp only for constant-rate streams and a decoder restarted at a keyframe is
the one thing that could make our frames differ from transformers' (a test holds them equal).
A clip whose data ends before the planned frames, or whose frames are not the declared size,
is refused: the frames the model gets are always the planned ones. No call decodes more than
max(planned index) + 1 frames of at most data.max_member_mb of data, so none can hang.

`decode_video` is mmpipe's tiny model's frame path (a Hugging Face model's frames go through its
own video processor instead, `mmpipe.data.hf_media.hf_video`): the picked frames, each resized by
the model's image rule (PIL bicubic, as images), an odd count padded to whole temporal patches by
repeating the last frame (Qwen2-VL's processor does the same).

`decode_audio_track` decodes a clip's first audio track whole (Qwen2.5-Omni's use_audio_in_video).

Every error of the container or the decoder becomes a `SampleError` (`undecodable video`,
`media too large`), never an exception of PyAV's own.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from PIL import Image

from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits, say
from mmpipe.data.skips import MEDIA_TOO_LARGE, UNDECODABLE_VIDEO, SampleError
from mmpipe.model.geometry import VideoMeta, video_frame_indices, video_frame_size
from mmpipe.model.spec import VisionSpec

VIDEO_EXTS = ("mp4", "mov", "mkv", "webm", "avi")
"""Video member suffixes the reader takes (containers FFmpeg reads; the format is found from the
bytes, the suffix only says the member is a video)."""


def _open(data: bytes):
    import av

    return av.open(io.BytesIO(data), mode="r")


def probe_video(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> VideoMeta:
    """A clip's header figures (no frame decoded), checked against the limits.

    Raises:
        SampleError: `undecodable video` (not a container PyAV reads, no video stream, no
            frames, no frame rate, no size), `media too large` (over the limits).
    """
    return probe_container(data, limits)[0]


def probe_container(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[VideoMeta, str]:
    """probe_video, and FFmpeg's name of the container format (e.g. `mov,mp4,m4a,3gp,3g2,mj2`)."""
    limits.check_bytes(data, "video")
    try:
        with _open(data) as container:
            return _header(container, limits), str(container.format.name)
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever FFmpeg / PyAV raise on hostile bytes
        raise SampleError(UNDECODABLE_VIDEO, f"{len(data)} bytes are not a readable video ({say(err)})") from None


def _header(container, limits: MediaLimits) -> VideoMeta:
    if not container.streams.video:
        kinds = ", ".join(s.type for s in container.streams) or "none"
        raise SampleError(UNDECODABLE_VIDEO, f"the {container.format.name} container has no video stream "
                                             f"(streams: {kinds})")
    s = container.streams.video[0]
    rate = s.average_rate or s.guessed_rate
    if not rate or not rate > 0:
        raise SampleError(UNDECODABLE_VIDEO, "the video stream declares no frame rate")
    fps = float(rate)
    frames = int(s.frames or 0)
    if frames <= 0 and "matroska" in container.format.name.split(","):
        seconds = _duration(s, container)  # Matroska / WebM record no frame count: duration x rate
        frames = round(seconds * fps) if seconds > 0 else 0
    if frames <= 0:
        raise SampleError(UNDECODABLE_VIDEO, "the video stream declares no frames")
    if frames > limits.max_video_frames:
        raise SampleError(MEDIA_TOO_LARGE, f"video of {frames:,} frames > data.max_video_frames="
                                           f"{limits.max_video_frames:,}")
    if frames / fps > limits.max_video_seconds:
        raise SampleError(MEDIA_TOO_LARGE, f"video of {frames / fps:.1f} s ({frames} frames at {fps:g} fps) > "
                                           f"data.max_video_seconds={limits.max_video_seconds:g}")
    h, w = int(s.height or 0), int(s.width or 0)
    if h <= 0 or w <= 0:
        raise SampleError(UNDECODABLE_VIDEO, f"the video stream declares frames of {h}x{w}")
    if h * w > limits.max_image_pixels:
        raise SampleError(MEDIA_TOO_LARGE, f"video frames of {h}x{w} = {h * w:,} pixels > data.max_image_pixels="
                                           f"{limits.max_image_pixels:,}")
    a_sec, a_rate = 0.0, 0
    if container.streams.audio:
        a = container.streams.audio[0]
        a_rate = int(a.rate or 0)
        a_sec = _duration(a, container) if a_rate > 0 else 0.0
        if a_sec <= 0:
            a_sec, a_rate = 0.0, 0  # a track of no known length is not one the planner can use
    return VideoMeta(frames=frames, fps=fps, height=h, width=w, audio_seconds=a_sec, audio_rate=a_rate)


def _duration(stream, container) -> float:
    """A stream's duration in seconds from the header (its own, else the container's)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * Fraction(stream.time_base))
    return container.duration / 1e6 if container.duration and container.duration > 0 else 0.0


def decode_frames(data: bytes, indices: tuple[int, ...], meta: VideoMeta,
                  limits: MediaLimits = DEFAULT_LIMITS) -> np.ndarray:
    """The frames `indices` (ascending, from video_frame_indices) as uint8 [n, H, W, 3] RGB,
    decoding no frame after the last of them.

    Raises:
        SampleError: `undecodable video` (a decoder error, data that ends before the last
            planned frame, a frame not of the declared size), `media too large`.
    """
    limits.check_bytes(data, "video")
    if not indices:
        raise SampleError(UNDECODABLE_VIDEO, "no frame was planned")
    from av.video.reformatter import VideoReformatter

    wanted = set(indices)
    last = max(indices)
    out: dict[int, np.ndarray] = {}
    reformat = VideoReformatter()  # one converter per clip: identical pixels, far cheaper than one per frame
    seen = 0
    try:
        with _open(data) as container:
            if not container.streams.video:
                raise SampleError(UNDECODABLE_VIDEO, "the container has no video stream")
            stream = container.streams.video[0]
            stream.thread_count = 1  # a loader process owns its share of the cores already
            for i, frame in enumerate(container.decode(stream)):
                seen = i + 1
                if (frame.height, frame.width) != (meta.height, meta.width):
                    raise SampleError(UNDECODABLE_VIDEO, f"frame {i} is {frame.height}x{frame.width}; the header "
                                                         f"declares {meta.height}x{meta.width}")
                if i in wanted:
                    out[i] = reformat.reformat(frame, format="rgb24").to_ndarray()
                if i >= last:
                    break
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001
        raise SampleError(UNDECODABLE_VIDEO, f"decoding failed after {seen} of {meta.frames} frames ({say(err)})"
                          ) from None
    if last not in out:
        raise SampleError(UNDECODABLE_VIDEO, f"the header declares {meta.frames} frames but the data ends after "
                                             f"{seen}; frame {last} was planned")
    return np.stack([out[i] for i in indices])


def decode_audio_track(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[np.ndarray, int]:
    """The first audio track of a container, whole, as a mono float32 waveform (the channels
    averaged) and its sample rate; what Qwen2.5-Omni's use_audio_in_video encodes. The caller
    resamples it and cuts it to the track's header duration, as a clip's wav is cut: decoders
    emit whole codec frames, so an AAC track decodes to its last frame's end (up to 1023 samples
    of encoder padding past the duration its header declares).

    Raises:
        SampleError: `undecodable video` (no audio track, a decoder error, no samples).
    """
    limits.check_bytes(data, "video")
    import av

    chunks: list[np.ndarray] = []
    rate = 0
    try:
        with _open(data) as container:
            if not container.streams.audio:
                raise SampleError(UNDECODABLE_VIDEO, "the container has no audio track")
            stream = container.streams.audio[0]
            stream.thread_count = 1
            planar = av.AudioResampler(format="fltp")  # float planes, the track's own layout and rate
            for frame in container.decode(stream):
                for out in planar.resample(frame):
                    chunks.append(out.to_ndarray().mean(axis=0))
                    rate = out.sample_rate
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever FFmpeg / PyAV raise on hostile bytes
        raise SampleError(UNDECODABLE_VIDEO, f"decoding its audio track failed ({say(err)})") from None
    if not chunks or rate <= 0:
        raise SampleError(UNDECODABLE_VIDEO, "its audio track holds no samples")
    return np.concatenate(chunks).astype(np.float32, copy=False), rate


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedVideo:
    """A clip ready for mmpipe's tiny vision encoder."""

    frames: np.ndarray
    """uint8 [n, H, W, 3]: the picked frames resized by the model's rule, n a multiple of the
    temporal patch (the last frame repeated)."""
    meta: VideoMeta
    """The header figures the frames were planned from."""


def decode_video(data: bytes, v: VisionSpec, meta: VideoMeta, limits: MediaLimits = DEFAULT_LIMITS) -> DecodedVideo:
    """A clip's frames for mmpipe's tiny model (see the module docstring).

    Raises:
        SampleError: `undecodable video`, `media too large`.
    """
    if v.video is None:
        raise SampleError(UNDECODABLE_VIDEO, "the model takes no video (model.vision.video is not set)")
    try:
        indices = video_frame_indices(v.video, meta.frames, meta.fps)
        h, w = video_frame_size(v, meta.height, meta.width, len(indices))
    except ValueError as err:
        raise SampleError(UNDECODABLE_VIDEO, f"the model's video rule refuses it ({err})") from None
    frames = decode_frames(data, indices, meta, limits)
    if (h, w) != frames.shape[1:3]:
        frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in frames])
    pad = -len(frames) % v.video.temporal_patch
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    return DecodedVideo(frames=np.ascontiguousarray(frames, dtype=np.uint8), meta=meta)
