"""The memory model follows the run's precision, ZeRO stage and optimizer; the runtime's
measured fixed costs reach every planner decision."""

import dataclasses

import numpy as np
import pytest

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.api import PlanProblem, StagePlan, StepCalibration, StepPlanner, calibrated_hardware
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.hardware import hardware_from_dict
from mmpipe.planner.precision import TrainingPrecision

from .helpers import hardware, model


def _layer(cost, name):
    return next(l for l in cost.layers if l.name == name)


def _static(precision, dp, trainable=("llm",), name="llm.block.0"):
    c = build_cost_model(model=model("llava-1.5-7b"), hardware=hardware("h100"), trainable=trainable,
                         dp=dp, precision=precision)
    i = c.names.index(name)
    return c.static_bytes(i, i + 1) / _layer(c, name).params


@pytest.mark.parametrize("kw,dp,per_param", [
    ({}, 4, 4 + 12 / 4),  # the spec: bf16 weight + grad, fp32 master + 2 Adam moments over dp
    ({"zero_stage": 0}, 4, 16),
    ({"precision": "fp16"}, 2, 4 + 12 / 2),
    ({"precision": "fp32"}, 4, 8 + 8 / 4),  # fp32 weight + grad, no master copy, 2 moments
    ({"precision": "fp32", "zero_stage": 0}, 4, 16),
    ({"optimizer": "sgd"}, 4, 4 + 4 / 4),  # runtime's SGD has no momentum: the master copy only
    ({"precision": "fp32", "optimizer": "sgd"}, 4, 8),
])
def test_static_bytes_per_trainable_parameter(kw, dp, per_param):
    assert _static(TrainingPrecision(**kw), dp) == pytest.approx(per_param)


def test_frozen_weights_activations_and_boundaries_follow_the_element_width():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    bf16 = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    fp32 = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1,
                            precision=TrainingPrecision(precision="fp32"))
    assert _static(TrainingPrecision(), 1, name="vision.block.0") == 2
    assert _static(TrainingPrecision(precision="fp32"), 1, name="vision.block.0") == 4
    for name in ("llm.block.3", "llm.head", "llm.norm"):
        assert _layer(fp32, name).act_bytes == 2 * _layer(bf16, name).act_bytes > 0, name
        assert _layer(fp32, name).recompute_bytes == 2 * _layer(bf16, name).recompute_bytes, name
    assert _layer(bf16, "llm.block.3").act_bytes == 34 * 4096
    i = bf16.names.index("llm.block.10")
    assert bf16.cut_fwd_bytes[i, 4] == 2 * 4096 and fp32.cut_fwd_bytes[i, 4] == 4 * 4096
    assert fp32.cut_bwd_bytes[i, 4] == 4 * 4096


def test_bad_precision_settings_name_the_key():
    with pytest.raises(ValueError, match=r"train.precision='fp8' is unknown; use fp32, bf16, fp16"):
        TrainingPrecision(precision="fp8")
    with pytest.raises(ValueError, match=r"train.zero_stage=2 is not supported with pipeline parallelism; "
                                         r"use 0 or 1"):
        TrainingPrecision(zero_stage=2)
    with pytest.raises(ValueError, match=r"train.optimizer='lamb' is unknown; use adamw, sgd"):
        TrainingPrecision(optimizer="lamb")
    with pytest.raises(ValueError, match=r"plan.memory_headroom=1.2 must be a fraction"):
        build_cost_model(model=model("tiny"), hardware=hardware("cpu"), trainable=("all",), memory_headroom=1.2)


def test_an_old_hardware_file_with_parameter_bytes_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"hardware.sharded_param_bytes is no longer a hardware setting: .* "
                                         r"follow train.precision, train.zero_stage and train.optimizer"):
        hardware_from_dict({"name": "x", "peak_flops": 1e12, "memory_gb": 8, "link_gbps": 1,
                            "sharded_param_bytes": 12})


def _text(n):
    return SampleFeatures(image_positions=(), image_tokens=(), audio_positions=(), audio_tokens=(),
                          text_tokens=n)


def _planner(hw, **kw):
    problem = PlanProblem(model=model("llava-1.5-7b"), hardware=hw, trainable=("llm",), dp=1,
                          policy="data-aware", micro_batches=4, **kw)
    return StepPlanner(problem, StagePlan(stages=[(0, 35), (35, 45), (45, 53), (53, 61)]))


def test_a_calibration_fit_becomes_the_hardware_the_planner_predicts_with():
    rng = np.random.default_rng(0)
    feats = [_text(int(t)) for t in rng.integers(100, 1500, 48)]
    hw = dataclasses.replace(hardware("h100"), micro_batch_overhead_s=1e-3, step_overhead_s=2e-3)
    raw = _planner(hw).plan(feats)
    m = len(raw.replicas[0])
    coef = (1.3, 0.004, 0.05)
    cal = StepCalibration(coef=coef)
    fitted = _planner(calibrated_hardware(hw, coef))
    # the same micro-batches priced on the fitted hardware are what the fit predicts
    same = fitted.stage_costs.cost.hardware
    assert (same.micro_batch_overhead_s, same.step_overhead_s) == (0.004, 0.05)  # the fit's own, not added
    from mmpipe.planner.samples import sample_table
    from mmpipe.planner.step import evaluate_step
    ev = evaluate_step(fitted.stage_costs, sample_table(feats), raw.replicas, packing=True)
    assert ev.step_time == pytest.approx(cal.predict(raw.compute[0], m), rel=1e-9)
    assert raw.step_time == pytest.approx(raw.compute[0] + 1e-3 * m + 2e-3, rel=1e-12)  # compute: no fixed costs


def test_the_per_micro_batch_cost_changes_the_micro_batch_count():
    rng = np.random.default_rng(1)
    feats = [_text(int(t)) for t in rng.integers(100, 1500, 96)]
    free = _planner(hardware("h100")).plan(feats)
    costly = _planner(dataclasses.replace(hardware("h100"), micro_batch_overhead_s=0.05)).plan(feats)
    assert len(costly.replicas[0]) < len(free.replicas[0])
    # and it is in the predicted step time: at least 50 ms per micro-batch on top
    assert costly.step_time >= free.step_time + 0.05 * len(costly.replicas[0]) * 0.9


def test_the_predicted_peak_of_every_stage_is_exposed_and_within_the_headroom():
    rng = np.random.default_rng(2)
    feats = [_text(int(t)) for t in rng.integers(200, 2000, 64)]
    hw = dataclasses.replace(hardware("h100"), memory_gb=50)
    step = _planner(hw, memory_headroom=0.1).plan(feats)
    usable = hw.usable_bytes * 0.9
    assert len(step.peak_bytes) == 1 and len(step.peak_bytes[0]) == 4
    assert max(step.peak_bytes[0]) <= usable
    assert max(step.peak_bytes[0]) > 0.95 * usable  # memory binds here: without the headroom it plans 45 GB
