"""What each `mmpipe <command>` does with a validated RunConfig, and how it introduces itself.

No Hydra here: mmpipe/cli.py composes the config, checks it (`Command.check`, before any
directory is made) and calls `Command.run` with the RunConfig and the job's `Invocation`.
Outputs go to the run directory (relative output paths land there; absolute ones are
honoured) and every command prints where they went.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mmpipe.config import RunConfig, eval_interval, tokenizer_source
from mmpipe.paths import PACKAGE_ROOT, resolve_path, shell_word


@dataclass(frozen=True, kw_only=True, slots=True)
class Invocation:
    """What a command knows of how it was called, beyond the config."""

    overrides: tuple[str, ...] = ()
    """The job's own overrides as typed (one job of a sweep: its values)."""
    search_path: tuple[str, ...] = ()
    """The user's config folders (--config-dir, hydra.searchpath), highest priority first, as Hydra
    writes them (file://DIR, pkg://MODULE); a command that starts mmpipe again passes them on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """One `mmpipe <name>` command."""

    name: str
    """As typed after `mmpipe`."""
    summary: str
    """One line for `mmpipe --help`."""
    run: Callable[[RunConfig, Invocation], int]
    """The command; returns the exit status."""
    keys: tuple[str, ...]
    """Config sections or dotted keys `--help` lists with their values and meaning."""
    examples: tuple[str, ...]
    """Command lines for `--help` (shell-safe as printed)."""
    check: Callable[[RunConfig], None] | None = None
    """Checks beyond the config (files exist, packages installed), before any directory is made."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Extra lines for `--help`."""
    arguments: str = "[KEY=VALUE ...]"
    """What follows the command in its usage line (besides Hydra's flags)."""


def output_path(rc: RunConfig, path: str | None) -> str | None:
    """Where a command writes `path`: relative paths land in the run directory."""
    if not path:
        return None
    return path if os.path.isabs(path) else str(Path(rc.run_dir) / path)


def checkpoint_policy(rc: RunConfig) -> str:
    """The run's checkpointing, as the start-up line states it."""
    t, where = rc.train, Path(rc.run_dir) / "checkpoints"
    if not t.save_every and not t.save_final:
        return ("checkpoints: none (train.save_final=true keeps the last step, "
                "train.save_every=N every N steps)")
    parts = [f"every {t.save_every} steps"] if t.save_every else []
    parts += ["after the last step"] if t.save_final else []
    return f"checkpoints: {' and '.join(parts)}, in {where}"


def check_train(rc: RunConfig) -> None:
    from mmpipe.runtime.metrics import check_loggers
    from mmpipe.runtime.preflight import check_data, checkpoint_dir

    rc = train_layout(rc, say=False)  # parallel.pp / dp = auto: the layout every check below needs
    if rc.train.resume:  # first: it reads one small file and imports no torch, so it answers in a second
        checkpoint_dir(rc)
    _check_model(rc)
    check_loggers(rc.train.loggers)
    check_data(rc)
    if eval_interval(rc):
        from mmpipe.runtime.evaluate import check_eval_data

        check_eval_data(rc)
    _check_pipeline(rc)
    _check_stages(rc)


def _check_stages(rc: RunConfig) -> None:
    """The stage cut every rank will choose (the user's, or the planner's on the first steps of
    the data), against memory: a layout that cannot hold the model (a fresh run's, or one a
    checkpoint is resumed on) is refused here, before any rank starts."""
    from mmpipe.runtime.hf_run import load_templater
    from mmpipe.runtime.stages import choose_stages

    choose_stages(rc, load_templater(rc))


def _check_model(rc: RunConfig) -> None:
    """A planner-only preset, a model this machine cannot hold: before anything runs."""
    from mmpipe.runtime.hf_run import check_model

    memory = check_model(rc)
    if memory and os.environ.get("RANK", "0") == "0":
        print(f"mmpipe: {memory}", flush=True)
    if rc.model.hf is not None and os.environ.get("RANK", "0") == "0":
        from mmpipe.model.hf.outer import source_note

        if note := source_note(rc.model):  # a full Qwen2.5-Omni folder: what of it trains
            print(f"mmpipe: {note}", flush=True)


