"""Re-cutting a running pipeline: whether another stage cut would train the steps the run has
just trained faster, by more than a threshold (plan.recut=auto).

The run's recent steps (the features of their samples, as the feeder planned them) are
planned twice with the same planner and micro-batch policy: once on the run's current cut,
once on the cut `plan_stages` chooses for those samples; both are priced with the same
hardware (the run's step-time re-fit when it has one). The predicted gain is the ratio of
their summed simulated step times, minus one. Pure: the runtime gathers the inputs and acts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec
from mmpipe.planner.api import StepPlanner, plan_stages
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.precision import TrainingPrecision

__all__ = ["RecutChoice", "consider_recut", "describe_gain"]


@dataclass(frozen=True, slots=True)
class RecutChoice:
    """The comparison behind a re-cut decision."""

    current: StagePlan
    """The run's cut."""
    candidate: StagePlan
    """The cut the planner chooses for the recent steps."""
    current_s: float
    """Summed simulated time of the recent steps on the current cut, s."""
    candidate_s: float
    """The same on the candidate cut, s."""
    steps: int
    """How many recent steps were compared."""
    threshold: float
    """plan.recut_gain."""

    @property
    def gain(self) -> float:
        """Predicted speed-up of the candidate, as a fraction (0.1: 10% faster; inf: the current
        cut cannot hold some of the samples in memory)."""
        if self.current_s == self.candidate_s:
            return 0.0
        return self.current_s / self.candidate_s - 1.0 if self.candidate_s > 0 else 0.0

    @property
    def recut(self) -> bool:
        """Re-cut: another cut, predicted faster by more than the threshold."""
        return self.candidate != self.current and self.gain > self.threshold

    def record(self) -> dict:
        """JSON-able: what metrics.jsonl and the re-cut request hold (`predicted_old_s` and
        `predicted_gain` null when the current cut cannot hold the samples: `current_fits`)."""
        fits = math.isfinite(self.current_s)
        return {"old": [list(s) for s in self.current.stages], "new": [list(s) for s in self.candidate.stages],
                "old_recompute": list(self.current.recompute), "new_recompute": list(self.candidate.recompute),
                "predicted_old_s": self.current_s if fits else None, "predicted_new_s": self.candidate_s,
                "predicted_gain": self.gain if fits else None, "current_fits": fits, "threshold": self.threshold,
                "steps_compared": self.steps, "recut": self.recut}


def describe_gain(record: dict) -> str:
    """A re-cut record's predicted gain, in words."""
    if not record.get("current_fits", True):
        return "the current cut cannot hold the recent samples in memory"
    return f"predicted {record['predicted_gain']:+.1%} faster"


def consider_recut(*, model: ModelSpec, hardware: HardwareSpec, trainable: tuple[str, ...], pp: int, dp: int,
                   current: StagePlan, steps: Sequence[Sequence[SampleFeatures]], policy: str, micro_batches: int,
                   replicas: int, threshold: float, precision: TrainingPrecision, memory_headroom: float,
                   lora: LoraSpec = NO_LORA) -> RecutChoice:
    """Compare the current cut with the planner's cut for `steps` (each the features one
    `StepPlanner.plan` call of the run receives: every replica's samples when steps are planned
    across replicas, `replicas` = dp, else one replica's, `replicas` = 1)."""
    common = dict(model=model, hardware=hardware, trainable=trainable, dp=dp, policy=policy,
                  micro_batches=micro_batches, precision=precision, memory_headroom=memory_headroom, lora=lora)
    candidate = plan_stages(pp=pp, sample=[f for s in steps for f in s], **common)

    def total(plan: StagePlan) -> float:
        planner = StepPlanner(stage_plan=plan, replicas=replicas, **common)
        try:
            return sum(planner.plan(list(s)).step_time for s in steps)
        except ValueError:  # a sample this cut cannot hold in memory: any cut that can is better
            return math.inf

    same = candidate == current
    current_s = total(current)
    return RecutChoice(current=current, candidate=candidate, current_s=current_s,
                       candidate_s=current_s if same else total(candidate), steps=len(steps), threshold=threshold)
