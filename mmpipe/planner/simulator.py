"""Discrete-event simulation of one replica's pipeline step under a schedule.

Each device runs its actions in the schedule's order; an action starts when the device is
free and its inputs have arrived (the previous chunk's forward plus the activation transfer,
or the next chunk's backward plus the gradient transfer). Transfers between chunks on the
same device are free. Activation memory of a micro-batch on a chunk is held from the start of
its forward until the end of its backward (or its W when backward is split), and a
recomputing stage needs its transient block activations on top while it runs backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmpipe.planner.schedules import Schedule


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One executed action, for reports and plots."""

    device: int
    """Device that ran it."""
    op: str
    """`F`, `B` or `W`."""
    mb: int
    """Micro-batch index."""
    chunk: int
    """Virtual stage."""
    start: float
    """Start time, s."""
    end: float
    """End time, s."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Outcome of simulating one replica's step."""

    makespan: float
    """Time from the first action's start to the last action's end, s."""
    busy: tuple[float, ...]
    """Compute time of each device, s."""
    idle: tuple[float, ...]
    """makespan - busy for each device, s."""
    peak_act: tuple[float, ...]
    """Peak in-flight activation memory of each device (bytes, or the unit of `act`)."""
    events: tuple[Event, ...] = ()
    """Every action with its times (only when asked for)."""

    @property
    def bubble(self) -> tuple[float, ...]:
        """Idle share of each device."""
        return tuple(i / self.makespan if self.makespan > 0 else 0.0 for i in self.idle)


def simulate(schedule: Schedule, *, fwd: np.ndarray, bwd: np.ndarray,
             wgrad: np.ndarray | None = None, send_fwd: np.ndarray | None = None,
             send_bwd: np.ndarray | None = None, act: np.ndarray | None = None,
             transient: np.ndarray | None = None, events: bool = False) -> SimResult:
    """Simulate a schedule.

    Args:
        schedule: per-device action lists.
        fwd, bwd: [chunks, m] forward and backward time of each micro-batch on each chunk;
            `bwd` is the input-gradient part when `wgrad` is given.
        wgrad: [chunks, m] weight-gradient time; for a schedule that does not split
            backward it is added to B; None means zero.
        send_fwd: [chunks, m] transfer time of chunk v's output to chunk v+1.
        send_bwd: [chunks, m] transfer time of chunk v's input gradient to chunk v-1.
        act: [chunks, m] activation memory held per micro-batch on each chunk.
        transient: [chunks, m] extra memory while the backward of that micro-batch runs.
        events: also return every action's start and end.
    Returns:
        makespan, per-device busy and idle time, and peak activation memory.
    """
    V, m = schedule.chunks, schedule.micro_batches
    fwd = np.asarray(fwd, dtype=float)
    bwd = np.asarray(bwd, dtype=float)
    if fwd.shape != (V, m) or bwd.shape != (V, m):
        raise ValueError(f"times must have shape (chunks={V}, micro_batches={m}); got "
                         f"{fwd.shape} and {bwd.shape}")
    zero = np.zeros((V, m))
    wg = zero if wgrad is None else np.asarray(wgrad, dtype=float)
    sf = zero if send_fwd is None else np.asarray(send_fwd, dtype=float)
    sb = zero if send_bwd is None else np.asarray(send_bwd, dtype=float)
    mem = zero if act is None else np.asarray(act, dtype=float)
    tr = zero if transient is None else np.asarray(transient, dtype=float)
    dev = schedule.device_of
    split = schedule.split_backward
    fl, bl, wl = fwd.tolist(), bwd.tolist(), wg.tolist()
    if not split:
        bl = (bwd + wg).tolist()
    sfl, sbl = sf.tolist(), sb.tolist()
    f_end = [[0.0] * m for _ in range(V)]
    b_end = [[0.0] * m for _ in range(V)]
    P = schedule.devices
    free = [0.0] * P
    busy = [0.0] * P
    evs: list[Event] = []
    # one pass in a dependency-respecting order: every input of an action is final by then
    for d, op, v, j in topological_order(schedule):
        if op == 0:
            ready = 0.0 if v == 0 else f_end[v - 1][j] + (sfl[v - 1][j] if dev[v - 1] != d else 0.0)
            dur = fl[v][j]
        elif op == 1:
            ready = f_end[v][j] if v == V - 1 else \
                b_end[v + 1][j] + (sbl[v + 1][j] if dev[v + 1] != d else 0.0)
            dur = bl[v][j]
        else:
            ready = b_end[v][j]
            dur = wl[v][j]
        start = free[d] if free[d] > ready else ready
        end = start + dur
        free[d] = end
        busy[d] += dur
        if op == 0:
            f_end[v][j] = end
        elif op == 1:
            b_end[v][j] = end
        if events:
            evs.append(Event(device=d, op="FBW"[op], mb=j, chunk=v, start=start, end=end))
    makespan = max(free) if P else 0.0
    peak = peak_memory(schedule, mem, tr)
    return SimResult(makespan=makespan, busy=tuple(busy),
                     idle=tuple(makespan - b for b in busy), peak_act=peak, events=tuple(evs))


