"""Media decoding: PNG/JPEG bytes to resized pixels, WAV bytes to log-mel features.

Shapes obey the planner's rules in `mmpipe.model.geometry`, so the encoder sequence lengths
the planner predicts are the ones the model gets:

- an image of h x w pixels becomes uint8 [H, W, 3] with (H, W) = resize_image(vision, h, w)
  (PIL bicubic);
- a clip of s seconds becomes float32 [mel_bins, audio_frames(audio, s)]: Whisper-style
  log-mel features (hann-window STFT of 25 ms, hop = sample_rate / frames_per_s, a Slaney
  mel filter bank, log10 clamped 8 decades below the peak, scaled as (x + 4) / 4), the
  clip cut at max_seconds.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers.audio_utils import mel_filter_bank

from mmpipe.data.skips import UNDECODABLE_AUDIO, UNDECODABLE_IMAGE, SampleError
from mmpipe.model.spec import AudioSpec, VisionSpec
from mmpipe.model.geometry import audio_frames, resize_image

WINDOW_S = 0.025
"""STFT window length in seconds (Whisper: 400 samples at 16 kHz)."""


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


def decode_image(data: bytes, v: VisionSpec) -> DecodedImage:
    """Decode image bytes (any format PIL reads) to RGB and resize by the vision rules.

    Raises:
        SampleError: reason `undecodable image`.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({err})") from None
    w, h = rgb.size
    if w <= 0 or h <= 0:
        raise SampleError(UNDECODABLE_IMAGE, f"image has size {h}x{w}")
    th, tw = resize_image(v, h, w)
    if (th, tw) != (h, w):
        rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC)
    return DecodedImage(pixels=np.asarray(rgb, dtype=np.uint8).copy(), size=(h, w))


