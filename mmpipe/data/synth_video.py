"""Synthetic video clips for the shipped data: a shape moving across a plain background, some with a
tone on an audio track, written as tiny MP4 files with PyAV.

A clip lasts 1 to 3 s at 4, 6 or 8 frames per second (4 to 24 frames) with sides of 32 to 64
pixels, so decoding one costs about a millisecond; MPEG-4 Part 2 video (FFmpeg's own `mpeg4`
encoder, in every PyAV wheel), and for a third of the clips an AAC track holding a tone at a named
pitch (models that take a video's audio read it; the questions never need it). The encoders run
single-threaded with FFmpeg's `bitexact` flags (no version strings in the file), so the same
seed gives the same bytes with the same FFmpeg build. Every answer follows from the frames: the
shape, its colour, the background and the direction it moves.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from mmpipe.data.synth_tasks import COLOURS, PITCHES, PLAIN_BACKGROUNDS, SHAPES, Draft, polygon
from mmpipe.model.geometry import VideoMeta

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Where the shape goes, as (dx, dy) on the frame."""
AUDIO_RATE = 8000
"""The tone track's sample rate."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Clip:
    """One generated video clip."""

    mp4: bytes
    """The container."""
    meta: VideoMeta
    """Its header figures (what probe_video reads back)."""
    shape: str
    colour: str
    background: str
    direction: str
    pitch: str = ""
    """The tone on the audio track ('' without one)."""

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.shape}"


def _frame(shape: str, fill: tuple[int, int, int], back: tuple[int, int, int], w: int, h: int,
           cx: float, cy: float, r: float) -> np.ndarray:
    img = Image.new("RGB", (w, h), back)
    d = ImageDraw.Draw(img)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.85
        d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "cross":
        t = r * 0.3
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
    else:
        d.polygon(polygon(shape, cx, cy, r), fill=fill)
    return np.asarray(img)


def write_mp4(frames: list[np.ndarray], fps: int, tone: np.ndarray | None = None) -> bytes:
    """An MP4 of uint8 RGB frames (even sides) at `fps`, with an optional mono float tone track
    at AUDIO_RATE; byte-reproducible (see the module docstring)."""
    import av

    h, w = frames[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = w, h, "yuv420p"
        video.codec_context.flags |= av.codec.context.Flags.bitexact
        video.options = {"qscale": "4"}
        video.thread_count = 1
        audio = None
        if tone is not None:
            audio = out.add_stream("aac", rate=AUDIO_RATE, layout="mono")
            audio.bit_rate = 16000
            audio.codec_context.flags |= av.codec.context.Flags.bitexact
            audio.thread_count = 1
        for f in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if audio is not None:
            chunk = av.AudioFrame.from_ndarray(tone.astype(np.float32)[None], format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = AUDIO_RATE, 0
            for packet in audio.encode(chunk):
                out.mux(packet)
            for packet in audio.encode():
                out.mux(packet)
    return buf.getvalue()


def make_clip(rng: random.Random) -> Clip:
    """A shape crossing the frame in one direction, maybe with a tone."""
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    background = rng.choice([b for b in PLAIN_BACKGROUNDS if b != colour])
    direction = rng.choice(list(DIRECTIONS))
    fps = rng.choice((4, 6, 8))
    n = rng.randint(fps, 3 * fps)  # 1 to 3 s; odd counts too (a temporal patch then repeats the last frame)
    seconds = n / fps
    w, h = 2 * rng.randint(16, 32), 2 * rng.randint(16, 32)
    r = min(w, h) * rng.uniform(0.18, 0.28)
    dx, dy = DIRECTIONS[direction]
    # from one side to the other along the direction, centred across it
    x0, x1 = (r, w - r) if dx > 0 else (w - r, r) if dx < 0 else (w / 2, w / 2)
    y0, y1 = (r, h - r) if dy > 0 else (h - r, r) if dy < 0 else (h / 2, h / 2)
    fill, back = COLOURS[colour], PLAIN_BACKGROUNDS[background]
    frames = [_frame(shape, fill, back, w, h, x0 + (x1 - x0) * i / (n - 1), y0 + (y1 - y0) * i / (n - 1), r)
              for i in range(n)]
    pitch, tone = "", None
    if rng.random() < 1 / 3:
        pitch = rng.choice(list(PITCHES))
        t = np.arange(round(seconds * AUDIO_RATE)) / AUDIO_RATE
        tone = 0.3 * np.sin(2 * math.pi * PITCHES[pitch] * t)
    mp4 = write_mp4(frames, fps, tone)
    meta = VideoMeta(frames=n, fps=float(fps), height=h, width=w, audio_seconds=seconds if pitch else 0.0,
                     audio_rate=AUDIO_RATE if pitch else 0)
    return Clip(mp4=mp4, meta=meta, shape=shape, colour=colour, background=background, direction=direction,
                pitch=pitch)


def video_task(rng: random.Random) -> Draft:
    """One clip and a question about what moves, its colour, where it goes or the whole scene."""
    c = make_clip(rng)
    kind = rng.randrange(5)
    if kind == 0:
        conv = [("<video>\nWhat moves in the video?", c.phrase)]
    elif kind == 1:
        conv = [("<video>\nWhich way does the shape move?", f"to the {c.direction}" if c.direction in ("left", "right")
                 else c.direction)]
    elif kind == 2:
        conv = [("<video>\nWhat colour is the moving shape?", c.colour)]
    elif kind == 3:
        conv = [("<video>\nDescribe the video.", f"{c.phrase} moving {c.direction} on a {c.background} background")]
    else:
        conv = [("<video>\nWhat shape is moving?", f"a {c.shape}"), ("Which way?", c.direction)]
    turns = [{"from": "human" if i % 2 == 0 else "gpt", "value": v} for pair in conv for i, v in enumerate(pair)]
    return Draft(task="video", conversations=turns, videos=[c.mp4], video_meta=[c.meta])