def makespan(schedule: Schedule, fwd: np.ndarray, bwd: np.ndarray, send_fwd: np.ndarray,
             send_bwd: np.ndarray) -> float:
    """The makespan `simulate` would report, without busy times, memory or events (the
    planner's inner loop calls this thousands of times). One chunk per device; `bwd` is the
    whole backward (input and weight gradients)."""
    if schedule.chunks != schedule.devices or schedule.split_backward:
        return simulate(schedule, fwd=fwd, bwd=bwd, send_fwd=send_fwd, send_bwd=send_bwd).makespan
    P = schedule.devices
    fl, bl = fwd.tolist(), bwd.tolist()
    sfl, sbl = send_fwd.tolist(), send_bwd.tolist()
    m = schedule.micro_batches
    f_end = [[0.0] * m for _ in range(P)]
    b_end = [[0.0] * m for _ in range(P)]
    free = [0.0] * P
    last = P - 1
    for d, op, _, j in topological_order(schedule):
        if op == 0:
            ready = f_end[d - 1][j] + sfl[d - 1][j] if d else 0.0
            t = free[d]
            end = (t if t > ready else ready) + fl[d][j]
            f_end[d][j] = end
        else:
            ready = b_end[d + 1][j] + sbl[d + 1][j] if d < last else f_end[d][j]
            t = free[d]
            end = (t if t > ready else ready) + bl[d][j]
            b_end[d][j] = end
        free[d] = end
    return max(free)


_ORDERS: dict[tuple, tuple[Schedule, list[tuple[int, int, int, int]]]] = {}


def topological_order(schedule: Schedule) -> list[tuple[int, int, int, int]]:
    """Every action as (device, op 0/1/2 = F/B/W, chunk, micro-batch) in an order where each
    action comes after its device predecessor and its data inputs. It depends on the schedule
    only, not on times, so it is computed once per schedule and reused by every simulation.
    Raises ValueError when the schedule deadlocks."""
    key = (schedule.name, schedule.devices, schedule.micro_batches, schedule.device_of,
           schedule.split_backward)
    hit = _ORDERS.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    V, m = schedule.chunks, schedule.micro_batches
    f_done = [[False] * m for _ in range(V)]
    b_done = [[False] * m for _ in range(V)]
    lists = schedule.actions
    ptr = [0] * schedule.devices
    out: list[tuple[int, int, int, int]] = []
    n_left = sum(len(a) for a in lists)
    progress = True
    while n_left and progress:
        progress = False
        for d, seq in enumerate(lists):
            while ptr[d] < len(seq):
                a = seq[ptr[d]]
                v, j = a.chunk, a.mb
                if a.op == "F":
                    if v > 0 and not f_done[v - 1][j]:
                        break
                    f_done[v][j] = True
                    op = 0
                elif a.op == "B":
                    if not f_done[v][j] or (v < V - 1 and not b_done[v + 1][j]):
                        break
                    b_done[v][j] = True
                    op = 1
                else:
                    if not b_done[v][j]:
                        break
                    op = 2
                out.append((d, op, v, j))
                ptr[d] += 1
                n_left -= 1
                progress = True
    if n_left:
        raise ValueError(f"schedule {schedule.name!r} deadlocks: an action waits for one that "
                         f"comes later on another device")
    if len(_ORDERS) > 512:
        _ORDERS.clear()
    _ORDERS[key] = (schedule, out)
    return out


def peak_memory(schedule: Schedule, mem: np.ndarray, tr: np.ndarray) -> tuple[float, ...]:
    """Walk each device's actions in order: F allocates, B (or W when split) frees."""
    peaks = []
    free_op = "W" if schedule.split_backward else "B"
    ml, tl = mem.tolist(), tr.tolist()
    for seq in schedule.actions:
        cur = peak = 0.0
        for a in seq:
            if a.op == "F":
                cur += ml[a.chunk][a.mb]
                peak = max(peak, cur)
            elif a.op == "B":
                peak = max(peak, cur + tl[a.chunk][a.mb])
            if a.op == free_op:
                cur -= ml[a.chunk][a.mb]
        peaks.append(peak)
    return tuple(peaks)


def chunk_values(schedule: Schedule, per_device: np.ndarray) -> np.ndarray:
    """Spread per-device figures [P, m] over the schedule's chunks ([chunks, m]): each chunk
    of device d gets an equal share of device d's figure (its layers split evenly)."""
    per_device = np.asarray(per_device, dtype=float)
    dev = schedule.device_of
    counts = np.bincount(np.asarray(dev), minlength=schedule.devices)
    return np.stack([per_device[d] / counts[d] for d in dev])
