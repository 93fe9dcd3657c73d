"""Validation's keys, cadence and held-out set, and `mmpipe eval`'s arguments, checked without
launching a process (tests/distributed/test_eval.py runs them for real)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import mmpipe.runtime.launch
from mmpipe.cli import load, main
from mmpipe.config import eval_interval
from mmpipe.runtime.evaluate import eval_config, eval_due
from mmpipe.runtime.preflight import write_run_config

HELD_OUT = "data/shards/train-000007.tar"


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was launched")

    monkeypatch.setattr(mmpipe.runtime.launch, "launch", refuse)


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_every=5"], "train.eval_every=5 needs held-out data: set data.eval_path=SHARDS (a shard brace list, "
                             "like data.path), or train.eval_every=0"),
    ([f"data.eval_path={HELD_OUT}", "parallel.dp=2", "train.eval_samples=1"],
     "train.eval_samples=1 is fewer than the parallel.dp=2 replicas, which each score a share; use "
     "train.eval_samples=2 or more"),
    (["train.eval_every=-1"], "train.eval_every=-1 must be a non-negative integer (0: never) or null"),
    (["train.eval_samples=0"], "train.eval_samples=0 must be a positive integer"),
    (["data.eval_path=''"], "data.eval_path='' names no shards"),
    (["model.llm.attention_dropout=1.5"], "model.llm.attention_dropout=1.5 must be in [0, 1)"),
])
def test_eval_keys_are_checked_before_launch(overrides, message, tmp_path, capsys, no_launch):
    assert main(["train", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_held_out_set_smaller_than_eval_samples_is_refused_before_launch(tmp_path, capsys, no_launch):
    assert main(["train", f"data.eval_path={HELD_OUT}", "train.eval_samples=251",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert ("mmpipe train: error: train.eval_samples=251: data.eval_path=data/shards/train-000007.tar holds 250 "
            "usable samples; lower train.eval_samples to 250 or add held-out shards") in capsys.readouterr().err
    assert main(["train", "data.eval_path=data/shards/valid-{000000..000001}.tar", "train.eval_every=2",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert "data.eval_path=" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_how_often_a_run_evaluates():
    assert eval_interval(load([], job="test")) == 0  # no held-out data: never
    assert eval_interval(load([f"data.eval_path={HELD_OUT}"], job="test")) == 6  # ten times over the 60 steps
    assert eval_interval(load([f"data.eval_path={HELD_OUT}", "train.steps=5"], job="test")) == 1
    assert eval_interval(load([f"data.eval_path={HELD_OUT}", "train.steps=25"], job="test")) == 3
    assert eval_interval(load([f"data.eval_path={HELD_OUT}", "train.eval_every=0"], job="test")) == 0
    assert eval_interval(load([f"data.eval_path={HELD_OUT}", "train.eval_every=7"], job="test")) == 7
    # counted from the run's first step, so a resumed run evaluates where an uninterrupted one does;
    # and always after the last step
    assert [s for s in range(4, 11) if eval_due(s, every=3, steps=10)] == [6, 9, 10]
    assert [s for s in range(1, 11) if eval_due(s, every=0, steps=10)] == []


def test_the_held_out_set_is_read_once_in_stream_order_and_planned_as_one_step():
    rc = load([f"data.eval_path={HELD_OUT}", "train.eval_samples=40", "parallel.dp=2", "train.global_batch=16",
               "train.micro_batches=4", "data=mixture", "data.num_workers=2", "data.epochs=3"], job="test")
    ev = eval_config(rc)
    d = ev.data
    assert (d.path, d.sources, d.shuffle_buffer, d.epochs, d.num_workers) == (HELD_OUT, None, 0, 1, 1)
    assert ev.plan.across_replicas  # every replica reads the whole set and scores its planned share
    # all 40 samples in one step, in micro-batches of a training step's size (2 samples): 10 per replica
    assert (ev.train.global_batch, ev.train.micro_batches) == (40, 10)
    assert (ev.train.steps, ev.model, ev.parallel, ev.run_dir) == (rc.train.steps, rc.model, rc.parallel, rc.run_dir)


def _finished_run(tmp_path: Path, *, steps=(2, 4), overrides=()) -> Path:
    """A run directory as `mmpipe train` leaves it (run.yaml, committed checkpoints' records)."""
    run = tmp_path / "run"
    rc = load(["parallel.dp=2", *overrides, f"hydra.run.dir={run}"], job="test")
    from dataclasses import replace

    write_run_config(replace(rc, run_dir=str(run)))
    for step in steps:
        folder = run / "checkpoints" / f"step{step}"
        folder.mkdir(parents=True)
        (folder / "committed.json").write_text(json.dumps({
            "format": 1, "step": step, "files": {},
            "topology": {"pp": 2, "dp": 2, "stages": [[0, 11], [11, 15]], "precision": "fp32", "zero": 0}}))
    (run / "checkpoints" / "step5").mkdir()  # a save that did not finish
    return run


def test_mmpipe_eval_scores_the_named_committed_checkpoint_in_a_job_folder_of_its_own(tmp_path, capsys, monkeypatch):
    run = _finished_run(tmp_path, overrides=[f"data.eval_path={HELD_OUT}", "train.eval_samples=24"])
    before = sorted(p for p in run.rglob("*"))
    launched = {}

    def fake_launch(argv, *, nproc, log_dir, name, **_):
        job = Path(argv[-2]).parent
        launched.update(nproc=nproc, checkpoint=argv[-1], name=name, job=job,
                        config=yaml.safe_load(Path(argv[-2]).read_text()), logs=log_dir)
        (job / "eval.json").write_text(json.dumps({"step": 2, "eval_loss": 5.25, "eval_samples": 24,
                                                   "eval_tokens": 2000, "eval_label_tokens": 600,
                                                   "eval_micro_batches": 3, "eval_s": 0.5}))
        return 0

    monkeypatch.setattr(mmpipe.runtime.launch, "launch", fake_launch)
    out = tmp_path / "figures.json"
    assert main(["eval", str(run), "checkpoint=step2", f"out={out}"]) == 0
    said = capsys.readouterr().out
    assert launched["nproc"] == 4 and launched["name"] == "mmpipe eval"
    assert launched["checkpoint"] == str(run / "checkpoints" / "step2")
    config = launched["config"]
    # the checkpoint's stages, the run's held-out set and size; every replica reads all of it
    assert config["plan"]["stages"] == [["vision.embed", "llm.block.1"], ["llm.block.2", "llm.head"]]
    assert config["data"]["eval_path"] == config["data"]["path"] == HELD_OUT
    assert config["train"]["eval_samples"] == 24 and config["plan"]["across_replicas"]
    assert not launched["job"].exists()  # the job's folder is gone, and nothing was written into the run's
    assert sorted(p for p in run.rglob("*")) == before
    assert (f"mmpipe eval: checkpoint {run / 'checkpoints' / 'step2'} (step 2): eval_loss 5.250000 over 24 samples "
            f"of {HELD_OUT} (2000 LLM tokens, 600 label tokens), in 0.5 s") in said
    assert json.loads(out.read_text())["eval_loss"] == 5.25
    # the newest committed checkpoint by default; other shards and sizes as given
    assert main(["eval", str(run), "data.path=data/shards/train-000006.tar", "train.eval_samples=8"]) == 0
    assert launched["checkpoint"] == str(run / "checkpoints" / "step4")
    assert (launched["config"]["data"]["eval_path"], launched["config"]["train"]["eval_samples"]) == (
        "data/shards/train-000006.tar", 8)


def test_mmpipe_eval_mistakes_are_one_line_before_launch(tmp_path, capsys, no_launch):
    run = _finished_run(tmp_path)

    def error(*args: str) -> str:
        assert main(["eval", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mmpipe eval: error: ") and err.count("\n") == 1, err
        return err

    assert "is not a run directory (no run.yaml)" in error(str(tmp_path))
    assert "give data.path=SHARDS, the held-out shards to score" in error(str(run))
    assert (f"checkpoint=step5: {run / 'checkpoints' / 'step5'} is not a committed checkpoint of {run} (committed: "
            f"step2, step4)") in error(str(run), "checkpoint=step5", f"data.path={HELD_OUT}")
    assert "steps=3: not an eval argument" in error(str(run), "steps=3")
    assert "train.eval_samples=0 must be a positive integer" in error(str(run), f"data.path={HELD_OUT}",
                                                                     "train.eval_samples=0")
    assert "train.eval_samples=251: data.eval_path=data/shards/train-000007.tar holds 250 usable samples" in error(
        str(run), f"data.path={HELD_OUT}", "train.eval_samples=251")
    assert "give one run directory" in error()
    (run / "checkpoints" / "step4" / "committed.json").write_text("{")
    assert f"the commit record {run / 'checkpoints' / 'step4' / 'committed.json'} is unreadable" in error(
        str(run), f"data.path={HELD_OUT}")


def test_help_lists_the_validation_keys_and_the_eval_command(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for key in ("data.eval_path: null", "train.eval_every: null", "train.eval_samples: 64"):
        assert key in text, key
    assert "Held-out shards" in text and "ten times over the run" in text
    assert main(["--help"]) == 0
    assert "  eval " in capsys.readouterr().out
    assert main(["eval", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: mmpipe eval RUN_DIR [checkpoint=stepN]")
