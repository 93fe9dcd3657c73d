#!/usr/bin/env python3
"""Write the public video workload trace, data/workloads/video-mix.jsonl (deterministic).

    python scripts/make_video_trace.py [--out data/workloads/video-mix.jsonl] [--lines 1024] [--seed 19]

A video-instruction SFT mixture as LLaVA-Video / LLaVA-OneVision style models are fine-tuned on
(the mixture weights and ranges are this trace's own choice; the trace format, with its `videos`
extension, is docs/spec.md section 1). Every clip is written as `mmpipe shards` records one from
its container's header: frames, frame rate, height, width and the audio track (or null):

- 35% video questions: one clip, lognormal around 40 s, 2 s to 3 min, at 24, 25, 30 or 60 fps,
  phone and camera sizes from 240p to 1080p (some portrait), 20-1500 text tokens (detailed
  captions are long);
- 10% short clips (action recognition): 2-10 s, 240p to 480p, 5-60 text tokens;
- 5% two clips in one sample (compare them), 3-60 s each;
- 25% image questions: one image (sometimes 2-4), photo-like sizes 320-2048 px a side;
- 5% an image and a clip in one sample;
- 20% text only, lognormal around 400 tokens, up to 8000.

Two thirds of the clips carry an audio track (44.1 or 48 kHz, as long as the video). Every
clip is at least 2 s at 24 fps or more, so it holds at least 48 frames: LLaVA-OneVision's preset
samples 32 frames a clip and, as transformers does, refuses a clip with fewer.
The lines are shuffled, so every 256-sample step holds all kinds.
"""

from __future__ import annotations

import numpy as np
from trace_mix import write_mix  # scripts/ is on sys.path when a script runs

ASPECTS = ((4, 3), (3, 4), (16, 9), (9, 16), (1, 1), (3, 2), (2, 3))
"""Height : width ratios of the images."""
SIZES = ((360, 640), (480, 854), (720, 1280), (1080, 1920), (480, 640), (640, 360), (1280, 720), (1920, 1080),
         (576, 1024))
"""(height, width) of the video clips: landscape 360p-1080p, 4:3 480p, portrait phone clips."""
SMALL = ((240, 320), (240, 426), (360, 480), (360, 640), (480, 640))
"""(height, width) of the short action clips."""
RATES = (24.0, 25.0, 30.0, 30.0, 30.0, 60.0)
"""Frame rates (30 fps most often)."""


def _image(rng: np.random.Generator) -> list[int]:
    a, b = ASPECTS[int(rng.integers(len(ASPECTS)))]
    long_side = int(rng.integers(320, 2049))
    h, w = (long_side, long_side * b // a) if a >= b else (long_side * a // b, long_side)
    return [max(h, 16), max(w, 16)]


def _tokens(rng: np.random.Generator, low: int, high: int, mean: float) -> int:
    return int(np.clip(rng.lognormal(np.log(mean), 0.8), low, high))


def _clip(rng: np.random.Generator, mean: float, low: float, high: float, sizes=SIZES) -> dict:
    """A clip's header figures: frames = duration x frame rate (at least 2 s: >= 48 frames)."""
    seconds = float(np.clip(rng.lognormal(np.log(mean), 0.8), low, high))
    fps = RATES[int(rng.integers(len(RATES)))]
    h, w = sizes[int(rng.integers(len(sizes)))]
    frames = int(round(seconds * fps))
    audio = {"seconds": round(frames / fps, 3), "rate": int(rng.choice((44100, 48000)))} if rng.random() < 2 / 3 \
        else None
    return {"frames": frames, "fps": fps, "seconds": round(frames / fps, 3), "height": h, "width": w, "audio": audio}


def sample(rng: np.random.Generator, kind: str) -> dict:
    images: list[list[int]] = []
    videos: list[dict] = []
    if kind == "video":
        videos, text = [_clip(rng, 40.0, 2.0, 180.0)], _tokens(rng, 20, 1500, 150)
    elif kind == "short":
        videos, text = [_clip(rng, 5.0, 2.0, 10.0, SMALL)], _tokens(rng, 5, 60, 15)
    elif kind == "two clips":
        videos, text = [_clip(rng, 15.0, 3.0, 60.0) for _ in range(2)], _tokens(rng, 30, 800, 120)
    elif kind == "image":
        images = [_image(rng) for _ in range(1 if rng.random() < 0.85 else int(rng.integers(2, 5)))]
        text = _tokens(rng, 20, 600, 80)
    elif kind == "image+video":
        images, videos, text = [_image(rng)], [_clip(rng, 20.0, 2.0, 120.0)], _tokens(rng, 20, 600, 100)
    else:
        text = _tokens(rng, 30, 8000, 400)
    return {"text_tokens": text, "images": images, "audio_seconds": [], "videos": videos}


KINDS = {"video": 0.35, "short": 0.10, "two clips": 0.05, "image": 0.25, "image+video": 0.05, "text": 0.20}
"""Share of each kind of sample."""


def main() -> None:
    write_mix(__doc__.splitlines()[0], name="video-mix", seed=19, kinds=KINDS, sample=sample)


if __name__ == "__main__":
    main()
