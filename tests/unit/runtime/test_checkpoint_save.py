"""Saving a checkpoint through a real DeepSpeed PipelineEngine (one stage, one rank, in this
process): committed.json is written only after every file of the step, and the folder's
entries, are flushed to disk; a write the disk refuses (full, not permitted), whether in
DeepSpeed's files, mmpipe's own, their flush or the marker itself, stops the save with one line
naming the file, and leaves no committed.json (a SIGKILL keeps the page cache, so only the
order of the flushes shows the first property; the fault-injection trials cannot). A resume
through it trains with the configured weight decay, not the one the checkpoint saved."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from mmpipe.runtime.checkpoint import MARKER, Checkpointer, CheckpointError

TOPOLOGY = {"pp": 1, "dp": 1, "stages": [[0, 2]], "precision": "fp32", "zero": 0}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1})[0]


def _checkpointer(engine, run_dir: Path, **settings) -> Checkpointer:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine.checkpoint_engine = TorchCheckpointEngine(config_params=None)  # DeepSpeed's, which Checkpointer replaces
    return Checkpointer(engine=engine, run_dir=run_dir, first=True, reads_data=True, dp_rank=0, keep_last=0,
                        topology=TOPOLOGY, schedule={"lr": 0.1, "warmup_steps": 0, "steps": 10}, **settings)


def test_committed_json_comes_after_every_file_and_the_folder_are_flushed(engine, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    folder = _checkpointer(engine, tmp_path).save(3, {"consumed": 3})
    marker = str(folder / MARKER)
    commit_at = events.index(("replace", marker))
    files = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    assert {"layer_00-model_states.pt", "layer_01-model_states.pt", "mp_rank_00_model_states.pt",
            "rng_rank0.pt", "data_state_dp0.json"} <= set(files)
    flushed_before = {Path(p).name for op, p in events[:commit_at] if op == "fsync"}
    assert set(files) <= flushed_before, f"not flushed before the commit: {set(files) - flushed_before}"
    assert ("fsync", str(folder)) in events[:commit_at]  # the folder's entries, before the marker names them
    # ... and the marker itself is flushed before it is renamed into place, its folder after
    assert any(op == "fsync" and Path(p).name.startswith(f".{MARKER}.tmp") for op, p in events[:commit_at])
    assert ("fsync", str(folder)) in events[commit_at + 1:]


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["deepspeed file", "rng file", "flush", "marker"])
def test_a_save_the_disk_refuses_is_one_line_and_not_committed(engine, tmp_path, monkeypatch, where):
    run = tmp_path / "run"
    saver = _checkpointer(engine, run)
    folder = run / "checkpoints" / "step2"
    real_save, real_fsync, real_open = torch.save, os.fsync, Path.open
    if where in ("deepspeed file", "rng file"):
        name = "layer_01-model_states.pt" if where == "deepspeed file" else "rng_rank0.pt"

        def save(obj, f, *args, **kwargs):
            if Path(str(f)).name == name:
                raise _enospc(f)
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
        said = f"{folder / name}: No space left on device"
    elif where == "flush":  # a delayed write finds the disk full only at fsync
        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith("mp_rank_00_model_states.pt"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        said = f"{folder / 'mp_rank_00_model_states.pt'}: Input/output error"
    else:  # the marker's own write
        def open_(self, mode="r", *args, **kwargs):
            if self.name.startswith(f".{MARKER}.tmp") and "w" in mode:
                raise _enospc(self)
            return real_open(self, mode, *args, **kwargs)

        monkeypatch.setattr(Path, "open", open_)
        said = f"{folder / ('.' + MARKER)}.tmp{os.getpid()}: No space left on device"
    with pytest.raises(CheckpointError) as err:
        saver.save(2, {"consumed": 2})
    message = str(err.value)
    assert message.startswith("cannot save checkpoint step2: ") and said in message, message
    assert f"; the save is not committed (no {MARKER}): " in message and "\n" not in message
    if where != "flush":  # a disk error that is not "full" gets "check the disk"
        assert "free space on that disk (or train in a run directory on another: hydra.run.dir=DIR)" in message
    assert not (folder / MARKER).exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{MARKER}")]  # no temporary marker
    monkeypatch.undo()
    assert (saver.save(2, {"consumed": 2}) / MARKER).is_file()  # the next save, with room, commits


def test_a_resume_trains_with_the_configured_weight_decay_and_says_so(make_engine, tmp_path, capsys):
    """Issue 34: DeepSpeed restores the optimizer's param_groups from the checkpoint, so a resume
    with a changed train.weight_decay trained with the saved one, bit for bit, silently. The
    resumed optimizer holds the configured value and the start-up line names it."""
    import json

    from mmpipe.runtime.checkpoint import Found

    engine, optimizer = make_engine({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1})
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    folder = _checkpointer(engine, tmp_path).save(3, {"consumed": 3})  # saved with weight_decay 0.0
    for group in optimizer.param_groups:  # the resumed run's optimizer, built with train.weight_decay=0.1
        group["weight_decay"] = 0.1
    resumed = _checkpointer(engine, tmp_path, optimizer_settings={"weight_decay": 0.1})
    capsys.readouterr()
    resumed.resume(Found(folder=folder, record=json.loads((folder / MARKER).read_text())))
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1]
    line = capsys.readouterr().out.strip()
    assert line.startswith("resumed from step 3") and line.endswith(
        "; train.weight_decay=0.1 applied (checkpoint: 0.0)"), line
