"""Re-fitting the cost model's step-level constants from measured steps, as training goes.

The layer costs come from presets or `mmpipe profile`; what a layer benchmark cannot see is
the runtime around it: the optimizer step, the engine's per-micro-batch work (instruction
dispatch, shape metadata, input copies, the loss), stage-to-stage waits. After each step the
runtime reports (compute, micro-batches, measured step time), where `compute` is the step's
simulated 1F1B makespan on the run's hardware *without* its fixed costs; the calibration fits

    measured = a * compute + b * micro_batches + c        a > 0, b >= 0, c >= 0

over a sliding window of past steps and predicts the next step from that fit before it runs
(so the reported error is out of sample). The fit is physical, not a free regression:

- **Constrained.** A runtime cannot give time back, so b and c are fixed *costs*: the small
  three-variable least-squares problem is solved exactly under the bounds (`bounded_lstsq`:
  every active set of bounds is tried, the best feasible solution kept; with three variables
  that is eight tiny solves). An unconstrained fit on a busy machine put b = -19 ms and c =
  -91 ms; clipping those to 0 afterwards left the other terms fitted to the wrong model.
- **Robust.** One step stalled by another process on the cores is not evidence about the
  runtime: iteratively reweighted least squares with Huber weights (`robust_fit`) gives a
  residual beyond 1.345 robust standard deviations (the MAD of the relative residuals) a
  weight that falls with its size.
- **Anchored.** Errors are relative (a step's residual over its measured time), and a weak
  prior (worth a tenth of a step) holds each coefficient near the hardware's own value where
  the window cannot tell them apart (every step with the same micro-batch count makes b and c
  one number).

`calibrated_hardware` turns a fit into the hardware's own constants (time constants scaled
by a, `micro_batch_overhead_s = b`, `step_overhead_s = c`), so that the planner's choices
(micro-batch counts above all) use what the runtime really costs; the runtime's feeder plans
with it once the fit has seen its warm-up steps (`runtime/feed.py`), and `mmpipe train` writes
it out at its end (runtime/hardware_file.py) for the next run and `mmpipe plan`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mmpipe.planner.hardware import HardwareSpec

Coef = tuple[float, float, float]
"""(a: scale of the simulated compute, b: s per micro-batch, c: s per step)."""
LOWER = (1e-3, 0.0, 0.0)
"""Bounds of (a, b, c): a strictly positive scale, fixed costs that are costs."""
HUBER_K = 1.345
"""Huber's constant: 95% efficiency under Gaussian noise, bounded influence beyond."""
MIN_SCALE = 0.01
"""Floor of the robust residual scale (relative): below 1% every step counts fully."""
IRLS_ROUNDS = 20
"""Reweighting rounds at most (they converge in a handful)."""


def bounded_lstsq(A: np.ndarray, y: np.ndarray, lower: tuple[float, ...]) -> np.ndarray:
    """argmin |A x - y|^2 subject to x >= lower, exactly, for a few variables.

    A convex quadratic under bounds has its minimum where some bounds are active and the
    other variables solve the unconstrained problem on their own: every subset of free
    variables is solved with the rest at their bounds, and the best feasible solution wins
    (2^n solves; n = 3 here). `A` must have full column rank on every subset (the prior rows
    of `robust_fit` see to it)."""
    n = A.shape[1]
    lo = np.asarray(lower, dtype=float)
    best, best_obj = lo.copy(), float(np.sum((A @ lo - y) ** 2))
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            x = lo.copy()
            f = list(free)
            rest = y - A @ x  # x is at the bounds everywhere; the free ones restart from 0 below
            rest += A[:, f] @ x[f]
            x[f], *_ = np.linalg.lstsq(A[:, f], rest, rcond=None)
            if np.all(x >= lo - 1e-12):
                obj = float(np.sum((A @ x - y) ** 2))
                if obj < best_obj:
                    best, best_obj = np.maximum(x, lo), obj
    return best


