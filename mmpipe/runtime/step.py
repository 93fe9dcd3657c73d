"""What one training step carries from one part of the loop to the next (runtime/train.py): the
step as fed (`FedStep`) and as trained (`TrainedStep`). Their own module because the loop
builds them and its metrics (runtime/step_metrics.py) read them."""

from __future__ import annotations

from dataclasses import dataclass

from mmpipe.runtime.batch import MicroBatch
from mmpipe.runtime.feed import PlannedStep
from mmpipe.runtime.spread import EncodeStep

__all__ = ["FedStep", "TrainedStep"]


@dataclass(frozen=True, slots=True)
class FedStep:
    """A step's micro-batches on this rank, with the whole step's figures (every replica)."""

    planned: PlannedStep | None
    micro_batches: list[MicroBatch]
    encode: EncodeStep | None
    """The step's spread-tower shares (plan.encoders), on every rank; None without."""
    label_tokens: int
    samples: int
    tokens: int
    """LLM tokens of the step's samples (every replica), padding not counted."""
    pad_tokens: int
    """Padding tokens plan.ladder added to them (every replica; 0 without a ladder)."""
    ideal_s: float
    """The step's samples (every replica) at the hardware config's peak rates, forward and
    backward, s: pp x dp times the step's lower bound."""
    flops: float
    """The step's model FLOPs (every replica; encoders included)."""
    predicted_s: float
    """The slowest replica's simulated step time."""
    compute_s: float
    """That replica's simulated compute, without the fixed costs (the re-fit's regressor)."""
    slow_micro_batches: int
    """That replica's micro-batch count."""
    started: float
    """perf_counter() when the step began."""


@dataclass(frozen=True, slots=True)
class TrainedStep:
    """What one optimizer step did, measured on this rank."""

    loss: float
    grad_norm: float
    """Global, before clipping."""
    nonfinite: bool
    lr: float
    """The rate the step trained with."""
    loss_scale: float | None
    """fp16: the scale the step's backward ran with."""
    engine_s: float
    """engine.train_batch's time."""
    step_s: float
    """The whole step's time, feeding and telemetry included."""
    stages: list[dict]
    """Every stage's busy, communication and optimizer seconds and peak memory."""
