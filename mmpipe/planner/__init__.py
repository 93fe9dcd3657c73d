"""Data-aware pipeline planning: cost model, schedules, simulator, partitioner, balancer.

Entry points: `mmpipe.planner.api` (plan_stages, StepPlanner, choose_encoders, consider_recut,
choose_layout, ... and what the runtime and config take from the planner), each taking a
`PlanProblem` (planner/problem.py), and `mmpipe.planner.command.run_plan` for `mmpipe plan`.
Everything here is pure: plain values in, plain values out, no torch.
"""
