"""Checkpoint pieces that need no processes: records, safe loading, the LR schedule, RNG."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from mmpipe.runtime.checkpoint import (
    CheckpointError,
    SafeCheckpointEngine,
    continue_schedule,
    rng_state,
    set_rng_state,
    truncate_records,
)
from mmpipe.runtime.pipeline import lr_lambda


def test_records_keep_the_steps_up_to_the_resumed_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # the last line cut by a kill
    truncate_records(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    truncate_records(path, 0)  # a fresh run in the same directory starts the record afresh
    assert path.read_text() == ""
    truncate_records(tmp_path / "absent.jsonl", 3)
    assert not (tmp_path / "absent.jsonl").exists()


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_file_that_would_run_code_is_refused_naming_it(tmp_path):
    evil = _RunsCode()
    evil.flag = tmp_path / "ran"
    path = tmp_path / "layer_03-model_states.pt"
    torch.save({"weight": torch.ones(2), "x": evil}, path)
    engine = SafeCheckpointEngine(zipfile_serialization=True, trusted=False)
    with pytest.raises(CheckpointError) as err:
        engine.load(str(path))
    assert str(err.value).startswith(f"{path} holds a Python object (posix.system)")
    assert "train.resume_unsafe=true" in str(err.value)
    assert not evil.flag.exists()
    plain = tmp_path / "plain.pt"
    torch.save({"weight": torch.arange(3.0), "step": 4, "groups": [{"lr": 0.1}]}, plain)
    assert engine.load(str(plain))["weight"].tolist() == [0.0, 1.0, 2.0]


def test_an_unreadable_file_is_named(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"weight": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}: "):
        SafeCheckpointEngine(zipfile_serialization=True, trusted=False).load(str(path))


def _scheduler(total: int, peak: float = 1e-3):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup=3, total=total))


def _step(sched) -> float:
    lr = sched.get_last_lr()[0]  # the rate a step trains with, as train.py logs it
    sched.optimizer.step()
    sched.step()
    return lr


def test_the_schedule_continues_from_the_step():
    whole = _scheduler(10)
    want = [_step(whole) for _ in range(10)]
    first = _scheduler(10)
    got = [_step(first) for _ in range(4)]
    again = _scheduler(10)
    again.load_state_dict(first.state_dict())  # what DeepSpeed restores
    continue_schedule(again, 4, peak=1e-3)
    got += [_step(again) for _ in range(6)]
    assert got == want
    # With a longer run the first resumed step already trains on the new cosine, not on the
    # rate the saved schedule left behind (that was the jump in the logged lr).
    longer = _scheduler(15)
    longer.load_state_dict(first.state_dict())
    assert continue_schedule(longer, 4, peak=1e-3) == pytest.approx(1e-3 * lr_lambda(4, warmup=3, total=15))


def test_rng_state_survives_a_safe_round_trip(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and (got[1] == want[1]).all() and got[2] == want[2]
