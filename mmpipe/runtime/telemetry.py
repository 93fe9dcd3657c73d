"""What each rank measures of itself: the time of every forward and backward of every
micro-batch, of communication, and of the optimizer step.

DeepSpeed's PipelineEngine executes a schedule of instructions; the timer wraps the engine's
own instruction handlers on this one engine instance, so nothing else changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("fwd", "bwd", "comm", "optim", "load")
_HANDLERS = {
    "_exec_forward_pass": "fwd",
    "_exec_backward_pass": "bwd",
    "_exec_send_activations": "comm",
    "_exec_recv_activations": "comm",
    "_exec_send_grads": "comm",
    "_exec_recv_grads": "comm",
    "_exec_reduce_grads": "comm",
    "_exec_reduce_tied_grads": "comm",
    "_exec_optimizer_step": "optim",
    "_exec_load_micro_batch": "load",
}


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """Seconds spent by one rank in one step, by kind, and per micro-batch."""

    totals: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    """Seconds per kind."""
    fwd: list[float] = field(default_factory=list)
    """Forward time of each micro-batch, in execution order."""
    bwd: list[float] = field(default_factory=list)
    """Backward time of each micro-batch, in execution order."""

    @property
    def busy(self) -> float:
        return self.totals["fwd"] + self.totals["bwd"]


class StageTimer:
    """Times the engine's schedule instructions on this rank."""

    def __init__(self, engine) -> None:
        self.current = StepTimes()
        # The engine dispatches through a class-level map of plain functions; an instance-level
        # copy with timed wrappers changes this engine only.
        engine._INSTRUCTION_MAP = {
            instr: self._timed(fn, _HANDLERS[fn.__name__]) if fn.__name__ in _HANDLERS else fn
            for instr, fn in type(engine)._INSTRUCTION_MAP.items()
        }

    def _timed(self, fn, kind: str):
        def run(engine, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.current.totals[kind] += dt
                if kind in ("fwd", "bwd"):
                    getattr(self.current, kind).append(dt)

        return run

    def take(self) -> StepTimes:
        """This step's times; the timer starts a new step."""
        done, self.current = self.current, StepTimes()
        return done


def gather_stage_times(times: StepTimes, *, world: int, device=None) -> torch.Tensor:
    """[world, len(KINDS)] seconds of every rank for this step (one all-gather)."""
    mine = torch.tensor([times.totals[k] for k in KINDS], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out)


def per_stage(table: torch.Tensor, stage_of_rank: list[int], pp: int) -> list[dict[str, float]]:
    """Mean over replicas of each stage's seconds by kind."""
    out = []
    for s in range(pp):
        rows = [r for r, st in enumerate(stage_of_rank) if st == s]
        mean = table[rows].mean(dim=0)
        out.append({k: float(mean[i]) for i, k in enumerate(KINDS)})
    return out
