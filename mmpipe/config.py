"""Typed run configuration, and the one place a Hydra config becomes plain values.

Everything below the CLI takes these dataclasses. Validation happens here, before any process
is launched, and every message names the key as the user types it, the bad value and the fix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmpipe.data.options import CAPTION_PROMPT, check_options
from mmpipe.machine import Machine
from mmpipe.model.group import model_from_group
from mmpipe.model.kernel_choice import KERNELS
from mmpipe.model.spec import NO_LORA, TRAINABLE_PREFIXES, LoraSpec, ModelSpec, layer_names
from mmpipe.paths import model_folder, nearest, resolve_path, shell_word
from mmpipe.planner.api import (  # planner-owned
    DEFAULT_HEADROOM,
    PACKED_POLICIES,
    POLICIES,
    Placement,
    PlanProblem,
    check_encoders_value,
    check_headroom,
    hardware_from_dict,
    parse_ladder,
)

PRECISIONS = ("fp32", "bf16", "fp16")
CPU_STAGES = 2
"""Pipeline stages of a run that sets no layout on a machine without a GPU: a real two-stage
pipeline, which is what the CPU demo is for."""
"""Values of train.precision."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    pp: int | str | None = None
    """Pipeline stages, `auto` (chosen among the splits of parallel.devices), or null (unset):
    fitted to the machine (`fit_machine`: one GPU -> 1; N GPUs -> the planner's choice over N;
    no GPU -> 2, a real two-stage pipeline on the CPU)."""
    dp: int | str | None = None
    """Data-parallel replicas, `auto`, or null (unset): fitted to the machine (no GPU -> 1)."""
    devices: int | None = None
    """Devices to split into pp x dp (needed when pp or dp is auto; unset on a GPU machine: the
    GPUs torch sees, or WORLD_SIZE under an external launcher)."""

    def __post_init__(self) -> None:
        for key, cpu in (("pp", CPU_STAGES), ("dp", 1)):  # built without a machine: the CPU layout
            if getattr(self, key) is None:
                object.__setattr__(self, key, cpu)
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


