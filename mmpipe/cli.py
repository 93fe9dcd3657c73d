"""`mmpipe <command> [key=value ...]`: the only module that sees Hydra.

Commands compose conf/config.yaml with the overrides (Hydra's own syntax and errors), turn it
into a validated RunConfig, and only then start any process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from mmpipe.config import PROJECT_ROOT, RunConfig, run_config_from_dict

CONF_DIR = Path(os.environ.get("MMPIPE_CONF", PROJECT_ROOT / "conf"))
USAGE = """usage: mmpipe <command> [key=value ...]

commands:
  train      train the configured model through DeepSpeed pipeline stages
  plan       plan a workload trace (stages, micro-batches) and compare with baselines
  simulate   compare pipeline schedules on the planned micro-batches of a trace
  profile    measure the model's layers on this machine; write conf/hardware/measured-<model>.yaml
  bench      train once per policy (alternating) on the same data; compare samples/s and bubbles
  shards     convert a LLaVA-style JSON + media folders into webdataset shards
  bench-data measure the loader (full decode vs metadata only)

examples:
  mmpipe train                                  # tiny model, shipped data, pp=2
  mmpipe train train.steps=20 parallel.dp=2     # 4 processes
  mmpipe train plan.stages=[[vision.embed,llm.block.1],[llm.block.2,llm.head]]
  mmpipe plan model=qwen2-vl-7b data=trace data.path=trace.jsonl hardware=h100 parallel.pp=4
  mmpipe train recipes=<name>                   # a ready experiment from recipes/
  mmpipe shards shards.json=llava.json shards.out=shards/ shards.image_root=images/
"""


def compose(overrides: list[str], *, job: str) -> tuple[dict[str, Any], str]:
    """Compose the config with Hydra; return the resolved mapping and the run directory."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    GlobalHydra.instance().clear()
    search = f"hydra.searchpath=[file://{PROJECT_ROOT}]"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=f"mmpipe_{job}"):
        cfg = hydra_compose(config_name="config", overrides=[search, *overrides], return_hydra_config=True)
    run_dir = str(OmegaConf.select(cfg, "hydra.run.dir"))
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.pop("recipes", None)
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(container, dict)
    return container, run_dir


def load(overrides: list[str], *, job: str) -> RunConfig:
    cfg, run_dir = compose(overrides, job=job)
    return run_config_from_dict(cfg, run_dir=run_dir)


def cmd_train(rc: RunConfig) -> int:
    from mmpipe.runtime.launch import launch, python_module, under_external_launcher
    from mmpipe.runtime.preflight import check_data, write_run_config

    check_data(rc)
    if under_external_launcher():
        from mmpipe.runtime.train import train

        train(rc)
        return 0
    path = write_run_config(rc)
    nproc = rc.launcher.nproc or rc.parallel.pp * rc.parallel.dp
    print(f"mmpipe train: {nproc} processes (pp={rc.parallel.pp} x dp={rc.parallel.dp}), run dir {rc.run_dir}",
          flush=True)
    return launch(python_module("mmpipe.runtime.worker", str(path)), nproc=nproc,
                  backend=rc.launcher.backend, master_port=rc.launcher.master_port)


def cmd_plan(rc: RunConfig, *, compare_schedules: bool = False) -> int:
    from mmpipe.config import hardware_spec, resolve_path
    from mmpipe.planner.api import TrainingPrecision
    from mmpipe.planner.command import run_plan

    trace, samples = None, None
    if rc.data.kind == "trace":
        trace = resolve_path(rc.data.path)
    else:  # the planner reads no data package: the shards' metadata is read here
        samples = _shard_meta(rc)
    run_plan(model=rc.model, hardware=hardware_spec(rc), pp=rc.parallel.fixed("pp"), dp=rc.parallel.fixed("dp"),
             devices=rc.parallel.devices, global_batch=rc.train.global_batch, micro_batches=rc.train.micro_batches,
             trainable=rc.train.trainable, policy=rc.plan.policy, trace_path=trace, samples=samples,
             source=rc.data.path, out=rc.plan.out, steps=rc.plan.steps, plot=rc.plan.plot,
             stages=list(rc.plan.stages or []) or None, compare_schedules=compare_schedules,
             memory_headroom=rc.plan.memory_headroom, precision=TrainingPrecision(optimizer=rc.train.optimizer))
    return 0


def _shard_meta(rc: RunConfig) -> list:
    """(key, metadata) of the shards' samples in stream order, media never read (every
    sample's `meta` is a trace line, docs/spec.md section 1); as many as plan.steps needs."""
    import itertools

    from mmpipe.config import resolve_path
    from mmpipe.data.reader import iter_meta

    if rc.data.sources is not None:
        raise ValueError("mmpipe plan data=shards reads one shard list (data.path); a mixture (data.sources) "
                         "is not supported: set data.sources=null")
    tok = None
    if rc.data.too_long == "truncate":
        from mmpipe.data.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_path(rc.data.tokenizer or "data/tokenizer.json"))
    metas = iter_meta(path=resolve_path(rc.data.path), seed=rc.train.seed, epochs=1,
                      shuffle_buffer=rc.data.shuffle_buffer, on_error=rc.data.on_error, spec=rc.model,
                      too_long=rc.data.too_long, tokenizer=tok)
    limit = rc.plan.steps * rc.train.global_batch if rc.plan.steps else None
    return list(itertools.islice(metas, limit))


