"""Re-fitting the cost model's step-level constants from measured steps, as training goes.

The layer costs come from presets or `mmpipe profile`; what a layer benchmark cannot see is
the runtime around it: the optimizer step, the engine's per-micro-batch work (instruction
dispatch, shape metadata, input copies, the loss), stage-to-stage waits. After each step the
runtime reports (simulated step time, micro-batches, measured step time); the calibration fits

    measured = scale * simulated + per_micro_batch * m + per_step

by least squares over a sliding window of past steps, and predicts the next step from that
fit before it runs (so the reported error is out of sample).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True, slots=True)
class StepCalibration:
    """Sliding-window least-squares calibration of predicted step times."""

    window: int = 32
    """Past steps the fit uses."""
    min_steps: int = 6
    """Steps observed before the fit replaces the raw simulation."""
    history: deque = field(default_factory=deque)
    """(simulated, micro_batches, measured) of past steps."""
    coef: tuple[float, float, float] = (1.0, 0.0, 0.0)
    """(scale, per_micro_batch_s, per_step_s) of the current fit."""

    def predict(self, simulated: float, micro_batches: int) -> float:
        a, b, c = self.coef
        return a * simulated + b * micro_batches + c

    def observe(self, simulated: float, micro_batches: int, measured: float) -> None:
        self.history.append((simulated, float(micro_batches), measured))
        while len(self.history) > self.window:
            self.history.popleft()
        if len(self.history) < self.min_steps:
            return
        h = np.array(self.history)
        A = np.stack([h[:, 0], h[:, 1], np.ones(len(h))], axis=1)
        coef, *_ = np.linalg.lstsq(A / h[:, 2:3], np.ones(len(h)), rcond=None)  # relative error
        if coef[0] <= 0 or not np.all(np.isfinite(coef)):  # degenerate window: scale only
            coef = np.array([float(np.sum(h[:, 2]) / np.sum(h[:, 0])), 0.0, 0.0])
        self.coef = (float(coef[0]), float(coef[1]), float(coef[2]))
