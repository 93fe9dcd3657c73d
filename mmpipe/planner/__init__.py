"""Data-aware pipeline planning: cost model, schedules, simulator, partitioner, balancer.

Entry points: `mmpipe.planner.api` (plan_stages, StepPlanner, stage_memory_warnings and what
the runtime and config take from the planner), `mmpipe.planner.command.run_plan` for
`mmpipe plan`. Everything here is pure: plain values in, plain values out, no torch.
"""
