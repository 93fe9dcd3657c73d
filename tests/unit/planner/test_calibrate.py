"""The step-time re-fit is physical: bounded fixed costs, outlier steps down-weighted, exact
bounded least squares."""

from __future__ import annotations

import numpy as np
import pytest

from mmpipe.planner.calibrate import LOWER, StepCalibration, bounded_lstsq, calibrated_hardware
from mmpipe.planner.hardware import HardwareSpec

STALLED = (5, 13, 22)
"""Steps of the noisy series that another process stalled (3x their time)."""


def noisy_series(seed: int = 0) -> list[tuple[float, int, float]]:
    """(compute, micro-batches, measured) of 32 steps whose compute cost grows faster than
    linearly (so a straight line through them crosses zero below the origin: a negative
    per-step cost is the least-squares answer), with 4% noise and three stalled steps."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(32):
        compute, m = rng.uniform(0.1, 0.4), int(rng.integers(2, 9))
        measured = (1.6 * compute * (1 + 1.5 * compute) + 0.02 * m) * (1 + rng.normal(0, 0.04))
        out.append((compute, m, measured * (3.0 if step in STALLED else 1.0)))
    return out


def test_a_noisy_series_with_outliers_yields_physical_fixed_costs():
    series = noisy_series()
    h = np.array(series)
    X = np.stack([h[:, 0], h[:, 1], np.ones(len(h))], axis=1)
    plain, *_ = np.linalg.lstsq(X / h[:, 2:3], np.ones(len(h)), rcond=None)
    assert plain[2] < -0.05  # the temptation: an unconstrained fit gives time back every step

    cal = StepCalibration(prior=(1.0, 0.0023, 0.026))
    for compute, m, measured in series:
        cal.observe(compute, m, measured)
    a, b, c = cal.coef
    assert a > 0 and b >= 0 and c >= 0
    assert 0.005 < b < 0.03  # a per-micro-batch cost is still found (0.02 in truth, traded against a)
    # the three stalled steps count at about a third; the others (nearly all) fully
    assert [i for i, w in enumerate(cal.weights) if w < 0.5] == list(STALLED)
    assert np.median([w for i, w in enumerate(cal.weights) if i not in STALLED]) == 1.0
    clean = [abs(mes / cal.predict(cmp, m) - 1) for i, (cmp, m, mes) in enumerate(series) if i not in STALLED]
    assert np.median(clean) < 0.1


def test_bounded_least_squares_meets_the_optimality_conditions():
    """At the solution the gradient vanishes in every free variable and points into the bound
    in every variable held at it (KKT), on random problems whose free optimum breaks a bound."""
    rng = np.random.default_rng(1)
    broke = 0
    for _ in range(200):
        A = rng.normal(size=(12, 3))
        y = rng.normal(size=12)
        x = bounded_lstsq(A, y, LOWER)
        free, *_ = np.linalg.lstsq(A, y, rcond=None)
        broke += bool(np.any(free < np.asarray(LOWER)))
        grad = 2 * A.T @ (A @ x - y)
        at_bound = np.isclose(x, LOWER)
        assert np.all(x >= np.asarray(LOWER) - 1e-12)
        assert np.allclose(grad[~at_bound], 0, atol=1e-8)
        assert np.all(grad[at_bound] >= -1e-8)
    assert broke > 100  # most problems needed the bounds


def test_noise_free_steps_are_fitted_closely_and_predicted_out_of_sample():
    rng = np.random.default_rng(0)
    cal = StepCalibration(min_steps=6)
    errors = []
    for _ in range(40):
        compute, m = rng.uniform(0.1, 0.4), int(rng.integers(3, 9))
        measured = 1.3 * compute + 0.006 * m + 0.01
        errors.append(abs(measured / cal.predict(compute, m) - 1))
        cal.observe(compute, m, measured)
    assert errors[0] > 0.3  # the raw simulation alone is far off
    assert max(errors[8:]) < 0.01  # once fitted, predictions made before each step are close
    assert cal.coef == pytest.approx((1.3, 0.006, 0.01), rel=0.15)  # the weak prior pulls a little


def test_the_fit_waits_for_its_warm_up_and_restores_from_its_state():
    cal = StepCalibration(min_steps=6, prior=(1.0, 0.002, 0.02), coef=(1.0, 0.002, 0.02))
    for _ in range(5):
        cal.observe(0.2, 4, 0.5)
    assert not cal.fitted and cal.predict(0.2, 4) == pytest.approx(0.2 + 0.008 + 0.02)  # still the prior
    for compute, m, measured in noisy_series():
        cal.observe(compute, m, measured)
    again = StepCalibration.from_state(cal.state_dict())
    assert again.state_dict() == cal.state_dict()
    again.observe(0.3, 5, 0.9)
    cal.observe(0.3, 5, 0.9)
    assert again.coef == cal.coef


def test_a_fit_outside_its_bounds_is_refused():
    hw = HardwareSpec(name="x", peak_flops=1e12, memory_gb=10, link_gbps=1)
    with pytest.raises(ValueError, match="a step-time fit needs a > 0, b >= 0, c >= 0; got a=1.0, b=-0.01"):
        calibrated_hardware(hw, (1.0, -0.01, 0.0))
