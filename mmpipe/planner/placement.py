"""Where a run's encoder towers run (plan.encoders): each placement the problem asks for gets
its best plan, and the fastest by simulated step time is kept (`choose_encoders`).

The value itself (`Placement`, the one parse of plan.encoders) is planner/problem.py's; what a
spread tower costs is planner/spread.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.problem import Placement, PlanProblem
from mmpipe.planner.spread import candidate_cuts, spread_model
from mmpipe.planner.stages import plan_stages
from mmpipe.planner.stepping import StepPlanner


@dataclass(frozen=True, slots=True)
class EncoderChoice:
    """The placements of the encoder towers compared, and the one chosen."""

    placement: Placement
    """The chosen placement of every tower of the model (`stages` | `spread`)."""
    stage_plan: StagePlan
    """Its stage plan (ranges over every layer, docs/spec.md section 4)."""
    candidates: tuple[tuple[Placement, float, StagePlan | None], ...]
    """Each placement compared, in `Placement.candidates` order: its summed simulated step
    time over the steps, s (inf when it does not fit), and its stage plan."""

    def times(self) -> dict[str, float]:
        """Summed simulated step time per placement name (`stages`, `spread`, ...)."""
        return {e.name: t for e, t, _ in self.candidates}


def choose_encoders(problem: PlanProblem, steps: Sequence[Sequence[SampleFeatures]],
                    stage_plan: StagePlan | None = None) -> EncoderChoice:
    """Resolve `problem.placement` for a run: with `auto`, every candidate placement (all
    stages; every tower spread; with two towers, the two mixed ones) gets its best plan (the
    stages `plan_stages` cuts for it on all of `steps`' samples, or the user's `stage_plan`),
    each step of `steps` is planned with a `StepPlanner` of that placement, and the placement
    with the least summed simulated step time wins (one off the stages only by OFF_STAGE_MARGIN;
    ties: the earlier candidate, so stages
    first); a placement that cannot hold a step counts as infinitely slow (when none can, the
    first with a stage plan is returned, so a user's `stage_plan` over memory is still trained
    with warnings; ValueError when no placement even has a stage plan). A resolved placement is
    priced the same way, alone.

    Args:
        steps: each the features one `StepPlanner.plan` call of the run receives (every
            replica's samples when steps are planned across replicas, `problem.replicas` =
            dp; one replica's, `problem.replicas` = 1).
    """
    sample = [f for st in steps for f in st]
    out: list[tuple[Placement, float, StagePlan | None]] = []
    errors: list[str] = []
    for enc in problem.placement.candidates(problem.model):
        one = dataclasses.replace(problem, placement=enc)
        plan: StagePlan | None = stage_plan
        try:
            staged = out[0][2] if out and not out[0][0].spread and stage_plan is None else None  # stages first
            cuts = candidate_cuts(spread_model(one.cost_model(), enc.mapping), plan or plan_stages(one, sample),
                                  staged)
            total, plan = _summed_time(one, cuts[0], steps), cuts[0]
            for cut in cuts[1:]:
                try:
                    t = _summed_time(one, cut, steps)
                except ValueError:  # this placement cannot run the towers' cut: the first stands
                    continue
                if t < total:
                    total, plan = t, cut
        except ValueError as err:  # a stage or a sample this placement cannot hold
            total = math.inf
            errors.append(f"{enc.name}: {err}")
        out.append((enc, total, plan))
    # the fastest (an off-stage one by OFF_STAGE_MARGIN); when none fits, the first that has a
    # stage plan (the user's stage plan is kept even over memory: the caller warns and trains it,
    # as without spread towers)
    best = min((i for i in range(len(out)) if out[i][2] is not None),
               key=lambda i: (out[i][0].ranking_time(out[i][1]), i), default=None)
    if best is None:
        raise ValueError(f"plan.encoders={problem.placement.given}: no placement of the encoder towers "
                         f"can be planned on these steps ({errors[0]})")
    enc, _, plan = out[best]
    assert plan is not None
    return EncoderChoice(placement=enc, stage_plan=plan, candidates=tuple(out))


def _summed_time(problem: PlanProblem, plan: StagePlan, steps: Sequence[Sequence[SampleFeatures]]) -> float:
    """The steps' summed simulated time on `plan` (inf when a step does not fit; ValueError
    when the placement cannot run that cut)."""
    planner = StepPlanner(problem, plan)
    planned = [planner.plan(list(st)) for st in steps]
    fits = all(max(max(rep, default=0.0) for rep in p.peak_bytes) <= planner.usable_bytes * (1 + 1e-9)
               for p in planned)
    return sum(p.step_time for p in planned) if fits else math.inf
