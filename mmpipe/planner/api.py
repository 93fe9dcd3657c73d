"""The planner's one entry for the runtime (and the names the CLI and config take from it).

    plan_stages(*, model, hardware, pp, dp, trainable, sample, micro_batches, policy) -> StagePlan
        Partition the layers into pp contiguous stages (and choose recompute per stage) for
        a policy, judged on `sample` (features of representative samples, e.g. one step).
        data-aware: bottleneck-minimising range search on real micro-batches of the sample,
        then a hill climb of the cuts on the simulated step time; ds-default and
        llava-grouped: DeepSpeed `parameters`; packed-ffd: encoders + first LLM chunk on
        stage 0. Baselines switch recompute on only if that is what their tuning picks.

    StepPlanner(*, model, hardware, trainable, dp, stage_plan, policy, micro_batches, ...)
        Built once per run; `.plan(features) -> StepPlan` plans one step's samples (in stream
        order): per replica the ordered micro-batches as indices into `features`, with the
        simulated step time and per-stage busy time of every replica.

    stage_memory_warnings(*, model, hardware, trainable, dp, stage_plan, policy, micro_batches,
                          sample) -> tuple[str, ...]
        One line per stage of a user's stage plan that exceeds memory under the cost model.

    plan_step(*, policy, features, stage_plan, cost, dp, micro_batches) -> Replicas
        `StepPlanner.plan` without the prediction, on a given CostModel.

    choose_layout(*, model, hardware, trainable, devices, global_batch, micro_batches, sample,
                  pp=None, dp=None, ...) -> LayoutChoice
        parallel.pp=auto / parallel.dp=auto: rank every pp x dp split of `devices` on the first
        steps of `sample` (features in stream order, whole steps of global_batch); `.best` has
        pp, dp and the stage plan it was priced with; `.layouts` the ranked table.

    consider_recut(*, model, hardware, trainable, pp, dp, current, steps, ...) -> RecutChoice
        plan.recut=auto: plan the run's recent steps (their samples' features) on the current
        cut and on the cut plan_stages chooses for them, with the same planner and hardware (the
        run's step-time re-fit); `.recut` when another cut is predicted faster by more than the
        threshold (a cut that cannot hold the samples in memory counts as infinitely slow).

    resolve_ladder(value, *, compiles, steps, **StepPlanner args) -> Ladder | None
        plan.ladder for a run: explicit rungs as given; `auto` (only where the attention kernel
        compiles) the rungs that pad least the packed rows the planner makes on `steps`
        (planner/ladder.py); None: micro-batches are not padded. `StepPlanner(ladder=...)`
        prices every micro-batch at its padded length and says it in `StepPlan.padded`.

    calibrated_hardware(hardware, coef) -> HardwareSpec
        The hardware whose predicted step time is a StepCalibration fit's prediction (time
        constants scaled by its a; its per-micro-batch and per-step costs b, c become
        micro_batch_overhead_s / step_overhead_s).

    validate_trainable(trainable, model) -> tuple[str, ...]
        ValueError for a name matching no layer, e.g. "train.trainable=[visoin] names
        'visoin', which matches no layer of model qwen2-vl-7b; use all, vision, ...".

Policies: data-aware, ds-default, llava-grouped, packed-ffd. The plan's contract is
docs/spec.md section 4. Every function takes `precision` (a TrainingPrecision: train.precision,
train.zero_stage, train.optimizer; default the spec's bf16, ZeRO-1, AdamW) and
`memory_headroom` (plan.memory_headroom; default 0 here, the config's default for commands).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec, layer_names
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import BASELINES, fitting_baseline_step, tune_baseline
from mmpipe.planner.calibrate import Coef, StepCalibration, calibrated_hardware
from mmpipe.planner.cost import (
    DEFAULT_HEADROOM,
    DEFAULT_PRECISION,
    KIND_STREAM,
    CostModel,
    build_cost_model,
    check_headroom,
    ideal_compute_s,
    model_flops,
    validate_trainable,
)
from mmpipe.planner.hardware import GB, HardwareSpec, hardware_from_dict, hardware_to_dict
from mmpipe.planner.ladder import LLM_STREAM, PAST_TOP_GROWTH, Ladder, choose_ladder, pad_tokens, parse_ladder
from mmpipe.planner.layout import Layout, LayoutChoice, costs_by_dp, search_layouts
from mmpipe.planner.partition import StagePlan, check_pp, data_aware_stages
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.samples import SampleTable, mb_streams, sample_table
from mmpipe.planner.spread import (
    Encoders,
    SpreadModel,
    candidate_placements,
    check_encoders_value,
    encode_costs,
    parse_encoders,
    pipeline_stage_costs,
    placement_name,
    plan_spread_step,
    reserve_bytes,
    reserved_pipeline,
    show_encoders,
    spread_model,
)
from mmpipe.planner.stage_cost import StageCosts, stage_costs
from mmpipe.planner.step import Replicas, evaluate_step

POLICIES = ("data-aware",) + BASELINES
"""Every plan.policy value."""
PACKED_POLICIES = ("data-aware", "packed-ffd")
"""Policies whose micro-batches are packed (the others pad to the longest sample)."""
UNLIMITED_MEMORY_GB = 1e6
"""Device memory a StepPlanner assumes when told to plan without the memory limit."""

__all__ = ["POLICIES", "PACKED_POLICIES", "Coef", "CostModel", "DEFAULT_HEADROOM", "DEFAULT_PRECISION",
           "HardwareSpec", "Ladder", "PAST_TOP_GROWTH",
           "Layout", "LayoutChoice", "Replicas", "StagePlan", "StepCalibration", "StepPlan",
           "StepPlanner", "StepWork", "TrainingPrecision", "RecutChoice", "EncoderChoice", "build_cost_model",
           "calibrated_hardware", "check_headroom", "check_policy", "choose_encoders", "choose_layout",
           "consider_recut", "describe_gain", "resolve_encoders", "check_encoders_value", "parse_encoders",
           "hardware_from_dict", "hardware_to_dict", "layer_stream", "packed_streams", "parse_ladder", "plan_stages",
           "plan_step", "resolve_ladder",
           "stage_memory_warnings", "step_work", "validate_trainable", "show_encoders", "placement_name"]


def packed_streams(features: Sequence[SampleFeatures]) -> tuple[np.ndarray, np.ndarray]:
    """[K] tokens and [K] sums of squared sequence lengths of each stream (samples.STREAMS)
    of one packed micro-batch of these samples: what the cost model prices a layer on."""
    T, S2 = mb_streams(sample_table(list(features)), [list(range(len(features)))], packing=True)
    return T[0], S2[0]


def layer_stream(name: str) -> int | None:
    """The stream (index into the arrays of `packed_streams`) layer `name` reads, None for a
    layer the cost model treats as free."""
    return KIND_STREAM.get(".".join(name.split(".")[:2]))


def check_policy(policy: str) -> None:
    """ValueError naming plan.policy and the known policies."""
    if policy not in POLICIES:
        raise ValueError(f"plan.policy={policy!r} is unknown; use {', '.join(POLICIES)}")


def resolve_encoders(encoders: object, model: ModelSpec) -> dict[str, str]:
    """A plan.encoders value other than `auto` as the placement of every tower of the model
    (None: all on the stages). ValueError for a bad value, a tower the model lacks, or
    `auto` (which `choose_encoders` resolves)."""
    value = parse_encoders(encoders, model)
    if value == "auto":
        raise ValueError("plan.encoders=auto is resolved by comparing the placements: call "
                         "choose_encoders and pass its .encoders")
    assert isinstance(value, dict)
    return value


def plan_stages(*, model: ModelSpec, hardware: HardwareSpec, pp: int, dp: int,
                trainable: tuple[str, ...], sample: list[SampleFeatures], micro_batches: int,
                policy: str, precision: TrainingPrecision = DEFAULT_PRECISION,
                memory_headroom: float = 0.0, lora: LoraSpec = NO_LORA,
                encoders: Encoders | str | None = None) -> StagePlan:
    """Stage ranges and recompute for a policy (see module docstring). `encoders`: the
    placement of the encoder towers (plan.encoders without auto; None: all on the stages);
    a spread tower's layers cost nothing on the stages, and the ranges still cover every
    layer (docs/spec.md section 4)."""
    check_policy(policy)
    check_pp(pp, len(layer_names(model)), model.name)
    cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp,
                            precision=precision, memory_headroom=memory_headroom, lora=lora)
    sm = spread_model(cost, None if encoders is None else resolve_encoders(encoders, model))
    table = sample_table(sample)
    rows = list(range(len(sample)))
    if sm.active:
        check_pp(pp, len(sm.keep), f"{model.name} with {placement_name(sm.encoders)} encoders")
        # what every rank leaves to the spread towers (stage 0's features: the step planner's
        # own per-stage reserve, where the balancer makes room with its micro-batches)
        reserve = reserve_bytes(sm, encode_costs(sm, table), rows, pp=pp, dp=dp)
        cost = reserved_pipeline(sm, float(reserve[-1]))
    if policy == "data-aware":
        plan = data_aware_stages(cost, table, [rows], pp=pp, dp=dp, micro_batches=micro_batches)
    else:
        plan = tune_baseline(policy, cost, table, [rows], pp=pp, dp=dp, micro_batches=micro_batches).stage_plan
    return sm.to_full(plan) if sm.active else plan


def plan_step(*, policy: str, features: list[SampleFeatures], stage_plan: StagePlan,
              cost: CostModel, dp: int, micro_batches: int) -> Replicas:
    """Per replica the ordered micro-batches (indices into `features`) of one step."""
    check_policy(policy)
    sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
    return _replicas(policy, sample_table(features), sc, dp, micro_batches)


def _replicas(policy: str, table: SampleTable, sc: StageCosts, dp: int,
              micro_batches: int) -> Replicas:
    """Every replica's micro-batches under the policy, for all samples of `table`.

    Data-aware is never predicted slower than packing: packed-ffd's step of the same samples on
    the same stages (its default pack, or the shorter one a run of it retries when that does not
    fit) stays among its candidates and is taken where the same simulator with the same costs
    (the run's step-time fit included, once the runtime re-plans with it) prices it faster and
    it fits; ties keep the balanced plan. Where a micro-batch's fixed cost rivals the pipelining
    it buys (a tiny model on a CPU), one large pack can beat any balanced split."""
    rows = list(range(len(table)))
    if policy != "data-aware":
        return fitting_baseline_step(policy, sc, table, rows, dp=dp, micro_batches=micro_batches)
    balanced = balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches)
    packed = fitting_baseline_step("packed-ffd", sc, table, rows, dp=dp, micro_batches=micro_batches)
    ours, theirs = (evaluate_step(sc, table, r, packing=True) for r in (balanced, packed))
    return packed if theirs.fits and theirs.step_time < ours.step_time else balanced


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
    """Plans the steps of a run: built once from the run's fixed choices, then `plan` per step.

    Every rank that plans the same samples with the same arguments gets the same plan (the
    planner is deterministic), so the ranks of a replica agree without talking.
    """

    def __init__(self, *, model: ModelSpec, hardware: HardwareSpec, trainable: Sequence[str],
                 dp: int, stage_plan: StagePlan, policy: str, micro_batches: int,
                 replicas: int | None = None, memory_limit: bool = True,
                 precision: TrainingPrecision = DEFAULT_PRECISION,
                 memory_headroom: float = 0.0, lora: LoraSpec = NO_LORA,
                 encoders: Encoders | str | None = None, ladder: Ladder | None = None) -> None:
        """Args:
            model, hardware, trainable, dp: what the cost model prices (dp: data-parallel
                replicas of the run, over which ZeRO-1 shards optimizer states).
            stage_plan: the run's stage ranges and recompute.
            policy: a plan.policy value; micro_batches: train.micro_batches.
            replicas: how many replicas one `plan` call deals its samples to (dp when a step
                is planned across replicas, 1 when each replica plans its own share); dp if
                not given.
            memory_limit: False plans as if memory were unlimited: for a user's stages that
                already exceed it under the cost model (trained with a warning), planning
                within it would refuse samples or steps the user chose to run anyway.
            precision: train.precision, train.zero_stage and train.optimizer (default the
                spec's bf16, ZeRO-1, AdamW).
            memory_headroom: plan.memory_headroom, the share of usable memory never planned
                into (default 0: all of it).
            encoders: the towers' placement (plan.encoders resolved, `choose_encoders(...)
                .encoders`; None: all on the stages). With a spread tower, `plan` also says
                which rank encodes which sample (`StepPlan.encode`), and its step time and
                memory include the pre-pass, the post-pass and the all-reduce.
            ladder: the lengths packed micro-batches are padded to (`resolve_ladder`; None:
                not padded; ignored by the padded policies): every micro-batch is priced at
                its padded length, and `StepPlan.padded` says each one's.
        To re-plan with what the runtime measured, build a new StepPlanner with
        `calibrated_hardware(hardware, calibration.coef)` (runtime/feed.py does, once the
        run's re-fit has seen its warm-up steps).
        """
        check_policy(policy)
        if not memory_limit:
            hardware = dataclasses.replace(hardware,
                                           memory_gb=max(hardware.memory_gb, UNLIMITED_MEMORY_GB))
        self.policy = policy
        self.micro_batches = micro_batches
        self.replicas = dp if replicas is None else replicas
        self.cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp,
                                     precision=precision, memory_headroom=memory_headroom, lora=lora)
        self.spread: SpreadModel = spread_model(
            self.cost, None if encoders is None else resolve_encoders(encoders, model))
        self.stage_plan = stage_plan
        self.dp = dp
        self.ladder = ladder if policy in PACKED_POLICIES else None
        self.stage_costs = (pipeline_stage_costs(self.spread, stage_plan,
                                                 reserve_bytes(self.spread, encode_costs(self.spread, sample_table([])),
                                                               [], pp=stage_plan.pp, dp=dp))
                            if self.spread.active else
                            stage_costs(self.cost, stage_plan.stages, stage_plan.recompute))
        self.stage_costs = dataclasses.replace(self.stage_costs, ladder=self.ladder)
        self.resident = hardware.reserved_gb * GB  # held by every rank whatever its plan

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
            reps = _replicas(self.policy, table, self.stage_costs, self.replicas, self.micro_batches)
            ev = evaluate_step(self.stage_costs, table, reps, packing=self.packing)
            return StepPlan(replicas=[[list(mb) for mb in rep] for rep in reps], step_time=ev.step_time,
                            busy=tuple(tuple(r.busy) if r is not None else () for r in ev.replicas),
                            peak_bytes=tuple(tuple(self.resident + b for b in rep) for rep in ev.replica_peaks),
                            compute=tuple(float(r.makespan) if r is not None else 0.0 for r in ev.replicas),
                            encode=tuple(((),) * pp for _ in reps), **self._padding(table, reps))
        sm = self.spread
        _, reps, ev, sp = plan_spread_step(
            sm, encode_costs(sm, table), table, range(len(table)), self.stage_plan,
            lambda sc: _replicas(self.policy, table, sc, self.replicas, self.micro_batches),
            pp=pp, dp=self.replicas, packing=self.packing, ranks=pp * self.dp, ladder=self.ladder)
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


def stage_memory_warnings(*, model: ModelSpec, hardware: HardwareSpec, trainable: Sequence[str],
                          dp: int, stage_plan: StagePlan, policy: str, micro_batches: int,
                          sample: Sequence[SampleFeatures],
                          precision: TrainingPrecision = DEFAULT_PRECISION,
                          memory_headroom: float = 0.0, lora: LoraSpec = NO_LORA) -> tuple[str, ...]:
    """Stages of a user's stage plan whose planned peak memory on `sample` (one step's samples,
    all replicas) exceeds the device under the cost model, one warning line each (the user's
    stages are trained anyway; the user hears which stage and by how much). A sample that
    fits on no micro-batch is one warning too."""
    check_policy(policy)
    cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp,
                            precision=precision, memory_headroom=memory_headroom, lora=lora)
    sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
    table = sample_table(sample)
    try:
        reps = _replicas(policy, table, sc, dp, micro_batches)
    except ValueError as err:  # e.g. a sample that fits on no micro-batch
        return (f"plan.stages: {err}",)
    ev = evaluate_step(sc, table, reps, packing=policy in PACKED_POLICIES)
    names = cost.names
    out = []
    for s, (a, b) in enumerate(stage_plan.stages):
        need, usable = float(ev.peak_bytes[s]), float(ev.usable)
        if need > usable:
            out.append(f"plan.stages: stage {s} ({names[a]}..{names[b - 1]}) needs {need / 1e9:.3g} GB "
                       f"under the cost model, {(need - usable) / 1e9:.3g} GB more than the "
                       f"{cost.usable_text()} on hardware {hardware.name}; it may run out of "
                       f"memory (move layers off it, or enable recompute)")
    return tuple(out)


def choose_layout(*, model: ModelSpec, hardware: HardwareSpec, trainable: Sequence[str],
                  devices: int, global_batch: int, micro_batches: int,
                  sample: Sequence[SampleFeatures], pp: int | None = None, dp: int | None = None,
                  precision: TrainingPrecision = DEFAULT_PRECISION,
                  memory_headroom: float = 0.0, probe_steps: int = 2, lora: LoraSpec = NO_LORA) -> LayoutChoice:
    """Rank the pp x dp splits of `devices` for the data-aware policy (planner.layout).

    Args:
        sample: features of the run's first samples in stream order, all replicas together
            (at least one whole step of global_batch); up to `probe_steps` whole steps are
            priced.
        pp, dp: the value the user fixed, or None for auto.
    Raises ValueError naming the keys when no layout is valid or the sample is short.
    """
    if global_batch < 1 or len(sample) < global_batch:
        raise ValueError(f"parallel.devices={devices}: choosing a layout needs one whole step of "
                         f"train.global_batch={global_batch} samples; the data gave "
                         f"{len(sample)}")
    k = max(1, min(probe_steps, len(sample) // global_batch))
    table = sample_table(list(sample[:k * global_batch]))
    steps = [list(range(i * global_batch, (i + 1) * global_batch)) for i in range(k)]
    costs = costs_by_dp(model=model, hardware=hardware, trainable=trainable, devices=devices, dp=dp,
                        precision=precision, memory_headroom=memory_headroom, lora=lora)
    return search_layouts(costs=costs, table=table, steps=steps, devices=devices,
                          global_batch=global_batch, micro_batches=micro_batches, pp=pp, dp=dp)


# -- where the encoder towers run (plan.encoders) ------------------------------------------

@dataclass(frozen=True, slots=True)
class EncoderChoice:
    """The placements of the encoder towers compared, and the one chosen."""

    encoders: dict[str, str]
    """The chosen placement of every tower of the model (`stages` | `spread`)."""
    stage_plan: StagePlan
    """Its stage plan (ranges over every layer, docs/spec.md section 4)."""
    candidates: tuple[tuple[dict[str, str], float, StagePlan | None], ...]
    """Each placement compared, in `candidate_placements` order: its summed simulated step
    time over the steps, s (inf when it does not fit), and its stage plan."""

    def times(self) -> dict[str, float]:
        """Summed simulated step time per placement name (`stages`, `spread`, ...)."""
        return {placement_name(e): t for e, t, _ in self.candidates}


def choose_encoders(*, model: ModelSpec, hardware: HardwareSpec, pp: int, dp: int,
                    trainable: Sequence[str], steps: Sequence[Sequence[SampleFeatures]], policy: str,
                    micro_batches: int, encoders: object = "auto", replicas: int | None = None,
                    stage_plan: StagePlan | None = None,
                    precision: TrainingPrecision = DEFAULT_PRECISION, memory_headroom: float = 0.0,
                    lora: LoraSpec = NO_LORA) -> EncoderChoice:
    """Resolve plan.encoders for a run: with `auto`, every candidate placement (all stages;
    every tower spread; with two towers, the two mixed ones) gets its best plan (the stages
    `plan_stages` cuts for it on all of `steps`' samples, or the user's `stage_plan`), each
    step of `steps` is planned with `StepPlanner(encoders=...)`, and the placement with the
    least summed simulated step time wins (ties: the earlier candidate, so stages first); a
    placement that cannot hold a step counts as infinitely slow (when none can, the first
    with a stage plan is returned, so a user's `stage_plan` over memory is still trained with
    warnings; ValueError when no placement even has a stage plan). Any other value is that
    placement alone, priced the same way.

    Args:
        steps: each the features one `StepPlanner.plan` call of the run receives (every
            replica's samples when steps are planned across replicas, `replicas` = dp, the
            default; one replica's, `replicas` = 1).
    """
    value = parse_encoders(encoders, model)
    cands = candidate_placements(model) if value == "auto" else [value]
    sample = [f for st in steps for f in st]
    common = dict(model=model, hardware=hardware, trainable=tuple(trainable), dp=dp, policy=policy,
                  micro_batches=micro_batches, precision=precision, memory_headroom=memory_headroom,
                  lora=lora)
    out: list[tuple[dict[str, str], float, StagePlan | None]] = []
    errors: list[str] = []
    for enc in cands:
        assert isinstance(enc, dict)
        plan: StagePlan | None = stage_plan
        try:
            plan = plan or plan_stages(pp=pp, sample=sample, encoders=enc, **common)
            planner = StepPlanner(stage_plan=plan, replicas=replicas, encoders=enc, **common)
            planned = [planner.plan(list(st)) for st in steps]
            fits = all(max(max(rep, default=0.0) for rep in p.peak_bytes) <= planner.usable_bytes * (1 + 1e-9)
                       for p in planned)
            total = sum(p.step_time for p in planned) if fits else math.inf
        except ValueError as err:  # a stage or a sample this placement cannot hold
            total = math.inf
            errors.append(f"{placement_name(enc)}: {err}")
        out.append((enc, total, plan))
    # the fastest; when none fits, the first that has a stage plan (the user's stage plan is
    # kept even over memory: the caller warns and trains it, as without spread towers)
    best = min((i for i in range(len(out)) if out[i][2] is not None), key=lambda i: (out[i][1], i),
               default=None)
    if best is None:
        raise ValueError(f"plan.encoders={show_encoders(encoders)}: no placement of the encoder towers "
                         f"can be planned on these steps ({errors[0]})")
    enc, total, plan = out[best]
    assert plan is not None
    return EncoderChoice(encoders=enc, stage_plan=plan, candidates=tuple(out))


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


# -- re-cutting a running pipeline (plan.recut=auto) ------------------------------------

@dataclass(frozen=True, slots=True)
class RecutChoice:
    """The comparison behind a re-cut decision."""

    current: StagePlan
    """The run's cut."""
    candidate: StagePlan
    """The cut the planner chooses for the recent steps."""
    current_s: float
    """Summed simulated time of the recent steps on the current cut, s."""
    candidate_s: float
    """The same on the candidate cut, s."""
    steps: int
    """How many recent steps were compared."""
    threshold: float
    """plan.recut_gain."""

    @property
    def gain(self) -> float:
        """Predicted speed-up of the candidate, as a fraction (0.1: 10% faster; inf: the current
        cut cannot hold some of the samples in memory)."""
        if self.current_s == self.candidate_s:
            return 0.0
        return self.current_s / self.candidate_s - 1.0 if self.candidate_s > 0 else 0.0

    @property
    def recut(self) -> bool:
        """Re-cut: another cut, predicted faster by more than the threshold."""
        return self.candidate != self.current and self.gain > self.threshold

    def record(self) -> dict:
        """JSON-able: what metrics.jsonl and the re-cut request hold (`predicted_old_s` and
        `predicted_gain` null when the current cut cannot hold the samples: `current_fits`)."""
        fits = math.isfinite(self.current_s)
        return {"old": [list(s) for s in self.current.stages], "new": [list(s) for s in self.candidate.stages],
                "old_recompute": list(self.current.recompute), "new_recompute": list(self.candidate.recompute),
                "predicted_old_s": self.current_s if fits else None, "predicted_new_s": self.candidate_s,
                "predicted_gain": self.gain if fits else None, "current_fits": fits, "threshold": self.threshold,
                "steps_compared": self.steps, "recut": self.recut}


def describe_gain(record: dict) -> str:
    """A re-cut record's predicted gain, in words."""
    if not record.get("current_fits", True):
        return "the current cut cannot hold the recent samples in memory"
    return f"predicted {record['predicted_gain']:+.1%} faster"


def consider_recut(*, model: ModelSpec, hardware: HardwareSpec, trainable: tuple[str, ...], pp: int, dp: int,
                   current: StagePlan, steps: Sequence[Sequence[SampleFeatures]], policy: str, micro_batches: int,
                   replicas: int, threshold: float, precision: TrainingPrecision, memory_headroom: float,
                   lora: LoraSpec = NO_LORA, encoders: Encoders | None = None) -> RecutChoice:
    """Compare the current cut with the planner's cut for `steps` (each the features one
    `StepPlanner.plan` call of the run receives: every replica's samples when steps are planned
    across replicas, `replicas` = dp, else one replica's, `replicas` = 1), both under the run's
    encoder placement `encoders` (resolved; None: every tower on the stages)."""
    common = dict(model=model, hardware=hardware, trainable=trainable, dp=dp, policy=policy,
                  micro_batches=micro_batches, precision=precision, memory_headroom=memory_headroom, lora=lora)
    candidate = plan_stages(pp=pp, sample=[f for s in steps for f in s], encoders=encoders, **common)

    def total(plan: StagePlan) -> float:
        planner = StepPlanner(stage_plan=plan, replicas=replicas, encoders=encoders, **common)
        try:
            return sum(planner.plan(list(s)).step_time for s in steps)
        except ValueError:  # a sample this cut cannot hold in memory: any cut that can is better
            return math.inf

    same = candidate == current
    current_s = total(current)
    return RecutChoice(current=current, candidate=candidate, current_s=current_s,
                       candidate_s=current_s if same else total(candidate), steps=len(steps), threshold=threshold)


# -- the lengths packed micro-batches are padded to (plan.ladder) -------------------------

def resolve_ladder(value: object, *, compiles: bool, steps: Sequence[Sequence[SampleFeatures]],
                   **planner: object) -> Ladder | None:
    """plan.ladder for a run (None: micro-batches keep their packed length).

    Args:
        value: plan.ladder (`auto`, `off` or rungs; ValueError in one line if bad).
        compiles: the run's attention kernel compiles per sequence length (FlexAttention on
            CUDA): only then does `auto` pad, so CPU runs and flash-attn runs stay unpadded.
        steps: the probe steps (each what one `StepPlanner.plan` call gets) whose packed
            micro-batch lengths `auto` spans with its rungs (ladder.choose_ladder).
        planner: the run's `StepPlanner` arguments (policy, stage_plan, ...); a padded policy
            (ds-default, llava-grouped) never gets a ladder.
    """
    v = parse_ladder(value)
    if v == "off" or planner.get("policy") not in PACKED_POLICIES:
        return None
    if isinstance(v, tuple):
        return Ladder(v)
    if not compiles:
        return None
    sp = StepPlanner(**planner)  # type: ignore[arg-type]
    lengths = [sum(st[i].llm_len for i in mb) for st in steps if st
               for rep in sp.plan(list(st)).replicas for mb in rep]
    return choose_ladder(lengths)