LOGGERS = ("jsonl", "tensorboard", "wandb")
"""Metric sinks train.loggers may name (mmpipe/runtime/metrics.py writes them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 60
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per optimizer step, all replicas together."""
    micro_batches: int = 4
    """Micro-batches per replica per step."""
    lr: float = 3e-3
    """Peak learning rate (0: the weights never change; each step only measures the loss)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 0
    """Seed of the initial weights and the data order."""
    trainable: tuple[str, ...] | None = None
    """Component prefixes trained in full (`all`: every layer train.lora does not adapt); null:
    [all] without adapters, [] (the adapters alone) with train.lora.r > 0."""
    lora: LoraSpec = NO_LORA
    """Low-rank adapters (peft's LoRA) on the Linear layers of some components; their base weights
    stay frozen (r=0: none)."""
    optimizer: str = "adamw"
    """adamw (torch AdamW, fused kernel, on every device: no DeepSpeed FusedAdam JIT build) | sgd
    (torch SGD, no momentum)."""
    precision: str = "fp32"
    """fp32 | bf16 (bf16 weights and activations, fp32 master weights and fp32 gradient
    accumulation) | fp16 (fp16 weights and activations, fp32 master weights, dynamic loss scale)."""
    zero_stage: int | None = None
    """0 | 1 (optimizer state sharded over the data-parallel replicas); null: 1 under bf16 and
    fp16 (the only stage DeepSpeed trains them correctly with under a pipeline), 0 under fp32."""
    attention: str = "auto"
    """Attention kernel of packed micro-batches (mmpipe/model/kernels.py): auto (flash where
    flash-attn imports, on CUDA, in bf16/fp16; else flex on CUDA; else sdpa) | flash (flash-attn
    varlen) | flex (FlexAttention with a document mask; CUDA) | sdpa (SDPA per segment) | eager
    (dense block-diagonal mask: the slow reference)."""
    save_every: int = 0
    """Committed checkpoint every N steps (0: none along the way)."""
    save_final: bool = False
    """Committed checkpoint after the last step (off by default: a default run writes no checkpoint)."""
    keep_last: int = 0
    """Committed checkpoints to keep (0: all); older ones go after each new commit, never the resumed one."""
    resume: str | None = None
    """Continue from a checkpoint: its folder (…/checkpoints/step<N>) or a run directory (its newest committed)."""
    resume_unsafe: bool = False
    """Allow torch.load(weights_only=False) for checkpoint files outside the run directory (runs their code)."""
    on_nonfinite: str = "stop"
    """A step with a non-finite loss or gradient norm (its update is withheld): stop (no save) | skip."""
    save_on_signal: bool = False
    """On SIGTERM, finish the current step, save a committed checkpoint and exit cleanly."""
    log_every: int = 1
    """Metrics line every N steps."""
    record_samples: bool = False
    """Write the sample keys of every micro-batch each data-reading rank fed (samples_rank*.jsonl),
    and at the end each rank's parameter digest (stage_rank*.json: param_sha256), so that runs can
    be checked: the replicas of a stage must end with the same weights."""
    trace: bool = False
    """Write every rank's pipeline instructions (forward, backward, sends, receives, encoder work)
    with their times as a Chrome trace, RUN_DIR/trace_rank<R>.json: open them in ui.perfetto.dev."""
    eval_every: int | None = None
    """Score data.eval_path every N steps and after the last step, logged as eval_loss; null: ten
    times over the run (every ceil(train.steps / 10) steps) when data.eval_path is set; 0: never."""
    eval_samples: int = 64
    """Held-out samples each evaluation scores: the first N of data.eval_path in stream order (never
    shuffled), the same every time, so evaluations compare."""
    loggers: tuple[str, ...] = ("jsonl",)
    """Where per-step metrics go: jsonl (metrics.jsonl, always written) | tensorboard (event files in
    RUN_DIR/tensorboard; pip install 'mmpipe[tensorboard]') | wandb (offline unless WANDB_MODE=online;
    pip install 'mmpipe[wandb]')."""

    @property
    def zero(self) -> int:
        """The ZeRO stage the run uses (train.zero_stage, or its default for the precision)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 0 if self.precision == "fp32" else 1

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch", "micro_batches", "log_every", "eval_samples"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"train.{key}={v!r} must be a positive integer")
        for key in ("warmup_steps", "save_every", "keep_last", "seed"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train.{key}={v!r} must be a non-negative integer")
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every < 0):
            raise ValueError(f"train.eval_every={self.eval_every!r} must be a non-negative integer (0: never) or null")
        if not self.lr >= 0:
            raise ValueError(f"train.lr={self.lr!r} must be >= 0 (0 keeps the weights as loaded)")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip!r} must be >= 0 (0 disables clipping)")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"train.optimizer={self.optimizer!r} is unknown; use adamw or sgd")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={self.on_nonfinite!r} is unknown; use stop or skip")
        if self.attention not in KERNELS:
            raise ValueError(f"train.attention={self.attention!r} is unknown; use {', '.join(KERNELS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is unknown; use {', '.join(PRECISIONS)}")
        if self.zero_stage not in (None, 0, 1):
            raise ValueError(f"train.zero_stage={self.zero_stage!r} is not supported: DeepSpeed's pipeline engine "
                             f"runs ZeRO stage 0 or 1 only (it refuses stages 2 and 3, which partition "
                             f"gradients); use train.zero_stage=0 or 1")
        if self.precision == "bf16" and self.zero_stage == 0:
            raise ValueError("train.zero_stage=0 with train.precision=bf16: DeepSpeed keeps fp32 master weights "
                             "and fp32 gradient accumulation for bf16 only in its ZeRO-1 optimizer "
                             "(BF16_Optimizer), which shards them over the replicas; use train.zero_stage=1 "
                             "or leave it unset")
        if self.precision == "fp16" and self.zero_stage == 0:
            raise ValueError("train.zero_stage=0 with train.precision=fp16: DeepSpeed's fp16 optimizer without "
                             "ZeRO never scales the loss yet divides the gradients by the loss scale (updates "
                             "65536x too small); use train.zero_stage=1 or leave it unset")
        if self.on_nonfinite == "skip" and self.zero != 0:
            raise ValueError(f"train.on_nonfinite=skip withholds a step's update in mmpipe's gradient hook, which runs "
                             f"with train.precision=fp32 and ZeRO stage 0 only (now precision={self.precision}, ZeRO "
                             f"stage {self.zero}: DeepSpeed's optimizer steps; under fp16 its loss scale already "
                             f"skips overflowing steps); use train.on_nonfinite=stop or train.zero_stage=0")
        if self.trainable is None:  # resolved once here; every reader sees a tuple
            object.__setattr__(self, "trainable", () if self.lora.active else ("all",))
        if not self.trainable and not self.lora.active:
            raise ValueError("train.trainable=[] trains nothing; use [all] or component prefixes "
                             "(or adapters: train.lora.r=16)")
        for name in self.loggers:
            if name not in LOGGERS:
                raise ValueError(f"train.loggers entry {name!r} is unknown; use {', '.join(LOGGERS)}")
        for t in self.trainable:
            if t not in TRAINABLE_PREFIXES:
                raise ValueError(
                    f"train.trainable entry {t!r} is unknown; use {', '.join(TRAINABLE_PREFIXES)}"
                )
            if t != "all" and self.lora.adapts(t):
                raise ValueError(f"train.trainable entry {t!r} is a part train.lora.parts={list(self.lora.parts)} "
                                 f"adapts (its base weights stay frozen); a layer trains in full or through "
                                 f"adapters: drop {t!r} from one of the two")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedSettings:
    config: str | None = None
    """A DeepSpeed JSON file merged over the config mmpipe generates (monitors, communication,
    activation checkpointing, steps_per_print, ...); keys mmpipe owns are refused (see
    mmpipe.runtime.dsconfig.OWNED)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    kind: str = "shards"
    """shards (webdataset tar shards) | trace (a JSONL workload trace, for planning)."""
    path: str = ""
    """Shard brace list or trace file."""
    eval_path: str | None = None
    """Held-out shards (the grammar of data.path) whose loss is reported as eval_loss while
    training (train.eval_every, train.eval_samples) and scored by `mmpipe eval`; null: none."""
    tokenizer: str | None = None
    """mmpipe's tokenizer JSON (made by mmpipe.data.synth) or a Hugging Face checkpoint folder (its
    tokenizer and chat template); None: the model's own (`tokenizer_source`)."""
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
    decode_workers: int | str = "auto"
    """Worker processes per data-reading rank that decode and collate the next steps'
    micro-batches (0: in the feeder thread, which shares the GIL with the training loop);
    auto: none below 4 cores a rank, else half its cores, at most 4 (runtime/host.py)."""
    sources: tuple[Mapping[str, Any], ...] | None = None
    """A mixture: [{name, path, weight, limit, limit_mode}, ...] (see `mmpipe train data=mixture --cfg job`)."""
    caption_prompt: str = CAPTION_PROMPT
    """Human turn of image-caption samples (img2dataset shards: KEY.jpg + KEY.txt); one <image>."""
    max_image_pixels: int = 64_000_000
    """An image whose header gives more pixels (height x width) is refused undecoded (`media too large`)."""
    max_member_mb: float = 100.0
    """An image or clip of more megabytes is refused undecoded (`media too large`); `mmpipe shards`
    reads no more than this of any media file."""
    max_audio_seconds: float = 600.0
    """A clip whose header gives a longer duration is refused undecoded (`media too large`)."""
    max_video_frames: int = 36_000
    """A video whose container header declares more frames is refused undecoded (`media too large`);
    at most the planned frames are ever decoded (20 minutes at 30 fps)."""
    max_video_seconds: float = 1200.0
    """A video whose header gives a longer duration (frames / frame rate) is refused undecoded
    (`media too large`)."""

    @property
    def limits(self):
        """The media limits as the data layer takes them (mmpipe.data.media.MediaLimits)."""
        from mmpipe.data.media import MediaLimits

        return MediaLimits(max_image_pixels=self.max_image_pixels, max_member_bytes=int(self.max_member_mb * 2**20),
                           max_audio_seconds=float(self.max_audio_seconds), max_video_frames=self.max_video_frames,
                           max_video_seconds=float(self.max_video_seconds))

    def __post_init__(self) -> None:
        _ = self.limits  # validates the media limits, naming the key
        check_options(on_error=self.on_error, too_long=self.too_long, shuffle_buffer=self.shuffle_buffer,
                      epochs=self.epochs, num_workers=self.num_workers, caption_prompt=self.caption_prompt,
                      decode_workers=self.decode_workers)
        if self.sources is not None:
            from mmpipe.data.mixture import mixture_from_dicts

            mixture_from_dicts(list(self.sources))
        if self.kind not in ("shards", "trace"):
            raise ValueError(f"data.kind={self.kind!r} is unknown; use shards or trace")
        if not self.path or self.path == "???":
            raise ValueError("data.path is not set; give data.path=FILE (a shard brace list or trace)")
        if self.eval_path is not None and not self.eval_path.strip():
            raise ValueError("data.eval_path='' names no shards; give held-out shards (a brace list, like data.path) "
                             "or null for no evaluation")


