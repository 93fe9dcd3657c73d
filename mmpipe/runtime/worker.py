"""Entry of each launched process: `python -m mmpipe.runtime.worker RUN_DIR/run.yaml`."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from mmpipe.config import run_config_from_dict
from mmpipe.runtime.checkpoint import RunStopped
from mmpipe.runtime.train import train


def main(path: str) -> int:
    cfg = yaml.safe_load(Path(path).read_text())
    rc = run_config_from_dict(cfg, run_dir=str(Path(path).parent))
    try:
        train(rc)
    except RunStopped as err:  # every rank agreed on it: one line, the same on each rank
        print(f"mmpipe train: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
