"""Re-fitting the cost model's step-level constants from measured steps, as training goes.

The layer costs come from presets or `mmpipe profile`; what a layer benchmark cannot see is
the runtime around it: the optimizer step, the engine's per-micro-batch work (instruction
dispatch, shape metadata, input copies, the loss), stage-to-stage waits. After each step the
runtime reports (simulated step time, micro-batches, measured step time); the calibration fits

    measured = scale * simulated + per_micro_batch * m + per_step

by least squares over a sliding window of past steps, and predicts the next step from that
fit before it runs (so the reported error is out of sample). `calibrated_hardware` turns a
fit into the hardware's own constants, so that the planner's choices (micro-batch counts
above all) use what the runtime really costs; `mmpipe train` writes them out at its end
(runtime/hardware_file.py) for the next run and `mmpipe plan`.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mmpipe.planner.hardware import HardwareSpec


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
    observed: int = 0
    """Steps observed in all."""
    errors: deque = field(default_factory=deque)
    """measured / predicted - 1 of the last `window` steps a fit predicted before they ran."""

    @property
    def fitted(self) -> bool:
        """Whether `coef` is a fit (enough steps observed), not the raw simulation."""
        return self.observed >= self.min_steps

    @property
    def median_error(self) -> float | None:
        """Median |measured / predicted - 1| over `errors` (None before any fitted prediction)."""
        return float(np.median(np.abs(np.array(self.errors)))) if self.errors else None

    def predict(self, simulated: float, micro_batches: int) -> float:
        a, b, c = self.coef
        return a * simulated + b * micro_batches + c

    def observe(self, simulated: float, micro_batches: int, measured: float) -> None:
        if self.fitted and (predicted := self.predict(simulated, micro_batches)) > 0:
            self.errors.append(measured / predicted - 1.0)
            while len(self.errors) > self.window:
                self.errors.popleft()
        self.observed += 1
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


def calibrated_hardware(hw: HardwareSpec, coef: tuple[float, float, float]) -> HardwareSpec:
    """The hardware whose simulated step time is what a StepCalibration fit predicts.

    With `coef` = (scale, per_micro_batch_s, per_step_s) fitted on step times simulated with
    `hw`, the returned hardware prices a step at scale * (the step on hw) + per_micro_batch_s
    * m + per_step_s: every time constant of hw is scaled (peak FLOP/s and link bandwidth
    divided by scale, every fixed time multiplied by it), which scales every simulated
    makespan exactly, and the fitted fixed costs join `micro_batch_overhead_s` and
    `step_overhead_s`, so the planner chooses its micro-batch counts with them. A fixed cost
    the fit puts below zero is taken as 0 (a runtime cannot give time back); a scale that is
    not positive leaves hw as it is (a degenerate fit).
    """
    scale, per_mb, per_step = (float(x) for x in coef)
    if not (scale > 0 and np.isfinite(scale)):
        return hw
    return dataclasses.replace(
        hw,
        peak_flops=hw.peak_flops / scale,
        link_gbps=hw.link_gbps / scale,
        link_latency_s=hw.link_latency_s * scale,
        op_overhead_s=hw.op_overhead_s * scale,
        kind_overhead_s={k: v * scale for k, v in hw.kind_overhead_s.items()},
        micro_batch_overhead_s=max(0.0, hw.micro_batch_overhead_s * scale + per_mb),
        step_overhead_s=max(0.0, hw.step_overhead_s * scale + per_step),
    )
