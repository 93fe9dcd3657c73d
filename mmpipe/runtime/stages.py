"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from mmpipe.config import RunConfig, plan_problem
from mmpipe.data.skips import SkipCounter
from mmpipe.model import kernels
from mmpipe.model.geometry import SampleFeatures, features
from mmpipe.model.spec import ModelSpec, image_blocks, layer_names
from mmpipe.planner.api import (
    PAST_TOP_GROWTH,
    Ladder,
    Placement,
    PlanProblem,
    StagePlan,
    choose_encoders,
    plan_stages,
    resolve_ladder,
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
    placement: Placement = Placement()
    """plan.encoders resolved: each tower's placement, `stages` or `spread` (runtime/spread.py)."""
    placements: dict[str, float] = field(default_factory=dict)
    """plan.encoders=auto: each placement's summed simulated step time over the sample steps, s."""
    ladder: Ladder | None = None
    """plan.ladder resolved: the lengths packed micro-batches are padded to (`ladder.rungs`,
    the few shapes a compiled attention kernel sees); None: not padded."""

    @property
    def spread(self) -> tuple[str, ...]:
        """The spread towers, in the model's order."""
        return self.placement.spread


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


def run_problem(rc: RunConfig, placement: Placement) -> PlanProblem:
    """The run's planning problem (`config.plan_problem`) with its placement as resolved (a
    ChosenStages' `placement`): what the feeder's StepPlanner, the ladder and the re-cut
    checks plan with."""
    return dataclasses.replace(plan_problem(rc), placement=placement)


def choose_stages(rc: RunConfig, tokenizer) -> ChosenStages:
    """The user's override when given (it always wins; the planner checks it against memory),
    else the policy's partition, planned on the first steps of the real data with the
    configured hardware's cost model; then the run's length ladder (`choose_ladder`)."""
    chosen = _choose_cut(rc, tokenizer)
    return dataclasses.replace(chosen, ladder=choose_ladder(rc, tokenizer, chosen))


def run_placement(rc: RunConfig, tokenizer) -> dict[str, str]:
    """plan.encoders as this run resolves it (tower -> stages | spread | nested; `auto` priced on the first
    steps of the data, as the ranks will): what `mmpipe bench` runs every policy with."""
    return _choose_cut(rc, tokenizer).placement.mapping


def choose_ladder(rc: RunConfig, tokenizer, chosen: ChosenStages) -> Ladder | None:
    """plan.ladder for this run: explicit rungs as given; auto only where the attention kernel
    compiles per length (model/kernels.py `compiles`), spanning the packed lengths the planner
    makes on the first steps of the data (workload_sample). Every rank derives the same ladder."""
    compiles = kernels.compiles(rc.train.attention, cuda=torch.cuda.is_available(), precision=rc.train.precision,
                                dropout=rc.model.llm.attention_dropout, blocks=image_blocks(rc.model))
    steps: list[list[SampleFeatures]] = []
    if rc.plan.ladder == "auto" and compiles:
        per_step = rc.train.global_batch // (1 if rc.plan.across_replicas else rc.parallel.dp)
        sample = workload_sample(rc, tokenizer)
        steps = [sample[i:i + per_step] for i in range(0, len(sample), per_step)]
    return resolve_ladder(run_problem(rc, chosen.placement), chosen.plan, rc.plan.ladder, compiles=compiles,
                          steps=steps, memory_limit=not chosen.warnings)


def _choose_cut(rc: RunConfig, tokenizer) -> ChosenStages:
    problem = plan_problem(rc)
    placement = problem.placement
    staged = Placement.staged(rc.model)
    # all on the stages: asked for, no tower to place, or one stage (a spread tower needs two)
    fixed = staged if not (placement.auto or placement.spread) or not staged.towers or rc.parallel.pp == 1 else None
    if rc.stage_bounds is not None:
        plan = StagePlan(stages=rc.stage_bounds, recompute=rc.plan.recompute or ())
        if fixed is not None:
            return ChosenStages(plan=plan, source="override", placement=fixed, warnings=stage_memory_warnings(
                problem, plan, workload_sample(rc, tokenizer, steps=1)))
    elif fixed is not None:
        plan = plan_stages(dataclasses.replace(problem, placement=fixed), workload_sample(rc, tokenizer))
        return ChosenStages(plan=plan, source=f"planner ({rc.plan.policy})", placement=fixed)
    # plan.encoders=auto or a spread tower: the planner prices the placements (with the user's
    # stages, or each with its own cut) on the first steps, as the feeder will plan them
    per_step = rc.train.global_batch // (1 if rc.plan.across_replicas else rc.parallel.dp)
    if rc.stage_bounds is not None and not placement.auto:
        _check_stage0(rc.model, placement, plan)
    sample = workload_sample(rc, tokenizer)
    steps = [sample[i:i + per_step] for i in range(0, len(sample), per_step)]
    given = plan if rc.stage_bounds is not None else None
    try:
        choice = choose_encoders(problem, steps, stage_plan=given)
    except ValueError:
        if placement.auto and given is None:  # the staged cut's own words on why nothing fits
            plan_stages(dataclasses.replace(problem, placement=staged), sample)
        raise
    _check_stage0(rc.model, choice.placement, choice.stage_plan)
    warnings: tuple[str, ...] = ()
    spread = choice.placement.spread
    if given is not None and not spread:
        warnings = stage_memory_warnings(problem, given, workload_sample(rc, tokenizer, steps=1))
    elif spread and math.isinf(next(t for e, t, _ in choice.candidates if e == choice.placement)):
        warnings = (f"plan.encoders={placement.given}: the planner finds no plan of the first steps that fits "
                    f"in memory with {', '.join(spread)} spread; the "
                    f"run plans its micro-batches without the memory limit (raise parallel.pp, lower "
                    f"train.global_batch, or set plan.encoders=stages)",)
    return ChosenStages(plan=choice.stage_plan, source="override" if given else f"planner ({rc.plan.policy})",
                        placement=choice.placement, warnings=warnings,
                        placements=choice.times() if placement.auto else {})


def _check_stage0(model: ModelSpec, placement: Placement, plan: StagePlan) -> None:
    """A spread tower's layers must lie on stage 0, which holds its weights (runtime/spread.py)."""
    names = layer_names(model)
    spread = [n for n in names if n.split(".")[0] in placement.spread]
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
    if choice.spread and choice.placement.nested:
        lines.append(f"encoders: {', '.join(choice.spread)} nested: held by stage 0, encoded by every stage of each "
                     f"replica inside its pipeline bubbles (its share of the replica's media), features sent to "
                     f"stage 0")
    elif choice.spread:
        lines.append(f"encoders: {', '.join(choice.spread)} spread: held by stage 0, encoded by every stage of each "
                     f"replica (its share of the replica's media), features sent to stage 0")
    if choice.placements:
        said = ", ".join(f"{k} {v:.3g} s" if math.isfinite(v) else f"{k}: does not fit in memory"
                         for k, v in choice.placements.items())
        lines.append(f"plan.encoders=auto chose {choice.placement.name} "
                     f"(simulated time of the first steps: {said})")
    if choice.ladder is not None:
        lines.append(f"plan.ladder: packed micro-batches padded to {choice.ladder.text()} LLM tokens "
                     f"(a longer one to the top rung grown by x{PAST_TOP_GROWTH:g} steps)")
    return "\n".join(lines)
