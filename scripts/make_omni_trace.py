#!/usr/bin/env python3
"""Write the public omni workload trace, data/workloads/omni-mix.jsonl (deterministic).

    python scripts/make_omni_trace.py [--out data/workloads/omni-mix.jsonl] [--lines 1024] [--seed 16]

An omni-modal SFT mixture as Qwen2.5-Omni-style thinkers are fine-tuned on (the mixture weights and
ranges are this trace's own choice; the trace format is docs/spec.md section 1):

- 30% image questions: one image (sometimes two), photo-like sizes 320-2048 px a side at
  common aspect ratios, 20-600 text tokens;
- 25% audio questions (speech recognition, audio captioning): one clip, lognormal around 8 s,
  0.5-60 s, 10-300 text tokens;
- 10% several clips (2-3, a dialogue's turns), 1-20 s each;
- 15% an image and a clip in one sample ("what do you see and hear");
- 20% text only, lognormal around 400 tokens, up to 8000.

The lines are shuffled, so every 256-sample step holds all kinds.
"""

from __future__ import annotations

import numpy as np
from trace_mix import write_mix  # scripts/ is on sys.path when a script runs

ASPECTS = ((4, 3), (3, 4), (16, 9), (9, 16), (1, 1), (3, 2), (2, 3))
"""Height : width ratios of the images."""


def _image(rng: np.random.Generator) -> list[int]:
    a, b = ASPECTS[int(rng.integers(len(ASPECTS)))]
    long_side = int(rng.integers(320, 2049))
    h, w = (long_side, long_side * b // a) if a >= b else (long_side * a // b, long_side)
    return [max(h, 16), max(w, 16)]


def _seconds(rng: np.random.Generator, mean: float, low: float, high: float) -> float:
    return round(float(np.clip(rng.lognormal(np.log(mean), 0.7), low, high)), 2)


def _tokens(rng: np.random.Generator, low: int, high: int, mean: float) -> int:
    return int(np.clip(rng.lognormal(np.log(mean), 0.8), low, high))


def sample(rng: np.random.Generator, kind: str) -> dict:
    if kind == "image":
        images = [_image(rng) for _ in range(1 if rng.random() < 0.85 else 2)]
        return {"text_tokens": _tokens(rng, 20, 600, 80), "images": images, "audio_seconds": []}
    if kind == "audio":
        return {"text_tokens": _tokens(rng, 10, 300, 40), "images": [],
                "audio_seconds": [_seconds(rng, 8.0, 0.5, 60.0)]}
    if kind == "clips":
        n = int(rng.integers(2, 4))
        return {"text_tokens": _tokens(rng, 20, 400, 80), "images": [],
                "audio_seconds": [_seconds(rng, 5.0, 1.0, 20.0) for _ in range(n)]}
    if kind == "image+audio":
        return {"text_tokens": _tokens(rng, 15, 300, 50), "images": [_image(rng)],
                "audio_seconds": [_seconds(rng, 6.0, 0.5, 30.0)]}
    return {"text_tokens": _tokens(rng, 30, 8000, 400), "images": [], "audio_seconds": []}


KINDS = {"image": 0.30, "audio": 0.25, "clips": 0.10, "image+audio": 0.15, "text": 0.20}
"""Share of each kind of sample."""


def main() -> None:
    write_mix(__doc__.splitlines()[0], name="omni-mix", seed=16, kinds=KINDS, sample=sample)


if __name__ == "__main__":
    main()
