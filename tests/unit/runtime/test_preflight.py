"""Config errors that only show at launch are caught before any process starts, naming the key."""

from __future__ import annotations

import pytest
import torch

import mmpipe.runtime.launch
from mmpipe.cli import main


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was launched")

    monkeypatch.setattr(mmpipe.runtime.launch, "launch", refuse)


def train(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", *overrides])
    return code, capsys.readouterr().err.strip()


def test_resume_from_a_missing_folder(tmp_path, capsys, no_launch) -> None:
    code, err = train(capsys, f"train.resume={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert err == (f"mmpipe train: error: train.resume={tmp_path / 'nope'}: no such folder; give a run directory "
                   f"or its checkpoints/step<N> folder")
    assert not (tmp_path / "run").exists()


def test_resume_from_a_folder_without_a_committed_checkpoint(tmp_path, capsys, no_launch) -> None:
    (tmp_path / "old" / "checkpoints" / "step4").mkdir(parents=True)  # a save that never committed
    (tmp_path / "old" / "checkpoints" / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "old" / "checkpoints" / "latest").write_text("step4")  # DeepSpeed's pointer is not trusted
    code, err = train(capsys, f"train.resume={tmp_path / 'old'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert err == (f"mmpipe train: error: train.resume={tmp_path / 'old'}: no committed checkpoint in "
                   f"{tmp_path / 'old' / 'checkpoints'} (unfinished saves: step4); start without train.resume")


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_unusable_run_dir(tmp_path, capsys, no_launch, where) -> None:
    (tmp_path / "f").write_text("")
    run_dir = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
    code, err = train(capsys, f"hydra.run.dir={run_dir}")
    assert code == 2
    said = "is a file, not a folder" if where == "file" else "cannot be created or written (Not a directory)"
    assert err == (f"mmpipe train: error: hydra.run.dir={run_dir} {said}; give a folder you can write, "
                   f"e.g. hydra.run.dir=runs/NAME")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda(tmp_path, capsys, no_launch) -> None:
    code, err = train(capsys, "launcher.backend=nccl", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert err == ("mmpipe train: error: launcher.backend=nccl needs a CUDA GPU, and torch sees none here "
                   "(torch.cuda.is_available() is False); use launcher.backend=auto or gloo")
