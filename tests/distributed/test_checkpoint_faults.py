"""Checkpoints under faults, as a user meets them: stopped runs, damaged files, non-finite steps.

The stop-and-resume cases run benchmarks/fault_injection.py's trials (two of its twenty-plus).
They also hold "same seed, same run": the steps a stopped run trains before it is stopped are a
fresh run of the reference's config, and their losses, learning rates, gradient norms and
recorded micro-batches must equal the reference's exactly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("fault_injection", ROOT / "benchmarks" / "fault_injection.py")
fi = sys.modules.setdefault("fault_injection", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fi)

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (a checkpoint every step, the last two kept): what every stopped
    and resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("checkpoint") / "reference"
    fi.reference(run_dir, STEPS)
    return run_dir


def test_stopped_runs_resume_exactly_as_if_uninterrupted(reference, tmp_path):
    rng = random.Random(0)
    # SIGTERM with train.save_on_signal: the ranks agree on a step, commit it and exit 0.
    term = fi.trial(tmp_path / "term", reference, steps=STEPS, how="TERM", save_s=0.0, run_s=0.0, rng=rng)
    assert not term.diffs, term.diffs
    assert term.notes[0].startswith("stopped on SIGTERM after step"), term.notes
    assert 0 < term.resumed_from < STEPS
    # SIGKILL to every rank just after a save began: resume skips the unfinished folder with a
    # warning and continues from the commit before it; metrics and sample records carry no
    # step twice; keep_last=2 pruned all but the last two and the one resumed from.
    kill = fi.trial(tmp_path / "kill", reference, steps=STEPS, how="KILL-save", save_s=0.0, run_s=0.0, rng=rng)
    assert kill.in_save
    assert not kill.diffs, kill.diffs


def _copy_checkpoint(reference, dest, step: int):
    shutil.copytree(reference / "checkpoints" / f"step{step}", dest / "checkpoints" / f"step{step}")
    return dest / "checkpoints" / f"step{step}"


def _one_error_line(out: str) -> str:
    # Every rank prints the same line (the launcher passes all ranks' output through, so a
    # line may start after rank 0's progress bar).
    lines = {l[l.index("mmpipe train: error:"):] for l in out.splitlines() if "mmpipe train: error:" in l}
    assert len(lines) == 1, lines
    assert "Traceback" not in out
    return lines.pop()


def test_damaged_checkpoint_is_refused_naming_every_damaged_file(reference, run_mmpipe, tmp_path):
    folder = _copy_checkpoint(reference, tmp_path / "old", 5)
    unfinished = folder.parent / "step6"
    shutil.copytree(folder, unfinished)
    (unfinished / "committed.json").unlink()
    model_states = folder / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[: model_states.stat().st_size // 2])
    layer = folder / "layer_03-model_states.pt"
    layer.write_bytes(bytes(layer.stat().st_size))
    position = folder / "data_state_dp0.json"
    position.write_text(position.read_text()[:40])
    tensor = folder / "layer_09-model_states.pt"  # 4 KB of noise inside a weight matrix: loads fine
    data = bytearray(tensor.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = random.Random(0).randbytes(4096)
    tensor.write_bytes(bytes(data))

    run = run_mmpipe("train", f"train.steps={STEPS}", f"train.resume={folder.parent.parent}")
    assert run.code == 2
    assert f"warning: skipping {unfinished}: not committed (its save did not finish)" in run.out
    line = _one_error_line(run.out)
    assert line.startswith(f"mmpipe train: error: checkpoint {folder} is damaged: ")
    for named in ("data_state_dp0.json has 40 bytes", "layer_03-model_states.pt does not match its recorded sha256",
                  "layer_09-model_states.pt does not match its recorded sha256",
                  f"mp_rank_00_model_states.pt has {model_states.stat().st_size} bytes"):
        assert named in line, named
    assert not (run.run_dir / "metrics.jsonl").exists()


class _RunsCode:
    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_checkpoint_that_would_run_code_is_refused(reference, run_mmpipe, tmp_path):
    """Someone else's checkpoint, with a commit record that matches its files."""
    folder = _copy_checkpoint(reference, tmp_path / "theirs", 5)
    flag = tmp_path / "code-ran"
    layer = folder / "layer_03-model_states.pt"
    state = torch.load(layer, weights_only=True)
    torch.save({**state, "extra": _RunsCode(flag)}, layer)
    record = json.loads((folder / "committed.json").read_text())
    record["files"][layer.name] = {"size": layer.stat().st_size,
                                   "sha256": hashlib.sha256(layer.read_bytes()).hexdigest()}
    (folder / "committed.json").write_text(json.dumps(record))

    run = run_mmpipe("train", f"train.steps={STEPS}", f"train.resume={folder}")
    assert run.code == 2
    line = _one_error_line(run.out)
    assert f"{layer} holds a Python object (posix.system)" in line
    assert "set train.resume_unsafe=true" in line
    assert not flag.exists()


def test_nonfinite_loss_stops_before_the_next_save(run_mmpipe):
    # An absurd peak rate makes step 1's update overflow the next forward: step 2 is NaN.
    run = run_mmpipe("train", "train.steps=4", "train.save_every=1", "train.lr=1e30")
    assert run.code == 2
    line = _one_error_line(run.out)
    assert ("error: step 2: loss nan, gradient norm nan: stopped without saving (train.on_nonfinite=stop); "
            f"the newest checkpoint is {run.run_dir / 'checkpoints' / 'step1'}; lower train.lr") in line
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == ["latest", "step1"]
    assert (run.run_dir / "checkpoints" / "step1" / "committed.json").is_file()


def test_nonfinite_skip_withholds_the_whole_update(run_mmpipe):
    run = run_mmpipe("train", "train.steps=3", "train.save_every=1", "train.lr=1e30", "train.on_nonfinite=skip")
    assert run.code == 0, run.out[-3000:]
    assert [r["nonfinite"] for r in run.metrics()] == [False, True, True]
    assert "warning: step 2: loss nan, gradient norm nan: update skipped (train.on_nonfinite=skip)" in run.out
    assert "| 2 updates skipped (non-finite)" in run.out
    # Skipped means untouched: the weights and the optimizer's moments and step counts of
    # step 3 are those of step 1 (zeroed gradients would still move AdamW by its momentum).
    ckpt = run.run_dir / "checkpoints"
    for one in sorted((ckpt / "step1").glob("*model_states.pt")):
        a = torch.load(one, weights_only=True)
        b = torch.load(ckpt / "step3" / one.name, weights_only=True)
        if one.name.startswith("mp_rank"):
            a, b = a["optimizer"]["state"], b["optimizer"]["state"]
        a, b = dict(fi.tensors(a)), dict(fi.tensors(b))
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), one.name
