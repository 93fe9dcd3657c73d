"""Typed run configuration, and the one place a Hydra config becomes plain values.

Everything below the CLI takes these dataclasses. Validation happens here, before any process
is launched, and every message names the key as the user types it, the bad value and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mmpipe.model.pretrained import Pretrained, check_matches
from mmpipe.model.spec import TRAINABLE_PREFIXES, ModelSpec, layer_names, spec_from_dict

PROJECT_ROOT = Path(__file__).resolve().parent.parent
from mmpipe.planner.api import DEFAULT_HEADROOM, POLICIES, check_headroom, hardware_from_dict  # noqa: E402


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    pp: int | str = 2
    """Pipeline stages, or `auto` (chosen among the splits of parallel.devices)."""
    dp: int | str = 1
    """Data-parallel replicas, or `auto`."""
    devices: int | None = None
    """Devices to split into pp x dp (needed when pp or dp is auto)."""

    def __post_init__(self) -> None:
        for key in ("pp", "dp"):
            v = getattr(self, key)
            if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"parallel.{key}={v!r} must be a positive integer or auto")
        n = self.devices
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"parallel.devices={n!r} must be a positive integer or null")
        if self.auto and n is None:
            raise ValueError(f"parallel.pp={self.pp} parallel.dp={self.dp}: auto needs "
                             f"parallel.devices=N, the devices to split into stages x replicas")
        if n is not None:
            for key in ("pp", "dp"):
                v = getattr(self, key)
                if v != "auto" and n % v:
                    raise ValueError(f"parallel.{key}={v} does not divide parallel.devices={n}; "
                                     f"use a divisor of {n} or auto")
            if not self.auto and self.pp * self.dp != n:
                raise ValueError(f"parallel.pp={self.pp} x parallel.dp={self.dp} = "
                                 f"{self.pp * self.dp} is not parallel.devices={n}; set one of "
                                 f"them to auto")

    @property
    def auto(self) -> bool:
        """pp or dp is still to be chosen (`resolve_layout`)."""
        return self.pp == "auto" or self.dp == "auto"

    def fixed(self, key: str) -> int | None:
        """parallel.pp or parallel.dp as a number, None when auto."""
        v = getattr(self, key)
        return None if v == "auto" else int(v)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 60
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per optimizer step, all replicas together."""
    micro_batches: int = 4
    """Micro-batches per replica per step."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 0
    """Seed of the initial weights and the data order."""
    trainable: tuple[str, ...] = ("all",)
    """Component prefixes that train."""
    optimizer: str = "adamw"
    """adamw | sgd."""
    save_every: int = 0
    """DeepSpeed checkpoint every N steps (0: only at the end)."""
    resume: str | None = None
    """Continue from a checkpoint: its folder (…/checkpoints/step<N>) or a run directory (its latest)."""
    log_every: int = 1
    """Metrics line every N steps."""
    record_samples: bool = False
    """Write the sample keys of every micro-batch each data-reading rank fed (samples_rank*.jsonl)."""

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch", "micro_batches", "log_every"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"train.{key}={v!r} must be a positive integer")
        for key in ("warmup_steps", "save_every", "seed"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train.{key}={v!r} must be a non-negative integer")
        if not self.lr > 0:
            raise ValueError(f"train.lr={self.lr!r} must be > 0")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip!r} must be >= 0 (0 disables clipping)")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"train.optimizer={self.optimizer!r} is unknown; use adamw or sgd")
        if not self.trainable:
            raise ValueError("train.trainable=[] trains nothing; use [all] or component prefixes")
        for t in self.trainable:
            if t not in TRAINABLE_PREFIXES:
                raise ValueError(
                    f"train.trainable entry {t!r} is unknown; use {', '.join(TRAINABLE_PREFIXES)}"
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    kind: str = "shards"
    """shards (webdataset tar shards) | trace (a JSONL workload trace, for planning)."""
    path: str = ""
    """Shard brace list or trace file."""
    tokenizer: str | None = None
    """Tokenizer JSON made by mmpipe.data.synth."""
    on_error: str = "skip"
    """skip (count and go on) | raise."""
    shuffle_buffer: int = 0
    """Sample shuffle buffer (0: stream order)."""
    epochs: int | None = None
    """Passes over the shards (None: forever)."""
    too_long: str = "drop"
    """A sample longer than model.llm.max_seq_len: drop (counted) | truncate (the answer's tail)."""
    num_workers: int = 1
    """Loader worker processes per data-reading rank (1: read in the trainer's feeder thread)."""
    sources: tuple[Mapping[str, Any], ...] | None = None
    """A mixture: [{name, path, weight, limit, limit_mode}, ...] (see conf/data/mixture.yaml)."""

    def __post_init__(self) -> None:
        if self.too_long not in ("drop", "truncate"):
            raise ValueError(f"data.too_long={self.too_long!r} is unknown; use drop or truncate")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"data.num_workers={self.num_workers!r} must be a positive integer")
        if self.sources is not None:
            from mmpipe.data.mixture import mixture_from_dicts

            mixture_from_dicts(list(self.sources))
        if self.kind not in ("shards", "trace"):
            raise ValueError(f"data.kind={self.kind!r} is unknown; use shards or trace")
        if not self.path or self.path == "???":
            raise ValueError("data.path is not set; give data.path=FILE (a shard brace list or trace)")
        if self.on_error not in ("skip", "raise"):
            raise ValueError(f"data.on_error={self.on_error!r} is unknown; use skip or raise")
        if self.shuffle_buffer < 0:
            raise ValueError(f"data.shuffle_buffer={self.shuffle_buffer} must be >= 0")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"data.epochs={self.epochs} must be >= 1, or null to repeat the data forever")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    policy: str = "data-aware"
    """data-aware | ds-default | llava-grouped | packed-ffd."""
    stages: tuple[tuple[str, str], ...] | None = None
    """User override: (first layer, last layer) of each stage."""
    out: str | None = None
    """Plan JSON path (mmpipe plan)."""
    steps: int | None = None
    """Plan only the first K steps (mmpipe plan)."""
    plot: str | None = None
    """PNG timeline of a step (mmpipe plan)."""
    across_replicas: bool = False
    """Training: plan each global step across the data-parallel replicas (every replica reads
    the whole stream and decodes its planned share) instead of each replica planning its own
    shards' samples."""
    memory_headroom: float = DEFAULT_HEADROOM
    """Share of usable device memory no plan fills (allocator fragmentation, buffers the cost
    model does not see); see docs/planner.md."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"plan.policy={self.policy!r} is unknown; use {', '.join(POLICIES)}")
        check_headroom(self.memory_headroom)
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"plan.steps={self.steps!r} must be a positive integer or null")


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherConfig:
    nproc: int | None = None
    """Local processes (default pp * dp)."""
    backend: str = "auto"
    """auto | gloo | nccl."""
    master_port: int = 0
    """Rendezvous port (0: a free one)."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"launcher.backend={self.backend!r} is unknown; use auto, gloo or nccl")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"launcher.nproc={self.nproc} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    out: str | None = None
    """Where `mmpipe profile` writes the machine description (default conf/hardware/measured-<model>.yaml)."""
    repeats: int = 5
    """Timed repetitions per layer and shape (the median is kept)."""

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"profile.repeats={self.repeats!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardsConfig:
    json: str | None = None
    """LLaVA-style JSON list to convert (mmpipe shards)."""
    out: str | None = None
    """Output folder of the shards and index.json."""
    image_root: str | None = None
    """Folder the JSON's image paths are relative to (default: the JSON's folder)."""
    audio_root: str | None = None
    """Folder the JSON's audio paths are relative to (default: the JSON's folder)."""
    maxcount: int = 1000
    """Samples per shard at most."""
    maxsize_mb: float | None = None
    """Shard size limit in MB (null: count only)."""
    prefix: str = "train"
    """Shard file prefix: <prefix>-000000.tar."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    policies: tuple[str, ...] = POLICIES
    """Policies `mmpipe bench` trains, alternating."""
    rounds: int = 2
    """Alternating rounds (each policy trains once per round)."""
    steps: int = 30
    """Steps per run (the first two are not timed)."""
    samples: int = 2000
    """Samples `mmpipe bench-data` reads from data.path."""
    generated: int = 5000
    """Samples of the larger generated set `mmpipe bench-data` also reads (0: skip)."""

    def __post_init__(self) -> None:
        for p in self.policies:
            if p not in POLICIES:
                raise ValueError(f"bench.policies entry {p!r} is unknown; use {', '.join(POLICIES)}")
        if self.rounds < 1 or self.steps < 3:
            raise ValueError(f"bench.rounds={self.rounds} / bench.steps={self.steps}: need rounds >= 1, steps >= 3")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """One whole run, validated."""

    model: ModelSpec
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    plan: PlanConfig
    launcher: LauncherConfig
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    pretrained: Pretrained = field(default_factory=Pretrained)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    hardware: Mapping[str, Any] = field(default_factory=dict)
    """Raw hardware group (typed by the planner)."""
    run_dir: str = "."
    """Where metrics.jsonl and checkpoints go."""

    @property
    def layers(self) -> list[str]:
        return layer_names(self.model)

    @property
    def stage_bounds(self) -> list[tuple[int, int]] | None:
        """The user's stage override as [start, end) indices, or None."""
        if self.plan.stages is None:
            return None
        return stages_to_bounds(self.plan.stages, self.layers)


