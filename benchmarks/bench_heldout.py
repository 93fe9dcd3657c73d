"""Planner benchmark on held-out synthetic traces: workloads the planner was not tuned on.

    python benchmarks/bench_heldout.py [--steps 2] [--batches 256,64] [--write DIR]

Four generators (fixed seeds, 1024 lines each), none of them one of the public traces:

- `mixture`: a LLaVA-OneVision-style mix: 50% LLaVA-pretrain-like (one 336 px image, 20-120
  text tokens), 30% text only (lognormal(6, 1) tokens, at most 8000), 20% two to four images of
  mixed sizes (224-1280 px a side) with lognormal(5, 0.7) tokens of text;
- `longtail-text`: text only, lognormal(5.5, 1.2) tokens, 8 to 8000;
- `images-only-big`: one image of 224-1280 px a side, 16-96 text tokens;
- `audio-mix`: 60% clips of 1-30 s with short captions, 20% one image of mixed size, 20% long
  text (lognormal(6.5, 0.8), at most 8000).

Each (trace, model, trainable set) is planned at pp=4 dp=2, h100, plan.memory_headroom=0.08, for
the first `--steps` steps of `--batches` samples, with the data-aware policy and the three tuned
baselines (docs/spec.md section 7). Printed per row: the efficiency (lower bound / step time,
means over the steps), whether every step fits memory, and whether data-aware beats every
tuned baseline. The last line is the held-out minimum efficiency at the first batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from mmpipe.model.group import model_from_group  # noqa: E402
from mmpipe.planner.api import PlanProblem  # noqa: E402
from mmpipe.planner.command import PlanInput, PlanOutput, run_plan  # noqa: E402
from mmpipe.planner.hardware import hardware_from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINES = 1024
ROWS = (("mixture", "qwen2-vl-7b", "vision.proj,llm"), ("mixture", "llava-1.5-7b", "vision.proj,llm"),
        ("mixture", "qwen2-vl-7b", "all"), ("mixture", "llava-1.5-7b", "all"),
        ("longtail-text", "qwen2-vl-7b", "vision.proj,llm"), ("longtail-text", "qwen2-vl-7b", "all"),
        ("images-only-big", "qwen2-vl-7b", "vision.proj,llm"), ("images-only-big", "qwen2-vl-7b", "all"),
        ("audio-mix", "omni-7b", "vision.proj,audio.proj,llm"), ("audio-mix", "omni-7b", "all"))


def _text(rng, mu: float, sigma: float, lo: int = 8, hi: int = 8000) -> int:
    return int(np.clip(rng.lognormal(mu, sigma), lo, hi))


def _side(rng) -> int:
    return int(rng.integers(224, 1281))


def generate(name: str, seed: int = 0) -> list[dict]:
    """The trace `name` (module docstring), LINES lines."""
    rng = np.random.default_rng({"mixture": 11, "longtail-text": 12, "images-only-big": 13,
                                 "audio-mix": 14}[name] + 100 * seed)
    out = []
    for _ in range(LINES):
        u = rng.random()
        if name == "mixture":
            if u < 0.5:
                line = {"text_tokens": int(rng.integers(20, 121)), "images": [[336, 336]]}
            elif u < 0.8:
                line = {"text_tokens": _text(rng, 6.0, 1.0)}
            else:
                line = {"text_tokens": _text(rng, 5.0, 0.7),
                        "images": [[_side(rng), _side(rng)] for _ in range(int(rng.integers(2, 5)))]}
        elif name == "longtail-text":
            line = {"text_tokens": _text(rng, 5.5, 1.2)}
        elif name == "images-only-big":
            line = {"text_tokens": int(rng.integers(16, 97)), "images": [[_side(rng), _side(rng)]]}
        else:
            if u < 0.6:
                line = {"text_tokens": _text(rng, 4.0, 0.5), "audio_seconds": [round(float(rng.uniform(1, 30)), 2)]}
            elif u < 0.8:
                line = {"text_tokens": _text(rng, 4.5, 0.6), "images": [[_side(rng), _side(rng)]]}
            else:
                line = {"text_tokens": _text(rng, 6.5, 0.8)}
        out.append(line)
    return out


def _model(name: str):
    return model_from_group(yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())).spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--write", help="also write the traces into this folder")
    ap.add_argument("--rows", help="only rows whose 'trace model trainable' contains this text")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    hw = hardware_from_dict(yaml.safe_load((ROOT / "conf" / "hardware" / "h100.yaml").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.write or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in dict.fromkeys(r[0] for r in ROWS):
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in generate(name)))
        print(f"pp=4 dp=2 hardware=h100 memory_headroom=0.08, first {args.steps} steps; eff. = lower bound / "
              f"step time; best baseline / data-aware in brackets")
        print(f"{'trace':<16} {'model':<13} {'trainable':<28}"
              + "".join(f" {f'eff. at {b}':>12} {'vs best':>8} {'ok':>4}" for b in batches) + f" {'s':>6}")
        first: list[float] = []
        for trace, mname, trainable in ROWS:
            if args.rows and args.rows not in f"{trace} {mname} {trainable}":
                continue
            cells = ""
            t0 = time.process_time()
            for b in batches:
                problem = PlanProblem(model=_model(mname), hardware=hw, pp=4, dp=2, global_batch=b, micro_batches=8,
                                      trainable=tuple(trainable.split(",")), policy="data-aware", memory_headroom=0.08)
                plan = run_plan(problem, PlanInput(trace_path=str(folder / f"{trace}.jsonl"), steps=args.steps),
                                output=PlanOutput(quiet=True))
                pred = plan["predicted"]
                ours = float(np.mean(pred["step_time_s"]))
                eff = float(np.mean(pred["lower_bound_s"])) / ours
                best = min(float(np.mean(v["step_time_s"])) if v["fits"] else float("inf")
                           for v in pred["baselines"].values())
                ok = pred.get("fits", True) and ours <= best
                cells += f" {eff:>12.3f} {best / ours:>7.2f}x {'yes' if ok else 'NO':>4}"
                if b == batches[0]:
                    first.append(eff)
            print(f"{trace:<16} {mname:<13} {trainable:<28}{cells} {time.process_time() - t0:>6.1f}", flush=True)
        if first:
            print(f"held-out minimum efficiency at {batches[0]} samples a step: {min(first):.3f}")


if __name__ == "__main__":
    sys.exit(main())
