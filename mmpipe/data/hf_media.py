"""Media for a Hugging Face model (`spec.hf` set): read and checked exactly as mmpipe.data.media
and mmpipe.data.video read them (sizes against the limits from the headers first; whatever a
decoder raises becomes a counted SampleError), then made into what the checkpoint's own
processors make of them (`mmpipe.model.hf.media`: its image processor, its Whisper feature
extractor; `mmpipe.model.hf.video`: its video processor, given the frames the geometry picks,
decoded with PyAV as transformers' own reader decodes them), so the model is given what
transformers would give it.

A clip is decoded whole and resampled whole, then cut at the model's max_seconds, as a clip
loaded at the model's rate (librosa.load, soundfile + a resampler) and cut by the feature
extractor is: a cut before resampling would change the last samples before the cut. Its
waveform is then cut or zero-padded to the samples its header duration gives (resampling may add
or drop one), so its valid frames, and hence its LLM tokens, are the ones the planner counted;
an image's patch grid (tiles) is checked against the geometry by `preprocess_images` itself.
With Qwen2.5-Omni's use_audio_in_video a clip's audio track is read the same way (decoded whole
with PyAV, resampled whole, cut or padded to the duration its header declares) and rides in the
clip's VideoInput.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits, decode_waveform, open_image, resample, say
from mmpipe.data.skips import UNDECODABLE_AUDIO, UNDECODABLE_IMAGE, UNDECODABLE_VIDEO, SampleError
from mmpipe.data.video import decode_audio_track, decode_frames
from mmpipe.model.geometry import SampleMeta, VideoMeta, audio_frames, audio_samples, video_frame_indices, video_track
from mmpipe.model.spec import ModelSpec


def hf_images(datas: list[bytes], spec: ModelSpec, limits: MediaLimits = DEFAULT_LIMITS) -> list:
    """A sample's images as the checkpoint's image processor makes them (ImageInputs), all in one
    call, as the model's processor makes one conversation's (OneVision tiles a lone image only).

    Raises:
        SampleError: `undecodable image` (also when the processor refuses one), `media too large`.
    """
    from mmpipe.model.hf.media import preprocess_images

    rgbs = []
    for data in datas:
        img = open_image(data, limits)
        try:
            with img:
                img.load()
                rgbs.append(img.convert("RGB"))
        except Exception as err:  # noqa: BLE001 - any decoder failure is this sample's problem
            raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({say(err)})") from None
    try:
        return preprocess_images(spec, rgbs)
    except ValueError as err:
        raise SampleError(UNDECODABLE_IMAGE, f"the model's image processor refuses it ({say(err)})") from None


def hf_audio(data: bytes, spec: ModelSpec, ext: str = "wav", limits: MediaLimits = DEFAULT_LIMITS,
             seconds: float | None = None):
    """A clip's log-mel features as the checkpoint's feature extractor makes them (an AudioInput)
    of its first model.audio.max_seconds (the whole clip is decoded and resampled; see above).

    Raises:
        SampleError: `undecodable audio` (also a clip whose decoded length is not the planned
            one), `media too large`.
    """
    from mmpipe.model.hf.media import preprocess_audio

    a = spec.audio
    x, head = decode_waveform(data, a, ext, limits, seconds=seconds)
    n = audio_samples(a, head.seconds)
    x = x[:n] if len(x) >= n else np.pad(x, (0, n - len(x)))
    return preprocess_audio(spec, x, a.sample_rate)


def hf_video(data: bytes, spec: ModelSpec, meta: VideoMeta, limits: MediaLimits = DEFAULT_LIMITS):
    """A clip's pixel values as the checkpoint's video processor makes them (a VideoInput) from
    the frames the model's geometry picks (only those are decoded).

    Raises:
        SampleError: `undecodable video` (also when the processor refuses it), `media too large`.
    """
    from mmpipe.model.hf.video import preprocess_video

    try:
        indices = video_frame_indices(spec.vision.video, meta.frames, meta.fps)
    except ValueError as err:
        raise SampleError(UNDECODABLE_VIDEO, f"the model's video rule refuses it ({err})") from None
    frames = decode_frames(data, indices, meta, limits)
    try:
        out = preprocess_video(spec, frames, meta, indices)
    except ValueError as err:
        raise SampleError(UNDECODABLE_VIDEO, f"the model's video processor refuses it ({say(err)})") from None
    if video_track(spec.vision, meta):  # Qwen2.5-Omni's use_audio_in_video: the track, as a clip
        x, rate = decode_audio_track(data, limits)
        try:
            x = resample(x, rate, spec.audio.sample_rate)
        except (ValueError, MemoryError, OverflowError) as err:
            raise SampleError(UNDECODABLE_VIDEO, f"its audio track at {rate} Hz cannot be resampled ({say(err)})"
                              ) from None
        out = dataclasses.replace(out, audio=_track(spec, x, meta))
    return out


def _track(spec: ModelSpec, x: np.ndarray, meta: VideoMeta):
    """A track's waveform (at the model's rate) cut or zero-padded to its header duration, through
    the feature extractor, as hf_audio does a clip."""
    from mmpipe.model.hf.media import preprocess_audio

    n = audio_samples(spec.audio, meta.audio_seconds)
    x = x[:n] if len(x) >= n else np.pad(x, (0, n - len(x)))
    return preprocess_audio(spec, x, spec.audio.sample_rate)


def blank_hf_media(meta: SampleMeta, spec: ModelSpec) -> tuple[list, list, list]:
    """Black images, silent clips and black frames of the planned sizes, through the processors
    (what a sample whose media fail to decode behind a valid header trains with; see decode_record)."""
    from mmpipe.model.hf.media import preprocess_audio, preprocess_images
    from mmpipe.model.hf.video import preprocess_video

    images = preprocess_images(spec, [np.zeros((h, w, 3), np.uint8) for h, w in meta.images]) if spec.vision else []
    audio = [preprocess_audio(spec, np.zeros(audio_samples(spec.audio, s), np.float32), spec.audio.sample_rate)
             for s in meta.audio_seconds] if spec.audio else []
    videos = []
    for m in meta.videos:
        indices = video_frame_indices(spec.vision.video, m.frames, m.fps)
        frames = np.zeros((len(indices), m.height, m.width, 3), np.uint8)
        vid = preprocess_video(spec, frames, m, indices)
        if video_track(spec.vision, m):
            vid = dataclasses.replace(vid, audio=_track(spec, np.zeros(0, np.float32), m))
        videos.append(vid)
    return images, audio, videos
