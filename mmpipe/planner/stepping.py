"""Planning a run's steps on its cut: `StepPlanner` (built once per run, `.plan(features)` per
step: every replica's micro-batches, the simulated step time, per-stage busy time and predicted
peak memory), what a step's samples need whatever the plan (`step_work`), and the lengths a
run's packed micro-batches are padded to (`resolve_ladder`).

Every rank that plans the same samples with the same problem gets the same plan (the planner is
deterministic), so the ranks of a replica agree without talking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.cost import CostModel, ideal_compute_s, model_flops
from mmpipe.planner.hardware import GB
from mmpipe.planner.ladder import LLM_STREAM, Ladder, choose_ladder, pad_tokens, parse_ladder
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.problem import PlanProblem
from mmpipe.planner.samples import SampleTable, sample_table
from mmpipe.planner.spread import (
    SpreadModel,
    encode_costs,
    pipeline_stage_costs,
    plan_spread_step,
    reserve_bytes,
    spread_model,
)
from mmpipe.planner.stage_cost import stage_costs
from mmpipe.planner.stages import PACKED_POLICIES, check_policy, plan_replicas
from mmpipe.planner.step import Replicas, evaluate_step

UNLIMITED_MEMORY_GB = 1e6
"""Device memory a StepPlanner assumes when told to plan without the memory limit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """One step planned, and what the cost model predicts for it."""

    replicas: Replicas
    """Per replica, its micro-batches in execution order, each a list of indices into the
    step's samples."""
    step_time: float
    """Simulated step time: the slowest replica's 1F1B makespan and per-micro-batch overhead,
    plus the per-step overhead, s."""
    busy: tuple[tuple[float, ...], ...]
    """Per replica, the simulated compute time of each stage, s (empty for a replica that got
    no samples)."""
    peak_bytes: tuple[tuple[float, ...], ...]
    """Per replica, the predicted peak memory of each stage: what its rank holds before the
    model (`HardwareSpec.reserved_gb`), weights, gradients, optimizer states and the exact 1F1B
    in-flight activations (with the hardware's measured slack), bytes: what the runtime logs
    beside the measured peak of that stage's rank."""
    compute: tuple[float, ...]
    """Per replica, its simulated 1F1B makespan without the runtime's fixed costs, s (what
    the step-time re-fit, `StepCalibration`, regresses measured steps on); 0 for a replica
    without samples. With spread towers: pre-pass + makespan + post-pass."""
    encode: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Per replica, per pipeline stage: the indices (into the step's samples) of the samples
    whose media that stage's rank encodes for the spread towers (every spread tower of a
    sample on one rank, only samples of that replica, each sample with such media exactly
    once); empty tuples when no tower is spread."""
    encode_recompute: str = "none"
    """What the encode shares keep from the pre-pass to the post-pass: none (every
    activation), blocks (block inputs) or tower (the tower's input only); planner.spread."""
    encode_seconds: tuple[tuple[float, ...], ...] = ()
    """Per replica, per stage: its rank's encode time this step (pre-pass forward and
    post-pass), s; empty when no tower is spread."""
    padded: tuple[tuple[int, ...], ...] = ()
    """With a ladder (plan.ladder): per replica, the LLM length each micro-batch is padded to
    and priced at (its rung); empty without one."""
    pad_tokens: tuple[int, ...] = ()
    """With a ladder: per replica, the padding tokens its micro-batches get (the rungs less the
    samples' LLM tokens); empty without one."""


class StepPlanner:
    """Plans the steps of a run: built once from the run's problem and cut, then `plan` per step."""

    def __init__(self, problem: PlanProblem, stage_plan: StagePlan, *, ladder: Ladder | None = None,
                 memory_limit: bool = True) -> None:
        """Args:
            problem: the run (`problem.replicas`: how many replicas one `plan` call deals its
                samples to, dp when a step is planned across replicas, 1 when each replica
                plans its own share; `problem.placement`: the towers' placement, resolved,
                `choose_encoders(...).placement`: with a spread tower `plan` also says which
                rank encodes which sample, `StepPlan.encode`, and its step time and memory
                include the pre-pass, the post-pass and the all-reduce).
            stage_plan: the run's stage ranges and recompute.
            ladder: the lengths packed micro-batches are padded to (`resolve_ladder`; None:
                not padded; ignored by the padded policies): every micro-batch is priced at
                its padded length, and `StepPlan.padded` says each one's.
            memory_limit: False plans as if memory were unlimited: for a user's stages that
                already exceed it under the cost model (trained with a warning), planning
                within it would refuse samples or steps the user chose to run anyway.
        To re-plan with what the runtime measured, build a new StepPlanner on the problem with
        `calibrated_hardware(hardware, calibration.coef)` (runtime/feed.py does, once the
        run's re-fit has seen its warm-up steps).
        """
        check_policy(problem.policy)
        if not memory_limit:
            hardware = problem.hardware
            problem = dataclasses.replace(problem, hardware=dataclasses.replace(
                hardware, memory_gb=max(hardware.memory_gb, UNLIMITED_MEMORY_GB)))
        self.problem = problem
        self.policy = problem.policy
        self.micro_batches = problem.micro_batches
        self.replicas = problem.replica_count
        self.cost = problem.cost_model()
        self.spread: SpreadModel = spread_model(self.cost, problem.placement.mapping)
        self.stage_plan = stage_plan
        self.dp = problem.fixed_dp
        self.ladder = ladder if problem.policy in PACKED_POLICIES else None
        self.stage_costs = (pipeline_stage_costs(self.spread, stage_plan,
                                                 reserve_bytes(self.spread, encode_costs(self.spread, sample_table([])),
                                                               [], pp=stage_plan.pp, dp=self.dp))
                            if self.spread.active else
                            stage_costs(self.cost, stage_plan.stages, stage_plan.recompute))
        self.stage_costs = dataclasses.replace(self.stage_costs, ladder=self.ladder)
        self.resident = problem.hardware.reserved_gb * GB  # held by every rank whatever its plan

    @property
    def usable_bytes(self) -> float:
        """Bytes a rank may fill beside what it holds before its model (`peak_bytes` counts
        that too): usable memory less the headroom, plus `HardwareSpec.reserved_gb`."""
        return self.cost.usable_bytes + self.resident

    @property
    def packing(self) -> bool:
        """Whether micro-batches are packed (else padded to their longest sample)."""
        return self.policy in PACKED_POLICIES

    def plan(self, features: Sequence[SampleFeatures]) -> StepPlan:
        """Plan one step's samples (in stream order) and predict its time."""
        table = sample_table(features)
        pp = self.stage_plan.pp
        if not self.spread.active:
            reps = plan_replicas(self.policy, table, self.stage_costs, self.replicas, self.micro_batches)
            ev = evaluate_step(self.stage_costs, table, reps, packing=self.packing)
            return StepPlan(replicas=[[list(mb) for mb in rep] for rep in reps], step_time=ev.step_time,
                            busy=tuple(tuple(r.busy) if r is not None else () for r in ev.replicas),
                            peak_bytes=tuple(tuple(self.resident + b for b in rep) for rep in ev.replica_peaks),
                            compute=tuple(float(r.makespan) if r is not None else 0.0 for r in ev.replicas),
                            encode=tuple(((),) * pp for _ in reps), **self._padding(table, reps))
        sm = self.spread
        _, reps, ev, sp = plan_spread_step(
            sm, encode_costs(sm, table), table, range(len(table)), self.stage_plan,
            lambda sc: plan_replicas(self.policy, table, sc, self.replicas, self.micro_batches),
            pp=pp, dp=self.replicas, packing=self.packing, ladder=self.ladder)
        return StepPlan(replicas=[[list(mb) for mb in rep] for rep in reps], step_time=sp.step_time,
                        busy=tuple(tuple(r.busy) if r is not None else () for r in ev.replicas),
                        peak_bytes=tuple(tuple(self.resident + b for b in rep) for rep in sp.peaks),
                        compute=sp.compute, encode=sp.encode, encode_recompute=sp.mode,
                        encode_seconds=sp.loads, **self._padding(table, reps))

    def _padding(self, table: SampleTable, reps: Replicas) -> dict:
        """StepPlan's `padded` and `pad_tokens` under the ladder (nothing without one)."""
        if self.ladder is None:
            return {}
        llm = table.tokens[:, LLM_STREAM]
        lengths = [[int(llm[mb].sum()) for mb in rep] for rep in reps]
        padded = tuple(tuple(self.ladder.pad_to(n) for n in rep) for rep in lengths)
        return {"padded": padded,
                "pad_tokens": tuple(int(pad_tokens(self.ladder, np.array(rep, dtype=float)).sum()) for rep in lengths)}


# -- what a step's samples need: its lower bound and its model FLOPs -----------------------

@dataclass(frozen=True, slots=True)
class StepWork:
    """The compute some samples need, whatever the plan."""

    ideal_s: float
    """Forward + backward time at the hardware's peak efficiency, no overhead, padding or
    recompute (summed over the step's samples and divided by pp x dp, the step's lower bound)."""
    flops: float
    """Model FLOPs (encoders, projectors and decoder; forward and the backward each layer needs)."""


def step_work(cost: CostModel, features: Sequence[SampleFeatures]) -> StepWork:
    """`StepWork` of these samples under `cost` (a StepPlanner's `.cost`)."""
    if not features:
        return StepWork(ideal_s=0.0, flops=0.0)
    table = sample_table(list(features))
    return StepWork(ideal_s=ideal_compute_s(cost, table), flops=model_flops(cost, table))


# -- the lengths packed micro-batches are padded to (plan.ladder) -------------------------

def resolve_ladder(problem: PlanProblem, stage_plan: StagePlan, value: object, *, compiles: bool,
                   steps: Sequence[Sequence[SampleFeatures]], memory_limit: bool = True) -> Ladder | None:
    """plan.ladder for a run (None: micro-batches keep their packed length).

    Args:
        problem, stage_plan, memory_limit: the run's `StepPlanner`; a padded policy
            (ds-default, llava-grouped) never gets a ladder.
        value: plan.ladder (`auto`, `off` or rungs; ValueError in one line if bad).
        compiles: the run's attention kernel compiles per sequence length (FlexAttention on
            CUDA): only then does `auto` pad, so CPU runs and flash-attn runs stay unpadded.
        steps: the probe steps (each what one `StepPlanner.plan` call gets) whose packed
            micro-batch lengths `auto` spans with its rungs (ladder.choose_ladder).
    """
    v = parse_ladder(value)
    if v == "off" or problem.policy not in PACKED_POLICIES:
        return None
    if isinstance(v, tuple):
        return Ladder(v)
    if not compiles:
        return None
    sp = StepPlanner(problem, stage_plan, memory_limit=memory_limit)
    lengths = [sum(st[i].llm_len for i in mb) for st in steps if st
               for rep in sp.plan(list(st)).replicas for mb in rep]
    return choose_ladder(lengths)
