"""What `mmpipe train`'s step-time re-fit learned becomes a hardware file the next run (or
`mmpipe plan`) composes with `--config-dir RUN_DIR/conf hardware=calibrated-<name>`, and the
planner then prices steps, and chooses micro-batch counts, with the fitted costs."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from mmpipe.cli import load
from mmpipe.config import hardware_spec
from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.api import PlanProblem, StepCalibration, StepPlanner, plan_stages
from mmpipe.planner.samples import sample_table
from mmpipe.planner.step import evaluate_step
from mmpipe.runtime.hardware_file import write_calibrated

COEF = (1.25, 0.3, 0.04)  # scale, s per micro-batch, s per step: a costly runtime around the layers


def _fitted(coef, steps=12) -> StepCalibration:
    rng = np.random.default_rng(0)
    cal = StepCalibration()
    for _ in range(steps):
        sim, m = rng.uniform(0.05, 0.5), int(rng.integers(2, 9))
        cal.observe(sim, m, coef[0] * sim + coef[1] * m + coef[2])
    return cal


def _features(n=16, seed=3) -> list[SampleFeatures]:
    rng = np.random.default_rng(seed)
    return [SampleFeatures(image_positions=(), image_tokens=(), audio_positions=(), audio_tokens=(),
                           text_tokens=int(t)) for t in rng.integers(20, 400, n)]


def _problem(rc, hw) -> PlanProblem:
    return PlanProblem(model=rc.model, hardware=hw, trainable=rc.train.trainable, pp=2, dp=1, policy="data-aware",
                       micro_batches=rc.train.micro_batches)


def _planner(rc, hw, stage_plan) -> StepPlanner:
    return StepPlanner(_problem(rc, hw), stage_plan)


def test_the_refit_is_written_as_a_hardware_file_the_planner_uses(tmp_path):
    rc = load([f"hydra.run.dir={tmp_path / 'run'}"], job="test")
    cal = _fitted(COEF)
    assert cal.coef[:2] == pytest.approx(COEF[:2], rel=0.1)  # noise-free steps; c, the smallest, takes the prior
    line = write_calibrated(rc, cal)
    path = tmp_path / "run" / "conf" / "hardware" / "calibrated-cpu.yaml"
    conf = tmp_path / "run" / "conf"
    a, b, c = cal.coef
    assert line == (f"calibrated hardware: {path} (a={a:.4g}, b={b * 1e3:.3g} ms, c={c * 1e3:.3g} ms; median "
                    f"prediction error {cal.median_error:.1%}); use: mmpipe train --config-dir={conf} "
                    f"hardware=calibrated-cpu")
    text = path.read_text()
    assert "re-fitted on the last 12 of 12 steps" in text
    assert f"# Use: mmpipe train --config-dir={conf} hardware=calibrated-cpu" in text
    assert f"with {cal.describe()} (out of sample" in text  # the file records the fit's error
    assert yaml.safe_load(text)["measured_for"] == "tiny"

    # It composes as the use line says, and holds exactly the fit it reports.
    cpu = hardware_spec(rc)
    calibrated = hardware_spec(load([f"hydra.searchpath=[file://{conf}]", "hardware=calibrated-cpu"], job="test"))
    assert calibrated.name == "calibrated-cpu"
    assert (calibrated.micro_batch_overhead_s, calibrated.step_overhead_s) == (b, c)
    assert calibrated.peak_flops == pytest.approx(cpu.peak_flops / a, rel=1e-12)

    # A step planned on the preset, priced on the calibrated hardware, is what the fit predicts.
    feats = _features()
    stages = plan_stages(_problem(rc, cpu), feats)
    raw = _planner(rc, cpu, stages).plan(feats)
    m = len(raw.replicas[0])
    on_fit = _planner(rc, calibrated, stages)
    priced = evaluate_step(on_fit.stage_costs, sample_table(feats), raw.replicas, packing=True).step_time
    assert priced == pytest.approx(cal.predict(raw.compute[0], m), rel=1e-9)
    # ... and the planner, paying 300 ms per micro-batch (the preset: 26 ms), plans fewer of them.
    assert len(on_fit.plan(feats).replicas[0]) < m


def test_a_run_too_short_to_fit_writes_nothing_and_says_so(tmp_path):
    rc = load([f"hydra.run.dir={tmp_path / 'run'}"], job="test")
    cal = _fitted(COEF, steps=5)
    assert write_calibrated(rc, cal) == ("calibrated hardware: none written (5 steps measured, the step-time "
                                         "re-fit needs 6; train more steps to calibrate)")
    assert not (tmp_path / "run" / "conf").exists()


def test_a_calibrated_file_is_calibrated_further_under_its_own_name(tmp_path):
    """A run on calibrated-cpu re-fits what is left: the new file replaces it, on top of it
    (its compute scaled once more, its fixed costs the new fit's own)."""
    first = tmp_path / "first"
    write_calibrated(load([f"hydra.run.dir={first}"], job="test"), _fitted(COEF))
    rc = load([f"hydra.searchpath=[file://{first / 'conf'}]", "hardware=calibrated-cpu",
               f"hydra.run.dir={tmp_path / 'second'}"], job="test")
    second = _fitted((1.1, 0.01, 0.0))
    write_calibrated(rc, second)
    again = hardware_spec(load([f"hydra.searchpath=[file://{tmp_path / 'second' / 'conf'}]",
                                "hardware=calibrated-cpu"], job="test"))
    assert again.micro_batch_overhead_s == second.coef[1]
    assert again.peak_flops == pytest.approx(hardware_spec(rc).peak_flops / second.coef[0], rel=1e-12)
