"""The machine a command runs on, as torch sees it, and what mmpipe's defaults make of it.

Two facts decide the defaults a user who sets nothing gets (`config.py: fit_machine`): how many
GPUs torch sees, and which hardware preset describes them. `detect` asks torch (the one place
that does); everything else here is pure, so tests state a machine instead of needing one.
"""

from __future__ import annotations

import os
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
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = os.environ.get("WORLD_SIZE")
    return Machine(gpus=gpus, gpu_name=torch.cuda.get_device_name(0) if gpus else None,
                   world=int(world) if world and world.isdigit() else None)
