"""The caches a run keeps across launches (launcher.cache_dir): compiled kernels and DeepSpeed's
JIT-built ops, in one folder per Python environment, really reused by the next process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mmpipe.cli import load
from mmpipe.commands import rank_env
from mmpipe.runtime.host import cache_dir, cache_env

# What a rank's torch.compile does with the environment the launcher gives it: compile one graph
# (on CPU, Inductor's C++ backend) and report the FX-graph cache's hits and misses.
COMPILE_ONCE = """
import json, torch
from torch._dynamo.utils import counters
torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.randn(16))
print(json.dumps({k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}))
"""


def _compile_in_a_fresh_process(env: dict[str, str]) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_second_launch_compiles_nothing_the_first_compiled(tmp_path, monkeypatch):
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(var, raising=False)
    env = rank_env(load([f"launcher.cache_dir={tmp_path / 'cache'}"]))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "cache" / "torch_extensions")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert _compile_in_a_fresh_process(env) == {"fxgraph_cache_miss": 1}
    assert _compile_in_a_fresh_process(env) == {"fxgraph_cache_hit": 1}  # the next launch: from the folder


def test_each_python_environment_keeps_its_own_ops_and_the_users_settings_win(monkeypatch):
    mine = cache_dir(None)
    assert mine.parent.name == "mmpipe" and mine.name.startswith(f"py{sys.version_info.major}")
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert cache_dir(None) != mine  # another install: another folder, so neither rebuilds the other's ops
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/users/own")
    assert "TORCH_EXTENSIONS_DIR" not in cache_env(None)  # the ranks inherit the user's own setting
