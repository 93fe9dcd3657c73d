"""Local process launcher (torchrun-style environment, no `--local_rank` argument).

`mmpipe train` starts `nproc` copies of a worker command with RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set, limits each one's torch threads to its share of the cores, and
stops them all if one fails. Under an external launcher (torchrun, deepspeed, a cluster
scheduler) those variables already exist and the worker runs in place instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def under_external_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# oneDNN (bf16/fp16 matmuls, convolutions on CPU) keeps a compiled kernel per input shape in
# two caches (its primitive cache and torch's ideep LRU cache) of 1024 entries each, ~1 MB an
# entry. Packed micro-batches bring new shapes every step, so a bf16 run on CPU grew by ~150 MB
# per step. 64 entries keep the reuse within a micro-batch (the same shapes in every layer and
# in backward): in a bf16 fwd+bwd loop over varying lengths the CPU time equalled the default's
# and the resident size levelled off, where with no cache at all each call recompiled (2.6x
# slower). The user's own settings of these variables win.
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def accelerator_env(backend: str) -> dict[str, str]:
    """DS_ACCELERATOR, the process-group backend and the CPU kernel-cache limits for this machine."""
    import torch

    gpu = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if gpu else "gloo"
    env = {"MMPIPE_BACKEND": backend}
    if not gpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.update({k: v for k, v in CPU_KERNEL_CACHES.items() if k not in os.environ})
    return env


def launch(argv: list[str], *, nproc: int, backend: str = "auto", master_port: int = 0,
           extra_env: dict[str, str] | None = None, timeout_s: float | None = None) -> int:
    """Run `argv` in `nproc` local processes; return 0, or the first failing exit code."""
    port = master_port or free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    base = dict(os.environ)
    base.update(accelerator_env(backend))
    base.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": str(threads),
        "MMPIPE_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    })
    base.update(extra_env or {})
    procs = []
    for rank in range(nproc):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
    start = time.monotonic()
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    _stop(procs)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                _stop(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    return code


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