def robust_fit(X: np.ndarray, y: np.ndarray, *, prior: Coef, prior_weight: float,
               lower: tuple[float, ...] = LOWER) -> tuple[np.ndarray, np.ndarray]:
    """Bounded, Huber-weighted fit of y ~ X @ coef in relative error, anchored at `prior`.

    Args:
        X: [n, 3] regressors (compute s, micro-batches, 1) of n steps.
        y: [n] measured step times, s (> 0).
        prior: coefficients the window is pulled towards where it cannot tell them apart.
        prior_weight: how many steps' worth each prior row counts.
    Returns:
        (coef, weights): the fit and each step's final Huber weight (1 = fully counted).
    """
    n = len(y)
    rel = X / y[:, None]  # a residual relative to the step's own time
    # one pseudo-row per coefficient: its contribution at the window's mean, relative to the mean step
    typical = np.mean(X, axis=0) / float(np.mean(y))
    P = np.diag(typical) * np.sqrt(prior_weight)
    p_target = typical * np.asarray(prior) * np.sqrt(prior_weight)
    w = np.ones(n)
    coef = np.asarray(prior, dtype=float)
    for _ in range(IRLS_ROUNDS):
        sw = np.sqrt(w)
        A = np.vstack([rel * sw[:, None], P])
        b = np.concatenate([sw, p_target])
        new = bounded_lstsq(A, b, lower)
        r = rel @ new - 1.0
        scale = max(MIN_SCALE, 1.4826 * float(np.median(np.abs(r - np.median(r)))))
        cut = HUBER_K * scale
        w_new = np.where(np.abs(r) <= cut, 1.0, cut / np.maximum(np.abs(r), 1e-300))
        done = np.allclose(new, coef, rtol=1e-9, atol=1e-12) and np.allclose(w_new, w, atol=1e-9)
        coef, w = new, w_new
        if done:
            break
    return coef, w


