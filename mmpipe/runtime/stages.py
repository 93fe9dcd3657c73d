"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmpipe.config import RunConfig, hardware_spec
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import PACKED_POLICIES, plan_stages, plan_step
from mmpipe.planner.cost import build_cost_model, sample_table, stage_costs
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.step import evaluate_step
from mmpipe.model.geometry import SampleFeatures, features


@dataclass(frozen=True, kw_only=True, slots=True)
class StageChoice:
    """Stage boundaries of a run and where they came from."""

    stages: list[tuple[int, int]]
    """[start, end) layer indices per stage."""
    recompute: list[bool]
    """Activation recomputation per stage."""
    source: str
    """`override` (plan.stages) or `planner (<policy>)`."""
    warnings: tuple[str, ...] = ()
    """Problems the cost model sees with these stages (e.g. a stage over memory)."""


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of each layer, counted on the meta device (no memory, any model size)."""
    from mmpipe.model.layers import build_layer

    counts = []
    with torch.device("meta"):
        for name in layer_names(spec):
            layer = build_layer(spec, name, seed=0, image_token=0, audio_token=0)
            counts.append(sum(p.numel() for p in layer.parameters()))
    return counts


def workload_sample(rc: RunConfig, tokenizer, *, steps: int = 4) -> list[SampleFeatures]:
    """Features of the first `steps` steps of every replica, from the samples' metadata only
    (no media decoded), read exactly as training will read them (shards or a mixture).

    Every rank computes the same list, so every rank derives the same stage plan without
    talking to the others.
    """
    from mmpipe.data.skips import SkipCounter
    from mmpipe.runtime.feed import make_stream

    across = rc.plan.across_replicas  # then one stream holds every replica's samples
    per_stream = rc.train.global_batch // (1 if across else rc.parallel.dp)
    out: list[SampleFeatures] = []
    for r in range(1 if across else rc.parallel.dp):
        stream = make_stream(rc, tokenizer=tokenizer, dp_rank=r, skips=SkipCounter())
        for n, rec in enumerate(stream.records()):
            if n >= per_stream * steps:
                break
            out.append(features(rc.model, rec.meta))
    return out


def choose_stages(rc: RunConfig, tokenizer) -> StageChoice:
    """The user's override when given (it always wins), else the policy's partition, planned
    on the first steps of the real data with the configured hardware's cost model."""
    pp = rc.parallel.pp
    if rc.stage_bounds is not None:
        stages = rc.stage_bounds
        return StageChoice(stages=stages, recompute=[False] * pp, source="override",
                           warnings=memory_warnings(rc, tokenizer, stages, [False] * pp))
    plan = plan_stages(model=rc.model, hardware=hardware_spec(rc), pp=pp, dp=rc.parallel.dp,
                       trainable=rc.train.trainable, sample=workload_sample(rc, tokenizer),
                       micro_batches=rc.train.micro_batches, policy=rc.plan.policy)
    return StageChoice(stages=list(plan.stages), recompute=list(plan.recompute),
                       source=f"planner ({rc.plan.policy})")


def memory_warnings(rc: RunConfig, tokenizer, stages: list[tuple[int, int]],
                    recompute: list[bool]) -> tuple[str, ...]:
    """Stages whose planned peak memory exceeds the device under the cost model (a user's
    override is trained anyway; the user hears which stage and by how much)."""
    hw = hardware_spec(rc)
    cost = build_cost_model(model=rc.model, hardware=hw, trainable=rc.train.trainable, dp=rc.parallel.dp)
    try:
        sc = stage_costs(cost, stages, recompute)
    except ValueError as err:  # weights alone do not fit: still the user's call
        return (f"plan.stages: {err}",)
    feats = workload_sample(rc, tokenizer, steps=1)
    plan = StagePlan(stages=list(stages), recompute=list(recompute))
    try:
        reps = plan_step(policy=rc.plan.policy, features=feats, stage_plan=plan, cost=cost, dp=rc.parallel.dp,
                         micro_batches=rc.train.micro_batches)
    except ValueError as err:  # e.g. a sample that fits on no micro-batch
        return (f"plan.stages: {err}",)
    ev = evaluate_step(sc, sample_table(feats), reps, packing=rc.plan.policy in PACKED_POLICIES)
    names = layer_names(rc.model)
    out = []
    for s, (a, b) in enumerate(stages):
        need, usable = float(ev.peak_bytes[s]), float(ev.usable)
        if need > usable:
            out.append(f"plan.stages: stage {s} ({names[a]}..{names[b - 1]}) needs {need / 1e9:.3g} GB under "
                       f"the cost model, {(need - usable) / 1e9:.3g} GB more than the {usable / 1e9:.3g} GB usable "
                       f"on hardware {hw.name}; it may run out of memory (move layers off it, or enable recompute)")
    return tuple(out)


def format_stage_table(rc: RunConfig, choice: StageChoice, names: list[str]) -> str:
    counts = layer_param_counts(rc.model)
    lines = [f"pipeline: {len(choice.stages)} stages x {rc.parallel.dp} replicas, "
             f"stages from {choice.source}"]
    lines.append(f"{'stage':>5}  {'layers':<36} {'count':>5} {'params':>10}  recompute")
    for s, (a, b) in enumerate(choice.stages):
        span = f"{names[a]} .. {names[b - 1]}" if b - a > 1 else names[a]
        lines.append(f"{s:>5}  {span:<36} {b - a:>5} {sum(counts[a:b]):>10,}  {choice.recompute[s]}")
    return "\n".join(lines)
