"""Pipeline schedules as data: per-device ordered lists of actions.

A schedule says, for each device, which (operation, micro-batch, chunk) it runs and in which
order; nothing here knows about time. The simulator, the plot and the runtime adapter all
consume the same lists. A *chunk* is a virtual stage: a contiguous slice of the model in model
order; with one chunk per device (1F1B, GPipe, ZB-H1) chunk == device.

Schedules:

- `1f1b`: exactly the order DeepSpeed's `TrainSchedule` executes (its even/odd step rule),
  which is what `mmpipe train` runs.
- `gpipe`: all forwards, then all backwards.
- `interleaved`: Megatron's interleaved 1F1B with `chunks` chunks per device (round robin).
- `zb-h1`: zero-bubble H1 (Qi et al. 2024): backward split into input gradient (B) and weight
  gradient (W), W deferred into bubbles, activation memory capped at 1F1B's.
- `v-half`, `v-min`: V-shaped placement (device d holds chunks d and 2P-1-d) with activation
  memory capped at about P/2 and P/3 micro-batches (Qi et al., NeurIPS 2024).

The zero-bubble family is produced by a greedy list scheduler on unit times under the memory
cap, which reproduces the published memory figures; for what-if comparisons only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work on a device."""

    op: str
    """`F` forward, `B` backward (input gradient, plus weights unless the schedule splits
    backward), `W` weight gradient."""
    mb: int
    """Micro-batch index (execution order of the replica's micro-batches)."""
    chunk: int
    """Virtual stage in model order (== device for one chunk per device)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A pipeline schedule for one replica and one step."""

    name: str
    """Schedule name (`1f1b`, `gpipe`, ...)."""
    devices: int
    """Pipeline devices (parallel.pp)."""
    micro_batches: int
    """Micro-batches in the step."""
    device_of: tuple[int, ...]
    """Device of each chunk (virtual stage), in model order."""
    actions: tuple[tuple[Action, ...], ...]
    """Per device, the actions in execution order."""
    split_backward: bool = False
    """B and W are separate actions (zero-bubble family)."""

    @property
    def chunks(self) -> int:
        return len(self.device_of)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """DeepSpeed TrainSchedule: at step t, stage s runs a forward when t and s have the same
    parity, else a backward; the micro-batch id follows from t and s (invalid ids idle)."""
    _check(pp, m)
    acts = []
    for s in range(pp):
        seq = []
        for t in range(2 * (m + pp - 1)):
            mb, fwd = one_f_one_b_step(t, s, pp)
            if 0 <= mb < m:
                seq.append(Action("F" if fwd else "B", mb, s))
        acts.append(tuple(seq))
    return Schedule(name="1f1b", devices=pp, micro_batches=m, device_of=tuple(range(pp)),
                    actions=tuple(acts))


