"""Per-step metrics reach every logger asked for, with the same figures; a missing one is caught before launch."""

from __future__ import annotations

import importlib.util
import json

import pytest

import mmpipe.runtime.launch
from mmpipe.cli import main
from mmpipe.runtime.metrics import MetricsWriter, ProgressBar

RECORDS = [{"step": s, "loss": 7.5 - s, "samples_per_s": 30.0 + s, "bubble": 0.25, "stage_busy_s": [0.1 * s, 0.2],
            "prediction_error": None, "micro_batches": 4, **({"eval_loss": 6.25} if s == 2 else {})} for s in (1, 2, 3)]


def test_tensorboard_event_files_hold_the_figures_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path / "metrics.jsonl", loggers=("jsonl", "tensorboard"))
    for r in RECORDS:
        writer.write(r)
    writer.close()
    assert [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 6.5), (2, 5.5), (3, 4.5)]
    assert [e.value for e in events.Scalars("samples_per_s")] == [31.0, 32.0, 33.0]
    assert [e.value for e in events.Scalars("stage_busy_s/0")] == pytest.approx([0.1, 0.2, 0.3])
    assert "prediction_error" not in events.Tags()["scalars"]  # null is not a figure
    assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(2, 6.25)]  # where the run evaluated


def test_the_progress_bar_shows_the_latest_held_out_loss(capsys):
    bar = ProgressBar(2)
    bar.update(loss=7.5, samples_per_s=30.0, tokens_per_s=900.0)
    bar.update(loss=6.5, samples_per_s=31.0, tokens_per_s=910.0, eval_loss=6.25)
    bar.close()
    assert "loss=6.500, eval_loss=6.250, samples_s=31.0, tokens_s=910" in capsys.readouterr().err


def test_a_logger_whose_package_is_missing_stops_before_launch(tmp_path, monkeypatch, capsys):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was launched")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setattr(mmpipe.runtime.launch, "launch", no_launch)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "train.loggers=[jsonl,tensorboard]"]) == 2
    assert ("train.loggers asks for tensorboard, but the tensorboard package is not installed; "
            "pip install 'mmpipe[tensorboard]', or drop tensorboard from train.loggers") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory was made
    assert main(["train", "train.loggers=[jsonl,tensorbord]"]) == 2
    assert "train.loggers entry 'tensorbord' is unknown; use jsonl, tensorboard, wandb" in capsys.readouterr().err
