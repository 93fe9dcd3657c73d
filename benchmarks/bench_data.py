"""Data reader benchmark: samples/s and MB/s of one worker, metadata-only vs full decoding.

    python benchmarks/bench_data.py [--path data/shards/train-{000000..000007}.tar]
        [--samples 2000] [--generated 5000]

Measures the shipped shards, then a generated set of --generated samples in a temporary
folder (0 skips it). Figures are recorded in docs/data.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmpipe.data.commands import run_bench_data  # noqa: E402
from mmpipe.model.group import model_from_group  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=str(ROOT / "data/shards/train-{000000..000007}.tar"))
    ap.add_argument("--tokenizer", default=str(ROOT / "data/tokenizer.json"))
    ap.add_argument("--model", default="tiny", help="a model preset (conf/model)")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--generated", type=int, default=5000)
    args = ap.parse_args()
    group = yaml.safe_load((ROOT / "conf" / "model" / f"{args.model}.yaml").read_text())
    spec = model_from_group(group).spec
    return run_bench_data(path=args.path, tokenizer=args.tokenizer, model=spec, samples=args.samples,
                          generated=args.generated)


if __name__ == "__main__":
    sys.exit(main())
