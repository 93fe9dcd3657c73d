"""A regular (non-editable) install trains from any directory: the configs, recipes and sample
data ship inside the wheel, and nothing is read from a checkout."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_a_wheel_install_trains_from_an_empty_directory(tmp_path):
    src = tmp_path / "src"  # build from a copy: no build/ or egg-info left in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "outputs", "multirun", ".venv",
        "tests", "benchmarks"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "dist").glob("mmpipe-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # this pip installs
    # The dependencies (torch, deepspeed, ...) come from this interpreter's environment; a path
    # listed in a .pth file is searched after the venv's own site-packages, so mmpipe is the wheel's.
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, text=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import mmpipe; print(mmpipe.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(purelib)), where
    proc = subprocess.run([str(venv / "bin" / "mmpipe"), "train", "train.steps=3"], cwd=empty, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = empty.glob("outputs/*/*")
    assert [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [p.name for p in empty.iterdir()] == ["outputs"]