_SCALARS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _check_type(prefix: str, key: str, annotation: str, value: Any) -> None:
    """Scalar settings must have their declared type (a typo like train.lr=abc is caught here,
    with the key, not as a TypeError deep inside)."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None and "None" in kinds:
        return
    for kind in kinds:
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if kind == "str" and isinstance(value, str):
            return
        if kind == "bool" and isinstance(value, bool):
            return
        if kind not in _SCALARS and kind != "None":
            return  # containers are checked by their own validation
    wanted = " or ".join(_SCALARS.get(k, "null") for k in kinds)
    raise ValueError(f"{prefix}.{key}={value!r} must be {wanted}")


def _section(cls: type, prefix: str, values: Mapping[str, Any] | None) -> Any:
    values = dict(values or {})
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"{prefix}.{key} is not a setting; known: {', '.join(sorted(fields))}")
        _check_type(prefix, key, str(fields[key].type), value)
    return cls(**values)


GROUPS = ("model", "parallel", "train", "data", "plan", "launcher", "profile", "pretrained", "shards", "bench",
          "hardware", "hydra")


def _tuple_of(section: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    out = dict(section or {})
    if isinstance(out.get(key), (list, tuple)):
        out[key] = tuple(out[key])
    elif isinstance(out.get(key), str):
        out[key] = (out[key],)
    return out


def run_config_from_dict(cfg: Mapping[str, Any], *, run_dir: str = ".") -> RunConfig:
    """Validate a resolved config mapping (what Hydra composed) into a RunConfig."""
    cfg = dict(cfg)
    for key in cfg:
        if key not in GROUPS:
            raise ValueError(f"{key} is not a config group; known: {', '.join(GROUPS)}")
    train = dict(cfg.get("train") or {})
    if "trainable" in train:
        t = train["trainable"]
        train["trainable"] = (t,) if isinstance(t, str) else tuple(t)
    plan = dict(cfg.get("plan") or {})
    if plan.get("stages") is not None:
        plan["stages"] = parse_stages(plan["stages"])
    rc = RunConfig(
        model=spec_from_dict(cfg["model"]),
        parallel=_section(ParallelConfig, "parallel", cfg.get("parallel")),
        train=_section(TrainConfig, "train", train),
        data=_section(DataConfig, "data", cfg.get("data")),
        plan=_section(PlanConfig, "plan", plan),
        launcher=_section(LauncherConfig, "launcher", cfg.get("launcher")),
        profile=_section(ProfileConfig, "profile", cfg.get("profile")),
        pretrained=_section(Pretrained, "pretrained", cfg.get("pretrained")),
        shards=_section(ShardsConfig, "shards", cfg.get("shards")),
        bench=_section(BenchConfig, "bench", _tuple_of(cfg.get("bench"), "policies")),
        hardware=dict(cfg.get("hardware") or {}),
        run_dir=run_dir,
    )
    check_run(rc)
    return rc


def check_run(rc: RunConfig) -> None:
    """Cross-key checks: the ones no single section can make (those on parallel.pp / dp wait
    for `resolve_layout` while they are auto)."""
    if rc.parallel.auto:
        _check_auto(rc)
        return
    pp, dp, t = rc.parallel.pp, rc.parallel.dp, rc.train
    n_layers = len(rc.layers)
    if pp > n_layers:
        raise ValueError(
            f"parallel.pp={pp} exceeds the {n_layers} layers of model {rc.model.name}; use at most {n_layers}"
        )
    if t.global_batch % dp:
        raise ValueError(
            f"train.global_batch={t.global_batch} is not divisible by parallel.dp={dp}; "
            f"use a multiple of {dp}"
        )
    per_replica = t.global_batch // dp
    if t.micro_batches > per_replica:
        raise ValueError(
            f"train.micro_batches={t.micro_batches} exceeds the {per_replica} samples each replica gets "
            f"per step (train.global_batch={t.global_batch} / parallel.dp={dp}); use at most {per_replica}"
        )
    world = rc.launcher.nproc if rc.launcher.nproc is not None else pp * dp
    if world != pp * dp:
        raise ValueError(
            f"launcher.nproc={world} does not equal parallel.pp * parallel.dp = {pp} * {dp} = {pp * dp}; "
            f"set launcher.nproc={pp * dp} or change parallel.dp to {max(1, world // pp)}"
        )
    if rc.plan.stages is not None and len(rc.plan.stages) != pp:
        raise ValueError(
            f"plan.stages gives {len(rc.plan.stages)} stages but parallel.pp={pp}; "
            f"give one [first,last] pair per stage or set parallel.pp={len(rc.plan.stages)}"
        )
    rc.stage_bounds  # validates names and tiling
    hardware_spec(rc)
    if rc.pretrained.any():
        check_matches(rc.model, rc.pretrained)


def _check_auto(rc: RunConfig) -> None:
    """What can be checked before the layout is chosen."""
    n = rc.parallel.devices
    if rc.launcher.nproc is not None and rc.launcher.nproc != n:
        raise ValueError(f"launcher.nproc={rc.launcher.nproc} does not equal parallel.devices={n}; "
                         f"set launcher.nproc={n} or leave it null")
    if rc.plan.stages is not None and rc.parallel.pp == "auto":
        raise ValueError(f"plan.stages gives {len(rc.plan.stages)} stages: with a stage override set "
                         f"parallel.pp={len(rc.plan.stages)} instead of auto")
    if rc.plan.stages is not None:
        stages_to_bounds(rc.plan.stages, rc.layers)  # validates names and tiling
    hardware_spec(rc)
    if rc.pretrained.any():
        check_matches(rc.model, rc.pretrained)


def resolve_layout(rc: RunConfig, sample) -> RunConfig:
    """The run with parallel.pp / parallel.dp = auto replaced by the planner's choice
    (`planner.api.choose_layout` on `sample`: the features of the run's first samples in
    stream order, at least one whole step), checked like any run; `rc` itself when nothing
    is auto. Pure: the caller reads the sample (before launching any process)."""
    if not rc.parallel.auto:
        return rc
    from dataclasses import replace

    from mmpipe.planner.api import choose_layout

    p = rc.parallel
    choice = choose_layout(model=rc.model, hardware=hardware_spec(rc), trainable=rc.train.trainable,
                           devices=p.devices, global_batch=rc.train.global_batch,
                           micro_batches=rc.train.micro_batches, sample=sample, pp=p.fixed("pp"),
                           dp=p.fixed("dp"), memory_headroom=rc.plan.memory_headroom)
    best = choice.best
    if not best.fits:
        raise ValueError(f"parallel.devices={p.devices}: no pp x dp layout fits in memory ("
                         + "; ".join(f"{x.pp}x{x.dp}: {x.note}" for x in choice.layouts) + ")")
    out = replace(rc, parallel=ParallelConfig(pp=best.pp, dp=best.dp, devices=p.devices))
    check_run(out)
    return out


def hardware_spec(rc: RunConfig):
    """The typed hardware description; a measured one must belong to the configured model."""
    hw = dict(rc.hardware)
    measured_for = hw.pop("measured_for", None)
    if measured_for is not None and measured_for != rc.model.name:
        raise ValueError(
            f"hardware={hw.get('name', '?')} was measured for model {measured_for}, not model {rc.model.name}; "
            f"run `mmpipe profile model={rc.model.name}` and use the file it writes"
        )
    return hardware_from_dict(hw)


def parse_stages(value: Any) -> tuple[tuple[str, str], ...]:
    """Accept [[first,last],...] (as Hydra parses it) or 'first:last,first:last' strings."""
    if isinstance(value, str):
        pairs = [p.split(":") for p in value.split(",") if p.strip()]
    else:
        pairs = [list(p) if not isinstance(p, str) else p.split(":") for p in value]
    out = []
    for p in pairs:
        if len(p) != 2:
            raise ValueError(
                f"plan.stages entry {p!r} is not a [first_layer,last_layer] pair; "
                f"write plan.stages=[[vision.embed,llm.block.1],[llm.block.2,llm.head]]"
            )
        out.append((str(p[0]).strip(), str(p[1]).strip()))
    return tuple(out)


def stages_to_bounds(stages: tuple[tuple[str, str], ...], layers: list[str]) -> list[tuple[int, int]]:
    """Turn (first, last) layer names per stage into [start, end) indices that tile `layers`."""
    index = {n: i for i, n in enumerate(layers)}
    bounds = []
    for s, (first, last) in enumerate(stages):
        for n in (first, last):
            if n not in index:
                near = [l for l in layers if l.split(".")[0] == n.split(".")[0]] or layers
                raise ValueError(
                    f"plan.stages: stage {s} names layer {n!r}, which the model does not have; "
                    f"layers run {layers[0]} ... {layers[-1]} (e.g. {', '.join(near[:4])})"
                )
        a, b = index[first], index[last] + 1
        if b <= a:
            raise ValueError(f"plan.stages: stage {s} [{first},{last}] is empty or reversed")
        bounds.append((a, b))
    expect = 0
    for s, (a, b) in enumerate(bounds):
        if a != expect:
            gap = layers[expect] if a - expect == 1 else f"{layers[expect]} .. {layers[a - 1]}"
            what = f"leaves {gap} uncovered" if a > expect else f"overlaps the previous stage at {layers[a]}"
            raise ValueError(
                f"plan.stages: stage {s} starts at {layers[a]} and {what}; each stage must start "
                f"right after the previous one ends, the first at {layers[0]} and the last ending at {layers[-1]}"
            )
        expect = b
    if expect != len(layers):
        gap = layers[-1] if expect == len(layers) - 1 else f"{layers[expect]} .. {layers[-1]}"
        raise ValueError(
            f"plan.stages: the last stage ends at {layers[expect - 1]}, leaving {gap} uncovered; "
            f"end the last stage at {layers[-1]}"
        )
    return bounds


def resolve_path(p: str) -> str:
    """A relative path is taken from the current directory, else from the project root."""
    if not p or os.path.isabs(p) or p.startswith("pipe:"):
        return p
    head = p.split("{")[0]
    if Path(head).exists() or Path(head).parent.exists() and str(Path(head).parent) != ".":
        return p
    if (PROJECT_ROOT / head).exists() or (PROJECT_ROOT / head).parent.exists():
        return str(PROJECT_ROOT / p)
    return p
