"""Judge a planned step: simulate every replica's micro-batches and check memory.

The step time is the slowest replica's time (its makespan plus the runtime's fixed cost per
micro-batch) plus the fixed cost per step (`HardwareSpec.replica_seconds`, `step_seconds`);
memory per stage is the static bytes plus the largest in-flight activation peak over
replicas, judged against the usable memory less the plan's headroom. Every policy (data-aware and baselines)
is scored by this one function, so comparisons are like for like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.ladder import padded_streams
from mmpipe.planner.samples import SampleTable, mb_streams
from mmpipe.planner.schedules import make_schedule
from mmpipe.planner.simulator import SimResult, chunk_values, simulate
from mmpipe.planner.stage_cost import MicroBatchCosts, StageCosts, micro_batch_costs

Replicas = list[list[list[int]]]
"""Per replica, its micro-batches in execution order, each a list of sample indices."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEval:
    """The simulated outcome of one step."""

    step_time: float
    """Slowest replica's time (makespan and per-micro-batch overhead) plus the per-step
    overhead, s."""
    replicas: tuple[SimResult | None, ...]
    """Per replica its simulation (None for a replica without samples)."""
    replica_times: tuple[float, ...]
    """Per replica its makespan plus per-micro-batch overhead, s (0 without samples)."""
    replica_peaks: tuple[tuple[float, ...], ...]
    """Per replica and stage: static + in-flight activation peak, bytes (static alone for a
    replica without samples)."""
    peak_bytes: np.ndarray
    """[P] static + largest in-flight activation peak over replicas."""
    usable: float
    """Bytes a plan may fill on a device (usable memory less the headroom)."""

    @property
    def fits(self) -> bool:
        return bool(np.all(self.peak_bytes <= self.usable * (1 + 1e-9)))

    @property
    def slowest(self) -> int:
        return int(np.argmax(self.replica_times))


def mb_costs(sc: StageCosts, table: SampleTable, mbs: Sequence[Sequence[int]], *,
             packing: bool) -> MicroBatchCosts:
    """Times and memory [P, m] of micro-batches given as rows of `table` (packed ones at the
    length `sc.ladder` pads them to)."""
    T, S2 = mb_streams(table, mbs, packing=packing)
    if packing:
        T, S2 = padded_streams(sc.ladder, T, S2)
    return micro_batch_costs(sc, T, S2)


def simulate_replica(c: MicroBatchCosts, *, schedule: str = "1f1b",
                     events: bool = False) -> SimResult:
    """Simulate one replica given its micro-batch costs [P, m] under a named schedule."""
    P, m = c.fwd.shape
    sch = make_schedule(schedule, P, m)
    if sch.chunks == P:
        return simulate(sch, fwd=c.fwd, bwd=c.bwd_in, wgrad=c.bwd_w, send_fwd=c.send_fwd,
                        send_bwd=c.send_bwd, act=c.act, transient=c.transient, events=events)
    # several chunks per device: each device's layers split evenly over its chunks; sends
    # happen at every chunk boundary that changes device
    V = sch.chunks
    sf = np.stack([c.send_fwd[min(sch.device_of[v], P - 2)] if P > 1 else np.zeros(m)
                   for v in range(V)])
    sb = np.stack([c.send_bwd[max(sch.device_of[v], 1)] if P > 1 else np.zeros(m)
                   for v in range(V)])
    return simulate(sch, fwd=chunk_values(sch, c.fwd), bwd=chunk_values(sch, c.bwd_in),
                    wgrad=chunk_values(sch, c.bwd_w), send_fwd=sf, send_bwd=sb,
                    act=chunk_values(sch, c.act), transient=chunk_values(sch, c.transient),
                    events=events)


def evaluate_step(sc: StageCosts, table: SampleTable, replicas: Replicas, *,
                  packing: bool) -> StepEval:
    """Simulate every replica of a step under 1F1B (sample indices are rows of `table`)."""
    P = sc.pp
    hw = sc.cost.hardware
    sims: list[SimResult | None] = []
    times: list[float] = []
    peaks: list[tuple[float, ...]] = []
    peak_act = np.zeros(P)
    for mbs in replicas:
        if not mbs:
            sims.append(None)
            times.append(0.0)
            peaks.append(tuple(float(x) for x in sc.static))
            continue
        r = simulate_replica(mb_costs(sc, table, mbs, packing=packing))
        sims.append(r)
        times.append(hw.replica_seconds(r.makespan, len(mbs)))
        peaks.append(tuple(float(x) for x in sc.static + np.asarray(r.peak_act)))
        peak_act = np.maximum(peak_act, np.asarray(r.peak_act))
    step_time = hw.step_seconds(max(times, default=0.0)) if any(replicas) else 0.0
    return StepEval(step_time=step_time, replicas=tuple(sims), replica_times=tuple(times),
                    replica_peaks=tuple(peaks), peak_bytes=sc.static + peak_act,
                    usable=sc.cost.usable_bytes)
