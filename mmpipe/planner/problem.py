"""What the planner is asked: one typed value for every planner entry (`PlanProblem`), and
where the encoder towers run (`Placement`, the one parse of plan.encoders).

Every entry of the planner (`plan_stages`, `StepPlanner`, `choose_encoders`, `consider_recut`,
`choose_layout`, `mmpipe plan`'s `run_plan`, ...) prices the same run: the model, the hardware,
what trains (in full or through LoRA adapters), the precision the memory is priced in, the
headroom no plan fills, the policy, the micro-batch rules, the layout and the placement of the
towers. Those travel together, as one frozen value, so an entry's signature says only what
varies per call (a step's samples, a cut); a new fact the planner must weigh is one field here,
not one keyword in every entry. `config.plan_problem(rc)` builds it from a run's config, and
`mmpipe plan` from the same function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec
from mmpipe.planner.cost import DEFAULT_PRECISION, CostModel, build_cost_model
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.precision import TrainingPrecision

TOWERS = ("vision", "audio")
"""Encoder towers, in layer order."""
PLACEMENTS = ("stages", "spread", "nested")
"""Where a tower runs: on the pipeline stages that hold its layers; `spread` over every rank of a
replica before and after the pipeline; `nested` over every rank of a replica inside the
pipeline's bubbles (planner/nested.py)."""
OFF_STAGE = ("spread", "nested")
"""The placements that encode a tower on every rank of a replica (its weights on stage 0)."""
OFF_STAGE_MARGIN = 0.15
"""`auto` moves a tower off the stages only when that is predicted at least this much faster
than keeping it there. Measured on the 2-core machine (docs/in-the-loop.md, 2 alternating
rounds each), nested towers ran slower than predicted against the stages every time: predicted
1.005x, 1.07x and 1.14x faster, they measured 0.96x, 0.96-0.98x and 0.86-0.93x (the simulator
takes a waiting rank's time as free; on a CPU machine it is not all free), so a predicted gain
below 15% is not trusted."""
ENCODER_VALUES = ("auto",) + PLACEMENTS
"""The single-word plan.encoders values."""


def model_towers(model: ModelSpec) -> tuple[str, ...]:
    """The encoder towers the model has, in layer order."""
    return tuple(t for t, enc in (("vision", model.vision), ("audio", model.audio)) if enc is not None)