def _check_pipeline(rc: RunConfig) -> None:
    """What the ranks' DeepSpeed pipeline needs: the tested release, the user's DeepSpeed JSON,
    the backend's devices, the attention kernel."""
    from mmpipe.machine import detect
    from mmpipe.model.kernels import check as check_kernel
    from mmpipe.model.spec import image_blocks
    from mmpipe.runtime.dsconfig import load_user_config, require_tested_deepspeed
    from mmpipe.runtime.host import precision_problem
    from mmpipe.runtime.preflight import check_backend, check_gpus

    require_tested_deepspeed()
    if rc.deepspeed.config is not None:
        load_user_config(rc.deepspeed.config)  # missing file, bad JSON, a key mmpipe owns: one line now
    check_backend(rc.launcher.backend)
    check_gpus(rc, detect())
    problem = precision_problem(rc.train.precision, rc.launcher.backend)  # DeepSpeed's refusal, before launch
    if problem:
        raise ValueError(problem)
    check_kernel(rc.train.attention, precision=rc.train.precision, blocks=image_blocks(rc.model))


def quiet_env(rc: RunConfig) -> dict[str, str]:
    """Environment for the ranks: the libraries' start-up chatter off unless asked for
    (launcher.verbose=true or MMPIPE_DEBUG=1, which the ranks then see)."""
    if rc.launcher.verbose or os.environ.get("MMPIPE_DEBUG") == "1":
        return {"MMPIPE_DEBUG": "1"}
    return {"MMPIPE_DEBUG": "0", "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def rank_env(rc: RunConfig) -> dict[str, str]:
    """What the ranks mmpipe launches get beyond the launcher's own variables: the quiet console
    and the compile and JIT-op caches of launcher.cache_dir (host.cache_env)."""
    from mmpipe.runtime.host import cache_env

    return {**cache_env(rc.launcher.cache_dir), **quiet_env(rc)}


def train_layout(rc: RunConfig, *, say: bool = True) -> RunConfig:
    """parallel.pp / parallel.dp = auto decided before launch: the planner ranks the layouts of
    parallel.devices on the run's first two steps of data.path (metadata only, no media read)."""
    if not rc.parallel.auto:
        return rc
    from dataclasses import replace

    from mmpipe.config import resolve_layout
    from mmpipe.model.geometry import features

    if rc.data.sources is not None:
        raise ValueError("parallel.pp / parallel.dp = auto plans on data.path's first steps; with a mixture "
                         "(data.sources) set both, e.g. as `mmpipe plan data=shards parallel.devices=N` chooses "
                         "them on one source")
    metas = shard_meta(replace(rc, plan=replace(rc.plan, steps=2)))
    out = resolve_layout(rc, [features(rc.model, meta) for _, meta in metas])
    if say and os.environ.get("RANK", "0") == "0":  # under an external launcher every rank decides the same
        print(f"mmpipe train: parallel.devices={rc.parallel.devices}: the planner chose pp={out.parallel.pp} x "
              f"dp={out.parallel.dp} (parallel.pp / parallel.dp were auto)", flush=True)
    return out


def oversubscribed(nproc: int, cores: int) -> str | None:
    """The warning for more ranks than CPU cores (they run, slowly), None when they fit."""
    if nproc <= cores:
        return None
    return (f"warning: {nproc} ranks share {cores} CPU cores; every step will be slow (each rank waits for a "
            f"core); fewer ranks (parallel.pp x parallel.dp) train faster here")


def run_train(rc: RunConfig, _inv: Invocation) -> int:
    from mmpipe.planner.api import describe_gain
    from mmpipe.runtime.launch import launch, under_external_launcher, worker_command
    from mmpipe.runtime.preflight import write_run_config
    from mmpipe.runtime.recut import clear_request, recut_config, take_request

    rc = train_layout(rc)
    if under_external_launcher() and rc.plan.recut == "auto":
        raise ValueError("plan.recut=auto relaunches the ranks on the new cut, which only mmpipe's own launcher "
                         "does; under torchrun or deepspeed use plan.recut=off (re-cut by resuming with new "
                         "plan.stages)")
    if under_external_launcher():
        from mmpipe.runtime.host import accelerator_env, cache_env
        from mmpipe.runtime.worker import run_rank

        for key, value in {**accelerator_env(rc.launcher.backend), **cache_env(rc.launcher.cache_dir)}.items():
            os.environ.setdefault(key, value)  # e.g. the CPU kernel-cache limits the local launcher sets
        return run_rank(rc)
    path = write_run_config(rc)
    logs = Path(rc.run_dir) / "logs"
    nproc = rc.launcher.nproc or rc.parallel.pp * rc.parallel.dp
    print(f"mmpipe train: config checked: model {rc.model.name}, pp={rc.parallel.pp} x dp={rc.parallel.dp}, "
          f"{rc.train.steps} steps of {rc.train.global_batch} samples, policy {rc.plan.policy}", flush=True)
    print(f"mmpipe train: run dir {rc.run_dir}; {checkpoint_policy(rc)}", flush=True)
    from mmpipe.runtime.host import describe_cache, resolve_backend

    if resolve_backend(rc.launcher.backend) == "nccl":  # only GPU runs compile kernels
        print(f"mmpipe train: {describe_cache(rc.launcher.cache_dir)}", flush=True)
    print(f"mmpipe train: launching {nproc} processes (pp={rc.parallel.pp} x dp={rc.parallel.dp}), each rank's "
          f"output in {logs}/rank<R>.log; each builds its pipeline stage with DeepSpeed, which takes a while on CPU",
          flush=True)
    if warning := oversubscribed(nproc, os.cpu_count() or 1):
        print(f"mmpipe train: {warning}", file=sys.stderr, flush=True)
    clear_request(Path(rc.run_dir))
    while True:
        code = launch(worker_command(str(path)), nproc=nproc, backend=rc.launcher.backend,
                      master_port=rc.launcher.master_port, log_dir=logs, grace_s=rc.launcher.grace_s,
                      extra_env=rank_env(rc))
        request = take_request(Path(rc.run_dir)) if code == 0 else None  # plan.recut=auto
        if request is None:
            return code
        rc = recut_config(rc, request)
        path = write_run_config(rc)
        print(f"mmpipe train: re-cut after step {request['step']}: stages {request['old']} -> {request['new']} "
              f"({describe_gain(request)}); relaunching {nproc} processes from its checkpoint", flush=True)


def check_plan(rc: RunConfig) -> None:
    if rc.data.kind == "shards":
        if rc.data.sources is not None:
            raise ValueError("mmpipe plan data=shards reads one shard list (data.path); a mixture (data.sources) "
                             "is not supported: set data.sources=null")
        from mmpipe.data.shards import check_shards, expansions

        check_shards(resolve_path(rc.data.path), root=PACKAGE_ROOT)
        for line in expansions(resolve_path(rc.data.path), root=PACKAGE_ROOT):
            print(f"mmpipe: {line}", flush=True)
        return
    if rc.data.kind != "trace":
        raise ValueError(f"data.kind={rc.data.kind!r}: mmpipe plan reads a workload trace or shard metadata; "
                         f"use data=trace data.path=FILE.jsonl (shipped: data/workloads/*.jsonl) or data=shards")
    if not Path(resolve_path(rc.data.path)).is_file():
        raise FileNotFoundError(f"data.path={rc.data.path}: no such trace file (a relative path is looked up in "
                                f"the current directory, then in the installed package: data/workloads/*.jsonl)")


def plan_precision(rc: RunConfig, inv: Invocation):
    """How `mmpipe plan` prices memory: the run's train.precision / train.zero_stage when the user
    sets them, else what every MLLM run the planner prices uses (bf16 + ZeRO-1, docs/spec.md §6;
    train.precision's own default, fp32, is what this CPU project trains with)."""
    from mmpipe.config import training_precision
    from mmpipe.planner.api import TrainingPrecision

    chosen = any(o.lstrip("+").partition("=")[0] in ("train.precision", "train.zero_stage") for o in inv.overrides)
    return training_precision(rc) if chosen else TrainingPrecision(optimizer=rc.train.optimizer)


def shard_meta(rc: RunConfig) -> list:
    """(key, metadata) of the shards' samples in stream order, media never read (every sample's
    `meta` is a trace line, docs/spec.md section 1); as many as plan.steps needs. Read here: the
    planner imports no data package."""
    import itertools

    from mmpipe.data.reader import iter_meta
    from mmpipe.runtime.hf_run import load_templater

    tok = load_templater(rc)  # text tokens are counted under the run's tokenizer (shards are not tied to one)
    metas = iter_meta(path=resolve_path(rc.data.path), seed=rc.train.seed, epochs=1,
                      shuffle_buffer=rc.data.shuffle_buffer, on_error=rc.data.on_error, spec=rc.model,
                      too_long=rc.data.too_long, tokenizer=tok, root=PACKAGE_ROOT)
    limit = rc.plan.steps * rc.train.global_batch if rc.plan.steps else None
    return list(itertools.islice(metas, limit))


def run_plan(rc: RunConfig, inv: Invocation, *, compare_schedules: bool = False) -> int:
    import dataclasses

    from mmpipe.config import plan_problem
    from mmpipe.planner.command import PlanInput, PlanOutput
    from mmpipe.planner.command import run_plan as plan

    trace, samples = (resolve_path(rc.data.path), None) if rc.data.kind == "trace" else (None, shard_meta(rc))
    # the run's problem, as training builds it; memory priced as `plan_precision` says, and
    # every step planned across the replicas
    problem = dataclasses.replace(plan_problem(rc), precision=plan_precision(rc, inv), replicas=None)
    plan(problem, PlanInput(trace_path=trace, samples=samples, source=rc.data.path, steps=rc.plan.steps),
         stages=list(rc.plan.stages or []) or None,
         output=PlanOutput(out=output_path(rc, rc.plan.out), plot=output_path(rc, rc.plan.plot),
                           compare_schedules=compare_schedules))
    return 0


def run_bench(rc: RunConfig, inv: Invocation) -> int:
    from mmpipe.runtime.bench import planner_placements
    from mmpipe.runtime.bench import run_bench as bench

    paths = ",".join("'" + p.replace("\\", "\\\\").replace("'", "\\'") + "'" for p in inv.search_path)
    bench(rc, [*([f"hydra.searchpath=[{paths}]"] if paths else []), *inv.overrides],
          planner_placements(train_layout(rc, say=False)))
    print(f"mmpipe bench: figures in {Path(rc.run_dir) / 'bench.json'}; each run's metrics in "
          f"{Path(rc.run_dir) / 'round<R>-<policy>'}/ (draw them: mmpipe report {shell_word(rc.run_dir)})")
    return 0


def run_bench_data(rc: RunConfig, _inv: Invocation) -> int:
    from mmpipe.data.commands import run_bench_data as bench_data

    return bench_data(path=resolve_path(rc.data.path), tokenizer=tokenizer_source(rc)[0],
                      model=rc.model, samples=rc.bench.samples, generated=rc.bench.generated, root=str(PACKAGE_ROOT))


def check_shards(rc: RunConfig) -> None:
    if not rc.shards.json or not rc.shards.out:
        raise ValueError("mmpipe shards needs shards.json=FILE.json and shards.out=FOLDER")


def run_shards(rc: RunConfig, _inv: Invocation) -> int:
    from mmpipe.data.commands import run_convert

    s = rc.shards
    return run_convert(json_path=s.json, out=s.out, tokenizer=tokenizer_source(rc)[0],
                       model=rc.model, image_root=s.image_root, audio_root=s.audio_root, maxcount=s.maxcount,
                       maxsize_mb=s.maxsize_mb, on_error=rc.data.on_error, prefix=s.prefix, limits=rc.data.limits,
                       allow_outside_roots=s.allow_outside_roots, video_root=s.video_root)


def run_profile(rc: RunConfig, _inv: Invocation) -> int:
    from mmpipe.runtime.profile import run_profile as profile

    profile(rc, out=output_path(rc, rc.profile.out), repeats=rc.profile.repeats,
            engine_steps=rc.profile.engine_steps)
    return 0


def check_report(rc: RunConfig) -> None:
    from mmpipe.report import find_runs

    if not rc.report.runs:
        raise ValueError("mmpipe report needs run directories: mmpipe report RUN_DIR [RUN_DIR ...] "
                         "(a sweep or bench directory stands for the runs inside it)")
    find_runs(rc.report.runs)


def run_report(rc: RunConfig, _inv: Invocation) -> int:
    from mmpipe.report import write_report

    path, lines = write_report(rc.report.runs, out=Path(output_path(rc, rc.report.out) or "report.png"))
    for line in lines:
        print(line)
    print(f"mmpipe report: wrote {path}", flush=True)
    return 0


_SETUP = ("model", "parallel", "hardware")

COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command(name="train", summary="train the configured model through DeepSpeed pipeline stages",
            run=run_train, check=check_train,
            keys=("parallel", "train", "data", "plan", "launcher", "model", "hardware"),
            examples=("mmpipe train                                   # tiny model, shipped data, pp=2",
                      "mmpipe train train.steps=20 parallel.dp=2      # 4 processes",
                      "mmpipe train recipes=tiny-pp4                  # a ready experiment (config group recipes)",
                      "mmpipe train -m plan.policy=data-aware,ds-default train.steps=3   # a sweep: one run each",
                      "mmpipe train " + shell_word("plan.stages=[[vision.embed,audio.proj],[llm.embed,llm.head]]"),
                      "mmpipe train \"data.path='data/llava/train-{000000..000041}.tar'\"   # braces: quote twice",
                      "mmpipe train " + shell_word("train.loggers=[jsonl,tensorboard]") + " train.save_final=true",
                      "mmpipe train data.eval_path=data/shards/train-000007.tar train.eval_every=10   # held-out loss",
                      "mmpipe train --cfg job                         # print the composed config, run nothing")),
    Command(name="plan", summary="plan a workload trace (stages, micro-batches) and compare with baselines",
            run=run_plan, check=check_plan,
            keys=(*_SETUP, "train.global_batch", "train.micro_batches", "train.trainable", "train.lora", "data.path",
                  "plan"),
            examples=("mmpipe plan recipes=plan-qwen2-vl-h100 data.path=data/workloads/vision-dynamic.jsonl "
                      "plan.out=plan.json plan.plot=timeline.png",
                      "mmpipe plan model=llava-1.5-7b data=trace data.path=data/workloads/llava-sft.jsonl "
                      "hardware=a100 parallel.pp=4"),
            notes=("plan.out and plan.plot land in the run directory unless absolute.",)),
    Command(name="simulate", summary="compare pipeline schedules on the planned micro-batches of a trace",
            run=lambda rc, inv: run_plan(rc, inv, compare_schedules=True), check=check_plan,
            keys=(*_SETUP, "train.global_batch", "train.micro_batches", "train.trainable", "train.lora", "data.path",
                  "plan"),
            examples=("mmpipe simulate recipes=plan-qwen2-vl-h100 data.path=data/workloads/vision-dynamic.jsonl",)),
    Command(name="profile",
            summary="measure the model's layers and a real pipeline on this machine; write a hardware config",
            run=run_profile, keys=(*_SETUP, "train.trainable", "train.lora", "train.seed", "train.precision",
                                   "train.zero_stage",
                                   "train.optimizer", "train.global_batch", "data.path", "profile"),
            examples=("mmpipe profile hydra.run.dir=runs/profile",
                      "mmpipe train --config-dir=runs/profile/conf hardware=measured-tiny",
                      "mmpipe profile model=hf model.path=/models/qwen2-vl hydra.run.dir=runs/profile-qwen"),
            notes=("The file lands in RUN_DIR/conf/hardware/measured-<model>.yaml: pass --config-dir=RUN_DIR/conf "
                   "to use it (a user config folder wins over the shipped one).",)),
    Command(name="bench",
            summary="train once per policy (alternating) on the same data; compare samples/s and bubbles",
            run=run_bench, check=check_train, keys=("bench.policies", "bench.encoders", "bench.rounds", "bench.steps"),
            examples=("mmpipe bench",
                      "mmpipe bench " + shell_word("bench.policies=[data-aware,ds-default]") + " bench.rounds=1",
                      "mmpipe bench hardware=measured-tiny parallel.dp=2"),
            notes=("Every train setting applies to the runs too (mmpipe train --help lists them).",
                   "Every policy trains with one encoder placement: plan.encoders (auto by default) resolved once, "
                   "for data-aware (or the first policy); bench.encoders asks for placements instead.")),
    Command(name="shards", summary="convert a LLaVA-style JSON + media folders into webdataset shards",
            run=run_shards, check=check_shards,
            keys=("shards", "data.tokenizer", "data.on_error", "model.name", "model.llm.max_seq_len"),
            examples=("mmpipe shards shards.json=llava.json shards.out=data/llava shards.image_root=/data/coco",
                      "mmpipe train \"data.path='data/llava/train-{000000..000041}.tar'\"")),
    Command(name="bench-data", summary="measure the loader (full decode vs metadata only)",
            run=run_bench_data, keys=("bench.samples", "bench.generated", "data.path", "data.tokenizer", "model.name"),
            examples=("mmpipe bench-data", "mmpipe bench-data bench.generated=0")),
    Command(name="report", summary="draw loss, samples/s, bubble and predicted vs measured step time of runs (PNG)",
            run=run_report, check=check_report, keys=("report",), arguments="RUN_DIR [RUN_DIR ...] [KEY=VALUE ...]",
            examples=("mmpipe report outputs/2026-01-31/12-00-00",
                      "mmpipe report multirun/2026-01-31/12-00-00      # a sweep: its runs side by side",
                      "mmpipe report runs/a runs/b report.out=/tmp/ab.png"),
            notes=("Positional arguments are run directories (they fill report.runs).",)),
)}