def _open_wav(data: bytes) -> tuple[int, int, int, bytes]:
    """(channels, sample width, rate, frames) of WAV bytes, or SampleError."""
    try:
        with wave.open(io.BytesIO(data), "rb") as wf:
            return wf.getnchannels(), wf.getsampwidth(), wf.getframerate(), wf.readframes(wf.getnframes())
    except (wave.Error, EOFError, OSError, ValueError) as err:
        raise SampleError(UNDECODABLE_AUDIO, f"{len(data)} bytes are not a PCM WAV file ({err})") from None


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """PCM WAV bytes to a mono float32 waveform in [-1, 1] and its sample rate.

    Raises:
        SampleError: reason `undecodable audio` (not WAV, not 8/16/32-bit PCM, or empty).
    """
    channels, width, rate, raw = _open_wav(data)
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = np.dtype("<i2") if width == 2 else np.dtype("<i4")
        x = np.frombuffer(raw[: len(raw) - len(raw) % width], dtype=dtype).astype(np.float32)
        x /= float(2 ** (8 * width - 1))
    else:
        raise SampleError(UNDECODABLE_AUDIO, f"{8 * width}-bit WAV is not supported; use 8, 16 or 32-bit PCM")
    n = len(x) // channels if channels > 0 else 0
    if n == 0 or rate <= 0:
        raise SampleError(UNDECODABLE_AUDIO, f"WAV holds no samples (rate {rate} Hz, {channels} channel(s))")
    x = x[: n * channels].reshape(n, channels).mean(axis=1)
    return x.astype(np.float32, copy=False), rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling (the synthetic data is stored at the model rate already)."""
    if rate == target:
        return x
    n = max(1, round(len(x) * target / rate))
    t = np.arange(n, dtype=np.float64) * (rate / target)
    return np.interp(t, np.arange(len(x), dtype=np.float64), x).astype(np.float32)


def hop_length(a: AudioSpec) -> int:
    """Samples between mel frames; sample_rate must be a multiple of frames_per_s."""
    if a.sample_rate % a.frames_per_s:
        raise ValueError(
            f"model.audio.sample_rate={a.sample_rate} is not a multiple of "
            f"model.audio.frames_per_s={a.frames_per_s}; mel frames need a whole-sample hop"
        )
    return a.sample_rate // a.frames_per_s


@lru_cache(maxsize=8)
def _mel_filters(n_fft: int, mel_bins: int, sample_rate: int) -> torch.Tensor:
    fb = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1, num_mel_filters=mel_bins, min_frequency=0.0,
        max_frequency=sample_rate / 2, sampling_rate=sample_rate, norm="slaney", mel_scale="slaney",
    )
    return torch.from_numpy(np.ascontiguousarray(fb.T, dtype=np.float32))  # [mel, freq]


def log_mel(x: np.ndarray, a: AudioSpec, seconds: float) -> np.ndarray:
    """Log-mel features [mel_bins, audio_frames(a, seconds)] of a waveform at a.sample_rate."""
    hop = hop_length(a)
    frames = audio_frames(a, seconds)
    n_fft = max(hop, round(a.sample_rate * WINDOW_S))
    want = frames * hop
    wav = torch.zeros(want, dtype=torch.float32)
    m = min(want, len(x))
    wav[:m] = torch.from_numpy(np.ascontiguousarray(x[:m], dtype=np.float32))
    spec = torch.stft(
        wav, n_fft=n_fft, hop_length=hop, window=torch.hann_window(n_fft), center=True,
        pad_mode="constant", return_complex=True,
    )[:, :frames]
    power = spec.abs() ** 2
    mel = _mel_filters(n_fft, a.mel_bins, a.sample_rate) @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return ((logm + 4.0) / 4.0).numpy().astype(np.float32, copy=False)


def decode_audio(data: bytes, a: AudioSpec, ext: str = "wav") -> DecodedAudio:
    """Decode WAV (or FLAC) bytes to log-mel features by the audio rules (resampled to a.sample_rate).

    Raises:
        SampleError: reason `undecodable audio`.
    """
    x, rate = read_audio(data, ext)
    seconds = len(x) / rate
    if not math.isfinite(seconds) or seconds <= 0:
        raise SampleError(UNDECODABLE_AUDIO, f"clip duration {seconds} s")
    x = resample(x, rate, a.sample_rate)
    return DecodedAudio(features=log_mel(x, a, seconds), seconds=seconds)


def soundfile_available() -> bool:
    """Whether FLAC can be read and written (the optional `soundfile` package)."""
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


FLAC_NEEDS_SOUNDFILE = "FLAC needs the soundfile package (pip install soundfile); or store the clips as WAV"


def read_audio(data: bytes, ext: str = "wav") -> tuple[np.ndarray, int]:
    """Mono float32 waveform and rate of a `wav` or `flac` member.

    Raises:
        SampleError: reason `undecodable audio`.
    """
    if ext == "wav":
        return read_wav(data)
    if ext != "flac":
        raise SampleError(UNDECODABLE_AUDIO, f".{ext} clips are not supported; use WAV (or FLAC with soundfile)")
    if not soundfile_available():
        raise SampleError(UNDECODABLE_AUDIO, FLAC_NEEDS_SOUNDFILE)
    import soundfile

    try:
        x, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as err:  # soundfile raises its own LibsndfileError
        raise SampleError(UNDECODABLE_AUDIO, f"{len(data)} bytes are not a readable FLAC file ({err})") from None
    if len(x) == 0 or rate <= 0:
        raise SampleError(UNDECODABLE_AUDIO, "FLAC holds no samples")
    return x.mean(axis=1).astype(np.float32), int(rate)


def probe_image(data: bytes) -> tuple[int, int]:
    """(height, width) from the image header, checking the file's structure without decoding pixels.

    Raises:
        SampleError: reason `undecodable image`.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            img.verify()  # PNG: chunk CRCs; cheap, no pixel decoding
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as err:
        raise SampleError(UNDECODABLE_IMAGE, f"{len(data)} bytes are not a readable image ({err})") from None
    if w <= 0 or h <= 0:
        raise SampleError(UNDECODABLE_IMAGE, f"image has size {h}x{w}")
    return h, w


def probe_audio(data: bytes, ext: str = "wav") -> float:
    """Clip duration in seconds from the header and the data length (no sample conversion).

    Raises:
        SampleError: reason `undecodable audio`.
    """
    if ext != "wav":
        x, rate = read_audio(data, ext)
        return len(x) / rate
    channels, width, rate, raw = _open_wav(data)
    if width not in (1, 2, 4):
        raise SampleError(UNDECODABLE_AUDIO, f"{8 * width}-bit WAV is not supported; use 8, 16 or 32-bit PCM")
    n = len(raw) // (width * channels) if channels > 0 else 0
    if n == 0 or rate <= 0:
        raise SampleError(UNDECODABLE_AUDIO, f"WAV holds no samples (rate {rate} Hz, {channels} channel(s))")
    return n / rate
