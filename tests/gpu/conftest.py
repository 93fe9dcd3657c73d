"""GPU checks: skipped on a machine without CUDA; `scripts/gpu_check.sh --full` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def train(tmp_path):
    """Run `python -m mmpipe train ARGS` as a user would; return (exit code, output, metrics)."""
    def go(*args: str, name: str = "run", timeout: float = 240):
        run_dir = tmp_path / name
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        proc = subprocess.run([sys.executable, "-m", "mmpipe", "train", *args, f"hydra.run.dir={run_dir}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.is_file() else []
        return proc.returncode, proc.stdout + proc.stderr, rows

    return go
