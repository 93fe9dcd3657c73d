"""This machine as the ranks see it: torch threads per rank, the process-group backend, and
the environment the accelerator needs. One home for these facts: the local launcher sets them
for its ranks, a rank under an external launcher (torchrun, deepspeed) decides them itself,
and `mmpipe profile` measures with the threads a training rank gets."""

from __future__ import annotations

import os

# oneDNN (bf16/fp16 matmuls, convolutions on CPU) keeps a compiled kernel per input shape in
# two caches (its primitive cache and torch's ideep LRU cache) of 1024 entries each, ~1 MB an
# entry. Packed micro-batches bring new shapes every step, so a bf16 run on CPU grew by ~150 MB
# per step. 64 entries keep the reuse within a micro-batch (the same shapes in every layer and
# in backward): in a bf16 fwd+bwd loop over varying lengths the CPU time equalled the default's
# and the resident size levelled off, where with no cache at all each call recompiled (2.6x
# slower). The user's own settings of these variables win.
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def threads_per_rank(local_ranks: int) -> int:
    """Torch threads for each of `local_ranks` processes on this machine: the cores shared out,
    so that several ranks do not oversubscribe them (at least one)."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def resolve_backend(backend: str) -> str:
    """launcher.backend with auto decided: nccl where torch sees a GPU, else gloo."""
    import torch

    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def accelerator_env(backend: str) -> dict[str, str]:
    """DS_ACCELERATOR, the process-group backend and the CPU kernel-cache limits for this machine."""
    import torch

    gpu = torch.cuda.is_available()
    env = {"MMPIPE_BACKEND": resolve_backend(backend)}
    if not gpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.update({k: v for k, v in CPU_KERNEL_CACHES.items() if k not in os.environ})
    return env