EXPORT_SUMMARY = "write a trained Hugging Face model back as its transformers class (from_pretrained loads it)"
EXPORT_USAGE = "usage: mmpipe export RUN_DIR [checkpoint=stepN] out=DIR [overwrite=true] [merge=true]"


EVAL_SUMMARY = "score a run's committed checkpoint on held-out shards through its pipeline (the held-out loss)"
EVAL_USAGE = "usage: mmpipe eval RUN_DIR [checkpoint=stepN] [data.path=SHARDS] [train.eval_samples=N] [out=FILE.json]"
EVAL_KEYS = ("checkpoint", "data.path", "train.eval_samples", "out")


CHECKPOINT_SUMMARY = "what a run's committed checkpoint holds and the layouts it resumes on"
CHECKPOINT_USAGE = "usage: mmpipe checkpoint info RUN_DIR|RUN_DIR/checkpoints/stepN"


DEMO_SUMMARY = "write tiny random Hugging Face checkpoints (LLaVA, Qwen2-VL, ...) to try model=hf on a CPU"
DEMO_USAGE = "usage: mmpipe demo-checkpoints OUT"


def usage() -> str:
    """The command list of `mmpipe --help`."""
    rows = {**{name: c.summary for name, c in COMMANDS.items()}, "eval": EVAL_SUMMARY, "export": EXPORT_SUMMARY,
            "checkpoint info": CHECKPOINT_SUMMARY, "demo-checkpoints": DEMO_SUMMARY}
    width = max(map(len, rows))
    return "\n".join(f"  {name:<{width}}  {summary}" for name, summary in rows.items())


