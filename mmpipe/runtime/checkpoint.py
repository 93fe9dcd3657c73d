"""Checkpoints that commit atomically, are verified at resume, and load without running code.

A checkpoint is the folder `checkpoints/step<N>/`. Every rank writes its part (DeepSpeed's
files, its RNG state, and on each replica's first stage the reader position); then, after a
barrier, rank 0 writes one marker, `committed.json`, that records the size and sha256 of every
file. Only a folder with that marker is a checkpoint: a save cut short (a killed job, a full
disk) leaves a folder without it, which resume skips with a warning. The marker is written to
a temporary file, fsynced, renamed into place and its folder fsynced, after every file it
names was fsynced, so it never exists before what it describes. DeepSpeed's own `latest` file
is written the same way after the commit, for DeepSpeed's tools only; mmpipe always loads an
explicit tag.

DeepSpeed's TorchCheckpointEngine unpickles with `torch.load(weights_only=False)`, so a
crafted file would run code on load. `SafeCheckpointEngine` replaces it on the engine and
loads with `weights_only=True`; see docs/runtime.md for what that covers.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from mmpipe.runtime.committed import (
    FORMAT,
    MARKER,
    CheckpointError,
    RunStopped,
    choose,
    layout_changes,
    newest_committed,
    required_files,
    reshard_problem,
    step_folders,
)
from mmpipe.runtime.reshard import ReshardError, load_states, order_file, read_states

STEP_FIT = "step_fit.json"
"""Rank 0's step-time re-fit after the step (planner/calibrate.py StepCalibration.state_dict)."""


# -- files ------------------------------------------------------------------------------


