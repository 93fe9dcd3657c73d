"""The machine a command runs on, as torch sees it, and what mmpipe's defaults make of it.

Two facts decide the defaults a user who sets nothing gets (`config.py: fit_machine`): how many
GPUs torch sees, and which hardware preset describes them. `detect` asks (the one place that
does); everything else here is pure, so tests state a machine instead of needing one.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

# Which preset (conf/hardware/<name>.yaml) describes a GPU, by the name torch reports
# (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB",
# "NVIDIA A100-SXM4-80GB", ...). Matched in order, on the upper-cased name: GH200 and H200 before
# H100's prefix rules. A GPU none of these names gets no preset: mmpipe plans it with the
# nearest figures it has and prints no efficiency or MFU against another device's peak.
GPU_PRESETS: tuple[tuple[str, str], ...] = (
    ("H200", "h200"),
    ("H100", "h100"),
    ("H800", "h100"),   # the H100's export variant: the same SMs and bf16 peak
    ("A100", "a100"),
    ("A800", "a100"),
)
CPU_PRESET = "cpu"
UNKNOWN_GPU_PRESET = "a100"
"""What an unknown GPU is planned with (its figures are the most conservative GPU preset's);
efficiency and MFU are not figured for it."""


@dataclass(frozen=True, slots=True)
class Machine:
    """What torch sees on this node."""

    gpus: int = 0
    """CUDA devices torch sees (torch.cuda.device_count; CUDA_VISIBLE_DEVICES applies)."""
    gpu_name: str | None = None
    """The first GPU's name as torch reports it (None: no GPU)."""
    world: int | None = None
    """WORLD_SIZE under an external launcher (torchrun, deepspeed): the ranks of the whole job,
    possibly over several nodes; None when mmpipe launches its own ranks."""

    @property
    def preset(self) -> str:
        """The hardware preset that describes this machine's device (cpu without a GPU)."""
        return (preset_for_gpu(self.gpu_name) or UNKNOWN_GPU_PRESET) if self.gpus else CPU_PRESET

    @property
    def device(self) -> str:
        """The device kind the ranks train on: a preset name, or `gpu` for one without a preset."""
        if not self.gpus:
            return CPU_PRESET
        return preset_for_gpu(self.gpu_name) or "gpu"

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU"
        return f"{self.gpus} x {self.gpu_name or 'GPU'}"


def preset_for_gpu(name: str | None) -> str | None:
    """The preset of the GPU torch calls `name`, None for a name no preset describes."""
    upper = (name or "").upper()
    return next((preset for key, preset in GPU_PRESETS if key in upper), None)


def detect() -> Machine:
    """This node's GPUs as torch sees them, and WORLD_SIZE under an external launcher."""
    world = os.environ.get("WORLD_SIZE")
    gpus, name = _torch_gpus() if "torch" in sys.modules or _rocm() else _driver_gpus(_cuda_driver())
    return Machine(gpus=gpus, gpu_name=name, world=int(world) if world and world.isdigit() else None)


def _torch_gpus() -> tuple[int, str | None]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus, torch.cuda.get_device_name(0) if gpus else None


def _rocm() -> bool:
    """An AMD GPU node (torch.cuda is HIP there; the CUDA driver below is absent)."""
    return os.path.exists("/dev/kfd")


def _cuda_driver():
    """The CUDA driver library, None where it is not installed (no NVIDIA GPU)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_gpus(lib) -> tuple[int, str | None]:
    """The GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES applies, as for torch),
    and the first one's name: the count and name torch reports. Asked of the driver because
    importing torch takes seconds, and the command line decides its defaults (and refuses bad
    settings, such as a resume that cannot work) before any rank starts; cuInit creates no
    context, and the ranks are new processes."""
    if lib is None:
        return 0, None
    count, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return 0, None  # a driver without a usable device (CUDA_VISIBLE_DEVICES="", a broken install)
    device = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(device), 0) != 0 or lib.cuDeviceGetName(name, len(name), device) != 0:
        return count.value, None
    return count.value, name.value.decode(errors="replace")
