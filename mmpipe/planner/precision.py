"""What a run keeps per parameter and per activation: precision, ZeRO stage and optimizer.

The bytes of a run's training state are facts of the run, not of the machine, so they live
here and `cost.build_cost_model` takes them as arguments (docs/spec.md section 6 states the
default: bf16 mixed precision, ZeRO-1, AdamW).

Per trainable parameter, every replica keeps its working weight and gradient in the run's
precision (2 + 2 bytes in bf16/fp16, 4 + 4 in fp32). The optimizer side is an fp32 master
copy (mixed precision only: fp32 training updates its weights in place) and one fp32 tensor
per optimizer state (AdamW: two moments; SGD as `runtime/pipeline.py: make_optimizer` builds
it, without momentum: none). ZeRO-1 shards the optimizer side over the `dp` replicas; ZeRO-0
keeps all of it on every replica. A frozen parameter is its weight only.

    bf16, ZeRO-1, AdamW:  4 + 12/dp    (the spec's figure; DeepSpeed's BF16_Optimizer keeps an
                                        fp32 gradient buffer too: 8 + 12/dp, `fp32_grad_accum`)
    bf16, ZeRO-0, AdamW:  16
    fp32, ZeRO-1, AdamW:  8 + 8/dp
    bf16, ZeRO-1, SGD:    4 + 4/dp

Activations and the hidden states sent between stages are tensors in the run's precision:
the per-token activation rules of `HardwareSpec` are stated for 2-byte activations and scale
with the element width (`activation_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Element bytes of the weights, gradients and activations of each train.precision."""
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}
"""fp32 tensors per parameter each train.optimizer keeps (SGD: no momentum, as the runtime
builds it)."""
ZERO_STAGES = (0, 1)
"""train.zero_stage values the pipeline engine runs."""
MASTER_BYTES = 4
"""An fp32 master weight (mixed precision) or one fp32 optimizer state, per parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingPrecision:
    """How a run stores its weights, gradients, optimizer states and activations."""

    precision: str = "bf16"
    """train.precision: fp32, bf16 or fp16 (the last two with fp32 master weights)."""
    zero_stage: int = 1
    """train.zero_stage: 1 shards master weights and optimizer states over the replicas, 0
    keeps them whole on every replica."""
    optimizer: str = "adamw"
    """train.optimizer: adamw (two fp32 moments) or sgd (none)."""
    fp32_grad_accum: bool = False
    """Every replica also keeps an fp32 gradient-accumulation buffer (4 more bytes per
    trainable parameter): DeepSpeed's BF16_Optimizer, which the runtime trains bf16 with, does.
    The spec's figures (docs/spec.md section 6) leave it out, so `mmpipe plan` prices it only
    for a run whose train.precision is given (config.training_precision)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is unknown; use "
                             f"{', '.join(PRECISIONS)}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"train.zero_stage={self.zero_stage!r} is not supported with pipeline "
                             f"parallelism; use 0 or 1")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"train.optimizer={self.optimizer!r} is unknown; use "
                             f"{', '.join(OPTIMIZER_STATES)}")

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight, gradient or activation element."""
        return PRECISIONS[self.precision]

    @property
    def activation_scale(self) -> float:
        """Factor on the per-token activation rules, which are stated for 2-byte elements."""
        return self.element_bytes / 2.0

    def replicated_bytes(self) -> float:
        """Bytes per trainable parameter on every replica: working weight and gradient (and
        the fp32 accumulation buffer where the optimizer keeps one)."""
        return 2.0 * self.element_bytes + (MASTER_BYTES if self.fp32_grad_accum else 0.0)

    def optimizer_bytes(self) -> float:
        """Bytes per trainable parameter of the optimizer side (master weight, states), whole."""
        master = MASTER_BYTES if self.precision != "fp32" else 0
        return float(master + MASTER_BYTES * OPTIMIZER_STATES[self.optimizer])

    def param_bytes(self, *, trainable: bool, dp: int) -> float:
        """Static bytes one parameter costs on its stage with `dp` data-parallel replicas."""
        if not trainable:
            return float(self.element_bytes)
        shards = dp if self.zero_stage == 1 else 1
        return self.replicated_bytes() + self.optimizer_bytes() / shards

    def describe(self) -> str:
        """One line for reports, e.g. `bf16, ZeRO-1, adamw`."""
        extra = ", fp32 gradient accumulation" if self.fp32_grad_accum else ""
        return f"{self.precision}, ZeRO-{self.zero_stage}, {self.optimizer}{extra}"
