"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmpipe.config import RunConfig, hardware_spec, training_precision
from mmpipe.data.skips import SkipCounter
from mmpipe.model.geometry import SampleFeatures, features
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import StagePlan, plan_stages, stage_memory_warnings
from mmpipe.runtime.stream import make_stream


@dataclass(frozen=True, kw_only=True, slots=True)
class ChosenStages:
    """A run's stage plan and where it came from."""

    plan: StagePlan
    """Stage ranges and recompute."""
    source: str
    """`override` (plan.stages) or `planner (<policy>)`."""
    warnings: tuple[str, ...] = ()
    """Problems the cost model sees with these stages (e.g. a stage over memory)."""


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of each layer, counted on the meta device (no memory, any model size)."""
    if spec.hf is not None:
        from mmpipe.model.hf import layer_params

        counts_by_name = layer_params(spec)
        return [counts_by_name[n] for n in layer_names(spec)]
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


def choose_stages(rc: RunConfig, tokenizer) -> ChosenStages:
    """The user's override when given (it always wins; the planner checks it against memory),
    else the policy's partition, planned on the first steps of the real data with the
    configured hardware's cost model."""
    common = dict(model=rc.model, hardware=hardware_spec(rc), dp=rc.parallel.dp, trainable=rc.train.trainable,
                  micro_batches=rc.train.micro_batches, policy=rc.plan.policy,
                  precision=training_precision(rc), memory_headroom=rc.plan.memory_headroom, lora=rc.train.lora)
    if rc.stage_bounds is not None:
        plan = StagePlan(stages=rc.stage_bounds, recompute=rc.plan.recompute or ())
        return ChosenStages(plan=plan, source="override", warnings=stage_memory_warnings(
            stage_plan=plan, sample=workload_sample(rc, tokenizer, steps=1), **common))
    plan = plan_stages(pp=rc.parallel.pp, sample=workload_sample(rc, tokenizer), **common)
    return ChosenStages(plan=plan, source=f"planner ({rc.plan.policy})")


def format_stage_table(rc: RunConfig, choice: ChosenStages, names: list[str]) -> str:
    counts = layer_param_counts(rc.model)
    plan = choice.plan
    lines = [f"pipeline: {plan.pp} stages x {rc.parallel.dp} replicas, "
             f"stages from {choice.source}"]
    lines.append(f"{'stage':>5}  {'layers':<36} {'count':>5} {'params':>10}  recompute")
    for s, (a, b) in enumerate(plan.stages):
        span = f"{names[a]} .. {names[b - 1]}" if b - a > 1 else names[a]
        lines.append(f"{s:>5}  {span:<36} {b - a:>5} {sum(counts[a:b]):>10,}  {plan.recompute[s]}")
    return "\n".join(lines)
