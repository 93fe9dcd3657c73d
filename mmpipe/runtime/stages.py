"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from mmpipe.config import RunConfig, hardware_spec, training_precision
from mmpipe.data.skips import SkipCounter
from mmpipe.model import kernels
from mmpipe.model.geometry import SampleFeatures, features
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import (
    PAST_TOP_GROWTH,
    Ladder,
    StagePlan,
    choose_encoders,
    plan_stages,
    resolve_encoders,
    resolve_ladder,
    show_encoders,
    stage_memory_warnings,
)
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
    encoders: dict[str, str] = field(default_factory=dict)
    """plan.encoders resolved: each tower's placement, `stages` or `spread` (runtime/spread.py)."""
    placements: dict[str, float] = field(default_factory=dict)
    """plan.encoders=auto: each placement's summed simulated step time over the sample steps, s."""
    ladder: Ladder | None = None
    """plan.ladder resolved: the lengths packed micro-batches are padded to (`ladder.rungs`,
    the few shapes a compiled attention kernel sees); None: not padded."""

    @property
    def spread(self) -> tuple[str, ...]:
        """The spread towers, in the model's order."""
        return tuple(t for t in ("vision", "audio") if self.encoders.get(t) == "spread")


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


def step_planner_args(rc: RunConfig, *, stage_plan: StagePlan, encoders: dict[str, str] | None,
                      over_memory: bool = False) -> dict:
    """The StepPlanner arguments of a run's steps (runtime/feed.py plans with them; the ladder
    is chosen with them). `over_memory`: the user's stages exceed memory under the cost model
    and were accepted with a warning: their micro-batches are planned without the memory limit
    rather than refused."""
    return dict(model=rc.model, trainable=rc.train.trainable, dp=rc.parallel.dp, stage_plan=stage_plan,
                policy=rc.plan.policy, micro_batches=rc.train.micro_batches,
                replicas=rc.parallel.dp if rc.plan.across_replicas else 1, memory_limit=not over_memory,
                precision=training_precision(rc), memory_headroom=rc.plan.memory_headroom,
                lora=rc.train.lora, encoders=encoders or None)


def choose_stages(rc: RunConfig, tokenizer) -> ChosenStages:
    """The user's override when given (it always wins; the planner checks it against memory),
    else the policy's partition, planned on the first steps of the real data with the
    configured hardware's cost model; then the run's length ladder (`choose_ladder`)."""
    chosen = _choose_cut(rc, tokenizer)
    return dataclasses.replace(chosen, ladder=choose_ladder(rc, tokenizer, chosen))


def run_placement(rc: RunConfig, tokenizer) -> dict[str, str]:
    """plan.encoders as this run resolves it (tower -> stages | spread; `auto` priced on the first
    steps of the data, as the ranks will): what `mmpipe bench` runs every policy with."""
    return _choose_cut(rc, tokenizer).encoders


def choose_ladder(rc: RunConfig, tokenizer, chosen: ChosenStages) -> Ladder | None:
    """plan.ladder for this run: explicit rungs as given; auto only where the attention kernel
    compiles per length (model/kernels.py `compiles`), spanning the packed lengths the planner
    makes on the first steps of the data (workload_sample). Every rank derives the same ladder."""
    compiles = kernels.compiles(rc.train.attention, cuda=torch.cuda.is_available(), precision=rc.train.precision,
                                dropout=rc.model.llm.attention_dropout)
    steps: list[list[SampleFeatures]] = []
    if rc.plan.ladder == "auto" and compiles:
        per_step = rc.train.global_batch // (1 if rc.plan.across_replicas else rc.parallel.dp)
        sample = workload_sample(rc, tokenizer)
        steps = [sample[i:i + per_step] for i in range(0, len(sample), per_step)]
    return resolve_ladder(rc.plan.ladder, compiles=compiles, steps=steps, hardware=hardware_spec(rc),
                          **step_planner_args(rc, stage_plan=chosen.plan, encoders=chosen.encoders,
                                              over_memory=bool(chosen.warnings)))


