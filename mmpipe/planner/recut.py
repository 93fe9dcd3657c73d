"""Whether to re-cut a running pipeline (plan.recut=auto): the run's recent steps planned on
its current cut and on the cut `plan_stages` chooses for them, with the same planner and
hardware (the run's step-time re-fit); `RecutChoice.recut` when another cut is predicted
faster by more than plan.recut_gain (a cut that cannot hold the samples in memory counts as
infinitely slow). The launcher's side (the request, the relaunch config) is runtime/recut.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.problem import PlanProblem
from mmpipe.planner.stages import plan_stages
from mmpipe.planner.stepping import StepPlanner


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


def consider_recut(problem: PlanProblem, current: StagePlan, steps: Sequence[Sequence[SampleFeatures]],
                   threshold: float) -> RecutChoice:
    """Compare the current cut with the planner's cut for `steps` (each the features one
    `StepPlanner.plan` call of the run receives: every replica's samples when steps are planned
    across replicas, `problem.replicas` = dp, else one replica's, `problem.replicas` = 1), both
    under the run's encoder placement (`problem.placement`, resolved)."""
    candidate = plan_stages(problem, [f for s in steps for f in s])

    def total(plan: StagePlan) -> float:
        planner = StepPlanner(problem, plan)
        try:
            return sum(planner.plan(list(s)).step_time for s in steps)
        except ValueError:  # a sample this cut cannot hold in memory: any cut that can is better
            return math.inf

    same = candidate == current
    current_s = total(current)
    return RecutChoice(current=current, candidate=candidate, current_s=current_s,
                       candidate_s=current_s if same else total(candidate), steps=len(steps), threshold=threshold)
