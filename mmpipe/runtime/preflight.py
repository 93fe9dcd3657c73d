"""Checks and files made before any process starts."""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from mmpipe.config import RunConfig
from mmpipe.machine import Machine
from mmpipe.paths import PACKAGE_ROOT, resolve_path


def check_data(rc: RunConfig) -> None:
    """The shards and the tokenizer exist (a clear error now, not a hang in every rank later)."""
    from mmpipe.data.shards import check_shards, expansions
    from mmpipe.runtime.hf_run import load_templater

    if rc.data.kind != "shards":
        raise ValueError(f"data.kind={rc.data.kind!r}: mmpipe train reads webdataset shards; use data=synthetic "
                         f"or a data config with kind: shards")
    paths = [s["path"] for s in rc.data.sources] if rc.data.sources else [rc.data.path]
    for path in paths:
        check_shards(resolve_path(path), root=PACKAGE_ROOT, dp_size=rc.parallel.dp,
                     num_workers=rc.data.num_workers)
        if os.environ.get("RANK", "0") == "0":  # a folder or a glob: say what it was read as
            for line in expansions(resolve_path(path), root=PACKAGE_ROOT):
                print(f"mmpipe: {line}", flush=True)
    load_templater(rc)


def check_launch(rc: RunConfig) -> None:
    """What would otherwise fail in every rank after launch: the run directory, train.resume
    and the backend. Raises ValueError naming the key."""
    check_backend(rc.launcher.backend)
    if rc.train.resume:
        checkpoint_dir(rc)
    check_run_dir(rc.run_dir)  # last: it creates the folder


def check_run_dir(run_dir: str) -> None:
    """The run directory can be created and written (it is created here)."""
    key = f"hydra.run.dir={run_dir}"
    fix = "give a folder you can write, e.g. hydra.run.dir=runs/NAME"
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{key} is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:  # a block written and flushed: a full disk shows
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space on that disk, or give a folder on another, e.g. hydra.run.dir=/other/disk/NAME"
        raise ValueError(f"{key} cannot be created or written ({err.strerror or err}); {fix}") from None


def checkpoint_dir(rc: RunConfig) -> Path:
    """The committed checkpoint folder train.resume names, once the rules the ranks apply at
    resume (runtime/committed.py `choose`: the same model, adapters, trained set, precision, a
    layout its optimizer state can be remapped to, a step below train.steps) pass on its
    record; the ranks then hash its files. Imports neither torch nor DeepSpeed.

    Raises:
        CheckpointError: one line naming train.resume, what differs and the fix.
    """
    from mmpipe.runtime.committed import CheckpointError, choose, run_topology

    key = f"train.resume={rc.train.resume}"
    choice = choose(Path(resolve_path(rc.train.resume)), key, Path(rc.run_dir), run_topology(rc), rc.train.steps)
    if isinstance(choice, str):
        raise CheckpointError(choice)
    return choice[0]


def check_backend(backend: str) -> None:
    """launcher.backend=nccl needs a CUDA device."""
    if backend != "nccl":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError("launcher.backend=nccl needs a CUDA GPU, and torch sees none here "
                         "(torch.cuda.is_available() is False); use launcher.backend=auto or gloo")


def check_gpus(rc: RunConfig, machine: Machine) -> None:
    """The local ranks mmpipe would launch over NCCL each get a GPU of their own: NCCL refuses two
    ranks on one device, and a rank given a device ordinal torch does not have dies with
    `CUDA error: invalid device ordinal`. Under an external launcher each node's launcher
    places its ranks; nothing to check here."""
    if machine.world is not None or rc.launcher.backend == "gloo" or not machine.gpus:
        return  # auto and nccl run NCCL where torch sees a GPU (host.resolve_backend)
    pp, dp = rc.parallel.pp, rc.parallel.dp
    ranks = rc.launcher.nproc or pp * dp
    if ranks <= machine.gpus:
        return
    one = "parallel.pp=1 parallel.dp=1" if machine.gpus == 1 else f"a layout of at most {machine.gpus} ranks"
    raise ValueError(f"parallel.pp={pp} x parallel.dp={dp} = {ranks} ranks need {ranks} GPUs over NCCL, and torch "
                     f"sees {machine.gpus} here ({machine.describe()}); use {one} (or leave parallel.pp and "
                     f"parallel.dp unset: they fit this machine), or launcher.backend=gloo to train on the CPU")


def to_plain(rc: RunConfig) -> dict:
    """The run's config as plain YAML-able values (what the workers read back)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        return x

    out = {k: plain(getattr(rc, k)) for k in ("model", "parallel", "train", "data", "plan", "launcher", "profile",
                                              "shards", "bench", "deepspeed")}
    out["hardware"] = plain(dict(rc.hardware))
    out["model"] = {k: v for k, v in out["model"].items() if v is not None}
    if rc.model_settings:  # a Hugging Face model: its group (folders), from which every reader rebuilds the spec
        out["model"] = plain(dict(rc.model_settings))
    return out


def write_run_config(rc: RunConfig) -> Path:
    """RUN_DIR/run.yaml; a new (not resumed) run also starts RUN_DIR/skips.jsonl afresh.

    Raises:
        ValueError: one line naming the file the disk refused (full, not writable).
    """
    run_dir = Path(rc.run_dir)
    path = run_dir / "run.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not rc.train.resume:
            (run_dir / "skips.jsonl").unlink(missing_ok=True)
        path.write_text(yaml.safe_dump(to_plain(rc), sort_keys=False))
    except OSError as err:
        raise ValueError(f"hydra.run.dir={rc.run_dir}: cannot write {err.filename or path} "
                         f"({err.strerror or err}); free space or give a folder you can write") from None
    return path
