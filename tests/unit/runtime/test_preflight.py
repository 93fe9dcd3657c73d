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


@pytest.mark.parametrize("errno_, said, fix", [
    (28, "No space left on device", "free space on that disk, or give a folder on another, e.g. "
                                    "hydra.run.dir=/other/disk/NAME"),
    (13, "Permission denied", "give a folder you can write, e.g. hydra.run.dir=runs/NAME"),
])
def test_a_run_dir_on_a_full_or_closed_disk(tmp_path, capsys, no_launch, monkeypatch, errno_, said, fix) -> None:
    """Tests run as root, whom chmod does not stop: the write is made to fail."""
    import os
    import tempfile

    def refuse(*args, **kwargs):
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    code, err = train(capsys, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert err == f"mmpipe train: error: hydra.run.dir={tmp_path / 'run'} cannot be created or written ({said}); {fix}"


def test_a_disk_that_fills_after_the_check_is_one_line_naming_the_file(tmp_path, monkeypatch) -> None:
    """run.yaml cannot be written (the disk filled after the check), and a rank's write fails
    mid-run: each is one line naming the file, never a traceback."""
    import errno
    import os
    from pathlib import Path

    from mmpipe.cli import load
    from mmpipe.runtime import worker
    from mmpipe.runtime.preflight import write_run_config

    rc = load([f"hydra.run.dir={tmp_path / 'run'}"], job="test")
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "run.yaml":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(ValueError) as err:
        write_run_config(rc)
    assert str(err.value) == (f"hydra.run.dir={tmp_path / 'run'}: cannot write {tmp_path / 'run' / 'run.yaml'} (No "
                              f"space left on device); free space or give a folder you can write")
    monkeypatch.setattr(Path, "write_text", real)

    import mmpipe.runtime.train

    for code, said, fix in ((errno.ENOSPC, "No space left on device", "free space on that disk"),
                            (errno.EACCES, "Permission denied", "make the run directory writable")):
        def fail(_rc, stop, code=code):
            raise OSError(code, os.strerror(code), str(tmp_path / "run" / "metrics.jsonl"))

        monkeypatch.setattr(mmpipe.runtime.train, "train", fail)
        monkeypatch.setenv("MMPIPE_ERROR_FILE", str(tmp_path / f"error{code}"))
        assert worker.run_rank(rc) == worker.EXIT_USER_ERROR
        line = (tmp_path / f"error{code}").read_text()
        assert line.startswith(f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: {said}; {fix}"), line
    import signal

    for s in worker.SIGNALS:  # run_rank installed the stop handlers in this process: put them back
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks DeepSpeed's CPU accelerator")
def test_a_precision_deepspeed_refuses_on_this_device(tmp_path, capsys, no_launch, monkeypatch) -> None:
    """DeepSpeed's CPU accelerator supports fp16 only where oneDNN has fp16 kernels: both answers."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from mmpipe.runtime.host import precision_problem

    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: False)
    code, err = train(capsys, "train.precision=fp16", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and not (tmp_path / "run").exists()
    assert err == ("mmpipe train: error: train.precision=fp16: DeepSpeed does not train fp16 on this CPU (its "
                   "CPU_Accelerator.is_fp16_supported() is False: oneDNN has no fp16 kernels here; they need "
                   "AVX512-FP16 or AMX-FP16); use train.precision=bf16 (supported here) or fp32")
    monkeypatch.setattr(CPU_Accelerator, "is_bf16_supported", lambda self: False)
    assert precision_problem("fp16", "auto").endswith("; use train.precision=fp32")
    assert precision_problem("bf16", "auto").startswith("train.precision=bf16: DeepSpeed does not train bf16 on this")
    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: True)
    assert precision_problem("fp16", "auto") is None and precision_problem("fp32", "auto") is None
