"""The step-time re-fit learns a runtime's fixed costs from measured steps, out of sample."""

from __future__ import annotations

import numpy as np
import pytest

from mmpipe.planner.calibrate import StepCalibration


def test_refit_recovers_scale_and_fixed_costs():
    rng = np.random.default_rng(0)
    cal = StepCalibration(min_steps=6)
    errors = []
    for step in range(40):
        sim, m = rng.uniform(0.1, 0.4), int(rng.integers(3, 9))
        measured = 1.3 * sim + 0.006 * m + 0.01
        errors.append(abs(measured / cal.predict(sim, m) - 1))
        cal.observe(sim, m, measured)
    assert errors[0] > 0.3  # the raw simulation alone is far off
    assert max(errors[8:]) < 1e-6  # once fitted, predictions made before each step are exact
    assert cal.coef == pytest.approx((1.3, 0.006, 0.01), rel=1e-6)


def test_refit_waits_for_enough_steps():
    cal = StepCalibration(min_steps=6)
    for _ in range(5):
        cal.observe(0.2, 4, 0.5)
    assert cal.predict(0.2, 4) == pytest.approx(0.2)  # still the raw simulation