def _flags(values) -> str:
    """A list of flags as it is written on the command line: [true,false]."""
    return "[" + ",".join(str(v).lower() if isinstance(v, bool) else repr(v) for v in values) + "]"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    policy: str = "data-aware"
    """data-aware | ds-default | llava-grouped | packed-ffd."""
    stages: tuple[tuple[str, str], ...] | None = None
    """User override: (first layer, last layer) of each stage."""
    recompute: tuple[bool, ...] | None = None
    """User override, with plan.stages: whether each stage recomputes its layers' activations
    in backward (null: no stage does)."""
    out: str | None = None
    """Plan JSON path (mmpipe plan; relative: in the run directory)."""
    steps: int | None = None
    """Plan only the first K steps (mmpipe plan)."""
    plot: str | None = None
    """PNG timeline of a step (mmpipe plan; relative: in the run directory)."""
    across_replicas: bool = False
    """Training: plan each global step across the data-parallel replicas (every replica reads
    the whole stream and decodes its planned share) instead of each replica planning its own
    shards' samples."""
    memory_headroom: float = DEFAULT_HEADROOM
    """Share of usable device memory no plan fills (allocator fragmentation, buffers the cost
    model does not see); see docs/planner.md."""
    refit: bool = True
    """Training: once the step-time re-fit has seen its warm-up steps, plan every later step's
    micro-batches (count, sizes, order) with the run's measured costs instead of the hardware
    config's (the stage cut stays). false: every step is planned with the hardware config,
    so the micro-batches are a function of the data alone and a run repeats bit for bit."""
    recut: str = "off"
    """Training: off | auto. auto: at each checkpoint (train.save_every), re-plan the stage cut on
    the samples trained since the last check, priced with the run's step-time re-fit; when
    another cut is predicted faster by more than plan.recut_gain, commit the checkpoint and
    relaunch the ranks on the new cut from it (the layout-changing resume). Off by default: a
    re-cut costs a relaunch (the ranks' start-up, tens of seconds) that short runs never repay."""
    recut_gain: float = 0.05
    """The least predicted speed-up (a fraction: 0.05 = 5%) for plan.recut=auto to re-cut."""
    encoders: str | Mapping[str, str] = "auto"
    """Where the encoder towers run: auto | stages | spread | nested, or per tower, e.g.
    "plan.encoders={vision: spread, audio: stages}" (a tower left out stays on the stages).
    stages: a tower's layers run on the pipeline stages that hold them; spread: every rank
    holds the whole tower and encodes a share of its replica's samples before the pipeline
    runs; nested: the same shares encoded inside the pipeline's 1F1B steps, where each rank
    would wait (docs/planner.md, Encoder placement); auto: the planner compares the best plan
    of each placement by its simulated step time and keeps the fastest (the stages unless
    another is predicted 15% faster)."""
    ladder: str | tuple[int, ...] = "auto"
    """Lengths packed micro-batches are padded to, so compiled attention kernels see a few
    shapes: auto | off | rising multiples of 128, e.g. "plan.ladder=[512,1024,2048]". auto: on
    in training runs whose attention kernel compiles (FlexAttention on CUDA), with the up to 8
    rungs that pad the first steps' packed micro-batches least; off elsewhere (CPU, flash-attn,
    mmpipe plan). The padding is a segment of its own without labels, and the planner prices it
    (docs/planner.md, Length ladder)."""

    def __post_init__(self) -> None:
        if self.recut not in ("off", "auto"):
            raise ValueError(f"plan.recut={self.recut!r} is unknown; use off or auto")
        if not (isinstance(self.recut_gain, (int, float)) and self.recut_gain >= 0):
            raise ValueError(f"plan.recut_gain={self.recut_gain!r} must be a fraction >= 0 (0.05: re-cut when "
                             f"another cut is predicted 5% faster)")
        if self.policy not in POLICIES:
            raise ValueError(f"plan.policy={self.policy!r} is unknown; use {', '.join(POLICIES)}")
        check_headroom(self.memory_headroom)
        check_encoders_value(self.encoders)
        ladder = parse_ladder(self.ladder)
        object.__setattr__(self, "ladder", ladder)  # frozen: rungs as a tuple, once
        if isinstance(ladder, tuple) and self.policy not in PACKED_POLICIES:
            raise ValueError(f"plan.ladder=[{','.join(map(str, ladder))}] pads packed micro-batches, but "
                             f"plan.policy={self.policy} pads each row to its longest sample; use plan.ladder=off "
                             f"or a packed policy ({', '.join(PACKED_POLICIES)})")
        if isinstance(self.encoders, Mapping):  # frozen: a plain dict, once
            object.__setattr__(self, "encoders", {str(k): v for k, v in self.encoders.items()})
        if self.recompute is not None:
            if self.stages is None:
                raise ValueError(f"plan.recompute={_flags(self.recompute)} needs plan.stages (it gives each "
                                 f"overridden stage's flag); set plan.stages too, or drop plan.recompute")
            if len(self.recompute) != len(self.stages) or not all(isinstance(r, bool) for r in self.recompute):
                raise ValueError(f"plan.recompute={_flags(self.recompute)} must hold one true/false per stage of "
                                 f"plan.stages ({len(self.stages)}), e.g. "
                                 f"plan.recompute=[{','.join(['false'] * len(self.stages))}]")
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
    grace_s: float = 10.0
    """When ranks are stopped (one failed, or the launcher got SIGTERM/SIGINT/SIGHUP): seconds
    between SIGTERM and SIGKILL."""
    verbose: bool = False
    """Show the libraries' start-up output (DeepSpeed's info lines, transformers warnings); the
    environment variable MMPIPE_DEBUG=1 does the same."""
    cache_dir: str | None = None
    """Where compiled kernels are kept across launches (torch.compile's Inductor and Triton caches)
    and DeepSpeed's JIT-built ops live (null: ~/.cache/mmpipe/<this Python environment>, one
    folder per environment so two installs never rebuild each other's ops). A variable the user
    set (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, TORCH_EXTENSIONS_DIR) wins."""

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ValueError(f"launcher.grace_s={self.grace_s!r} must be >= 0 (seconds before SIGKILL)")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"launcher.backend={self.backend!r} is unknown; use auto, gloo or nccl")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"launcher.nproc={self.nproc} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    out: str | None = None
    """Where `mmpipe profile` writes the machine description (default RUN_DIR/conf/hardware/measured-<model>.yaml,
    usable with --config-dir RUN_DIR/conf; relative: in the run directory)."""
    repeats: int = 5
    """Timed repetitions per layer and micro-batch (the median is kept)."""
    engine_steps: int = 3
    """Steps the real pipeline trains for each micro-batch count (1 to 16) when `mmpipe profile`
    measures the engine's fixed costs and a rank's memory."""

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"profile.repeats={self.repeats!r} must be a positive integer")
        if not isinstance(self.engine_steps, int) or self.engine_steps < 1:
            raise ValueError(f"profile.engine_steps={self.engine_steps!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardsConfig:
    json: str | None = None
    """LLaVA-style JSON list to convert (mmpipe shards)."""
    out: str | None = None
    """Output folder of the shards and index.json (your data, not the run's: relative to the current directory)."""
    image_root: str | None = None
    """Folder the JSON's image paths are relative to (default: the JSON's folder)."""
    audio_root: str | None = None
    """Folder the JSON's audio paths are relative to (default: the JSON's folder)."""
    video_root: str | None = None
    """Folder the JSON's video paths are relative to (default: the JSON's folder)."""
    maxcount: int = 1000
    """Samples per shard at most."""
    maxsize_mb: float | None = None
    """Shard size limit in MB (null: count only)."""
    prefix: str = "train"
    """Shard file prefix: <prefix>-000000.tar."""
    allow_outside_roots: bool = False
    """Let media paths lead out of image_root / audio_root / video_root (`..`, absolute paths, symlinks);
    by default such an entry is skipped as `outside root`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    policies: tuple[str, ...] = POLICIES
    """Policies `mmpipe bench` trains, alternating."""
    encoders: tuple[str, ...] = ()
    """Encoder placements (plan.encoders values: stages, spread, auto) each policy trains with, as
    runs of their own (`data-aware/spread`, ...; an auto resolved for each policy); empty: every
    policy trains with plan.encoders resolved once, for data-aware (or the first policy)."""
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
        for e in self.encoders:
            if e not in ("stages", "spread", "nested", "auto"):
                raise ValueError(f"bench.encoders entry {e!r} is unknown; use stages, spread, nested or auto "
                                 f"(a per-tower placement goes in plan.encoders)")
        if self.rounds < 1 or self.steps < 3:
            raise ValueError(f"bench.rounds={self.rounds} / bench.steps={self.steps}: need rounds >= 1, steps >= 3")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportConfig:
    runs: tuple[str, ...] = ()
    """Run directories (or sweep / bench directories holding several) that `mmpipe report` draws;
    `mmpipe report DIR [DIR ...]` fills this."""
    out: str = "report.png"
    """The PNG `mmpipe report` writes (relative: in the run directory)."""

    def __post_init__(self) -> None:
        if not self.out.lower().endswith(".png"):
            raise ValueError(f"report.out={self.out!r} must name a .png file")


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareOrigin:
    """What a hardware config says about itself, beside the HardwareSpec the planner reads
    (mmpipe/planner/hardware.py; together they are the `hardware` group's keys)."""

    measured_for: str | None = None
    """The model `mmpipe profile` measured this description with (null: a preset, for any model)."""
    device: str | None = None
    """The device these figures describe: a preset name (cpu, h100, h200, a100) or `gpu` for one
    without a preset (mmpipe/machine.py). A run prints efficiency and MFU only on that device
    (null: a file that does not say; taken as this machine's)."""


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
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    hardware: Mapping[str, Any] = field(default_factory=dict)
    """Raw hardware group (typed by the planner's HardwareSpec plus HardwareOrigin)."""
    run_dir: str = "."
    """Where metrics.jsonl and checkpoints go."""
    model_settings: Mapping[str, Any] = field(default_factory=dict)
    """A Hugging Face model group as given, folders absolute (run.yaml records it; see
    mmpipe.model.group.ModelChoice); empty for mmpipe's own figures."""
    planner_only: str | None = None
    """Why the model preset can be planned but not trained (omni-7b), else None."""
    machine_notes: tuple[str, ...] = ()
    """What `fit_machine` decided for this machine (the layout, hardware=auto), for the start-up lines."""

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
            near = nearest(key, list(fields))
            hint = f"did you mean {prefix}.{near}?" if near else f"known: {', '.join(sorted(fields))}"
            raise ValueError(f"{prefix}.{key}={value!r}: no such config key; {hint}")
        _check_type(prefix, key, str(fields[key].type), value)
    return cls(**values)


GROUPS = ("model", "parallel", "train", "data", "plan", "launcher", "profile", "shards", "bench", "report",
          "deepspeed", "hardware", "hydra")


def _tuple_of(section: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    out = dict(section or {})
    if isinstance(out.get(key), (list, tuple)):
        out[key] = tuple(out[key])
    elif isinstance(out.get(key), str):
        out[key] = (out[key],)
    return out


def run_config_from_dict(cfg: Mapping[str, Any], *, run_dir: str = ".", machine: Machine | None = None,
                         hardware_set: Collection[str] = (), presets: Sequence[Path] = ()) -> RunConfig:
    """Validate a resolved config mapping (what Hydra composed) into a RunConfig; what it leaves
    to the machine (the layout, hardware=auto) is fitted to `machine` (None: a machine without a
    GPU, so nothing is asked of torch). `hardware_set`: the hardware keys the user set on top of
    hardware=auto; `presets`: the folders its preset is looked up in, first match wins (default:
    the shipped conf/hardware)."""
    cfg = dict(cfg)
    for key in cfg:
        if key not in GROUPS:
            raise ValueError(f"{key} is not a config group; known: {', '.join(GROUPS)}")
    cfg, notes = fit_machine(cfg, machine or Machine(), hardware_set=hardware_set, presets=presets)
    train = dict(cfg.get("train") or {})
    for key in ("trainable", "loggers"):
        if train.get(key) is not None:
            t = train[key]
            train[key] = (t,) if isinstance(t, str) else tuple(t)
    if train.get("lora") is not None:
        train["lora"] = _section(LoraSpec, "train.lora", _tuple_of(_tuple_of(train["lora"], "target_modules"),
                                                                    "parts"))
    plan = dict(cfg.get("plan") or {})
    if plan.get("stages") is not None:
        plan["stages"] = parse_stages(plan["stages"])
    model = model_from_group(cfg["model"], resolve=model_folder)
    rc = RunConfig(
        model=model.spec,
        parallel=_section(ParallelConfig, "parallel", cfg.get("parallel")),
        train=_section(TrainConfig, "train", train),
        data=_section(DataConfig, "data", cfg.get("data")),
        plan=_section(PlanConfig, "plan", _tuple_of(plan, "recompute")),  # plan.ladder: PlanConfig parses it
        launcher=_section(LauncherConfig, "launcher", cfg.get("launcher")),
        profile=_section(ProfileConfig, "profile", cfg.get("profile")),
        shards=_section(ShardsConfig, "shards", cfg.get("shards")),
        bench=_section(BenchConfig, "bench", _tuple_of(cfg.get("bench"), "policies")),
        report=_section(ReportConfig, "report", _tuple_of(cfg.get("report"), "runs")),
        deepspeed=_section(DeepSpeedSettings, "deepspeed", cfg.get("deepspeed")),
        hardware=dict(cfg.get("hardware") or {}),
        run_dir=run_dir,
        model_settings=model.settings,
        planner_only=model.planner_only,
        machine_notes=tuple(notes),
    )
    check_run(rc)
    return rc


AUTO_HARDWARE = "auto"
"""hardware=auto (conf/hardware/auto.yaml): the preset of the device torch sees."""


def fit_machine(cfg: Mapping[str, Any], machine: Machine, *, hardware_set: Collection[str] = (),
                presets: Sequence[Path] = ()) -> tuple[dict[str, Any], list[str]]:
    """What the user left to the machine, decided: hardware=auto becomes the preset of the device
    torch sees (the user's own hardware.KEY settings kept on top), and an unset parallel.pp /
    parallel.dp a layout for its devices: no GPU (or launcher.backend=gloo) -> pp=2 x dp=1 on
    the CPU; one GPU -> pp=1 x dp=1; N GPUs (or WORLD_SIZE ranks under an external launcher) ->
    parallel.devices=N with pp / dp auto, chosen by the planner before launch. A parallel.devices
    the user gives is split by the planner on any machine. Returns the config and one line per
    decision."""
    import yaml

    from mmpipe.paths import CONF_DIR

    out, notes = dict(cfg), []
    hw = dict(out.get("hardware") or {})
    if hw.get("name") == AUTO_HARDWARE:
        preset = machine.preset
        found = [f / f"{preset}.yaml" for f in (*presets, CONF_DIR / "hardware") if (f / f"{preset}.yaml").is_file()]
        chosen = yaml.safe_load(found[0].read_text())
        chosen.update({k: hw[k] for k in hardware_set if k in hw and k != "name"})
        out["hardware"] = chosen
        if not machine.gpus:
            notes.append(f"hardware=auto: no GPU, the {preset} preset")
        elif machine.device == "gpu":
            chosen["device"] = "gpu"
            notes.append(f"hardware=auto: {machine.gpu_name} has no preset; planned with the {preset} preset's "
                         f"figures, no efficiency or MFU printed (`mmpipe profile` measures this GPU)")
        else:
            notes.append(f"hardware=auto: {machine.gpu_name}, the {preset} preset")
    par = dict(out.get("parallel") or {})
    pp, dp, devices = par.get("pp"), par.get("dp"), par.get("devices")
    stages = (out.get("plan") or {}).get("stages")
    if pp is None and stages:
        pp = len(parse_stages(stages))
    backend = (out.get("launcher") or {}).get("backend", "auto")
    gpu = machine.gpus > 0 and backend != "gloo"
    if pp is None or dp is None:
        n = devices or ((machine.world or machine.gpus) if gpu else None)
        if n is None:  # no GPU, no device count: the CPU demo layout
            pp, dp = CPU_STAGES if pp is None else pp, 1 if dp is None else dp
            where = "no GPU" if not machine.gpus else f"launcher.backend={backend}"
            notes.append(f"layout: parallel.pp / parallel.dp unset ({where}): pp={pp} x dp={dp} on the CPU")
        elif n == 1:
            pp, dp = 1 if pp is None else pp, 1 if dp is None else dp
            notes.append(f"layout: parallel.pp / parallel.dp unset, 1 device ({machine.describe()}): pp={pp} x dp={dp}")
        else:
            pp, dp, devices = "auto" if pp is None else pp, "auto" if dp is None else dp, n
            notes.append(f"layout: parallel.pp / parallel.dp unset, {n} devices ({machine.describe()}): the planner "
                         f"chooses pp x dp before launch")
    out["parallel"] = {**par, "pp": pp, "dp": dp, "devices": devices}
    return out, notes


def check_run(rc: RunConfig) -> None:
    """Cross-key checks: the ones no single section can make (those on parallel.pp / dp wait
    for `resolve_layout` while they are auto)."""
    rc.train.lora.check_parts(rc.model)
    placement = Placement.parse(rc.plan.encoders, rc.model)  # a tower the model lacks
    if rc.parallel.auto:
        _check_auto(rc)
        return
    pp, dp, t = rc.parallel.pp, rc.parallel.dp, rc.train
    if pp == 1 and placement.spread:
        raise ValueError(f"plan.encoders={placement.given} needs parallel.pp >= 2 (a spread tower "
                         f"is encoded by the stages of a replica; with one stage it is staged); set parallel.pp=2 "
                         f"or more, or plan.encoders=stages")
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
    _ = rc.stage_bounds  # validates names and tiling
    _check_eval(rc)
    _check_recut(rc)
    hardware_spec(rc)


def _check_recut(rc: RunConfig) -> None:
    """A re-cut happens at a checkpoint, between stages: it needs both."""
    if rc.plan.recut != "auto":
        return
    if not rc.train.save_every:
        raise ValueError("plan.recut=auto re-cuts at checkpoints: set train.save_every=N (a re-cut is considered "
                         "every N steps), or plan.recut=off")
    if isinstance(rc.parallel.pp, int) and rc.parallel.pp < 2:
        raise ValueError(f"plan.recut=auto moves stage cuts, and parallel.pp={rc.parallel.pp} has none; use "
                         f"parallel.pp=2 or more, or plan.recut=off")


def _check_eval(rc: RunConfig) -> None:
    """Validation needs held-out data, and enough of it for every replica to score a share."""
    t, dp = rc.train, rc.parallel.dp
    if t.eval_every and not rc.data.eval_path:
        raise ValueError(f"train.eval_every={t.eval_every} needs held-out data: set data.eval_path=SHARDS (a shard "
                         f"brace list, like data.path), or train.eval_every=0")
    if rc.data.eval_path and isinstance(dp, int) and t.eval_samples < dp:
        raise ValueError(f"train.eval_samples={t.eval_samples} is fewer than the parallel.dp={dp} replicas, which "
                         f"each score a share; use train.eval_samples={dp} or more")


EVALS_PER_RUN = 10
"""Evaluations over a run when data.eval_path is set and train.eval_every is null."""


def eval_interval(rc: RunConfig) -> int:
    """Steps between evaluations (train.eval_every, resolved; each run also evaluates after its
    last step); 0: the run does not evaluate."""
    if not rc.data.eval_path:
        return 0
    every = rc.train.eval_every
    return -(-rc.train.steps // EVALS_PER_RUN) if every is None else every


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
    _check_eval(rc)
    _check_recut(rc)
    hardware_spec(rc)


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
    choice = choose_layout(plan_problem(rc), sample)
    best = choice.best
    if not best.fits:
        raise ValueError(f"parallel.devices={p.devices}: no pp x dp layout fits in memory ("
                         + "; ".join(f"{x.pp}x{x.dp}: {x.note}" for x in choice.layouts) + ")")
    out = replace(rc, parallel=ParallelConfig(pp=best.pp, dp=best.dp, devices=p.devices))
    check_run(out)
    return out


def plan_problem(rc: RunConfig) -> PlanProblem:
    """What the planner is asked for this run (planner/problem.py's PlanProblem): the one place a
    RunConfig becomes the planner's inputs, for training (stage cut, steps, placement, re-cuts,
    the layout) and `mmpipe plan` alike. pp / dp are None while auto; one step-planning call
    deals to every replica with plan.across_replicas, else to its own replica only; the
    placement is plan.encoders parsed (still `auto` until `choose_encoders` resolves it)."""
    p = rc.parallel
    return PlanProblem(model=rc.model, hardware=hardware_spec(rc), trainable=rc.train.trainable,
                       micro_batches=rc.train.micro_batches, policy=rc.plan.policy,
                       global_batch=rc.train.global_batch, pp=p.fixed("pp"), dp=p.fixed("dp"), devices=p.devices,
                       replicas=None if rc.plan.across_replicas else 1, precision=training_precision(rc),
                       memory_headroom=rc.plan.memory_headroom, lora=rc.train.lora,
                       placement=Placement.parse(rc.plan.encoders, rc.model))


def training_precision(rc: RunConfig):
    """What the planner prices a run's memory with: its precision, ZeRO stage and optimizer, and
    the fp32 gradient-accumulation buffer DeepSpeed's BF16_Optimizer keeps (bf16 trains with it;
    docs/runtime.md, "Precision and ZeRO")."""
    from mmpipe.planner.api import TrainingPrecision

    return TrainingPrecision(precision=rc.train.precision, zero_stage=rc.train.zero, optimizer=rc.train.optimizer,
                             fp32_grad_accum=rc.train.precision == "bf16")


def hardware_spec(rc: RunConfig):
    """The typed hardware description; a measured one must belong to the configured model."""
    hw = dict(rc.hardware)
    measured_for = hw.get("measured_for", HardwareOrigin().measured_for)
    if measured_for is not None and measured_for != rc.model.name:
        raise ValueError(
            f"hardware={hw.get('name', '?')} was measured for model {measured_for}, not model {rc.model.name}; "
            f"run `mmpipe profile {shell_word(f'model={rc.model.name}')}` and use the file it writes"
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
                f"write {shell_word('plan.stages=[[vision.embed,llm.block.1],[llm.block.2,llm.head]]')}"
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


DEFAULT_TOKENIZER = "data/tokenizer.json"
"""mmpipe's own tokenizer (the shipped data's), the tokenizer of mmpipe's own models."""


def tokenizer_source(rc: RunConfig) -> tuple[str, str]:
    """(file or folder, the key it comes from) of the run's tokenizer: data.tokenizer when set;
    else a Hugging Face model's checkpoint folder (its tokenizer and chat template: model.path, or
    a composition's model.llm.path); else mmpipe's own tokenizer."""
    from mmpipe.data.chat import checkpoint_folder

    if rc.data.tokenizer:
        return resolve_path(rc.data.tokenizer), "data.tokenizer"
    if rc.model.hf is None:
        return resolve_path(DEFAULT_TOKENIZER), "data.tokenizer"
    folder = checkpoint_folder(rc.model)
    if folder is None:
        raise ValueError(f"model {rc.model.name} has no checkpoint folder to take its tokenizer and chat template "
                         f"from (a preset builds random weights); give data.tokenizer=DIR, a folder holding the "
                         f"model's tokenizer with a chat template")
    key = "model.path" if any(part == "model" for part, _ in rc.model.hf.weights) else "model.llm.path"
    return str(folder), key
