"""The planner's one entry for the runtime and the commands (`runtime/` imports nothing else of
the planner): names only, each defined in the module of its concept.

Every planning entry takes a `PlanProblem` (planner/problem.py: the model, hardware, what
trains, precision, LoRA, headroom, policy, micro-batch rules, layout and the towers'
`Placement`; `config.plan_problem(rc)` builds it from a run's config) and only what varies per
call:

    plan_stages(problem, sample) -> StagePlan                              planner/stages.py
        problem.pp contiguous stages (and recompute per stage) for the policy, judged on
        `sample` (features of representative samples, e.g. one step).
    stage_memory_warnings(problem, stage_plan, sample) -> tuple[str, ...]  planner/stages.py
        One line per stage of a user's stage plan that exceeds memory under the cost model.
    plan_step(problem, stage_plan, features) -> Replicas                   planner/stages.py
        `StepPlanner.plan` without the prediction.
    StepPlanner(problem, stage_plan, *, ladder, memory_limit)              planner/stepping.py
        Built once per run; `.plan(features) -> StepPlan` plans one step's samples (in stream
        order): per replica the ordered micro-batches as indices into `features`, with the
        simulated step time, per-stage busy time and predicted peak memory.
    resolve_ladder(problem, stage_plan, value, *, compiles, steps, ...)    planner/stepping.py
        plan.ladder for a run: explicit rungs as given; `auto` (only where the attention kernel
        compiles) the rungs that pad least the packed rows the planner makes on `steps`.
    choose_layout(problem, sample, probe_steps) -> LayoutChoice            planner/layout.py
        parallel.pp=auto / parallel.dp=auto: rank every pp x dp split of problem.devices on
        the first steps of `sample`; `.best` has pp, dp and the stage plan it was priced with.
    choose_encoders(problem, steps, stage_plan) -> EncoderChoice           planner/placement.py
        plan.encoders for a run: each candidate placement's best plan, the fastest kept.
    consider_recut(problem, current, steps, threshold) -> RecutChoice      planner/recut.py
        plan.recut=auto: the run's recent steps on the current cut and on the cut plan_stages
        chooses for them; `.recut` when another cut is predicted faster by more than the
        threshold.

And what the runtime and the config take beside them: `calibrated_hardware(hardware, coef)`
(a StepCalibration fit as HardwareSpec constants), `step_work` (a step's lower bound and model
FLOPs), `validate_trainable`, `check_policy`, the plan.encoders grammar (`Placement`,
`check_encoders_value`, `show_encoders`, `placement_name`), plan.ladder's `parse_ladder`,
hardware files (`hardware_from_dict`, `hardware_to_dict`) and `mmpipe profile`'s layer streams
(`packed_streams`, `layer_stream`). Policies: data-aware, ds-default, llava-grouped,
packed-ffd. The plan's contract is docs/spec.md section 4.
"""

from __future__ import annotations

from mmpipe.planner.calibrate import Coef, StepCalibration, calibrated_hardware
from mmpipe.planner.cost import (
    DEFAULT_HEADROOM,
    DEFAULT_PRECISION,
    CostModel,
    build_cost_model,
    check_headroom,
    layer_stream,
    validate_trainable,
)
from mmpipe.planner.hardware import HardwareSpec, hardware_from_dict, hardware_to_dict
from mmpipe.planner.ladder import PAST_TOP_GROWTH, Ladder, parse_ladder
from mmpipe.planner.layout import Layout, LayoutChoice, choose_layout
from mmpipe.planner.nested import BACKWARD, ENCODE, FORWARD, TOWER_BACKWARD
from mmpipe.planner.nested import program as nested_program
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.placement import EncoderChoice, choose_encoders
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.problem import (
    Placement,
    PlanProblem,
    check_encoders_value,
    placement_name,
    show_encoders,
)
from mmpipe.planner.recut import RecutChoice, consider_recut, describe_gain
from mmpipe.planner.samples import packed_streams
from mmpipe.planner.stages import (
    PACKED_POLICIES,
    POLICIES,
    check_policy,
    plan_stages,
    plan_step,
    stage_memory_warnings,
)
from mmpipe.planner.step import Replicas
from mmpipe.planner.stepping import StepPlan, StepPlanner, StepWork, resolve_ladder, step_work

__all__ = ["DEFAULT_HEADROOM", "DEFAULT_PRECISION", "PACKED_POLICIES", "PAST_TOP_GROWTH", "POLICIES", "Coef",
           "CostModel", "EncoderChoice", "HardwareSpec", "Ladder", "Layout", "LayoutChoice", "Placement",
           "PlanProblem", "RecutChoice", "Replicas", "StagePlan", "StepCalibration", "StepPlan", "StepPlanner",
           "StepWork", "TrainingPrecision", "build_cost_model", "calibrated_hardware", "check_encoders_value",
           "check_headroom", "check_policy", "choose_encoders", "choose_layout", "consider_recut", "describe_gain",
           "hardware_from_dict", "hardware_to_dict", "layer_stream", "packed_streams", "parse_ladder",
           "BACKWARD", "ENCODE", "FORWARD", "TOWER_BACKWARD", "nested_program", "placement_name",
           "plan_stages", "plan_step", "resolve_ladder", "show_encoders",
           "stage_memory_warnings",
           "step_work", "validate_trainable"]
