"""Decoded media have exactly the shapes the planner's features rules predict."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import soundfile
from PIL import Image
from transformers import WhisperFeatureExtractor

from mmpipe.data.media import decode_audio, decode_image, probe_audio, resample
from mmpipe.data.skips import SampleError
from mmpipe.model.geometry import audio_frames, audio_positions, resize_image
from mmpipe.model.spec import AudioSpec


def png(h: int, w: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), 200 if mode == "L" else (200, 30, 30, 255)[: len(mode)]).save(buf, format="PNG")
    return buf.getvalue()


def wav(x: np.ndarray, *, rate: int = 8000, width: int = 2, channels: int = 1) -> bytes:
    if width == 1:
        raw = (np.clip(np.round(x * 127) + 128, 0, 255)).astype(np.uint8)
    else:
        raw = (np.clip(x, -1, 1) * 32767).astype("<i2")
    if channels == 2:
        raw = np.repeat(raw, 2)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(channels)
        wf.setsampwidth(width)
        wf.setframerate(rate)
        wf.writeframes(raw.tobytes())
    return buf.getvalue()


def tone(freq: float, seconds: float, rate: int = 8000) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return 0.5 * np.sin(2 * np.pi * freq * t)


@pytest.mark.parametrize("h, w", [(16, 16), (37, 200), (200, 50), (300, 300), (10, 10), (128, 128)])
def test_image_shape_follows_the_resize_rule(tiny_spec, h, w) -> None:
    img = decode_image(png(h, w), tiny_spec.vision)
    th, tw = resize_image(tiny_spec.vision, h, w)
    assert img.pixels.shape == (th, tw, 3)
    assert img.pixels.dtype == np.uint8
    assert img.size == (h, w)
    v = tiny_spec.vision
    assert th * tw <= v.max_pixels and th % (v.patch * v.merge) == 0 and tw % (v.patch * v.merge) == 0


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_grey_alpha_and_palette_images_become_rgb(tiny_spec, mode) -> None:
    data = png(32, 48, "RGB" if mode == "P" else mode)
    if mode == "P":
        buf = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("P").save(buf, format="PNG")
        data = buf.getvalue()
    assert decode_image(data, tiny_spec.vision).pixels.shape == (32, 48, 3)


def test_image_colours_survive(tiny_spec) -> None:
    px = decode_image(png(64, 64), tiny_spec.vision).pixels
    assert tuple(px[32, 32]) == (200, 30, 30)


def test_garbage_image_is_undecodable(tiny_spec) -> None:
    with pytest.raises(SampleError, match="not a readable image") as err:
        decode_image(b"\x89PNG not really", tiny_spec.vision)
    assert err.value.reason == "undecodable image"


@pytest.mark.parametrize("seconds", [0.3, 1.0, 2.5, 6.0, 9.0])
@pytest.mark.parametrize("width", [1, 2])
def test_audio_features_shape_follows_the_frame_rule(tiny_spec, seconds, width) -> None:
    a = tiny_spec.audio
    clip = decode_audio(wav(tone(440, seconds), width=width), a)
    assert clip.features.shape == (a.mel_bins, audio_frames(a, clip.seconds))
    assert clip.features.dtype == np.float32
    assert abs(clip.seconds - seconds) < 1e-3
    assert np.isfinite(clip.features).all()
    if seconds > a.max_seconds:  # cut at max_seconds
        assert clip.features.shape[1] == int(a.max_seconds * a.frames_per_s)


def test_higher_pitch_lights_up_higher_mel_bins(tiny_spec) -> None:
    low = decode_audio(wav(tone(220, 1.0)), tiny_spec.audio).features
    high = decode_audio(wav(tone(1760, 1.0)), tiny_spec.audio).features
    assert low.mean(axis=1).argmax() < high.mean(axis=1).argmax()


def test_stereo_and_other_rates_are_mixed_down_and_resampled(tiny_spec) -> None:
    a = tiny_spec.audio
    clip = decode_audio(wav(tone(440, 1.5, rate=16000), rate=16000, channels=2), a)
    assert clip.seconds == pytest.approx(1.5)
    assert clip.features.shape == (a.mel_bins, audio_frames(a, 1.5))
    same = decode_audio(wav(tone(440, 1.5)), a).features
    assert clip.features.mean(axis=1).argmax() == same.mean(axis=1).argmax()


def test_audio_positions_match_the_planner(tiny_spec) -> None:
    a = tiny_spec.audio
    clip = decode_audio(wav(tone(440, 3.33)), a)
    assert -(-clip.features.shape[1] // a.conv_stride) == audio_positions(a, clip.seconds)


@pytest.mark.parametrize("data", [b"RIFF....WAVEjunk", b"", wav(np.zeros(0))])
def test_garbage_or_empty_audio_is_undecodable(tiny_spec, data) -> None:
    with pytest.raises(SampleError) as err:
        decode_audio(data, tiny_spec.audio)
    assert err.value.reason == "undecodable audio"


def encoded(x: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, subtype, ext", [
    ("WAV", "FLOAT", "wav"), ("WAV", "DOUBLE", "wav"), ("WAV", "PCM_24", "wav"), ("WAV", "PCM_32", "wav"),
    ("FLAC", "PCM_16", "flac"), ("FLAC", "PCM_24", "flac"), ("OGG", "VORBIS", "ogg"),
])
def test_every_sample_format_decodes_to_the_planned_shape(tiny_spec, fmt, subtype, ext) -> None:
    a = tiny_spec.audio
    x = tone(440, 1.7, rate=16000).astype(np.float32)
    data = encoded(x, 16000, fmt, subtype)
    assert probe_audio(data, ext) == pytest.approx(1.7)  # from the header
    clip = decode_audio(data, a, ext, seconds=1.7)
    assert clip.features.shape == (a.mel_bins, audio_frames(a, 1.7))
    same = decode_audio(wav(tone(440, 1.7)), a).features  # 16-bit PCM at the model rate
    assert clip.features.mean(axis=1).argmax() == same.mean(axis=1).argmax()
    if subtype in ("FLOAT", "DOUBLE", "PCM_24", "PCM_32"):  # lossless within float32
        direct = decode_audio(encoded(x, 16000, "WAV", "FLOAT"), a).features
        assert np.allclose(clip.features, direct, atol=1e-4)


def test_a_clip_that_does_not_last_as_planned_is_refused(tiny_spec) -> None:
    with pytest.raises(SampleError, match="the clip lasts 1.000 s, 2.000 s were planned") as err:
        decode_audio(wav(tone(440, 1.0)), tiny_spec.audio, seconds=2.0)
    assert err.value.reason == "undecodable audio"


def whisper_spec(**kw) -> AudioSpec:
    return AudioSpec(blocks=1, hidden=8, mlp=8, heads=1, proj=(8,), **kw)


def test_log_mel_equals_whispers_feature_extractor(tiny_spec) -> None:
    # The tiny model's figures: 32 mel bins at 8 kHz, 100 frames/s (hop 80, a 25 ms window of 200).
    a = tiny_spec.audio
    data = wav(tone(440, 2.345) + 0.1 * tone(1900, 2.345))
    x, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    frames = audio_frames(a, 2.345)
    with pytest.warns(UserWarning, match="mel filter has all zero values"):  # 0-8 kHz filters at 8 kHz
        fe = WhisperFeatureExtractor(feature_size=a.mel_bins, sampling_rate=a.sample_rate, hop_length=80, n_fft=200)
    want = fe(x, sampling_rate=rate, padding="max_length", max_length=frames * 80, return_tensors="np")
    got = decode_audio(data, a).features
    assert got.shape == (a.mel_bins, frames)
    np.testing.assert_allclose(got, want["input_features"][0], rtol=0, atol=1e-6)


def test_a_30_s_clip_gets_exactly_whispers_default_features() -> None:
    # Whisper's own configuration (80 mel bins, 16 kHz, hop 160, n_fft 400, 30 s chunks), used as is.
    a = whisper_spec(mel_bins=80, sample_rate=16000, frames_per_s=100, max_seconds=30.0)
    rng = np.random.default_rng(0)
    x = (0.3 * tone(300, 30.0, rate=16000) + 0.05 * rng.standard_normal(480000)).astype(np.float32)
    data = encoded(x, 16000, "WAV", "FLOAT")
    want = WhisperFeatureExtractor()(x, sampling_rate=16000, return_tensors="np")["input_features"][0]
    got = decode_audio(data, a).features
    assert got.shape == want.shape == (80, 3000)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_resampling_filters_out_what_lies_above_the_new_nyquist_frequency() -> None:
    # 44.1 kHz -> 16 kHz: an 11 kHz tone is above the new 8 kHz Nyquist frequency. Linear
    # interpolation folds it to 16 - 11 = 5 kHz at nearly full power; a band-limited resampler
    # removes it. A 1 kHz tone passes either way.
    def rms(v: np.ndarray) -> float:
        return float(np.sqrt(np.mean(v[2000:-2000] ** 2)))

    high, low = tone(11000, 1.0, rate=44100), tone(1000, 1.0, rate=44100)
    linear = np.interp(np.arange(16000) * 44100 / 16000, np.arange(44100), high)
    assert rms(linear) > 0.5 * rms(high)  # what the test guards against: an alias in the band
    assert rms(resample(high.astype(np.float32), 44100, 16000)) < 0.01 * rms(high)
    assert rms(resample(low.astype(np.float32), 44100, 16000)) == pytest.approx(rms(low), rel=0.02)
