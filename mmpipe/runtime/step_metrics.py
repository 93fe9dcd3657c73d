"""Rank 0's account of the training steps: each step's metrics.jsonl record, the progress bar,
the console notes the steps raise, and what the run's summary reports of them (the steps'
throughput records, each stage's memory peaks, the efficiency figures).

One component (`StepMetrics`), built once by runtime/train.py and called once per step, so a new
figure lands here and not in the loop. The sinks themselves (metrics.jsonl, TensorBoard, wandb,
the tqdm bar) are runtime/metrics.py's; the figures come from the step's records
(runtime/step.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.planner.api import HardwareSpec, StepCalibration
from mmpipe.runtime.checkpoint import truncate_records
from mmpipe.runtime.evaluate import EvalResult
from mmpipe.runtime.metrics import MetricsWriter, ProgressBar
from mmpipe.runtime.step import FedStep, TrainedStep
from mmpipe.runtime.telemetry import busy_s

__all__ = ["StepMetrics", "efficiency"]


def efficiency(rc: RunConfig, hw: HardwareSpec, fed: FedStep, step_s: float, *, figured: bool) -> dict:
    """The step against its lower bound (its samples' forward and backward at the hardware
    config's peak rates, spread evenly over every rank: docs/planner.md), and the model-FLOPs
    utilisation with the encoders' FLOPs counted, both over the measured step time; the two
    fractions are None where the config's peak rates are not this device's (`figured` False)."""
    world = rc.parallel.pp * rc.parallel.dp
    bound = fed.ideal_s / world
    timed = step_s > 0 and figured
    return {"lower_bound_s": bound, "bound_fraction": bound / step_s if timed else None,
            "model_flops": fed.flops,
            "mfu": fed.flops / (step_s * world * hw.peak_flops) if timed else None}


class StepMetrics:
    """Rank 0's metrics of the run's steps. It owns the sinks (metrics.jsonl and the other
    loggers, the progress bar), the step-time re-fit's observations (a step's prediction is made
    before the step is observed), and what the summary reads at the end (`report`): every step's
    throughput record, each stage's largest measured and predicted peak memory, and each step's
    efficiency. A resumed run's metrics.jsonl loses the lines after its checkpoint first."""

    def __init__(self, rc: RunConfig, *, calibration: StepCalibration, hardware: HardwareSpec, start: int,
                 memory_kind: str, figured: bool):
        path = Path(rc.run_dir) / "metrics.jsonl"
        if rc.train.resume:
            truncate_records(path, start)
        self._writer = MetricsWriter(path, append=bool(rc.train.resume), loggers=rc.train.loggers)
        self._bar: ProgressBar | None = None
        self._rc = rc
        self._calibration = calibration
        self._hardware = hardware
        self._start = start
        self._memory_kind = memory_kind
        """What the measured peaks are (telemetry.PeakMemory.kind)."""
        self._figured = figured
        """Whether the hardware config's peak rates are this device's (else no efficiency figures)."""
        self._announced = False
        """Whether the console was told the feeder now plans with the run's own fit."""
        self._eval_loss: float | None = None
        self._steps: list[dict] = []
        self._peak: list[float] = []
        self._predicted: list[float] = []
        self._efficiency: list[tuple[float, float]] = []

    def begin(self) -> None:
        """Start the progress bar (after the start-up lines, which would land on its line)."""
        self._bar = ProgressBar(self._rc.train.steps - self._start)

    def note(self, message: str) -> None:
        """A line above the bar."""
        self._bar.note(message)

    def log(self, step: int, fed: FedStep, trained: TrainedStep, evaluated: EvalResult | None,
            recut: dict | None, measure_recut: Callable[[int, float], dict | None],
            recut_line: Callable[[dict], str]) -> None:
        """The step's metrics line (every train.log_every steps, the last, a non-finite one, one
        with an evaluation, one with a re-cut check and one with a re-cut's measured gain) and the
        progress bar. `measure_recut(step, step_time)` is the re-cut's measurement
        (recut.Recut.measured), `recut_line` its console line."""
        rc = self._rc
        rec = self._record(step, fed, trained)
        if evaluated is not None:
            rec.update(evaluated.record())
            self._eval_loss = evaluated.loss
        if recut is not None:
            rec["recut"] = recut
        rec["first_of_launch"] = step == self._start + 1
        self._steps.append({k: rec[k] for k in ("step", "samples", "tokens", "step_time", "first_of_launch")})
        measured = measure_recut(step, rec["step_time"])
        if measured is not None:
            rec["recut_measured"] = measured
            self.note(recut_line(measured))
        if (step % rc.train.log_every == 0 or step == rc.train.steps or trained.nonfinite or evaluated is not None
                or recut is not None or measured is not None):
            self._writer.write(rec)
        self._bar.update(loss=trained.loss, samples_per_s=rec["samples_per_s"], tokens_per_s=rec["tokens_per_s"],
                         eval_loss=self._eval_loss)
        self._track_memory([st["mem"] for st in trained.stages], fed.planned.predicted_peak_bytes)

    def report(self, result) -> None:
        """Into the run's result (runtime/train.RunResult), what its summary reads of the steps."""
        result.steps = self._steps
        result.peak_memory = self._peak
        result.predicted_memory = self._predicted
        result.memory_measure = self._memory_kind if self._peak else ""
        result.efficiency = self._efficiency

    def close(self) -> None:
        self._writer.close()
        if self._bar is not None:
            self._bar.close()  # before any error line, which would land on the bar's line

    def _record(self, step: int, fed: FedStep, trained: TrainedStep) -> dict:
        """The step's metrics.jsonl line; the calibrated prediction is made before this step is observed."""
        mbs, stages, dt, engine_s = len(fed.micro_batches), trained.stages, trained.step_s, trained.engine_s
        busy = [busy_s(st) for st in stages]
        cal, compute, m_slow = self._calibration, fed.compute_s, fed.slow_micro_batches
        raw = cal.simulated(compute, m_slow)  # the hardware config's prediction
        pred = cal.predict(compute, m_slow)  # fitted on earlier steps only
        cal.observe(compute, m_slow, engine_s)
        fit = fed.planned.fit
        if fit is not None and not self._announced:
            self._announced = True
            self.note(f"step {step}: micro-batches are planned with this run's step-time fit from now on "
                      f"(a={fit[0]:.3g}, b={fit[1] * 1e3:.3g} ms per micro-batch, c={fit[2] * 1e3:.3g} ms per "
                      f"step; hardware {self._rc.hardware.get('name')} said b={cal.prior[1] * 1e3:.3g} ms, "
                      f"c={cal.prior[2] * 1e3:.3g} ms)")
        rec = {"step": step, "loss": round(trained.loss, 6), "samples_per_s": fed.samples / dt,
               "tokens_per_s": fed.tokens / dt, "step_time": dt, "lr": trained.lr,
               "grad_norm": trained.grad_norm if math.isfinite(trained.grad_norm) else None,
               "samples": fed.samples, "tokens": fed.tokens, "pad_tokens": fed.pad_tokens,
               "label_tokens": fed.label_tokens, "micro_batches": mbs,
               "engine_time": engine_s, "stage_busy_s": busy,
               "stage_comm_s": [st["comm"] for st in stages], "optim_s": max(st["optim"] for st in stages),
               "bubble": 1.0 - sum(busy) / (len(busy) * engine_s),
               "predicted_step_time": pred, "simulated_step_time": raw,
               "calibration": list(cal.coef), "planned_with_fit": fit is not None,
               "predicted_busy_s": list(fed.planned.predicted_busy),
               "prediction_error": engine_s / pred - 1.0 if pred > 0 else None,
               "overhead_s": dt - engine_s, "plan_s": fed.planned.plan_seconds, "feed_s": fed.planned.feed_seconds,
               "stage_peak_mem_gb": [st["mem"] / 1e9 for st in stages], "peak_mem_measure": self._memory_kind,
               "predicted_peak_mem_gb": [b / 1e9 for b in fed.planned.predicted_peak_bytes],
               "nonfinite": trained.nonfinite}
        rec.update(efficiency(self._rc, self._hardware, fed, dt, figured=self._figured))
        if rec["bound_fraction"] is not None:
            self._efficiency.append((rec["bound_fraction"], rec["mfu"]))
        if self._rc.train.precision == "fp16":
            rec["loss_scale"] = trained.loss_scale  # a step that overflowed was skipped: grad_norm null
        return rec

    def _track_memory(self, measured: list[float], predicted) -> None:
        """Keep each stage's largest measured and predicted peak for the summary."""
        self._peak = [max(a, b) for a, b in zip(self._peak or [0.0] * len(measured), measured)]
        self._predicted = [max(a, b) for a, b in zip(self._predicted or [0.0] * len(predicted), predicted)]