def one_f_one_b_step(t: int, s: int, pp: int) -> tuple[int, bool]:
    """DeepSpeed TrainSchedule's step rule: the micro-batch stage s works on at step t (out of
    range: idle) and whether it is a forward."""
    if t % 2 == 0 and s % 2 == 0:
        return t // 2 - s // 2, True
    if t % 2 == 1 and s % 2 == 1:
        return (t - 1) // 2 - s // 2, True
    if t % 2 == 0:  # odd stage, even step
        return t // 2 - pp + (s + 1) // 2, False
    return (t - 1) // 2 - pp + 1 + s // 2, False


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards in order, then all backwards in order."""
    _check(pp, m)
    acts = tuple(tuple([Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)])
                 for s in range(pp))
    return Schedule(name="gpipe", devices=pp, micro_batches=m, device_of=tuple(range(pp)),
                    actions=acts)


def interleaved(pp: int, m: int, chunks: int = 2) -> Schedule:
    """Megatron interleaved 1F1B: chunk c of device d is virtual stage c*pp + d; micro-batches
    advance in groups of pp. Needs m to be a multiple of pp."""
    _check(pp, m)
    if m % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple "
                         f"of parallel.pp={pp}; use 1f1b or change train.micro_batches")
    total = m * chunks

    def fwd_of(k: int) -> tuple[int, int]:
        return (k // (pp * chunks)) * pp + k % pp, (k // pp) % chunks

    def bwd_of(k: int) -> tuple[int, int]:
        return (k // (pp * chunks)) * pp + k % pp, chunks - 1 - (k // pp) % chunks

    acts = []
    for d in range(pp):
        warm = min((pp - d - 1) * 2 + (chunks - 1) * pp, total)
        seq: list[Action] = []
        f = b = 0
        for _ in range(warm):
            mb, c = fwd_of(f)
            seq.append(Action("F", mb, c * pp + d))
            f += 1
        while f < total:
            mb, c = fwd_of(f)
            seq.append(Action("F", mb, c * pp + d))
            f += 1
            mb, c = bwd_of(b)
            seq.append(Action("B", mb, c * pp + d))
            b += 1
        while b < total:
            mb, c = bwd_of(b)
            seq.append(Action("B", mb, c * pp + d))
            b += 1
        acts.append(tuple(seq))
    device_of = tuple(v % pp for v in range(pp * chunks))
    return Schedule(name="interleaved", devices=pp, micro_batches=m, device_of=device_of,
                    actions=tuple(acts))


def zb_h1(pp: int, m: int) -> Schedule:
    """Zero-bubble H1: 1F1B placement, B/W split, at most pp - d micro-batches in flight."""
    _check(pp, m)
    return _greedy("zb-h1", pp, m, tuple(range(pp)), [pp - d for d in range(pp)])


def v_half(pp: int, m: int) -> Schedule:
    """V-shaped placement, activation memory about pp/2 micro-batches."""
    _check(pp, m)
    # caps count chunk slots: a micro-batch fills 2 slots of a V-shaped device
    return _greedy("v-half", pp, m, _v_placement(pp), [max(2, pp)] * pp)


def v_min(pp: int, m: int) -> Schedule:
    """V-shaped placement, activation memory about pp/3 micro-batches."""
    _check(pp, m)
    return _greedy("v-min", pp, m, _v_placement(pp), [max(2, math.ceil(2 * pp / 3))] * pp)


def _v_placement(pp: int) -> tuple[int, ...]:
    return tuple(range(pp)) + tuple(reversed(range(pp)))


def _greedy(name: str, pp: int, m: int, device_of: tuple[int, ...], cap: list[int]) -> Schedule:
    """List-schedule F/B/W on unit times with per-device activation-memory caps (in slots).

    Memory is counted per (micro-batch, chunk) slot, 1/k of a micro-batch for a device with k
    chunks, held from the micro-batch's first forward on the device (the later chunks are
    reserved then) until that chunk's W. A new micro-batch is admitted only if all its slots
    fit under the cap, so an admitted one can always finish: no deadlock for any cap >= 1.
    Priority: B (critical path), F of an admitted micro-batch, F of a new micro-batch if the
    cap allows, then W (fills bubbles and frees memory).
    """
    V = len(device_of)
    chunks_of = [[v for v in range(V) if device_of[v] == d] for d in range(pp)]
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    held = [0] * pp  # reserved slots per device
    admitted: list[set[int]] = [set() for _ in range(pp)]
    next_f = [[0] * V for _ in range(pp)]  # per device, per chunk: next mb to forward
    next_b = [[0] * V for _ in range(pp)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    acts: list[list[Action]] = [[] for _ in range(pp)]
    total = m * V * 3
    done = t = 0
    while done < total:
        for d in range(pp):
            k = len(chunks_of[d])
            room = cap[d] - held[d] >= k
            act = _pick(t, m, V, chunks_of[d], f_done, b_done, admitted[d], room,
                        next_f[d], next_b[d], pending_w[d])
            if act is None:
                continue
            acts[d].append(act)
            done += 1
            key = (act.mb, act.chunk)
            if act.op == "F":
                f_done[key] = t + 1
                next_f[d][act.chunk] += 1
                if act.mb not in admitted[d]:
                    admitted[d].add(act.mb)
                    held[d] += k
            elif act.op == "B":
                b_done[key] = t + 1
                next_b[d][act.chunk] += 1
                pending_w[d].append(key)
            else:
                held[d] -= 1
        t += 1
        if t > 10 * total + 100:
            raise RuntimeError(f"{name}: greedy schedule made no progress (bug)")
    return Schedule(name=name, devices=pp, micro_batches=m, device_of=device_of,
                    actions=tuple(tuple(a) for a in acts), split_backward=True)


def _pick(t: int, m: int, V: int, chunks: list[int], f_done: dict, b_done: dict,
          admitted: set[int], room: bool, next_f: list[int], next_b: list[int],
          pending_w: list[tuple[int, int]]) -> Action | None:
    # B: micro-batches leave in order per chunk; later chunks first (closer to the loss)
    for v in sorted(chunks, reverse=True):
        j = next_b[v]
        if j >= m or (j, v) not in f_done:
            continue
        dep = f_done[(j, v)] if v == V - 1 else b_done.get((j, v + 1), t + 1)
        if dep <= t:
            return Action("B", j, v)
    # F: an admitted micro-batch on a later chunk first, then a new one if there is room
    for v in sorted(chunks, reverse=True):
        j = next_f[v]
        if j >= m or not (j in admitted or room):
            continue
        if v == 0 or f_done.get((j, v - 1), t + 1) <= t:
            return Action("F", j, v)
    if pending_w:
        j, v = pending_w.pop(0)
        return Action("W", j, v)
    return None


def _check(pp: int, m: int) -> None:
    if pp < 1:
        raise ValueError(f"parallel.pp={pp} must be >= 1")
    if m < 1:
        raise ValueError(f"micro-batches={m} must be >= 1")


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "v-half": v_half,
    "v-min": v_min,
}
"""Schedule generators by name: generator(pp, micro_batches) -> Schedule."""


@lru_cache(maxsize=256)
def make_schedule(name: str, pp: int, m: int) -> Schedule:
    """A schedule by name (cached: schedules are immutable data)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} is unknown; use {', '.join(SCHEDULES)}")
    return SCHEDULES[name](pp, m)