def cmd_bench(rc: RunConfig, overrides: list[str]) -> int:
    from mmpipe.runtime.bench import run_bench
    from mmpipe.runtime.preflight import check_data

    check_data(rc)
    run_bench(rc, overrides)
    return 0


def cmd_bench_data(rc: RunConfig) -> int:
    from mmpipe.config import resolve_path
    from mmpipe.data.commands import run_bench_data

    return run_bench_data(path=resolve_path(rc.data.path), tokenizer=resolve_path(rc.data.tokenizer or ""),
                          model=rc.model, samples=rc.bench.samples, generated=rc.bench.generated,
                          root=str(PROJECT_ROOT))


def cmd_shards(rc: RunConfig) -> int:
    from mmpipe.config import resolve_path
    from mmpipe.data.commands import run_convert

    s = rc.shards
    if not s.json or not s.out:
        raise ValueError("mmpipe shards needs shards.json=FILE.json and shards.out=FOLDER")
    return run_convert(json_path=s.json, out=s.out, tokenizer=resolve_path(rc.data.tokenizer or ""),
                       model=rc.model, image_root=s.image_root, audio_root=s.audio_root, maxcount=s.maxcount,
                       maxsize_mb=s.maxsize_mb, on_error=rc.data.on_error, prefix=s.prefix)


def cmd_profile(rc: RunConfig) -> int:
    from mmpipe.runtime.profile import run_profile

    run_profile(rc, out=rc.profile.out, repeats=rc.profile.repeats)
    return 0


COMMANDS: dict[str, Callable[[RunConfig, list[str]], int]] = {
    "train": lambda rc, _: cmd_train(rc),
    "plan": lambda rc, _: cmd_plan(rc),
    "simulate": lambda rc, _: cmd_plan(rc, compare_schedules=True),
    "profile": lambda rc, _: cmd_profile(rc),
    "bench": cmd_bench,
    "shards": lambda rc, _: cmd_shards(rc),
    "bench-data": lambda rc, _: cmd_bench_data(rc),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher inserts --local_rank=N; ranks come from the environment instead.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, overrides = argv[0], argv[1:]
    if any(o in ("-h", "--help") for o in overrides):
        print(USAGE)
        print(f"configuration ({CONF_DIR / 'config.yaml'}; groups: "
              + ", ".join(f"{g}=[{' '.join(sorted(p.stem for p in (CONF_DIR / g).glob('*.yaml')))}]"
                          for g in ("model", "data", "hardware")) + "):\n")
        print((CONF_DIR / "config.yaml").read_text())
        return 0
    if cmd not in COMMANDS:
        print(f"mmpipe: unknown command {cmd!r}; use one of {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        rc = load(overrides, job=cmd)
    except Exception as err:  # noqa: BLE001
        if not _is_user_error(err):
            raise
        print(f"mmpipe {cmd}: error: {_explain(err, overrides)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rc, overrides)
    except Exception as err:  # noqa: BLE001 - one clean line for config and input errors
        if not _is_user_error(err):
            raise
        msg = str(err).strip().replace("\n", " ")
        print(f"mmpipe {cmd}: error: {msg}", file=sys.stderr)
        return 2


def _explain(err: BaseException, overrides: list[str]) -> str:
    """Hydra's message, plus the closest real key when an override names one that does not exist."""
    import difflib
    import re

    msg = " ".join(str(err).split())
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "?")
        known = _known_keys()
        near = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {near[0]}?" if near else "run `mmpipe train --help` for the groups"
        return f"{key}={value}: no such config key; {hint}"
    m = re.search(r"Could not find '([\w-]+)/([^']+)'\s*Available options in '[\w-]+':\s*(.*?)\s*Config search path", msg)
    if m:
        group, name, options = m.groups()
        return f"{group}={name}: no such {group} config; available: {', '.join(options.split())}"
    import yaml

    if isinstance(err, yaml.YAMLError):
        return f"a config file is not valid YAML: {msg}"
    return msg


def _known_keys() -> list[str]:
    """Every settable key, dotted, from the root config and each group's default file."""
    import yaml

    def flat(prefix: str, node) -> list[str]:
        if isinstance(node, dict):
            return [k for key, v in node.items() for k in flat(f"{prefix}.{key}", v)]
        return [prefix]

    root = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    keys = [k for g, sec in root.items() if g != "defaults" and isinstance(sec, dict) for k in flat(g, sec)]
    for entry in root.get("defaults", []):
        if isinstance(entry, dict):
            (group, name), = entry.items()
            path = CONF_DIR / group / f"{name}.yaml"
            if name and path.is_file():
                keys += flat(group, yaml.safe_load(path.read_text()))
    return keys


def _is_user_error(err: BaseException) -> bool:
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(err, (ValueError, FileNotFoundError, HydraException, OmegaConfBaseException, yaml.YAMLError))


if __name__ == "__main__":
    sys.exit(main())