def show_encoders(value: object) -> str:
    """A plan.encoders value as it is written on the command line."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def check_encoders_value(value: object) -> None:
    """The shape of a plan.encoders value, without the model: auto, stages, spread, nested, or a
    mapping of towers (vision, audio) to stages | spread | nested (spread and nested not mixed:
    one schedule runs a step). ValueError naming the key."""
    fix = "use auto, stages, spread, nested, or per tower e.g. \"plan.encoders={vision: spread, audio: stages}\""
    if isinstance(value, str):
        if value not in ENCODER_VALUES:
            raise ValueError(f"plan.encoders={value!r} is unknown; {fix}")
        return
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"plan.encoders={show_encoders(value)} is not a placement; {fix}")
    for tower, where in value.items():
        if tower not in TOWERS:
            raise ValueError(f"plan.encoders={show_encoders(value)} names {tower!r}, which is not an "
                             f"encoder tower; name vision or audio")
        if where not in PLACEMENTS:
            raise ValueError(f"plan.encoders={show_encoders(value)} places {tower} at {where!r}; "
                             f"use stages, spread or nested")
    if {"spread", "nested"} <= set(value.values()):
        raise ValueError(f"plan.encoders={show_encoders(value)} mixes spread and nested towers, which one step "
                         f"cannot run (the nested schedule encodes inside the pipeline, spread before it); "
                         f"place both towers nested, or one of them on the stages")


def placement_name(encoders: Mapping[str, str]) -> str:
    """`stages`, `spread`, `nested`, or the mixed placement's off-stage towers, e.g. `vision spread`."""
    off = [t for t, w in encoders.items() if w in OFF_STAGE]
    if not off:
        return "stages"
    how = "nested" if any(w == "nested" for w in encoders.values()) else "spread"
    if len(off) == len(encoders):
        return how
    return " + ".join(off) + " " + how


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """plan.encoders for one model: `auto` (still to be chosen, `choose_encoders`), or where each
    of its towers runs. Built by `Placement.parse`, the one reading of the config value; every
    other module asks this value (`mapping`, `spread`, `name`, `candidates`, `to_config`)
    instead of reading plan.encoders again."""

    towers: tuple[tuple[str, str], ...] = ()
    """(tower, `stages` | `spread`) for every tower of the model, in layer order; empty when
    `auto` (and in the default, which keeps every tower on the stages)."""
    auto: bool = False
    """plan.encoders=auto: the planner compares the candidates and keeps the fastest."""
    given: str = field(default="stages", compare=False)
    """The value as the user wrote it (`show_encoders`), for messages and the plan JSON."""

    @classmethod
    def parse(cls, value: object, model: ModelSpec) -> Placement:
        """plan.encoders for `model` (None: stages; a mapping leaves the towers it does not name
        on the stages). ValueError for a bad value or a tower the model lacks."""
        if value is None:
            value = "stages"
        check_encoders_value(value)
        towers = model_towers(model)
        given = show_encoders(value)
        if isinstance(value, str):
            if value in OFF_STAGE and not towers:
                raise ValueError(f"plan.encoders={value}: model {model.name} has no encoder tower; "
                                 f"use auto or stages")
            if value == "auto":
                return cls(auto=True, given=given)
            return cls(towers=tuple((t, value) for t in towers), given=given)
        assert isinstance(value, Mapping)
        for tower in value:
            if tower not in towers:
                have = " or ".join(towers) if towers else "no tower (use auto or stages)"
                raise ValueError(f"plan.encoders={given} names {tower}, which model "
                                 f"{model.name} does not have; it has {have}")
        return cls(towers=tuple((t, str(value.get(t, "stages"))) for t in towers), given=given)

    @classmethod
    def of(cls, encoders: Mapping[str, str]) -> Placement:
        """A resolved placement (tower -> stages | spread | nested, every tower of the model)."""
        return cls(towers=tuple((str(t), str(w)) for t, w in encoders.items()), given=show_encoders(encoders))

    @classmethod
    def staged(cls, model: ModelSpec) -> Placement:
        """Every tower of `model` on the pipeline stages."""
        return cls.parse("stages", model)

    @property
    def mapping(self) -> dict[str, str]:
        """Tower -> `stages` | `spread`. ValueError for `auto`, which `choose_encoders` resolves."""
        if self.auto:
            raise ValueError("plan.encoders=auto is resolved by comparing the placements: call "
                             "choose_encoders and use its .placement")
        return dict(self.towers)

    @property
    def spread(self) -> tuple[str, ...]:
        """The towers encoded off the stages (spread or nested), in layer order (none for `auto`)."""
        return tuple(t for t, w in self.towers if w in OFF_STAGE)

    @property
    def nested(self) -> bool:
        """The off-stage towers run under the nested schedule (inside the pipeline's bubbles)."""
        return any(w == "nested" for _, w in self.towers)

    @property
    def name(self) -> str:
        """`auto`, `stages`, `spread` or the spread towers of a mixed placement (`vision spread`)."""
        return "auto" if self.auto else placement_name(dict(self.towers))

    def candidates(self, model: ModelSpec) -> tuple[Placement, ...]:
        """What this value asks the planner to compare: for `auto` all on the stages, every
        tower spread, every tower nested, and with two towers the mixed placements (stages
        first: it wins ties); else this placement alone."""
        if not self.auto:
            return (self,)
        towers = model_towers(model)
        out = [{t: "stages" for t in towers}]
        for how in OFF_STAGE if towers else ():
            out.append({t: how for t in towers})
            if len(towers) == 2:
                out += [{towers[0]: how, towers[1]: "stages"}, {towers[0]: "stages", towers[1]: how}]
        return tuple(Placement.of(e) for e in out)

    def ranking_time(self, seconds: float) -> float:
        """What `auto` compares this candidate by: its predicted time, an off-stage placement's
        raised by OFF_STAGE_MARGIN (it must win by that much)."""
        return seconds / (1.0 - OFF_STAGE_MARGIN) if self.spread else seconds

    def to_config(self) -> str | dict[str, str]:
        """The plan.encoders value that gives this placement back (a relaunch's config): `auto`,
        the resolved tower mapping, or `stages` for a model without towers."""
        if self.auto:
            return "auto"
        return dict(self.towers) if self.towers else "stages"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanProblem:
    """The run a plan is for: everything every planner entry prices, passed whole."""

    model: ModelSpec
    """The architecture (layer names, sizes, towers)."""
    hardware: HardwareSpec
    """Time constants, memory and link of one device (a run's re-fit swaps in
    `calibrated_hardware`)."""
    trainable: tuple[str, ...]
    """train.trainable: component prefixes trained in full."""
    micro_batches: int
    """train.micro_batches: the baselines' count, and where the data-aware search starts."""
    policy: str = "data-aware"
    """plan.policy."""
    global_batch: int | None = None
    """train.global_batch: samples per step over all replicas (the layout search and `mmpipe
    plan` cut the data into steps of it; a step's planner takes its samples as given)."""
    pp: int | None = None
    """parallel.pp: pipeline stages; None while auto (`choose_layout`), or where the stage plan
    passed beside the problem fixes it (`StepPlanner`)."""
    dp: int | None = None
    """parallel.dp: data-parallel replicas, over which ZeRO shards optimizer states; None while
    auto."""
    devices: int | None = None
    """parallel.devices: what an auto layout splits into pp x dp."""
    replicas: int | None = None
    """How many replicas one step-planning call deals its samples to: dp when a step is planned
    across the replicas (None means dp), 1 when each replica plans its own share."""
    precision: TrainingPrecision = DEFAULT_PRECISION
    """train.precision, train.zero_stage, train.optimizer as the memory is priced."""
    memory_headroom: float = 0.0
    """plan.memory_headroom: the share of usable memory no plan fills (0 here: all of it; the
    config's default for runs and `mmpipe plan` is 0.08)."""
    lora: LoraSpec = NO_LORA
    """train.lora: adapters, their base weights frozen."""
    placement: Placement = Placement()
    """plan.encoders parsed (the default keeps every tower on the stages)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "trainable", tuple(self.trainable))  # frozen: a tuple, once

    @property
    def replica_count(self) -> int:
        """Replicas one step-planning call deals to (`replicas`, else dp)."""
        return self.replicas if self.replicas is not None else self.fixed_dp

    @property
    def fixed_dp(self) -> int:
        """dp as a number; ValueError while it is auto."""
        if self.dp is None:
            raise ValueError("parallel.dp=auto: choose the layout first (choose_layout)")
        return self.dp

    @property
    def fixed_pp(self) -> int:
        """pp as a number; ValueError while it is auto."""
        if self.pp is None:
            raise ValueError("parallel.pp=auto: choose the layout first (choose_layout)")
        return self.pp

    def cost_model(self, dp: int | None = None) -> CostModel:
        """Every layer costed for this run (`build_cost_model`), with its dp or the given one
        (the layout search prices each dp a layout may take)."""
        return build_cost_model(model=self.model, hardware=self.hardware, trainable=self.trainable,
                                dp=self.fixed_dp if dp is None else dp, precision=self.precision,
                                memory_headroom=self.memory_headroom, lora=self.lora)
