"""Decoded media have exactly the shapes the planner's features rules predict."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
from PIL import Image

from mmpipe.data.media import decode_audio, decode_image
from mmpipe.data.skips import SampleError
from mmpipe.model.geometry import audio_frames, audio_positions, resize_image


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
