"""The command line both public-trace writers share (scripts/make_omni_trace.py and
scripts/make_video_trace.py): a fixed share of each kind of sample, shuffled with the seed, one
JSON line per sample, written to data/workloads/<name>.jsonl unless --out says otherwise."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_mix(description: str, *, name: str, seed: int, kinds: dict[str, float],
              sample: Callable[[np.random.Generator, str], dict]) -> None:
    """Parse --out/--lines/--seed and write the trace: `kinds` maps each kind to its share (text
    takes the rounding remainder), `sample(rng, kind)` makes one line."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=str(ROOT / "data" / "workloads" / f"{name}.jsonl"))
    ap.add_argument("--lines", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=seed)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    counts = {k: int(round(p * args.lines)) for k, p in kinds.items()}
    counts["text"] += args.lines - sum(counts.values())
    order = [k for k, n in counts.items() for _ in range(n)]
    rng.shuffle(order)
    lines = [json.dumps(sample(rng, k)) for k in order]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} samples to {args.out}: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
