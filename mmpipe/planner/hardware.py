"""What one accelerator and its links cost: the single home of every cost constant.

The cost model (`planner.cost`, `planner.stage_cost`) reads nothing else: peak FLOP/s, the
small-micro-batch efficiency curve, the fixed per-op overhead, the runtime's fixed costs per
micro-batch and per step, link bandwidth and latency, and the activation rules of thumb of
docs/spec.md section 6 (the bytes of weights, gradients and optimizer states follow the run's
precision, ZeRO stage and optimizer: `planner.precision`). Presets live in
`conf/hardware/*.yaml`; a measured machine is the same dataclass with `kind_efficiency` /
`kind_overhead_s` filled in by `mmpipe profile`, and `micro_batch_overhead_s` /
`step_overhead_s` by a measured run (`calibrate.calibrated_hardware` turns the online re-fit
of `runtime/train.py` into them; the run writes the result as
RUN_DIR/conf/hardware/calibrated-<name>.yaml).

Efficiency curve: a layer kind running on a micro-batch whose stream holds `T` tokens reaches

    efficiency(T) = max_efficiency * T / (T + half_tokens)

of `peak_flops` (a saturating curve: half of `max_efficiency` at `half_tokens` tokens), and each
layer pays `op_overhead_s` per pass on top. A replica's step is its simulated 1F1B makespan
plus `micro_batch_overhead_s` per micro-batch, and the step adds `step_overhead_s` (optimizer
step, gradient reduction, engine bookkeeping). The planner's lower bound uses
`max_efficiency` (the best a layer can do), never the dense peak alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

GB = 1e9
"""Bytes in a gigabyte as the presets count them (decimal, like vendors do)."""
RUN_STATE_KEYS = ("trainable_param_bytes", "sharded_param_bytes", "frozen_param_bytes",
                  "boundary_bytes_per_hidden")
"""Keys older hardware files carried for what is now the run's precision (planner.precision)."""
ORIGIN_KEYS = ("measured_for", "device")
"""Keys a hardware file carries about where its figures come from, not figures: the run's config
reads them (mmpipe/config.py, HardwareOrigin); the planner passes over them."""
KIND_FALLBACK = {"vision.window": "vision.block"}
"""A layer kind without measured figures of its own takes those of this kind (the same module)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareSpec:
    """One pipeline device and the link between neighbouring stages."""

    name: str
    """Preset name (`h100`, `a100`, `cpu`) or the profiled machine's name."""
    peak_flops: float
    """Dense bf16 peak of one device, FLOP/s."""
    memory_gb: float
    """Device memory, GB (1e9 bytes)."""
    link_gbps: float
    """Bandwidth between neighbouring pipeline stages, GB/s (gigaBYTES per second)."""
    link_latency_s: float = 2e-5
    """Fixed cost of one point-to-point transfer."""
    max_efficiency: float = 0.65
    """Fraction of peak a large micro-batch reaches (the top of the efficiency curve)."""
    half_tokens: float = 384.0
    """Tokens in a micro-batch's stream at which a layer reaches half of max_efficiency."""
    op_overhead_s: float = 4e-5
    """Fixed time of one layer's forward pass (kernel launches, hooks); backward pays it
    again for each pass it makes."""
    micro_batch_overhead_s: float = 0.0
    """Fixed time the runtime spends per micro-batch of a replica outside the layers (engine
    instructions, input copies, loss bookkeeping); measured, not a rule of thumb (0 in the
    presets, which follow docs/spec.md section 6)."""
    step_overhead_s: float = 0.0
    """Fixed time per step outside the pipeline (optimizer step, gradient reduction); it
    moves every plan alike, so it changes predictions, not choices."""
    usable_fraction: float = 0.9
    """Share of device memory the planner may fill."""
    reserved_gb: float = 0.0
    """What a rank holds before its model is built, GB: the interpreter and its libraries,
    the process group, the CUDA context. Usable memory is less this, and every predicted peak
    includes it. `mmpipe profile` measures it (a rank's resident set on CPU); 0 in the GPU
    presets, which price tensor bytes as docs/spec.md section 6 does."""
    memory_slack: float = 0.0
    """Bytes a rank holds beyond the planner's own per planned byte (weights, gradients,
    optimizer states, activations): the allocator's free blocks, DeepSpeed's receive and
    flattening buffers, the autograd graph, the feeder's decoded steps. Every planned byte
    costs (1 + memory_slack); measured by `mmpipe profile` on a real pipeline."""
    act_bytes_per_hidden: float = 34.0
    """Activation bytes kept per token per transformer block, per unit of hidden width, at
    2-byte elements (Korthikanti et al. 2022, flash attention); fp32 runs keep twice as many."""
    recompute_bytes_per_hidden: float = 2.0
    """Bytes kept per token per block under recomputation (the block input), per unit of
    hidden width at 2-byte elements; one block's full activations come on top during its
    recompute."""
    io_bytes_per_hidden: float = 4.0
    """Bytes kept per token per non-block layer (embed, projector, norm), per unit of width,
    at 2-byte elements."""
    logits_bytes_per_vocab: float = 6.0
    """Bytes the LM head keeps per token per vocabulary entry for the loss, at 2-byte
    elements."""
    kind_efficiency: Mapping[str, float] = field(default_factory=dict)
    """Measured max_efficiency per layer kind (`llm.block`, `vision.block`, `llm.head`, ...),
    overriding max_efficiency for that kind; written by `mmpipe profile`."""
    kind_overhead_s: Mapping[str, float] = field(default_factory=dict)
    """Measured per-pass overhead per layer kind, overriding op_overhead_s for that kind."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("hardware.name is empty; name the machine, e.g. h100")
        for key in ("peak_flops", "memory_gb", "link_gbps", "max_efficiency", "half_tokens",
                    "usable_fraction", "act_bytes_per_hidden", "logits_bytes_per_vocab"):
            _check_positive(key, getattr(self, key))
        for key in ("link_latency_s", "op_overhead_s", "micro_batch_overhead_s", "step_overhead_s",
                    "reserved_gb", "memory_slack", "recompute_bytes_per_hidden", "io_bytes_per_hidden"):
            _check_nonneg(key, getattr(self, key))
        if self.max_efficiency > 1:
            raise ValueError(f"hardware.max_efficiency={self.max_efficiency} is above 1; "
                             f"give a fraction of peak_flops, e.g. 0.65")
        if self.usable_fraction > 1:
            raise ValueError(f"hardware.usable_fraction={self.usable_fraction} is above 1; "
                             f"give a fraction of memory_gb, e.g. 0.9")
        for kind, eff in self.kind_efficiency.items():
            if not (isinstance(eff, (int, float)) and 0 < eff <= 1):
                raise ValueError(f"hardware.kind_efficiency.{kind}={eff!r} must be in (0, 1]")
        for kind, ovh in self.kind_overhead_s.items():
            if not (isinstance(ovh, (int, float)) and ovh >= 0):
                raise ValueError(f"hardware.kind_overhead_s.{kind}={ovh!r} must be >= 0")

    @property
    def usable_bytes(self) -> float:
        """Bytes the planner may fill on one device."""
        return self.memory_gb * GB * self.usable_fraction - self.reserved_gb * GB

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * GB

    def efficiency_max(self, kind: str) -> float:
        """Top of the efficiency curve for a layer kind such as `llm.block` (a windowed vision
        block, `vision.window`, runs at a vision block's measured figure unless it has its own)."""
        fallback = self.kind_efficiency.get(KIND_FALLBACK.get(kind, kind), self.max_efficiency)
        return float(self.kind_efficiency.get(kind, fallback))

    def overhead(self, kind: str) -> float:
        """Per-pass fixed time of a layer kind."""
        fallback = self.kind_overhead_s.get(KIND_FALLBACK.get(kind, kind), self.op_overhead_s)
        return float(self.kind_overhead_s.get(kind, fallback))

    def replica_seconds(self, makespan: float, micro_batches: int) -> float:
        """A replica's step time: its simulated makespan plus the runtime's fixed cost per
        micro-batch (`step_overhead_s` comes once per step on top, `step_seconds`)."""
        return makespan + self.micro_batch_overhead_s * micro_batches

    def step_seconds(self, slowest_replica: float) -> float:
        """The step time from its slowest replica's time (`replica_seconds`)."""
        return slowest_replica + self.step_overhead_s


def hardware_from_dict(d: Mapping[str, Any]) -> HardwareSpec:
    """Build a HardwareSpec from a plain mapping (a resolved `hardware` config group).

    Unknown keys and values of the wrong type are errors naming `hardware.<key>`.
    """
    known = {f.name: f for f in fields(HardwareSpec)}
    kwargs: dict[str, Any] = {}
    for key, value in dict(d).items():
        if key in ORIGIN_KEYS:
            continue
        if key in RUN_STATE_KEYS:
            raise ValueError(f"hardware.{key} is no longer a hardware setting: the bytes of weights, "
                             f"gradients, optimizer states and stage boundaries follow "
                             f"train.precision, train.zero_stage and train.optimizer; delete the line")
        if key not in known:
            raise ValueError(f"hardware.{key} is not a hardware setting; known: "
                             f"{', '.join(sorted(known))}")
        if key == "name":
            kwargs[key] = str(value)
        elif key in ("kind_efficiency", "kind_overhead_s"):
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise ValueError(f"hardware.{key}={value!r} must be a mapping such as "
                                 f"{{llm.block: 0.6}}")
            kwargs[key] = {str(k): _number(f"hardware.{key}.{k}", v) for k, v in value.items()}
        else:
            kwargs[key] = _number(f"hardware.{key}", value)
    missing = [k for k in ("name", "peak_flops", "memory_gb", "link_gbps") if k not in kwargs]
    if missing:
        raise ValueError(f"hardware.{missing[0]} is missing; a hardware preset needs name, "
                         f"peak_flops, memory_gb and link_gbps")
    return HardwareSpec(**kwargs)


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    """The inverse of hardware_from_dict (what `mmpipe profile` writes as YAML)."""
    out: dict[str, Any] = {}
    for f in fields(HardwareSpec):
        v = getattr(hw, f.name)
        out[f.name] = dict(v) if isinstance(v, Mapping) else v
    return out


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)  # YAML may give "1e12" as a string
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a number") from None
    return float(value)


def _check_positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"hardware.{key}={value!r} must be > 0")


def _check_nonneg(key: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"hardware.{key}={value!r} must be >= 0")
