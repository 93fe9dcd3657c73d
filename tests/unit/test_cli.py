"""mmpipe behaves as a Hydra app: help, --cfg, the override grammar, sweeps, config dirs, and
outputs in the run directory; mistakes are one line with a fix that pastes into a shell."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

import mmpipe.runtime.launch
from mmpipe.cli import load, main
from mmpipe.paths import CONF_DIR
from mmpipe.report import find_runs


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty directory; fail if anything would launch training processes."""
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was launched")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mmpipe.runtime.launch, "launch", no_launch)
    return tmp_path


def test_cfg_job_prints_the_composed_config_and_starts_nothing(in_tmp, capsys):
    assert main(["train", "--cfg", "job", "train.steps=7", "model.llm.blocks=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7 and cfg["model"]["llm"]["blocks"] == 3
    assert cfg["train"]["save_final"] is False  # defaults come from the dataclasses
    assert {"parallel", "data", "plan", "launcher", "hardware", "report"} <= set(cfg)
    assert list(in_tmp.iterdir()) == []  # no run directory, no outputs/


def test_cfg_hydra_and_info_work_as_in_any_hydra_app(in_tmp, capsys):
    assert main(["train", "--cfg", "hydra", "--package", "hydra.job"]) == 0
    assert "chdir: false" in capsys.readouterr().out
    assert main(["plan", "--info", "defaults"]) == 0
    out = capsys.readouterr().out
    assert "model/tiny" in out and "schema" in out
    assert list(in_tmp.iterdir()) == []


def test_help_lists_commands_and_config_groups(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "plan", "simulate", "profile", "bench", "shards", "bench-data", "report", "export"):
        assert f"\n  {command} " in out
    assert ("model: compose, gemma3-12b, hf, internvl3-8b, llava-1.5-7b, llava-next-mistral-7b, "
            "llava-onevision-qwen2-7b, omni-7b, qwen2-audio-7b, qwen2-vl-7b, qwen2.5-omni-7b, qwen2.5-vl-7b, "
            "qwen3-vl-8b, tiny") in out
    assert ("recipes: llava-lora, llava-next-lora, llava-next-sft, llava-stage1, llava-stage2, onevision-lora, "
            "onevision-sft, plan-qwen2-vl-h100, plan-qwen2.5-omni-h100, qwen2-audio-lora, qwen2-vl-lora, qwen2-vl-sft, "
            "qwen2.5-omni-lora, qwen2.5-omni-sft, qwen2.5-vl-lora, qwen2.5-vl-sft, qwen3-vl-lora, qwen3-vl-sft, "
            "tiny-pp2-dp2, tiny-pp4") in out


def test_command_help_is_specific_and_shows_the_values_it_would_run_with(capsys):
    assert main(["shards", "--help", "shards.maxcount=50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mmpipe shards: convert a LLaVA-style JSON")
    assert "mmpipe shards shards.json=llava.json shards.out=data/llava" in out
    assert "shards.maxcount: 50" in out and "Samples per shard at most." in out
    assert "train.lr" not in out and "parallel.pp" not in out
    assert main(["train", "--help", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "train.steps: 7" in out and "Optimizer steps." in out
    assert "data: curriculum, mixture, shards, synthetic, trace" in out


def test_help_of_a_hugging_face_group_lists_its_folders(capsys):
    """`model.path` is mandatory (`???`), which a DictConfig's `in` hides: it is listed all the same."""
    assert main(["train", "model=hf", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  model.path: ???" in out and "model=hf: a local checkpoint folder written by save_pretrained" in out
    assert main(["train", "model=compose", "model.vision.path=/m/clip", "--help"]) == 0
    out = capsys.readouterr().out
    for line in ("  model.llm.path: ???", "  model.vision.path: /m/clip", "  model.audio.path: null",
                 "  model.projector.path: null"):
        assert line in out, line
    assert "model=compose: a Llama / Mistral / Qwen2 causal LM folder" in out


def test_override_grammar_adds_removes_and_force_sets():
    rc = load(["+model.vision.cls_token=true", "~model.audio", "++train.steps=3"])
    assert rc.model.vision.cls_token is True
    assert rc.model.audio is None
    assert rc.train.steps == 3


@pytest.mark.parametrize("args, message", [
    (["~train.resume"], "~train.resume: train.resume is null already; nothing to remove"),
    (["~train.loggers"], "~train.loggers: a typed setting cannot be removed; set it instead"),
    (["+train.seed=3"], "+train.seed=3: train.seed is set already; drop the + (or write ++ to add or set)"),
    (["+train.stpes=3"], "train.stpes=3: no such config key; did you mean train.steps?"),
    (["train.trainable=llm"], "train.trainable='llm' must be a list such as [a,b]"),
    # an element of the wrong type is reported on the list as typed
    (["plan.recompute=[maybe,false]"], "plan.recompute='[maybe,false]' must be a list such as [true,false] or null"),
    (["train.lr=1e-3,3e-3"], "train.lr=1e-3,3e-3 gives several values: add -m to run one job per value"),
    (["data.path=data/llava/train-{000000..000041}.tar"],
     "to pass the value as a string, quote it for Hydra and the shell: "
     "mmpipe train \"data.path='data/llava/train-{000000..000041}.tar'\""),
])
def test_grammar_mistakes_are_one_line_with_the_fix(args, message, in_tmp, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(in_tmp.iterdir()) == []


def test_a_key_given_twice_is_an_error_naming_both_and_the_quoting_that_works(in_tmp, capsys):
    # What bash makes of the unquoted brace list data.path=d/train-{000000..000002}.tar
    words = shlex.split("mmpipe train data.path=d/train-000000.tar data.path=d/train-000001.tar "
                        "data.path=d/train-000002.tar")
    assert main(words[1:]) == 2
    err = capsys.readouterr().err
    assert "data.path is given 3 times (data.path=d/train-000000.tar, data.path=d/train-000001.tar" in err
    fix = err.split("whole: ")[1].strip()
    assert shlex.split(fix)[2] == "data.path='d/train-{000000..000002}.tar'"  # what Hydra then receives
    assert main(["train", "train.steps=3", "train.steps=4"]) == 2
    assert "train.steps is given 2 times (train.steps=3, train.steps=4)" in capsys.readouterr().err


def test_a_user_config_dir_adds_options_and_wins_over_the_shipped_ones(in_tmp, capsys):
    (in_tmp / "mine" / "hardware").mkdir(parents=True)
    shipped = yaml.safe_load((CONF_DIR / "hardware/cpu.yaml").read_text())
    (in_tmp / "mine" / "hardware" / "cpu.yaml").write_text(yaml.safe_dump(dict(shipped, memory_gb=7.0)))
    (in_tmp / "mine" / "hardware" / "box.yaml").write_text(yaml.safe_dump(dict(shipped, name="box")))
    assert main(["train", "--config-dir", "mine", "hardware=cpu", "--cfg", "job", "--package", "hardware"]) == 0
    assert yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])["memory_gb"] == 7.0
    # hardware=auto (the default) on this GPU-less machine takes the cpu preset from the user's folder too
    assert load(["hydra.searchpath=[file://mine]"]).hardware["memory_gb"] == 7.0
    assert main(["train", "--config-dir=mine", "hardware=box", "--cfg", "job", "--package", "hardware"]) == 0
    assert "name: box" in capsys.readouterr().out


def test_every_job_of_a_sweep_is_checked_before_any_directory_is_made(in_tmp, capsys):
    assert main(["train", "-m", "parallel.pp=2,40", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "error: job parallel.pp=40 train.steps=1: parallel.pp=40 exceeds the 15 layers of model tiny" in err
    assert list(in_tmp.iterdir()) == []


def test_plan_outputs_land_in_the_run_dir_with_hydra_files(in_tmp, capsys):
    trace = in_tmp / "trace.jsonl"
    trace.write_text('{"text_tokens": 40, "images": [[224, 224]]}\n{"text_tokens": 90}\n' * 4)
    run = in_tmp / "run"
    assert main(["plan", "data=trace", f"data.path={trace}", "train.global_batch=4", "train.micro_batches=2",
                 "plan.out=plan.json", f"hydra.run.dir={run}"]) == 0
    assert f"plan written to {run / 'plan.json'}" in capsys.readouterr().out
    assert json.loads((run / "plan.json").read_text())
    assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())[-1] == "plan.out=plan.json"
    assert {p.name for p in (run / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert sorted(p.name for p in in_tmp.iterdir()) == ["run", "trace.jsonl"]  # nothing in the cwd


def _fake_run(path: Path, policy: str, slow: float, *, evaluated: bool = False) -> None:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"plan.policy={policy}", "train.steps=3"]))
    rows = [{"step": s, "loss": 7.0 - s, "samples_per_s": 60.0 / slow, "samples": 12, "tokens": 1200,
             "step_time": 0.2 * slow, "bubble": 0.2 * slow, "engine_time": 0.2 * slow,
             "predicted_step_time": 0.19 * slow, "prediction_error": 0.05, "stage_busy_s": [0.1, 0.1],
             "bound_fraction": 0.5 / slow, "mfu": 0.1 / slow,
             **({"eval_loss": 6.5 - s / 4} if evaluated and s > 1 else {})}
            for s in (1, 2, 3)]
    if policy == "ds-default":  # this run re-cut after step 2 and measured the gain at step 3
        rows[1]["recut"] = {"recut": True, "old": [[0, 1], [1, 15]], "new": [[0, 12], [12, 15]],
                            "predicted_gain": 0.07, "current_fits": True}
        rows[2]["recut_measured"] = {"after_step": 2, "gain": 0.05}
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_draws_several_runs_into_one_png(in_tmp, capsys, monkeypatch):
    import matplotlib.axes

    drawn, plot = {}, matplotlib.axes.Axes.plot

    def record(ax, x, y, *args, **kwargs):
        drawn[kwargs.get("label")] = (list(x), list(y))
        return plot(ax, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    _fake_run(in_tmp / "sweep" / "0", "data-aware", 1.0, evaluated=True)
    _fake_run(in_tmp / "sweep" / "1", "ds-default", 2.0)
    assert main(["report", "sweep/0", "sweep/1", "hydra.run.dir=out"]) == 0
    out = capsys.readouterr().out
    png = in_tmp / "out" / "report.png"
    assert f"mmpipe report: wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert ("plan.policy=data-aware: 3 steps, loss 6.000 -> 4.000, eval_loss 6.000 -> 5.750 (2 evaluations), "
            "60.0 samples/s, 0.200 s a step, bubble 20.0%, |prediction error| 5.0%, 50.0% of the lower bound, "
            "MFU 10.00% (encoders counted)") in out
    assert "plan.policy=ds-default: 3 steps, loss 6.000 -> 4.000, 30.0 samples/s, 0.400 s a step, bubble 40.0%" in out
    assert ("fastest first (each over the same 1 step of every run (step 3); the first 2 steps of each launch not "
            "timed): plan.policy=data-aware 60.0 samples/s, plan.policy=ds-default 30.0 samples/s") in out
    assert "re-cut after step 2: [[0, 1], [1, 15]] -> [[0, 12], [12, 15]], predicted +7.0% faster, measured " \
           "+5.0%" in out
    # the held-out loss is drawn where the run evaluated; a run that did not has no such line
    assert drawn["plan.policy=data-aware eval_loss"] == ([2, 3], [6.0, 5.75])
    assert drawn["plan.policy=ds-default of bound"] == ([1, 2, 3], [25.0, 25.0, 25.0])
    assert "plan.policy=ds-default eval_loss" not in drawn
    assert find_runs(["sweep"]) == [Path("sweep/0"), Path("sweep/1")]  # a sweep directory stands for its runs
    assert main(["report", "nowhere", "hydra.run.dir=out2"]) == 2
    assert "report.runs: nowhere is not a directory" in capsys.readouterr().err
    assert not (in_tmp / "out2").exists()  # checked before the run directory is made


def test_train_with_auto_layout_launches_the_planners_choice(in_tmp, capsys, monkeypatch):
    """`mmpipe train parallel.devices=N parallel.pp=auto parallel.dp=auto`: the layout is chosen
    from the data before launch, and the launcher gets the chosen pp x dp (not N guessed)."""
    launched = {}

    def fake_launch(argv, *, nproc, **_):
        launched["nproc"] = nproc
        launched["run"] = yaml.safe_load(Path(argv[-1]).read_text())
        return 0

    monkeypatch.setattr(mmpipe.runtime.launch, "launch", fake_launch)
    assert main(["train", "parallel.devices=2", "parallel.pp=auto", "parallel.dp=auto",
                 "hydra.run.dir=run"]) == 0
    out = capsys.readouterr().out
    p = launched["run"]["parallel"]
    assert launched["nproc"] == p["pp"] * p["dp"] == 2
    assert f"the planner chose pp={p['pp']} x dp={p['dp']} (parallel.pp / parallel.dp were auto)" in out
    assert f"launching 2 processes (pp={p['pp']} x dp={p['dp']})" in out


def test_auto_layout_with_a_mixture_is_a_one_line_error(in_tmp, capsys):
    assert main(["train", "data=mixture", "parallel.devices=2", "parallel.pp=auto", "parallel.dp=auto",
                 "hydra.run.dir=run"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp / parallel.dp = auto plans on data.path's first steps; with a mixture (data.sources)" in err
    assert not Path("run").exists()


def test_more_ranks_than_cores_is_a_one_line_warning():
    """Issue 34: parallel.pp=5 on 2 cores started 5 processes without a word."""
    from mmpipe.commands import oversubscribed

    assert oversubscribed(2, 2) is None
    assert oversubscribed(5, 2) == ("warning: 5 ranks share 2 CPU cores; every step will be slow (each rank waits "
                                    "for a core); fewer ranks (parallel.pp x parallel.dp) train faster here")
