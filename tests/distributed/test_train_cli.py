"""`mmpipe train` as a user runs it: real processes, DeepSpeed pipeline, shipped shards."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from mmpipe.cli import load
from mmpipe.config import hardware_spec
from mmpipe.model.spec import layer_names
from mmpipe.planner.api import calibrated_hardware

pytestmark = pytest.mark.distributed


def test_default_run_learns_and_reports(run_mmpipe):
    run = run_mmpipe("train")  # the README's main job: defaults, 60 steps, pp=2
    assert run.code == 0, run.out[-3000:]
    m = run.metrics()
    assert [r["step"] for r in m] == list(range(1, 61))
    for key in ("step", "loss", "samples_per_s", "tokens_per_s", "step_time"):
        assert all(key in r for r in m)
    first = sum(r["loss"] for r in m[:5]) / 5
    last = sum(r["loss"] for r in m[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert re.search(r"done: 60 steps in [\d.]+s \| loss [\d.]+ -> [\d.]+", run.out)
    assert "skipped 0 samples" in run.out
    assert "tokens per step:" in run.out
    # The default run states its checkpoint policy at start and writes none (train.save_final=false).
    assert "checkpoints: none (train.save_final=true keeps the last step" in run.out
    assert "| no checkpoint" in run.out and not (run.run_dir / "checkpoints").exists()
    assert (run.run_dir / ".hydra" / "config.yaml").is_file() and (run.run_dir / "run.yaml").is_file()
    # Telemetry: every stage measured busy, a bubble share, and a prediction that was re-fitted.
    for r in m:
        assert len(r["stage_busy_s"]) == 2 and all(b > 0 for b in r["stage_busy_s"])
        assert 0.0 <= r["bubble"] < 1.0
        assert r["plan_s"] >= 0 and r["feed_s"] > 0 and r["overhead_s"] >= 0
    _check_refit(m)
    # What the re-fit learned is written for the next run: the cpu preset with the last fit's constants.
    conf = run.run_dir / "conf"
    path = conf / "hardware" / "calibrated-cpu.yaml"
    assert f"calibrated hardware: {path} (a=" in run.out
    assert yaml.safe_load(path.read_text())["measured_for"] == "tiny"
    want = calibrated_hardware(hardware_spec(load([], job="test")), m[-1]["calibration"])
    got = hardware_spec(load([f"hydra.searchpath=[file://{conf}]", "hardware=calibrated-cpu"], job="test"))
    assert got.name == "calibrated-cpu"
    for key in ("micro_batch_overhead_s", "step_overhead_s", "peak_flops", "op_overhead_s"):
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-12), key


def _check_refit(m: list[dict]) -> None:
    """Every logged prediction is the re-fit of the steps before it (out of sample), replayed
    here from the logged figures alone (no timing bound: the figures are whatever this machine
    measured): the hardware config's own prediction for the warm-up steps, then the bounded,
    robust fit of measured = a * compute + b * micro_batches + c over the steps before it, with
    compute the simulated step time less the config's fixed costs; every fitted fixed cost is a
    cost (b, c >= 0), and prediction_error = measured / predicted - 1."""
    from mmpipe.planner.api import StepCalibration

    hw = hardware_spec(load([], job="test"))  # the default run's hardware=cpu
    cal = StepCalibration.for_hardware(hw)
    for r in m:
        compute = r["simulated_step_time"] - hw.micro_batch_overhead_s * r["micro_batches"] - hw.step_overhead_s
        want = cal.predict(compute, r["micro_batches"])
        assert r["predicted_step_time"] == pytest.approx(want, rel=1e-9), \
            f"step {r['step']}: predicted {r['predicted_step_time']}, the fit of the steps before it gives {want}"
        assert r["prediction_error"] == pytest.approx(r["engine_time"] / want - 1.0, rel=1e-9, abs=1e-12), r["step"]
        cal.observe(compute, r["micro_batches"], r["engine_time"])
        assert r["calibration"] == pytest.approx(list(cal.coef), rel=1e-9), r["step"]
        a, b, c = r["calibration"]
        assert a > 0 and b >= 0 and c >= 0, r["calibration"]  # a physical fit
    assert cal.fitted and len({tuple(r["calibration"]) for r in m[cal.min_steps:]}) > 1  # the fit moves with the steps


def test_config_error_launches_nothing(run_mmpipe):
    run = run_mmpipe("train", "parallel.dp=2", "launcher.nproc=2")
    assert run.code == 2
    assert "launcher.nproc=2 does not equal parallel.pp * parallel.dp = 2 * 2 = 4" in run.out
    assert not run.run_dir.exists()


def test_mixture_reports_what_it_drew(run_mmpipe):
    # with train.trace (the run is short and already launched): every rank's timeline of the run
    run = run_mmpipe("train", "data=mixture", "train.steps=5", "train.trace=true")
    assert run.code == 0, run.out[-3000:]
    line = next(l for l in run.out.splitlines() if l.startswith("mixture realised:"))
    counts = dict(re.findall(r"(synth-[ab]) (\d+)", line))
    assert int(counts["synth-a"]) + int(counts["synth-b"]) == 5 * 16
    assert int(counts["synth-a"]) > 2 * int(counts["synth-b"])  # weights 3:1
    metrics = [json.loads(l) for l in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    for rank, (passes, sends) in enumerate([("ForwardPass", "SendActivation"), ("BackwardPass", "SendGrad")]):
        events = json.loads((run.run_dir / f"trace_rank{rank}.json").read_text())  # closed at the run's end
        assert events[0]["args"]["name"] == f"rank {rank} (stage {rank})"
        steps = [e for e in events if e.get("tid") == 1]
        assert [e["args"]["step"] for e in steps] == [1, 2, 3, 4, 5]
        for k, (step, m) in enumerate(zip(steps, metrics)):  # each step's passes, one per micro-batch
            ran = [e for e in events if e.get("tid") == 0 and e["args"]["step"] == k + 1]
            assert sum(e["name"] == passes for e in ran) == m["micro_batches"], (rank, k)
            assert sum(e["name"] == sends for e in ran) == m["micro_batches"], (rank, k)
            assert all(step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1 for e in ran)


def test_a_sweep_runs_one_job_per_policy_each_in_its_own_directory(run_mmpipe):
    run = run_mmpipe("train", "-m", "plan.policy=data-aware,ds-default", "train.steps=2", name="sweep")
    sweep = run.run_dir  # the helper's hydra.run.dir is ignored by a sweep; hydra.sweep.dir is set too
    assert run.code == 0, run.out[-3000:]
    assert "mmpipe train: 2 jobs, one after another" in run.out
    for job, policy in (("0", "data-aware"), ("1", "ds-default")):
        d = sweep / job
        assert [json.loads(l)["step"] for l in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
        assert overrides == [f"plan.policy={policy}", "train.steps=2"]
        assert yaml.safe_load((d / "run.yaml").read_text())["plan"]["policy"] == policy
        assert {p.name for p in (d / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert "stages from planner (data-aware)" in run.out and "stages from planner (ds-default)" in run.out


def test_bench_compares_policies_on_the_same_data(run_mmpipe):
    run = run_mmpipe("bench", "bench.policies=[data-aware,ds-default]", "bench.rounds=1", "bench.steps=4")
    assert run.code == 0, run.out[-3000:]
    table = {l.split()[0]: l.split() for l in run.out.splitlines() if l.startswith(("data-aware ", "ds-default "))}
    assert set(table) == {"data-aware", "ds-default"}
    assert table["data-aware"][-1] == "1.00x"
    assert f"mmpipe bench: figures in {run.run_dir / 'bench.json'}" in run.out
    figures = json.loads((run.run_dir / "bench.json").read_text())
    assert [f["policy"] for f in figures] == ["data-aware", "ds-default"]
    assert all(f["samples_per_s"] > 0 for f in figures)
    # Same data and steps: both policies trained on the same samples, so their first losses agree.
    a = [json.loads(l) for l in (run.run_dir / "round0-data-aware" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (run.run_dir / "round0-ds-default" / "metrics.jsonl").read_text().splitlines()]
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)


def test_stage_override_moves_layers_and_a_frozen_stage_trains_nothing(run_mmpipe):
    """The user's stages win, even over memory: under the cost model stage 1 does not fit in
    15 MB, and the run trains anyway with a warning naming the stage and the figures (every
    warning's text: tests/unit/runtime/test_stages.py)."""
    stages = "plan.stages=[[vision.embed,audio.proj],[llm.embed,llm.head]]"
    run = run_mmpipe("train", "train.steps=3", "train.trainable=[llm]", "train.save_final=true", stages,
                     "hardware.memory_gb=0.015")
    assert run.code == 0, run.out[-3000:]
    assert "stages from override" in run.out
    assert re.search(r"warning: plan\.stages: stage 1 \(llm\.embed\.\.llm\.head\) needs [\d.]+ GB for weights, "
                     r"gradients and optimizer states alone, more than the [\d.]+ GB usable", run.out), run.out[-2000:]
    from mmpipe.config import tokenizer_source
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.model.layers import build_layer

    rc = load(["train.trainable=[llm]"], job="test")
    names = layer_names(rc.model)
    split = names.index("llm.embed")
    held = {d["stage"]: d["layers"] for d in run.stage_files()}
    assert held == {0: names[:split], 1: names[split:]}
    # The printed table says the same as what each rank holds.
    assert re.search(r"0\s+vision\.embed \.\. audio\.proj\s+8\s", run.out)
    assert re.search(r"1\s+llm\.embed \.\. llm\.head\s+7\s", run.out)
    # The frozen stage's weights are its initial ones; the trainable stage's moved.
    tok = load_tokenizer(tokenizer_source(rc)[0])
    ckpt = run.run_dir / "checkpoints" / "step3"
    for i in (names.index("vision.block.0"), names.index("llm.block.0")):
        saved = torch.load(ckpt / f"layer_{i:02d}-model_states.pt", map_location="cpu", weights_only=True)
        init = build_layer(rc.model, names[i], seed=0, image_token=tok.image_id, audio_token=tok.audio_id).state_dict()
        same = all(torch.equal(saved[k], v) for k, v in init.items())
        assert same == names[i].startswith("vision"), names[i]


def test_external_launcher_with_the_wrong_process_count_is_a_clear_error(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "mmpipe",
                           "train", "parallel.dp=2", f"hydra.run.dir={tmp_path}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("parallel.pp * parallel.dp = 2 * 2 = 4 does not equal the 2 processes launched"
            in proc.stdout + proc.stderr)