@dataclass(kw_only=True, slots=True)
class StepCalibration:
    """Sliding-window, bounded, robust calibration of predicted step times."""

    window: int = 32
    """Past steps the fit uses."""
    min_steps: int = 6
    """Steps observed before the fit replaces the prior (the warm-up)."""
    prior: Coef = (1.0, 0.0, 0.0)
    """The coefficients before any step: (1, the hardware's micro_batch_overhead_s, its
    step_overhead_s), so that an unfitted prediction is the raw simulation."""
    prior_weight: float = 0.1
    """Steps' worth of each prior pseudo-observation: enough to decide what the window cannot
    (b against c when every step has the same micro-batch count), too little to move what it
    can (noise-free steps are fitted to within a few percent)."""
    history: deque = field(default_factory=deque)
    """(compute, micro_batches, measured) of past steps."""
    coef: Coef = (1.0, 0.0, 0.0)
    """(a, b, c) of the current fit (until `fitted`: the prior, as `for_hardware` sets it)."""
    weights: tuple[float, ...] = ()
    """The robust weight of each step of `history` in the current fit (1 = fully counted)."""
    observed: int = 0
    """Steps observed in all."""
    errors: deque = field(default_factory=deque)
    """measured / predicted - 1 of the last `window` steps a fit predicted before they ran."""

    def __post_init__(self) -> None:
        a, b, c = self.prior
        if not (a > 0 and b >= 0 and c >= 0):
            raise ValueError(f"step-time prior {self.prior} must have a > 0, b >= 0, c >= 0")

    @classmethod
    def for_hardware(cls, hw: HardwareSpec, **kwargs) -> StepCalibration:
        """A calibration whose prior is `hw`'s own fixed costs."""
        prior = (1.0, hw.micro_batch_overhead_s, hw.step_overhead_s)
        return cls(prior=prior, coef=prior, **kwargs)

    @property
    def fitted(self) -> bool:
        """Whether `coef` is a fit (enough steps observed), not the prior."""
        return self.observed >= self.min_steps

    @property
    def median_error(self) -> float | None:
        """Median |measured / predicted - 1| over `errors` (None before any fitted prediction)."""
        return float(np.median(np.abs(np.array(self.errors)))) if self.errors else None

    @property
    def down_weighted(self) -> int:
        """Steps of the window the robust fit counts at less than half."""
        return int(sum(w < 0.5 for w in self.weights))

    def predict(self, compute: float, micro_batches: int) -> float:
        """The step time the current fit predicts."""
        a, b, c = self.coef
        return a * compute + b * micro_batches + c

    def simulated(self, compute: float, micro_batches: int) -> float:
        """The step time the prior (the hardware config's own costs) predicts."""
        a, b, c = self.prior
        return a * compute + b * micro_batches + c

    def observe(self, compute: float, micro_batches: int, measured: float) -> None:
        """Record one step (its simulated compute on the run's hardware, its micro-batch
        count, its measured time) and re-fit."""
        if not measured > 0:
            return  # nothing was timed (a step without samples on this rank)
        if self.fitted and (predicted := self.predict(compute, micro_batches)) > 0:
            self.errors.append(measured / predicted - 1.0)
            while len(self.errors) > self.window:
                self.errors.popleft()
        self.observed += 1
        self.history.append((float(compute), float(micro_batches), float(measured)))
        while len(self.history) > self.window:
            self.history.popleft()
        if len(self.history) < self.min_steps:
            return
        h = np.array(self.history)
        X = np.stack([h[:, 0], h[:, 1], np.ones(len(h))], axis=1)
        coef, w = robust_fit(X, h[:, 2], prior=self.prior, prior_weight=self.prior_weight)
        if np.all(np.isfinite(coef)):
            self.coef = (float(coef[0]), float(coef[1]), float(coef[2]))
            self.weights = tuple(float(x) for x in w)

    def describe(self) -> str:
        """`a=1.31, b=14.5 ms, c=94.3 ms; median prediction error 7.3%` (for logs and files)."""
        a, b, c = self.coef
        err = self.median_error
        return (f"a={a:.4g}, b={b * 1e3:.3g} ms, c={c * 1e3:.3g} ms; median prediction error "
                + (f"{err:.1%}" if err is not None else "n/a"))

    def state_dict(self) -> dict:
        """Everything the fit depends on, as plain JSON values (saved with a checkpoint)."""
        return {"window": self.window, "min_steps": self.min_steps, "prior": list(self.prior),
                "prior_weight": self.prior_weight, "history": [list(x) for x in self.history],
                "coef": list(self.coef), "weights": list(self.weights), "observed": self.observed,
                "errors": list(self.errors)}

    @classmethod
    def from_state(cls, state: dict) -> StepCalibration:
        """The calibration `state_dict` described."""
        return cls(window=int(state["window"]), min_steps=int(state["min_steps"]),
                   prior=tuple(float(x) for x in state["prior"]),
                   prior_weight=float(state["prior_weight"]),
                   history=deque(tuple(float(v) for v in x) for x in state["history"]),
                   coef=tuple(float(x) for x in state["coef"]),
                   weights=tuple(float(x) for x in state["weights"]), observed=int(state["observed"]),
                   errors=deque(float(x) for x in state["errors"]))


def calibrated_hardware(hw: HardwareSpec, coef: Coef) -> HardwareSpec:
    """The hardware whose simulated step time is what a StepCalibration fit predicts.

    With `coef` = (a, b, c) fitted on steps whose compute was simulated on `hw`, the returned
    hardware prices a step at a * (its compute on hw) + b * m + c: every time constant of hw
    that the compute depends on is scaled (peak FLOP/s and link bandwidth divided by a, every
    per-op time multiplied by it), which scales every simulated makespan exactly, and b and c
    *become* `micro_batch_overhead_s` and `step_overhead_s` (they were fitted as the whole
    fixed costs, not as corrections of hw's). So the file written from a fit holds exactly
    that fit, and the planner chooses its micro-batch counts with it. ValueError for a fit
    outside the bounds StepCalibration keeps (a <= 0, b < 0 or c < 0)."""
    a, b, c = (float(x) for x in coef)
    if not (a > 0 and b >= 0 and c >= 0 and np.isfinite(a + b + c)):
        raise ValueError(f"a step-time fit needs a > 0, b >= 0, c >= 0; got a={a}, b={b}, c={c}")
    return dataclasses.replace(
        hw,
        peak_flops=hw.peak_flops / a,
        link_gbps=hw.link_gbps / a,
        link_latency_s=hw.link_latency_s * a,
        op_overhead_s=hw.op_overhead_s * a,
        kind_overhead_s={k: v * a for k, v in hw.kind_overhead_s.items()},
        micro_batch_overhead_s=b,
        step_overhead_s=c,
    )