def sha256_of(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file (what `sha256sum` prints)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
        return f.tell(), h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk (Linux accepts a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a part, even across a crash. A
    failed write (a full disk) leaves the old file and no temporary one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def cannot_save(folder: Path, err: OSError) -> str:
    """The one line every rank stops with when a save cannot be written: the file, why, that
    nothing was committed, and the fix."""
    where = f"{err.filename}: " if err.filename else ""
    fix = ("free space on that disk (or train in a run directory on another: hydra.run.dir=DIR)"
           if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make the run directory writable by this user"
           if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "check the disk")
    return (f"cannot save checkpoint {folder.name}: {where}{err.strerror or err}; the save is not committed (no "
            f"{MARKER}): {fix}, then resume from the last committed checkpoint with train.resume")


def truncate_records(path: Path, step: int) -> None:
    """Keep the JSON lines of `path` whose "step" is at most `step` (the resumed step: later
    lines belong to steps that will be trained again). Atomic; a missing file stays missing."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # a line cut by a kill: it belongs to no finished step
            continue
    write_atomic(path, "".join(kept).encode())


def _discard(folder: Path) -> None:
    """Remove a step folder, marker first: a crash halfway leaves an uncommitted folder."""
    marker = folder / MARKER
    if marker.exists():
        marker.unlink()
        fsync_path(folder)
    shutil.rmtree(folder, ignore_errors=True)


# -- loading without running code -------------------------------------------------------


def _deepspeed_data_types() -> list:
    """DeepSpeed's plain-data classes in its optimizer states (ZeRO, fp16/bf16): their
    constructors and attribute updates run no code of the file's choosing, so the restricted
    unpickler may build them."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with `torch.load(weights_only=True)`.

    The files of an mmpipe checkpoint hold tensors, plain containers and, with ZeRO or a loss
    scaler, a few DeepSpeed data classes (allowed by name), which the restricted unpickler
    builds without calling code of the file's choosing. A file that needs more is refused
    with a one-line error naming it, unless `trusted` (train.resume_unsafe, or the checkpoint
    lies in this run's own directory): then it is loaded as DeepSpeed would, with a warning.
    Reading errors name the file too (DeepSpeed's tracebacks do not).
    """

    def __init__(self, *, zipfile_serialization: bool, trusted: bool):
        super().__init__(config_params=None)
        self.zipfile_serialization = zipfile_serialization
        self.trusted = trusted
        self.write_error: OSError | None = None
        """The first write that failed during a save (a full disk, no permission). Kept, not
        raised: DeepSpeed's save_checkpoint has barriers after the writes, which every rank must
        reach; the Checkpointer then stops all ranks with one line and commits nothing."""

    def save(self, state_dict, path: str) -> None:
        if self.write_error is not None:
            return  # this save is lost already: write nothing more
        try:
            super().save(state_dict, path)
        except OSError as err:
            self.write_error = err if err.filename else OSError(err.errno, err.strerror or str(err), path)

    def makedirs(self, path, exist_ok=False) -> None:
        try:
            super().makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            if self.write_error is None:
                self.write_error = err

    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(_deepspeed_data_types()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            what = found.group(1) if found else str(err).strip().splitlines()[0]
            if not self.trusted:
                raise CheckpointError(
                    f"{path} holds a Python object ({what}) that torch.load(weights_only=True) refuses to build: "
                    f"loading it could run code from the file; if you trust this checkpoint, set "
                    f"train.resume_unsafe=true") from None
            print(f"warning: {path} holds {what}; loaded with torch.load(weights_only=False) (trusted checkpoint)",
                  file=sys.stderr, flush=True)
            return torch.load(path, map_location=map_location, weights_only=False)
        except (RuntimeError, EOFError, OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(f"cannot read checkpoint file {path}: {first}") from None


# -- RNG --------------------------------------------------------------------------------


def rng_state() -> dict:
    """This process's random states, as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


# -- the learning-rate schedule ---------------------------------------------------------


def continue_schedule(scheduler, step: int, *, peak: float) -> float:
    """Put a LambdaLR at `step` of the configured schedule; return the next step's rate.

    DeepSpeed restores the scheduler's state_dict (last_epoch, base_lrs, _last_lr), but a
    LambdaLR's function is not saved: it is the closure of the current config. With a changed
    train.steps (the cosine's span) or train.lr the first resumed step trained at the restored
    rate and the later ones at the new function's, so the logged lr jumped. The rate is a pure
    function of (step, config), so it is recomputed here from the step alone.
    """
    scheduler.base_lrs = [peak] * len(scheduler.base_lrs)
    scheduler.last_epoch = step - 1
    scheduler.step()
    return scheduler.get_last_lr()[0]


def apply_optimizer_settings(optimizer, settings: dict[str, float]) -> dict[str, float]:
    """Put the configured optimizer settings (`weight_decay`) into every parameter group of
    `optimizer` and of each optimizer it wraps (DeepSpeed's bf16 / fp16 / ZeRO wrappers keep the
    torch optimizer as `.optimizer`); return the values the loaded state held where they differ.

    A checkpoint's optimizer state carries its param_groups: torch's load_state_dict (and the
    reshard loader after it) puts the saved weight_decay back, so a resume with a changed
    train.weight_decay trained with the old one, bit for bit, without a word. The setting is
    the config's; only the moments and the step count are the checkpoint's.
    """
    was: dict[str, float] = {}
    seen: set[int] = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        for group in getattr(opt, "param_groups", None) or []:
            for key, value in settings.items():
                if key in group and group[key] != value:
                    was.setdefault(key, group[key])
                    group[key] = value
        opt = getattr(opt, "optimizer", None)
    return was


# -- stopping ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StepVerdict:
    """What every rank agreed on after a step."""

    nonfinite: bool
    """The loss or the gradient norm was not finite on some rank (its update was withheld)."""
    stop: bool
    """Some rank was asked to stop: save now and end."""


def agree_after_step(*, nonfinite: bool, stop: bool, device) -> StepVerdict:
    """One all-reduce: every rank takes the same decision at the same step (`nonfinite`: this
    rank saw a non-finite loss or gradient norm; `stop`: it was asked to stop)."""
    flags = torch.tensor([float(nonfinite), float(stop)], dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return StepVerdict(nonfinite=bool(flags[0] > 0), stop=bool(flags[1] > 0))


def _agree(problem: str | None, kind: type[RunStopped] = CheckpointError) -> None:
    """Raise the first rank's problem on every rank, or return when there is none."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, problem)
    found = [p for p in parts if p]
    if found:
        raise kind(found[0])


def first_nonfinite(module, optimizer) -> str | None:
    """The first parameter or optimizer state of this rank that holds a NaN or an infinity."""
    for name, p in module.named_parameters():
        if not bool(torch.isfinite(p.detach()).all()):
            return f"parameter {name}"
    for state in getattr(optimizer, "state", {}).values():
        for key, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return f"optimizer state {key}"
    return None


# -- committing, finding and checking a checkpoint -------------------------------------


def commit(folder: Path, *, step: int, files: dict, topology: dict, schedule: dict) -> None:
    """Write the marker that makes `folder` a checkpoint; `files` maps every other file of it
    to its size and sha256, all already fsynced."""
    import deepspeed

    fsync_path(folder)  # the entries of every file, before the marker that names them
    record = {"format": FORMAT, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "topology": topology, "schedule": schedule,
              "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__}, "files": files}
    write_atomic(folder / MARKER, json.dumps(record, indent=1).encode())
    fsync_path(folder.parent)


def refuse_other_history(run_dir: Path) -> None:
    """A run that does not resume must not save next to another run's committed checkpoints:
    a later resume would pick their newest and mix two histories; collective."""
    problem = None
    if dist.get_rank() == 0:
        steps = [p.name for _, p in step_folders(run_dir / "checkpoints") if (p / MARKER).is_file()]
        if steps:
            problem = (f"{run_dir} already holds committed checkpoints of another run ({', '.join(steps)}); continue "
                       f"it with train.resume={run_dir}, or train in a new run directory (hydra.run.dir=NEW)")
    _agree(problem)


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A committed checkpoint whose files all match their record."""

    folder: Path
    """The step folder."""
    record: dict
    """Its commit marker."""

    @property
    def step(self) -> int:
        return int(self.record["step"])


def load_step_fit(found: Found) -> dict | None:
    """The step-time re-fit a checkpoint saved (its STEP_FIT), None for one without (older
    checkpoints, runs too short to fit)."""
    path = found.folder / STEP_FIT
    return json.loads(path.read_text()) if path.is_file() else None


def describe(target: Path) -> str:
    """`mmpipe checkpoint info`: what a committed checkpoint holds and the layouts it resumes on
    (the rules `find_checkpoint` applies)."""
    folder, warnings = newest_committed(target, str(target))
    record = json.loads((folder / MARKER).read_text())
    topo, files = record.get("topology") or {}, record.get("files") or {}
    model = topo.get("model") or {}
    parts = [f"{c} {', '.join(f'{k} {v}' for k, v in model[c].items())}" for c in ("vision", "audio", "llm")
             if model.get(c)]
    lora = topo.get("lora")
    size = sum(f.get("size", 0) for f in files.values())
    zero, precision = topo.get("zero", 0), topo.get("precision", "fp32")
    why = reshard_problem(topo, files)
    lines = [
        f"checkpoint {folder}: step {record.get('step')}, committed, {len(files)} files, {size / 2**20:.1f} MiB",
        f"model: {model.get('name')} ({model.get('class')}; {'; '.join(parts)})",
        f"layout: parallel.pp={topo.get('pp')} x parallel.dp={topo.get('dp')}, stages {topo.get('stages')} "
        f"(layer index ranges)",
        f"training: train.precision={precision}, ZeRO stage {zero}; "
        + (f"LoRA {lora} (the frozen base weights are not in the files)" if lora else "no adapters"),
        "resumes on: the same model and train.precision"
        + (f" and train.lora={lora}" if lora else " and no train.lora")
        + ("; any parallel.pp, cut, parallel.dp and ZeRO stage the precision allows (the optimizer state is "
           "remapped by parameter)" if why is None
           else f"; this layout only ({why.split(': resume')[0]})")
        + "; on another parallel.dp the readers continue with the samples the old replicas had not taken (a "
        "mixture restarts its epoch), and the steps hold the same samples with plan.across_replicas=true",
    ]
    return "\n".join(lines + [f"warning: {w}" for w in warnings])


def find_checkpoint(target: Path, *, given: str, run_dir: Path, topology: dict, steps: int,
                    key: str | None = None) -> Found:
    """The newest committed checkpoint at `target` (a step folder, a checkpoints folder or a
    run directory; `given` as the user typed it), checked file by file; collective. Errors
    start with `key` (default `train.resume=<given>`).

    Rank 0 chooses and prints the warnings; every rank hashes a share of the files; every
    rank raises the same CheckpointError when something is wrong, naming every damaged file.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    key = key or f"train.resume={given}"
    choice: list = [choose(target, key, run_dir, topology, steps) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise CheckpointError(choice[0])
    folder, record, warnings, earlier = choice[0]
    if rank == 0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
    problems = []
    for name in sorted(record["files"])[rank::world]:
        want, path = record["files"][name], folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} recorded")
        elif sha256_of(path)[1] != want["sha256"]:
            problems.append(f"{name} does not match its recorded sha256")
    parts: list = [None] * world
    dist.all_gather_object(parts, problems)
    found = sorted(p for part in parts for p in part)
    if found:
        fix = f"resume from an earlier one (train.resume={earlier})" if earlier else "start a new run"
        raise CheckpointError(f"checkpoint {folder} is damaged: {'; '.join(found)}; restore these files or {fix}")
    return Found(folder=folder, record=record)


# -- save and resume --------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Checkpointer:
    """One rank's side of saving the run's checkpoints and of loading one."""

    engine: object
    """The DeepSpeed PipelineEngine."""
    run_dir: Path
    """The run directory; checkpoints go to run_dir/checkpoints."""
    first: bool
    """First stage of its replica: writes the replica's reader position."""
    reads_data: bool
    """First or last stage: needs the reader position at resume."""
    dp_rank: int
    """Data-parallel replica."""
    keep_last: int
    """Committed checkpoints kept (0: all)."""
    topology: dict
    """pp, dp and stage bounds: a checkpoint loads only into the same."""
    schedule: dict
    """lr, warmup_steps, steps: the learning-rate schedule."""
    optimizer_settings: dict = field(default_factory=dict)
    """weight_decay: the optimizer's settings, applied over a resumed checkpoint's (apply_optimizer_settings)."""
    resume_unsafe: bool = False
    """Load files that need torch.load(weights_only=False) from outside the run directory."""
    newest: Path | None = field(default=None, init=False)
    """The newest committed checkpoint this run saved or resumed from."""
    _resumed_from: Path | None = field(default=None, init=False)

    @property
    def root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def adapters(self) -> bool:
        """A LoRA run: its layer files hold what trains, not the frozen base weights, which every
        start builds again from the model's source (DeepSpeed's exclude_frozen_parameters)."""
        return bool(self.topology.get("lora"))

    def __post_init__(self) -> None:
        current = self.engine.checkpoint_engine
        if type(current) is not TorchCheckpointEngine:
            raise CheckpointError(f"DeepSpeed checkpoint engine {type(current).__name__} is not supported: mmpipe "
                                  f"replaces DeepSpeed's torch engine to load without running code")
        self.engine.checkpoint_engine = SafeCheckpointEngine(
            zipfile_serialization=current.zipfile_serialization, trusted=False)

    # -- save ------------------------------------------------------------------------

    def save(self, step: int, reader_state: dict | None, step_fit: dict | None = None) -> Path:
        """Write checkpoint `step` from every rank, then commit it (rank 0); collective.
        `step_fit` (rank 0): the step-time re-fit's state after this step, which a resumed run
        plans with until it has fitted its own (STEP_FIT)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        folder = self.root / f"step{step}"
        bad = first_nonfinite(self.engine.module, self.engine.optimizer)
        _agree(f"not saving step {step}: {bad} of rank {rank} is not finite" if bad else None, RunStopped)
        problem = None
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                _discard(folder)  # an unfinished save of the same step
            except OSError as err:
                problem = cannot_save(folder, err)
        _agree(problem)  # also the barrier before anyone writes
        writer = self.engine.checkpoint_engine
        writer.write_error = None
        self.engine.save_checkpoint(str(self.root), tag=folder.name, client_state={"step": step}, save_latest=False,
                                    exclude_frozen_parameters=self.adapters)
        problem = cannot_save(folder, writer.write_error) if writer.write_error else None
        writer.write_error = None
        if problem is None:
            try:
                torch.save(rng_state(), folder / f"rng_rank{rank}.pt")
                if self.dp_rank == 0:  # the optimizer's parameters, by their layout-free names
                    (folder / order_file(self.engine.stage_id)).write_text(json.dumps(self._trained_names()))
                if self.first:
                    if reader_state is None:
                        raise OSError("the reader position of this step is unknown")
                    (folder / f"data_state_dp{self.dp_rank}.json").write_text(json.dumps(reader_state))
                if step_fit is not None:
                    (folder / STEP_FIT).write_text(json.dumps(step_fit))
            except OSError as err:
                problem = cannot_save(folder, err)
        _agree(problem)  # also the barrier after which every file exists
        names: list = [sorted(p.name for p in folder.iterdir()) if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        mine, problem = {}, None
        for name in names[0][rank::world]:  # each rank fsyncs and hashes a share of the files
            try:
                fsync_path(folder / name)  # a delayed write that finds the disk full fails here
                size, digest = sha256_of(folder / name)
            except OSError as err:
                named = err if err.filename else OSError(err.errno, err.strerror, str(folder / name))
                problem = cannot_save(folder, named)
                break
            mine[name] = {"size": size, "sha256": digest}
        parts: list = [None] * world
        dist.all_gather_object(parts, (mine, problem))
        problem = next((p for _, p in parts if p), None)
        if rank == 0 and problem is None:
            files = dict(sorted((k, v) for part, _ in parts for k, v in part.items()))
            missing = sorted(set(required_files(self.topology)) - set(files))
            if missing:
                problem = f"checkpoint {folder} lacks {', '.join(missing)} after the save; not committed"
            else:
                problem = self._commit(folder, step, files)
        _agree(problem)
        self.newest = folder
        return folder

    def _commit(self, folder: Path, step: int, files: dict) -> str | None:
        """Commit, then point DeepSpeed's `latest` at it and prune; the error line if the commit
        itself cannot be written (then no marker is left)."""
        try:
            commit(folder, step=step, files=files, topology=self.topology, schedule=self.schedule)
        except OSError as err:
            (folder / MARKER).unlink(missing_ok=True)  # written but not flushed: not a commit
            return cannot_save(folder, err)
        try:
            write_atomic(self.root / "latest", folder.name.encode())  # for DeepSpeed's tools; mmpipe reads markers
        except OSError as err:
            print(f"warning: checkpoint {folder.name} is committed, but DeepSpeed's `latest` file could not be "
                  f"updated ({err.strerror or err}); mmpipe does not read it", file=sys.stderr, flush=True)
        self._prune()
        return None

    def _prune(self) -> None:
        """Keep the newest `keep_last` committed checkpoints (and the one resumed from); drop
        unfinished saves older than the newest commit. Runs only after a new commit."""
        if not self.keep_last:
            return
        folders = step_folders(self.root)
        committed = [p for _, p in folders if (p / MARKER).is_file()]
        keep = set(committed[:self.keep_last]) | {self._resumed_from}
        newest_step = int(committed[0].name.removeprefix("step"))
        for step, p in folders:
            if p not in keep and ((p / MARKER).is_file() or step < newest_step):
                _discard(p)

    # -- resume ----------------------------------------------------------------------

    def resume(self, found: Found) -> tuple[int, dict | None]:
        """Load a checked checkpoint into the engine, the RNG and the schedule; return its
        step and this replica's reader position; collective."""
        rank, folder, step = dist.get_rank(), found.folder, found.step
        safe = self.engine.checkpoint_engine
        safe.trusted = self.resume_unsafe or folder.resolve().is_relative_to(self.run_dir.resolve())
        problem, reader_state = None, None
        saved = found.record["topology"]
        saved_dp = saved["dp"]
        reshard = bool(layout_changes(saved, self.topology))
        try:
            self._check_layer_keys(folder)
            if reshard:
                self._reshard(folder, saved, step)
            else:
                _, client = self.engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                                        load_module_strict=not self.adapters)
                if client is None or client.get("step") != step:
                    problem = f"checkpoint {folder}: DeepSpeed found no model states for step {step}"
            if saved_dp == self.topology["dp"] and not reshard:
                set_rng_state(torch.load(folder / f"rng_rank{rank}.pt", weights_only=True))
            if self.reads_data:
                state_file = folder / f"data_state_dp{self.dp_rank % saved_dp}.json"
                reader_state = json.loads(state_file.read_text())
                if reader_state is not None:  # every replica's position: another dp or worker count continues them
                    reader_state["replicas"] = [json.loads((folder / f"data_state_dp{d}.json").read_text())
                                                for d in range(saved_dp)]
        except CheckpointError as err:
            problem = str(err)
        except Exception as err:  # noqa: BLE001 - verified files that still do not load: say which checkpoint
            first = (str(err).strip().splitlines() or [""])[0]
            problem = f"cannot load checkpoint {folder}: {type(err).__name__}: {first}"
        safe.trusted = False
        _agree(problem)
        lr = continue_schedule(self.engine.lr_scheduler, step, peak=self.schedule["lr"])
        was = apply_optimizer_settings(self.engine.optimizer, self.optimizer_settings)
        if rank == 0:
            self._announce(found, lr, was)
        self.newest = folder
        if folder.parent.resolve() == self.root.resolve():
            self._resumed_from = folder
        return step, reader_state

    def load_weights(self, found: Found) -> None:
        """Load only the model weights of a checked checkpoint (`mmpipe eval`): no optimizer
        state, learning-rate schedule, random state or reader position; collective."""
        problem = None
        try:
            self._check_layer_keys(found.folder)
            _, client = self.engine.load_checkpoint(str(found.folder.parent), tag=found.folder.name,
                                                    load_module_only=True, load_optimizer_states=False,
                                                    load_lr_scheduler_states=False,
                                                    load_module_strict=not self.adapters)
            if client is None or client.get("step") != found.step:
                problem = f"checkpoint {found.folder}: DeepSpeed found no model states for step {found.step}"
        except CheckpointError as err:
            problem = str(err)
        except Exception as err:  # noqa: BLE001 - verified files that still do not load: say which checkpoint
            first = (str(err).strip().splitlines() or [""])[0]
            problem = f"cannot load checkpoint {found.folder}: {type(err).__name__}: {first}"
        _agree(problem)

    def _trained_names(self) -> list[str]:
        """This stage's trained parameters in the optimizer's order (make_optimizer takes the
        module's parameters that require a gradient, in order), by their PipelineModule names:
        `<global layer index>.<parameter>` and `tied_modules.<key>.<parameter>`, the same in
        every layout."""
        return [n for n, p in self.engine.module.named_parameters() if p.requires_grad]

    def _reshard(self, folder: Path, saved: dict, step: int) -> None:
        """Load a checkpoint written with another layout (pipeline cut, replicas, ZeRO stage): the
        layer files are named by global layer index, so DeepSpeed's own loader reads this stage's
        whatever the cut; the optimizer state is read by parameter name from every old stage's
        (and replica's) files and put into this rank's optimizer (runtime/reshard.py); the
        schedule and step counters come from the first old stage."""
        module, engine = self.engine.module, self.engine
        module.load_state_dir(str(folder), checkpoint_engine=engine.checkpoint_engine, strict=not self.adapters)
        names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        try:
            load = functools.partial(engine.checkpoint_engine.load, map_location="cpu")  # not onto the saver's GPU
            states = read_states(folder, saved, set(names.values()), load)
        except ReshardError as err:
            raise CheckpointError(str(err)) from None
        unknown = [n for n in names.values() if n not in states.known and n != "frozen_stage_anchor"]
        if unknown:
            raise CheckpointError(f"checkpoint {folder}: this run trains {unknown[:3]}, which the checkpoint's "
                                  f"optimizer does not hold (another train.trainable?)")
        load_states(engine, names, states)
        counters = states.counters
        engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
        engine.global_steps, engine.global_samples = counters["global_steps"], counters["global_samples"]
        engine.skipped_steps = counters["skipped_steps"]
        if counters.get("step") != step:
            raise CheckpointError(f"checkpoint {folder}: its model states are of step {counters.get('step')}, "
                                  f"not {step}")

    def _check_layer_keys(self, folder: Path) -> None:
        """A LoRA checkpoint loads its layers non-strictly (the frozen base weights are not in the
        files), so this rank first checks that each of its layer files holds exactly the layer's
        trained tensors: no missing adapter, nothing the layer does not have."""
        if not self.adapters:
            return
        module = self.engine.module
        for idx, layer in enumerate(module.forward_funcs):
            if not isinstance(layer, torch.nn.Module):
                continue
            path = Path(module.ckpt_layer_path(str(folder), idx))  # DeepSpeed's own name of the file
            saved = set(torch.load(path, map_location="cpu", weights_only=True))
            frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
            want = set(layer.state_dict()) - frozen
            if saved != want:
                odd = sorted(saved ^ want)[:3]
                raise CheckpointError(f"checkpoint {folder}: {path.name} does not hold the trained tensors of "
                                      f"layer {getattr(layer, 'name', idx)} (differs in {odd}); it is not a "
                                      f"checkpoint of this LoRA run")

    def _announce(self, found: Found, lr: float, was: dict[str, float]) -> None:
        positions = []
        for d in range(found.record["topology"]["dp"]):
            state = json.loads((found.folder / f"data_state_dp{d}.json").read_text()) or {}
            positions.append(f"replica {d} after {state.get('consumed', '?')} samples")
        applied = "".join(f"; train.{k}={self.optimizer_settings[k]} applied (checkpoint: {v})" for k, v in was.items())
        print(f"resumed from step {found.step} (checkpoint {found.folder}), sample position: {', '.join(positions)}"
              f"{applied}", flush=True)
        saved = found.record.get("schedule", {})
        changed = [f"train.{k}={v} (checkpoint: {saved.get(k)})" for k, v in self.schedule.items()
                   if saved.get(k) != v]
        if changed:
            print(f"warning: {', '.join(changed)}: the learning-rate schedule is recomputed for this config "
                  f"from step {found.step + 1} on (lr {lr:.6g} at step {found.step + 1})", file=sys.stderr, flush=True)