def _choose_cut(rc: RunConfig, tokenizer) -> ChosenStages:
    common = dict(model=rc.model, hardware=hardware_spec(rc), dp=rc.parallel.dp, trainable=rc.train.trainable,
                  micro_batches=rc.train.micro_batches, policy=rc.plan.policy,
                  precision=training_precision(rc), memory_headroom=rc.plan.memory_headroom, lora=rc.train.lora)
    towers = [t for t in ("vision", "audio") if getattr(rc.model, t) is not None]
    value = rc.plan.encoders
    fixed = {t: "stages" for t in towers} if value == "stages" or not towers or rc.parallel.pp == 1 else None
    if rc.stage_bounds is not None:
        plan = StagePlan(stages=rc.stage_bounds, recompute=rc.plan.recompute or ())
        if fixed is not None:
            return ChosenStages(plan=plan, source="override", encoders=fixed, warnings=stage_memory_warnings(
                stage_plan=plan, sample=workload_sample(rc, tokenizer, steps=1), **common))
    elif fixed is not None:
        plan = plan_stages(pp=rc.parallel.pp, sample=workload_sample(rc, tokenizer), **common)
        return ChosenStages(plan=plan, source=f"planner ({rc.plan.policy})", encoders=fixed)
    # plan.encoders=auto or a spread tower: the planner prices the placements (with the user's
    # stages, or each with its own cut) on the first steps, as the feeder will plan them
    across = rc.plan.across_replicas
    per_step = rc.train.global_batch // (1 if across else rc.parallel.dp)
    if rc.stage_bounds is not None and value != "auto":
        _check_stage0(rc.model, resolve_encoders(value, rc.model), plan)
    sample = workload_sample(rc, tokenizer)
    steps = [sample[i:i + per_step] for i in range(0, len(sample), per_step)]
    given = plan if rc.stage_bounds is not None else None
    try:
        choice = choose_encoders(pp=rc.parallel.pp, steps=steps, encoders=value,
                                 replicas=rc.parallel.dp if across else 1, stage_plan=given, **common)
    except ValueError:
        if value == "auto" and given is None:  # the staged cut's own words on why nothing fits
            plan_stages(pp=rc.parallel.pp, sample=sample, **common)
        raise
    _check_stage0(rc.model, choice.encoders, choice.stage_plan)
    warnings: tuple[str, ...] = ()
    spread = any(w == "spread" for w in choice.encoders.values())
    if given is not None and not spread:
        warnings = stage_memory_warnings(stage_plan=given, sample=workload_sample(rc, tokenizer, steps=1), **common)
    elif spread and math.isinf(next(t for e, t, _ in choice.candidates if e == choice.encoders)):
        warnings = (f"plan.encoders={show_encoders(value)}: the planner finds no plan of the first steps that fits "
                    f"in memory with {', '.join(t for t, w in choice.encoders.items() if w == 'spread')} spread; the "
                    f"run plans its micro-batches without the memory limit (raise parallel.pp, lower "
                    f"train.global_batch, or set plan.encoders=stages)",)
    return ChosenStages(plan=choice.stage_plan, source="override" if given else f"planner ({rc.plan.policy})",
                        encoders=choice.encoders, warnings=warnings,
                        placements=choice.times() if value == "auto" else {})


def _check_stage0(model: ModelSpec, encoders: dict[str, str], plan: StagePlan) -> None:
    """A spread tower's layers must lie on stage 0, which holds its weights (runtime/spread.py)."""
    names = layer_names(model)
    spread = [n for n in names if encoders.get(n.split(".")[0]) == "spread"]
    end = plan.stages[0][1]
    if spread and names.index(spread[-1]) >= end:
        raise ValueError(f"plan.stages ends stage 0 at {names[end - 1]}, but plan.encoders spreads "
                         f"{spread[-1].split('.')[0]}, whose layers stage 0 must hold (up to {spread[-1]}); "
                         f"end stage 0 after {spread[-1]}, or set plan.encoders=stages")


def format_stage_table(rc: RunConfig, choice: ChosenStages, names: list[str]) -> str:
    counts = layer_param_counts(rc.model)
    plan = choice.plan
    lines = [f"pipeline: {plan.pp} stages x {rc.parallel.dp} replicas, "
             f"stages from {choice.source}"]
    lines.append(f"{'stage':>5}  {'layers':<36} {'count':>5} {'params':>10}  recompute")
    for s, (a, b) in enumerate(plan.stages):
        span = f"{names[a]} .. {names[b - 1]}" if b - a > 1 else names[a]
        lines.append(f"{s:>5}  {span:<36} {b - a:>5} {sum(counts[a:b]):>10,}  {plan.recompute[s]}")
    if choice.spread:
        lines.append(f"encoders: {', '.join(choice.spread)} spread: held by stage 0, encoded by every stage of each "
                     f"replica (its share of the replica's media), features sent to stage 0")
    if choice.placements:
        said = ", ".join(f"{k} {v:.3g} s" if math.isfinite(v) else f"{k}: does not fit in memory"
                         for k, v in choice.placements.items())
        lines.append(f"plan.encoders=auto chose {'+'.join(choice.spread) or 'stages'} "
                     f"(simulated time of the first steps: {said})")
    if choice.ladder is not None:
        lines.append(f"plan.ladder: packed micro-batches padded to {choice.ladder.text()} LLM tokens "
                     f"(a longer one to the top rung grown by x{PAST_TOP_GROWTH:g} steps)")
    return "\n".join(lines)
