"""Media decoding: image bytes to resized pixels, audio bytes to Whisper log-mel features.

Shapes obey the planner's rules in `mmpipe.model.geometry`, so the encoder sequence lengths
the planner predicts are the ones the model gets:

- an image of h x w pixels becomes uint8 [H, W, 3] with (H, W) = resize_image(vision, h, w)
  (PIL bicubic);
- a clip of s seconds becomes float32 [mel_bins, audio_frames(audio, s)]: the log-mel
  features of transformers' `WhisperFeatureExtractor` (configured with the model's mel bins,
  sample rate and hop, a 25 ms window) over the clip cut at max_seconds and zero-padded to
  whole frames.

Audio is read with `soundfile` (libsndfile: WAV of any sample format, FLAC, OGG) and
resampled with `soxr` (band-limited, so tones above the new Nyquist frequency are filtered out
rather than folded into the band as linear interpolation would).

Everything here treats its input as hostile: sizes are checked against `MediaLimits` from the
headers before any pixel or sample is decoded, and any error a decoder raises becomes a
`SampleError` with a reason (`undecodable image`, `undecodable audio`, `media too large`),
never an exception of the decoder's own.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from mmpipe.data.skips import MEDIA_TOO_LARGE, UNDECODABLE_AUDIO, UNDECODABLE_IMAGE, SampleError
from mmpipe.model.geometry import audio_frames, resize_image
from mmpipe.model.spec import AudioSpec, VisionSpec

WINDOW_S = 0.025
"""STFT window length in seconds (Whisper: 400 samples at 16 kHz)."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
"""What PIL may open as a sample's image: the formats of the member suffixes the reader takes
(fewer decoders exposed to hostile bytes)."""
AUDIO_EXTS = ("wav", "flac", "ogg")
"""Audio member suffixes the reader takes (libsndfile reads each; MP3 is left out because its
length is not in its header, and the planner needs the exact duration before decoding)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaLimits:
    """Sizes above which a medium is refused (`media too large`) before it is decoded."""

    max_image_pixels: int = 64_000_000
    """Height x width from the image header (data.max_image_pixels)."""
    max_member_bytes: int = 100 * 2**20
    """Bytes of one image or clip (data.max_member_mb)."""
    max_audio_seconds: float = 600.0
    """Clip duration from the audio header (data.max_audio_seconds)."""
    max_video_frames: int = 36_000
    """Frames a video container's header declares (data.max_video_frames; 20 minutes at 30 fps).
    No more frames than the planned ones are ever decoded, so this bounds the decoding work."""
    max_video_seconds: float = 1200.0
    """A video's duration from its header, frames / frame rate (data.max_video_seconds)."""

    def __post_init__(self) -> None:
        for key, v in (("data.max_image_pixels", self.max_image_pixels),
                       ("data.max_member_mb", self.max_member_bytes),
                       ("data.max_audio_seconds", self.max_audio_seconds),
                       ("data.max_video_frames", self.max_video_frames),
                       ("data.max_video_seconds", self.max_video_seconds)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{key}={v!r} must be > 0")

    def check_bytes(self, data: bytes, what: str) -> None:
        if len(data) > self.max_member_bytes:
            raise SampleError(MEDIA_TOO_LARGE, f"{what} of {len(data) / 2**20:.1f} MB > data.max_member_mb="
                                               f"{self.max_member_bytes / 2**20:g}")


DEFAULT_LIMITS = MediaLimits()


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedImage:
    """An image ready for the vision encoder."""

    pixels: np.ndarray
    """uint8 [H, W, 3] after the resize rule."""
    size: tuple[int, int]
    """(height, width) of the stored image before resizing (what SampleMeta lists)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedAudio:
    """An audio clip ready for the audio encoder."""

    features: np.ndarray
    """float32 [mel_bins, frames] log-mel features."""
    seconds: float
    """Duration of the stored clip (samples / sample rate), before cutting at max_seconds."""


# ---------------------------------------------------------------------------- images

def open_image(data: bytes, limits: MediaLimits,
               formats: tuple[str, ...] | None = IMAGE_FORMATS) -> Image.Image:
    """The opened image (header read, no pixels decoded) once its size passed the limits;
    `formats=None` lets PIL try every format it knows (the converter re-encodes them).

    Raises:
        SampleError: `undecodable image` or `media too large`.
    """
    limits.check_bytes(data, "image")
    try:
        img = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as err:  # PIL's own ceiling (2 x Image.MAX_IMAGE_PIXELS), read first
        raise SampleError(MEDIA_TOO_LARGE, f"image refused as a decompression bomb ({err}); "
                                           f"data.max_image_pixels={limits.max_image_pixels:,}") from None
    except Exception as err:  # noqa: BLE001 - any decoder failure is this sample's problem
        raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({say(err)})") from None
    w, h = img.size
    if w <= 0 or h <= 0:
        img.close()
        raise SampleError(UNDECODABLE_IMAGE, f"image has size {h}x{w}")
    if w * h > limits.max_image_pixels:
        img.close()
        raise SampleError(MEDIA_TOO_LARGE, f"image of {h}x{w} = {w * h:,} pixels > data.max_image_pixels="
                                           f"{limits.max_image_pixels:,}")
    return img


def probe_image(data: bytes, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """(height, width) from the image header, checking the file's structure without decoding pixels.

    Raises:
        SampleError: `undecodable image`, or `media too large` over the limits.
    """
    img = open_image(data, limits)
    try:
        w, h = img.size
        img.verify()  # PNG: chunk CRCs; cheap, no pixel decoding
    except Exception as err:  # noqa: BLE001
        raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({say(err)})") from None
    finally:
        img.close()
    return h, w


def decode_image(data: bytes, v: VisionSpec, limits: MediaLimits = DEFAULT_LIMITS) -> DecodedImage:
    """Decode image bytes (PNG, JPEG, WebP) to RGB and resize by the vision rules.

    Raises:
        SampleError: `undecodable image` (including pixel data cut short or corrupt behind a
            valid header), or `media too large`.
    """
    img = open_image(data, limits)
    try:
        with img:
            img.load()
            rgb = img.convert("RGB")
        w, h = rgb.size
        th, tw = resize_image(v, h, w)
        if (th, tw) != (h, w):
            rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC)
        pixels = np.asarray(rgb, dtype=np.uint8).copy()
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001
        raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({say(err)})") from None
    return DecodedImage(pixels=pixels, size=(h, w))


# ---------------------------------------------------------------------------- audio

@dataclass(frozen=True, kw_only=True, slots=True)
class AudioHeader:
    """What an audio file's header says."""

    frames: int
    """Samples per channel."""
    rate: int
    """Sample rate in Hz."""
    channels: int
    """Channels (mixed down to mono when decoded)."""
    format: str
    """libsndfile's container name (WAV, FLAC, OGG)."""

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def _soundfile(data: bytes):
    import soundfile

    return soundfile.SoundFile(io.BytesIO(data))


def _read_header(f, limits: MediaLimits) -> AudioHeader:
    head = AudioHeader(frames=int(f.frames), rate=int(f.samplerate), channels=int(f.channels), format=str(f.format))
    if head.rate <= 0 or head.channels <= 0 or head.frames <= 0:
        raise SampleError(UNDECODABLE_AUDIO, f"{head.format} holds no samples ({head.frames} frames, "
                                             f"{head.rate} Hz, {head.channels} channel(s))")
    if head.seconds > limits.max_audio_seconds:
        raise SampleError(MEDIA_TOO_LARGE, f"clip of {head.seconds:.1f} s > data.max_audio_seconds="
                                           f"{limits.max_audio_seconds:g}")
    return head


def probe_audio(data: bytes, ext: str = "wav", limits: MediaLimits = DEFAULT_LIMITS) -> float:
    """Clip duration in seconds from the header (no sample decoded).

    Raises:
        SampleError: `undecodable audio`, or `media too large`.
    """
    return read_header(data, ext, limits).seconds


def read_header(data: bytes, ext: str = "wav", limits: MediaLimits = DEFAULT_LIMITS) -> AudioHeader:
    """The header of a `wav`, `flac` or `ogg` clip (see probe_audio)."""
    _check_ext(ext)
    limits.check_bytes(data, "clip")
    try:
        with _soundfile(data) as f:
            return _read_header(f, limits)
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001 - libsndfile's errors, and anything else it raises
        raise SampleError(UNDECODABLE_AUDIO, f"{len(data)} bytes are not a readable .{ext} clip ({say(err)})"
                          ) from None


def read_audio(data: bytes, ext: str = "wav", limits: MediaLimits = DEFAULT_LIMITS,
               max_seconds: float | None = None) -> tuple[np.ndarray, int, AudioHeader]:
    """Mono float32 waveform (channels averaged), its rate, and the header; at most
    `max_seconds` are decoded (the rest of a long clip is never read).

    Raises:
        SampleError: `undecodable audio` (also when the data ends before the header's length),
            or `media too large`.
    """
    _check_ext(ext)
    limits.check_bytes(data, "clip")
    try:
        with _soundfile(data) as f:
            head = _read_header(f, limits)
            want = head.frames if max_seconds is None else min(head.frames, math.ceil(max_seconds * head.rate))
            x = f.read(frames=want, dtype="float32", always_2d=True)
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001
        raise SampleError(UNDECODABLE_AUDIO, f"{len(data)} bytes are not a readable .{ext} clip ({say(err)})"
                          ) from None
    if len(x) < want:
        raise SampleError(UNDECODABLE_AUDIO, f"the header promises {head.frames} samples but the data ends after "
                                             f"{len(x)}")
    x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    if not np.isfinite(x).all():
        raise SampleError(UNDECODABLE_AUDIO, "the clip holds NaN or infinite samples")
    return np.ascontiguousarray(x, dtype=np.float32), head.rate, head


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling with soxr (its default high quality)."""
    if rate == target:
        return x
    import soxr

    return soxr.resample(x, rate, target).astype(np.float32, copy=False)


def hop_length(a: AudioSpec) -> int:
    """Samples between mel frames; sample_rate must be a multiple of frames_per_s."""
    if a.sample_rate % a.frames_per_s:
        raise ValueError(
            f"model.audio.sample_rate={a.sample_rate} is not a multiple of "
            f"model.audio.frames_per_s={a.frames_per_s}; mel frames need a whole-sample hop"
        )
    return a.sample_rate // a.frames_per_s


@lru_cache(maxsize=8)
def feature_extractor(mel_bins: int, sample_rate: int, hop: int, n_fft: int):
    """transformers' WhisperFeatureExtractor with the model's figures.

    Whisper's extractor spans its mel filters over 0-8 kHz whatever the sample rate; below
    16 kHz the filters above the Nyquist frequency are empty (constant floor values) and
    transformers warns about it once per construction. That is what the extractor computes,
    and mmpipe keeps its features identical to it, so the warning is silenced here.
    """
    from transformers import WhisperFeatureExtractor

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="At least one mel filter has all zero values")
        return WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=sample_rate, hop_length=hop,
                                       n_fft=n_fft)


def n_fft(a: AudioSpec) -> int:
    """STFT size: a 25 ms window (at least one hop)."""
    return max(hop_length(a), round(a.sample_rate * WINDOW_S))


def log_mel(x: np.ndarray, a: AudioSpec, seconds: float) -> np.ndarray:
    """Log-mel features [mel_bins, audio_frames(a, seconds)] of a waveform at a.sample_rate.

    WhisperFeatureExtractor pads (or cuts) the waveform to frames x hop samples and drops the
    STFT's last frame, which gives exactly audio_frames(a, seconds) frames; the shape is
    checked all the same, as the planner and the model rely on it.
    """
    hop = hop_length(a)
    frames = audio_frames(a, seconds)
    fe = feature_extractor(a.mel_bins, a.sample_rate, hop, n_fft(a))
    out = fe(x, sampling_rate=a.sample_rate, padding="max_length", max_length=frames * hop, truncation=True,
             return_tensors="np")["input_features"][0]
    if out.shape != (a.mel_bins, frames):
        raise RuntimeError(f"WhisperFeatureExtractor gave {out.shape} features, the geometry needs "
                           f"{(a.mel_bins, frames)}")
    return out.astype(np.float32, copy=False)


def decode_audio(data: bytes, a: AudioSpec, ext: str = "wav", limits: MediaLimits = DEFAULT_LIMITS,
                 seconds: float | None = None) -> DecodedAudio:
    """Decode a clip to log-mel features by the audio rules (resampled to a.sample_rate).

    Only the first model.audio.max_seconds are decoded. `seconds`, when given, is the planned
    duration (from the header at planning time): a clip that decodes to another length is
    refused, so the features always have the planned frame count.

    Raises:
        SampleError: `undecodable audio`, or `media too large`.
    """
    x, head = decode_waveform(data, a, ext, limits, seconds=seconds, max_seconds=a.max_seconds)
    return DecodedAudio(features=log_mel(x, a, head.seconds), seconds=head.seconds)


def decode_waveform(data: bytes, a: AudioSpec, ext: str, limits: MediaLimits, *, seconds: float | None,
                    max_seconds: float | None = None) -> tuple[np.ndarray, AudioHeader]:
    """A clip's mono waveform at a.sample_rate and its header; refused (undecodable audio) when
    its length is not the planned `seconds` or its rate cannot be resampled."""
    x, rate, head = read_audio(data, ext, limits, max_seconds=max_seconds)
    if seconds is not None and audio_frames(a, seconds) != audio_frames(a, head.seconds):
        raise SampleError(UNDECODABLE_AUDIO, f"the clip lasts {head.seconds:.3f} s, {seconds:.3f} s were planned")
    try:
        return resample(x, rate, a.sample_rate), head
    except (ValueError, MemoryError, OverflowError) as err:  # e.g. an absurd rate in the header
        raise SampleError(UNDECODABLE_AUDIO, f"a clip at {rate} Hz cannot be resampled ({say(err)})") from None


def _check_ext(ext: str) -> None:
    if ext not in AUDIO_EXTS:
        raise SampleError(UNDECODABLE_AUDIO, f".{ext} clips are not read; use {', '.join(AUDIO_EXTS)}")


def say(err: BaseException) -> str:
    """An exception as a short phrase: its message, or its type when it has none."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300] if text else type(err).__name__
