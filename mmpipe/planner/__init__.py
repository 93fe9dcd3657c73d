"""Data-aware pipeline planning: cost model, schedules, simulator, partitioner, balancer.

Entry points: `mmpipe.planner.api` (plan_stages, plan_step, validate_trainable) for the
runtime, `mmpipe.planner.command.run_plan` for `mmpipe plan`. Everything here is pure: plain
values in, plain values out, no torch.distributed.
"""

from mmpipe.planner.api import POLICIES, StagePlan, plan_stages, plan_step, validate_trainable
from mmpipe.planner.cost import CostModel, build_cost_model
from mmpipe.planner.hardware import HardwareSpec, hardware_from_dict

__all__ = ["POLICIES", "CostModel", "HardwareSpec", "StagePlan", "build_cost_model",
           "hardware_from_dict", "plan_stages", "plan_step", "validate_trainable"]
