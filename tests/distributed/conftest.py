"""Helpers for tests that run real multi-process jobs (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    code: int
    out: str
    run_dir: Path

    def metrics(self) -> list[dict]:
        return [json.loads(l) for l in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def stage_files(self) -> list[dict]:
        return sorted((json.loads(p.read_text()) for p in self.run_dir.glob("stage_rank*.json")),
                      key=lambda d: d["rank"])

    def samples(self, rank: int) -> list[dict]:
        return [json.loads(l) for l in (self.run_dir / f"samples_rank{rank}.jsonl").read_text().splitlines()]


def mmpipe(*args: str, run_dir: Path, timeout: float = 300) -> Run:
    """Run `python -m mmpipe ARGS hydra.run.dir=RUN_DIR` as a user would (a sweep, -m: with
    hydra.sweep.dir=RUN_DIR, its jobs in RUN_DIR/0, RUN_DIR/1, ...); capture its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    where = [f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}"] if "-m" in args else [f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, "-m", "mmpipe", *args, *where], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )
    return Run(code=proc.returncode, out=proc.stdout + proc.stderr, run_dir=run_dir)


@pytest.fixture
def run_mmpipe(tmp_path):
    def go(*args: str, timeout: float = 300, name: str = "run") -> Run:
        return mmpipe(*args, run_dir=tmp_path / name, timeout=timeout)

    return go
