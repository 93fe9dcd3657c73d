"""This machine as the ranks see it: torch threads per rank, the process-group backend, and
the environment the accelerator needs. One home for these facts: the local launcher sets them
for its ranks, a rank under an external launcher (torchrun, deepspeed) decides them itself,
and `mmpipe profile` measures with the threads a training rank gets."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# oneDNN (bf16/fp16 matmuls, convolutions on CPU) keeps a compiled kernel per input shape in
# two caches (its primitive cache and torch's ideep LRU cache) of 1024 entries each, ~1 MB an
# entry. Packed micro-batches bring new shapes every step, so a bf16 run on CPU grew by ~150 MB
# per step. 64 entries keep the reuse within a micro-batch (the same shapes in every layer and
# in backward): in a bf16 fwd+bwd loop over varying lengths the CPU time equalled the default's
# and the resident size levelled off, where with no cache at all each call recompiled (2.6x
# slower). The user's own settings of these variables win.
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def cache_dir(configured: str | None) -> Path:
    """launcher.cache_dir, or ~/.cache/mmpipe/<environment>: one folder per Python environment
    (its interpreter's version and prefix), so that two installs side by side keep their own
    compiled kernels and JIT-built ops instead of rebuilding each other's."""
    if configured:
        return Path(configured).expanduser().resolve()
    digest = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    name = f"py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmpipe" / name


def cache_env(configured: str | None) -> dict[str, str]:
    """The variables that put torch.compile's caches (Inductor's FX-graph and AOTAutograd caches,
    Triton's kernels) and DeepSpeed's JIT-built ops (torch's cpp_extension folder) under
    cache_dir: a resumed, re-cut or benchmarked run, and the next run, compile nothing they
    compiled before. Torch's default for the op folder, ~/.cache/torch_extensions/<py><cuda>,
    is shared by every environment with the same Python and CUDA, so two installs of different
    DeepSpeed releases rebuilt each other's op and a rank waited out the rendezvous. The user's
    own settings of these variables win."""
    root = cache_dir(configured)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
           "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    return {k: v for k, v in env.items() if k not in os.environ}


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


def precision_problem(precision: str, backend: str) -> str | None:
    """Why DeepSpeed would refuse `train.precision` on the device the ranks get (None: it runs).

    DeepSpeed asks its accelerator at engine start (`is_fp16_supported` / `is_bf16_supported`)
    and raises "Type fp16 is not supported on your device." in every rank; the same questions
    are asked here, of the accelerator the ranks will use (its CPU one where torch sees no GPU,
    as accelerator_env sets it), before anything is launched. On CPU DeepSpeed asks oneDNN,
    which supports fp16 only on CPUs with AVX512-FP16 or AMX-FP16."""
    if precision == "fp32":
        return None
    import torch

    if accelerator_env(backend).get("DS_ACCELERATOR") == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        accelerator = CPU_Accelerator()
        isa = precision.upper()  # FP16 / BF16
        device, why = "this CPU", f"oneDNN has no {precision} kernels here; they need AVX512-{isa} or AMX-{isa}"
    else:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        device = f"this GPU ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "this device"
        why = "the GPU's compute capability is too old for it"
    supported = accelerator.is_fp16_supported() if precision == "fp16" else accelerator.is_bf16_supported()
    if supported:
        return None
    other = "bf16" if precision == "fp16" and accelerator.is_bf16_supported() else None
    fix = f"use train.precision={other} (supported here) or fp32" if other else "use train.precision=fp32"
    return (f"train.precision={precision}: DeepSpeed does not train {precision} on {device} (its "
            f"{type(accelerator).__name__}.is_{precision}_supported() is False: {why}); {fix}")


def training_device(device) -> str:
    """The device kind ranks on torch device `device` train on: cpu, or the GPU's preset name
    (`gpu` for one without a preset; mmpipe/machine.py)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        from mmpipe.machine import detect

        return detect().device
    return "cpu"


def figures_mismatch(hardware: Mapping[str, Any], device: str) -> str | None:
    """Why a run training on `device` prints no efficiency or MFU against the hardware config's
    peak rates (None: it does). A config that does not say which device it describes (a measured
    file of an older mmpipe) is taken as this machine's."""
    described, name = hardware.get("device"), hardware.get("name")
    if described is None or (described == device and device != "gpu"):
        return None
    if described == "gpu":
        return f"hardware={name} has no peak rates of this GPU (`mmpipe profile` measures them)"
    return (f"hardware={name} describes {described} and the ranks train on {device}; "
            f"hardware=auto or a measured file of this machine gives the figures")


def describe_cache(configured: str | None) -> str:
    """The start-up line of a GPU run's kernel cache: where, and whether earlier launches filled it."""
    root = cache_dir(configured)
    inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or root / "inductor")
    graphs = sum(1 for _ in (inductor / "fxgraph").rglob("*") if _.is_file()) if (inductor / "fxgraph").is_dir() else 0
    state = (f"warm: {graphs} compiled graph(s) from earlier launches" if graphs else
             "cold: the first step compiles the attention kernels, once for every length")
    return f"compile cache {inductor} ({state}; launcher.cache_dir sets the folder)"


DECODE_WORKERS_MAX = 4
"""The most decode worker processes data.decode_workers=auto gives a rank."""


def decode_workers(setting: int | str, threads: int) -> int:
    """data.decode_workers for a rank with `threads` torch threads (threads_per_rank).

    auto: none below 4 threads: there each core is busy with the rank's own kernels (CPU
    training) and the reader, so a worker process only takes turns with them and the thread
    path costs nothing extra (the 2-core machine, where each rank has one or two cores). With
    more (a GPU node, where the cores only launch kernels) half of them, at most
    DECODE_WORKERS_MAX: the rest stay with the training process and the reader's workers."""
    if setting != "auto":
        return int(setting)
    return 0 if threads < 4 else min(DECODE_WORKERS_MAX, threads // 2)


def parent_death_signal():
    """A preexec_fn that makes the kernel SIGKILL the child when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing may be imported after fork

    def arm() -> None:
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG

    return arm