def checkpoint_command(args: list[str]) -> int:
    """`mmpipe checkpoint info RUN_DIR`: the newest committed checkpoint of a run (or the step
    folder given), its model, layout, precision and adapters, and what it can resume on."""
    import sys

    from mmpipe.runtime.checkpoint import CheckpointError, describe

    if any(a in ("-h", "--help") for a in args):
        print(f"{CHECKPOINT_USAGE}\n\n{CHECKPOINT_SUMMARY}.")
        return 0
    if len(args) != 2 or args[0] != "info":
        print(f"mmpipe checkpoint: error: {CHECKPOINT_USAGE}", file=sys.stderr)
        return 2
    try:
        print(describe(Path(args[1])))
    except (CheckpointError, OSError, ValueError, KeyError) as err:
        print(f"mmpipe checkpoint: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


def export_command(args: list[str]) -> int:
    """`mmpipe export RUN_DIR [checkpoint=stepN] out=DIR`. Not a Hydra app: its arguments name a
    finished run (whose run.yaml holds the model and seed), not a configuration to compose."""
    import sys

    from mmpipe.runtime.export import run_export

    if any(a in ("-h", "--help") for a in args):
        print(f"{EXPORT_USAGE}\n\n{EXPORT_SUMMARY}: the run's newest committed checkpoint, or checkpoint=stepN;\n"
              f"tokenizer and processor files are copied from the source checkpoint.\n"
              f"out is never a source folder of the model; it may be new, empty or an earlier export\n"
              f"(replaced once the new one is complete); files it did not write are refused, never deleted;\n"
              f"overwrite=true also replaces an earlier export's files changed since it wrote them.\n"
              f"A train.lora run exports PEFT's adapter folder (PeftModel.from_pretrained(<source model>, out)\n"
              f"loads it); merge=true writes the whole model with the adapters merged instead.")
        return 0
    runs = [a for a in args if "=" not in a]
    # export.overwrite=true, as the other commands' keys are spelled, means overwrite=true
    keys = {k.removeprefix("export."): v for k, v in (a.split("=", 1) for a in args if "=" in a)}
    try:
        unknown = sorted(set(keys) - {"checkpoint", "out", "overwrite", "merge"})
        if unknown:
            raise ValueError(f"{unknown[0]}={keys[unknown[0]]}: not an export argument; {EXPORT_USAGE}")
        if len(runs) != 1 or not keys.get("out"):
            raise ValueError(f"give one run directory and out=DIR; {EXPORT_USAGE}")
        flags = {k: keys.get(k, "false").lower() for k in ("overwrite", "merge")}
        for k, flag in flags.items():
            if flag not in ("true", "false"):
                raise ValueError(f"{k}={keys[k]}: give {k}=true or {k}=false")
        report = run_export(runs[0], out=keys["out"], checkpoint=keys.get("checkpoint"),
                            overwrite=flags["overwrite"] == "true", merge=flags["merge"] == "true")
    except (ValueError, FileNotFoundError) as err:
        print(f"mmpipe export: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, no permission: the export was not written, the old folder kept
        where = f"{err.filename}: " if err.filename else ""
        print(f"mmpipe export: error: {where}{err.strerror or err}; the export to out={keys['out']} stopped and "
              f"left that folder as it was: free space, or give a folder you can write", file=sys.stderr)
        return 2
    if report.adapters:
        print(f"mmpipe export: wrote PEFT's adapter folder, {report.tensors} tensors ({report.bytes / 2**20:.1f} MiB), "
              f"to {report.folder} in {report.seconds:.1f} s: PeftModel.from_pretrained(<the source model>, DIR) "
              f"loads it; merge=true writes the merged model")
        return 0
    print(f"mmpipe export: wrote {report.tensors} tensors ({report.bytes / 2**20:.1f} MiB, {report.shards} "
          f"safetensors file(s); {len(report.copied)} held by no pipeline layer, copied from the source) to "
          f"{report.folder} in {report.seconds:.1f} s")
    return 0


def eval_command(args: list[str]) -> int:
    """`mmpipe eval RUN_DIR [checkpoint=stepN] [data.path=SHARDS] [train.eval_samples=N] [out=FILE.json]`.
    Not a Hydra app: its arguments name a finished run (run.yaml holds the model, precision and
    parallel layout; the checkpoint its stages), not a configuration to compose. The ranks run in
    a temporary folder: nothing is written into the run directory."""
    import json
    import sys
    import tempfile

    from mmpipe.runtime.eval_job import eval_job

    if any(a in ("-h", "--help") for a in args):
        print(f"{EVAL_USAGE}\n\n{EVAL_SUMMARY}: the run's newest committed checkpoint, or checkpoint=stepN; the first\n"
              f"train.eval_samples samples (default: the run's) of data.path (default: the run's data.eval_path), in\n"
              f"stream order, scored as a run scores its eval_loss (the mean cross-entropy per label token),\n"
              f"in parallel.pp x parallel.dp local processes as the run trained. out=FILE.json: the figures too.")
        return 0
    runs = [a for a in args if "=" not in a]
    keys = dict(a.split("=", 1) for a in args if "=" in a)
    with tempfile.TemporaryDirectory(prefix="mmpipe-eval-") as tmp:
        try:
            unknown = sorted(set(keys) - set(EVAL_KEYS))
            if unknown:
                raise ValueError(f"{unknown[0]}={keys[unknown[0]]}: not an eval argument; {EVAL_USAGE}")
            if len(runs) != 1:
                raise ValueError(f"give one run directory; {EVAL_USAGE}")
            samples = keys.get("train.eval_samples")
            if samples is not None and not samples.isdigit():
                raise ValueError(f"train.eval_samples={samples} must be a positive integer")
            job = eval_job(runs[0], checkpoint=keys.get("checkpoint"), data_path=keys.get("data.path"),
                           samples=int(samples) if samples else None, job_dir=tmp)
            from mmpipe.runtime.evaluate import check_eval_data  # torch: after the arguments are checked

            _check_model(job.rc)
            check_eval_data(job.rc)
            _check_pipeline(job.rc)
        except (ValueError, FileNotFoundError) as err:
            print(f"mmpipe eval: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        code, result = _launch_eval(job)
    if result is None:
        return code or 1
    rc = job.rc
    print(f"mmpipe eval: checkpoint {job.checkpoint} (step {job.step}): eval_loss {result['eval_loss']:.6f} over "
          f"{result['eval_samples']} samples of {rc.data.eval_path} ({result['eval_tokens']} LLM tokens, "
          f"{result['eval_label_tokens']} label tokens), in {result['eval_s']:.1f} s", flush=True)
    if keys.get("out"):
        figures = {"checkpoint": str(job.checkpoint), "data_path": rc.data.eval_path, **result}
        Path(keys["out"]).write_text(json.dumps(figures, indent=1) + "\n")
        print(f"mmpipe eval: wrote {keys['out']}")
    return 0


def _launch_eval(job) -> tuple[int, dict | None]:
    """Score an EvalJob in parallel.pp x parallel.dp local processes (the launcher and worker `mmpipe
    train` uses). Returns the launcher's exit status and rank 0's figures (None on failure)."""
    import json

    from mmpipe.runtime.evaluate import result_path
    from mmpipe.runtime.launch import launch, worker_command
    from mmpipe.runtime.preflight import write_run_config

    rc = job.rc
    nproc = rc.parallel.pp * rc.parallel.dp
    print(f"mmpipe eval: scoring checkpoint {job.checkpoint} on the first {rc.train.eval_samples} samples of "
          f"{rc.data.eval_path}: launching {nproc} processes (pp={rc.parallel.pp} x dp={rc.parallel.dp})", flush=True)
    path = write_run_config(rc)
    code = launch(worker_command(str(path), str(job.checkpoint)), nproc=nproc, backend=rc.launcher.backend,
                  master_port=rc.launcher.master_port, log_dir=Path(rc.run_dir) / "logs", grace_s=rc.launcher.grace_s,
                  name="mmpipe eval", extra_env=rank_env(rc))
    out = result_path(rc.run_dir)
    return code, json.loads(out.read_text()) if code == 0 and out.is_file() else None


def demo_command(args: list[str]) -> int:
    """`mmpipe demo-checkpoints OUT`: tiny checkpoint folders written by transformers itself
    (mmpipe.model.hf.demo), one per supported architecture. Not a Hydra app: one folder argument.
    Refuses a folder that already holds files (it writes only into an empty or new one)."""
    import sys
    from pathlib import Path

    if any(a in ("-h", "--help") for a in args):
        print(f"{DEMO_USAGE}\n\n{DEMO_SUMMARY}.\nEach subfolder of OUT is a checkpoint (config.json, "
              f"model.safetensors, tokenizer with a chat template, processor config):\n"
              f"  mmpipe train model=hf model.path=OUT/llava train.steps=10")
        return 0
    if len(args) != 1 or "=" in args[0]:
        print(f"mmpipe demo-checkpoints: error: give one output folder; {DEMO_USAGE}", file=sys.stderr)
        return 2
    from mmpipe.model.hf.demo import MARKER, write_all

    out = Path(args[0])
    # a folder this command wrote before (its marker file) is written again; anything else that
    # holds files is the user's
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        print(f"mmpipe demo-checkpoints: error: {shell_word(str(out))} already exists and holds files mmpipe did "
              f"not write; give a new or empty folder", file=sys.stderr)
        return 2
    for name, folder in write_all(out).items():
        print(f"{name}: {folder}")
    return 0
