"""The nested placement of encoder towers (plan.encoders=nested): encoder work inside the
pipeline's bubbles, as one instruction stream per stage that the runtime executes
(runtime/nested.py) and the simulator prices (`simulate_nested`).

A nested tower is held as a spread one (its weights on stage 0, a replica on every other rank
of the replica, planner/spread.py), and the same per-sample shares encode it; what changes is
*when*. Under DeepSpeed's 1F1B `TrainSchedule`, stage s runs nothing in its first s steps (it
waits for micro-batch 0's activations) and nothing after its last backward (it waits for the
optimizer step): 2s idle steps per step. The nested schedule puts the tower there:

- stage s >= 1 encodes its share of every micro-batch at step 0, in execution order, and sends
  each micro-batch's features to stage 0 as soon as they are made (they are in flight while it
  waits for micro-batch 0);
- stage 0 encodes its own share of micro-batch k just before k's forward, and waits there for
  the other ranks' features of k (nothing waits for all of them, as the spread pre-pass does);
- stage 0 sends the feature gradients of micro-batch k right after k's backward, and runs its
  own share's tower backward of k there (as a staged tower's backward would run);
- stage s >= 1 runs its shares' tower backward after its own last backward (its cool-down
  bubble), micro-batch by micro-batch as their gradients arrive; then the towers' gradients
  are reduced to stage 0 (as spread).

So a rank's encode work costs nothing where it fits the time its stage waits anyway; the
planner (`assign_shares`) gives each rank of stage s >= 1 the samples whose encoding fits its
warm-up bubble and whose features arrive before stage 0 needs them, and stage 0 the rest.

`program` is the one home of this order: the runtime inserts its instructions into DeepSpeed's
steps from it, the simulator executes it, and the plan JSON records its slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.schedules import one_f_one_b_step

ENCODE, FORWARD, BACKWARD, TOWER_BACKWARD = "E", "F", "B", "T"
"""The ops of a nested stage program: encode a share, the pipeline's forward and backward, the
tower backward of a share."""


@dataclass(frozen=True, slots=True)
class Op:
    """One entry of a stage's nested program."""

    op: str
    """ENCODE, FORWARD, BACKWARD or TOWER_BACKWARD."""
    mb: int
    """Micro-batch (execution order of the replica's micro-batches)."""
    step: int
    """The DeepSpeed TrainSchedule step it runs in (0 .. 2 (m + pp - 1) - 1)."""


def program(pp: int, m: int, stage: int, shares: Sequence[int]) -> tuple[Op, ...]:
    """Stage `stage`'s ops in execution order: DeepSpeed's 1F1B forwards and backwards with the
    encoding and tower backward of the micro-batches in `shares` (those this stage's rank
    encodes part of) where the nested schedule puts them.

    Steps order every dependency between stages (an op at step t needs only ops of earlier
    steps), so the program waits for nothing it could not have: stage 0 forwards micro-batch
    k at step 2k and runs its backward at step `b0(k)`. Stage 0 encodes its part of k just
    before that forward and runs its tower backward right after that backward. A stage s >= 1
    encodes its part of k just before its last pipeline op of a step <= 2k - 2 (one step of
    slack for the features' trip; none such: first thing, at step 0), so encode work fills the
    waits of its own pipeline ops, and runs the tower backward of k just before its first
    pipeline op of a step >= b0(k) + 2 (after the last one, in its cool-down, when none), when
    the gradients have had a step to arrive. Within a step, an op of the pipeline runs after
    the encode and tower work placed before it."""
    total = 2 * (m + pp - 1)
    pipe = [Op(FORWARD if fwd else BACKWARD, mb, t) for t in range(total)
            for mb, fwd in (one_f_one_b_step(t, stage, pp),) if 0 <= mb < m]
    mine = sorted(set(int(k) for k in shares))
    if any(not 0 <= k < m for k in mine):
        raise ValueError(f"stage {stage}: encode shares name micro-batches {mine}, the step has {m}")
    if stage == 0:
        out: list[Op] = []
        for op in pipe:
            if op.op == FORWARD and op.mb in mine:
                out.append(Op(ENCODE, op.mb, op.step))
            out.append(op)
            if op.op == BACKWARD and op.mb in mine:
                out.append(Op(TOWER_BACKWARD, op.mb, op.step))
        return tuple(out)
    before: dict[int, list[Op]] = {}  # index of the pipeline op they precede (len(pipe): after all)
    for k in mine:
        at = [n for n, op in enumerate(pipe) if op.step <= 2 * k - 2]
        n = at[-1] if at else 0
        before.setdefault(n, []).append(Op(ENCODE, k, pipe[n].step if at else 0))
    for k in mine:
        due = stage0_backward_step(pp, k) + 2
        n = next((n for n, op in enumerate(pipe) if op.step >= due), len(pipe))
        before.setdefault(n, []).append(Op(TOWER_BACKWARD, k, pipe[n].step if n < len(pipe) else total - 1))
    out = []
    for n, op in enumerate(pipe + [None]):
        out += sorted(before.get(n, ()), key=lambda o: (o.op != ENCODE, o.mb))
        if op is not None:
            out.append(op)
    return tuple(out)


def stage0_backward_step(pp: int, k: int) -> int:
    """The TrainSchedule step in which stage 0 runs micro-batch k's backward."""
    return 2 * (k + pp - 1) + 1


def slots(pp: int, m: int, shares: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Per stage, [micro-batch, encode step, tower-backward step] of each micro-batch it
    encodes part of (`shares[s]`: those micro-batches): what the plan JSON records."""
    out = []
    for s, mbs in enumerate(shares):
        ops = program(pp, m, s, mbs)
        enc = {o.mb: o.step for o in ops if o.op == ENCODE}
        back = {o.mb: o.step for o in ops if o.op == TOWER_BACKWARD}
        out.append([[k, enc[k], back[k]] for k in sorted(enc)])
    return out


# -- the simulator: the same program, timed ---------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class NestedTimes:
    """What one replica's nested step costs (`simulate_nested`)."""

    makespan: float
    """From the first op's start to the last op's end on any stage, s."""
    pipeline_end: float
    """When the last pipeline backward ends (tower backward after it is exposed), s."""
    wait: float
    """Time stage 0 waited for other ranks' features before its forwards, s."""
    busy: tuple[float, ...]
    """Per stage, its compute time (pipeline, encode and tower backward), s."""
    first_forward: tuple[float, ...]
    """Per stage, when its first forward starts (its warm-up bubble ends), s."""


def simulate_nested(*, fwd: np.ndarray, bwd: np.ndarray, send_fwd: np.ndarray, send_bwd: np.ndarray,
                    encode: np.ndarray, tower_backward: np.ndarray, transfer: np.ndarray,
                    parts: np.ndarray | None = None) -> NestedTimes:
    """Time the nested program of one replica: every stage runs `program`'s ops in order, each
    when its stage is free and its inputs are there.

    Args:
        fwd, bwd, send_fwd, send_bwd: [pp, m] the pipeline's forward and whole backward time of
            each micro-batch on each stage, and the activation / gradient transfer from stage s
            to its neighbour (MicroBatchCosts, the towers' layers not among the stages').
        encode, tower_backward: [pp, m] stage s's encode and tower-backward time of its part of
            micro-batch k (0: no part; stage 0's encode runs just before k's forward).
        transfer: [pp, m] sending stage s's features of micro-batch k to stage 0 (and their
            gradients back), latency included; row 0 unused.
        parts: [pp, m] stage s encodes part of micro-batch k (default: where it spends time).
    Dependencies: a stage's forward of k after the previous stage's plus the transfer; stage
    0's after every other rank's features of k arrived; a backward after the next stage's
    (the last stage's after its forward); a tower backward of k after stage 0's backward of k
    plus the gradient transfer. Transfers do not queue on a link (each is its own)."""
    P, m = fwd.shape
    has = (encode > 0) | (tower_backward > 0) if parts is None else np.asarray(parts, dtype=bool)
    progs = [program(P, m, s, [k for k in range(m) if has[s, k]]) for s in range(P)]
    f_end = np.full((P, m), np.nan)
    b_end = np.full((P, m), np.nan)
    e_end = np.full((P, m), np.nan)
    ends = {ENCODE: e_end, FORWARD: f_end, BACKWARD: b_end}
    free = [0.0] * P
    busy = [0.0] * P
    ptr = [0] * P
    wait = 0.0
    total = sum(len(p) for p in progs)
    done = 0
    while done < total:
        moved = False
        for s in range(P):
            while ptr[s] < len(progs[s]):
                o = progs[s][ptr[s]]
                k = o.mb
                if o.op == ENCODE:
                    ready, dur = 0.0, float(encode[s, k])
                elif o.op == FORWARD:
                    if s:
                        ready = f_end[s - 1, k] + send_fwd[s - 1, k]
                    else:
                        parts = [e_end[r, k] + transfer[r, k] for r in range(1, P) if has[r, k]]
                        ready = max(parts, default=0.0)
                    dur = float(fwd[s, k])
                elif o.op == BACKWARD:
                    ready = f_end[s, k] if s == P - 1 else b_end[s + 1, k] + send_bwd[s + 1, k]
                    dur = float(bwd[s, k])
                else:
                    ready = b_end[0, k] + (transfer[s, k] if s else 0.0)
                    dur = float(tower_backward[s, k])
                if np.isnan(ready):
                    break
                start = max(free[s], float(ready))
                if o.op == FORWARD and s == 0:
                    wait += start - free[s]
                end = start + dur
                free[s] = end
                busy[s] += dur
                if o.op in ends:
                    ends[o.op][s, k] = end
                ptr[s] += 1
                done += 1
                moved = True
        if not moved:
            raise RuntimeError("the nested program has a cycle (a bug: stage programs wait on each other)")
    return NestedTimes(makespan=max(free), pipeline_end=float(np.nanmax(b_end)), wait=wait, busy=tuple(busy),
                       first_forward=tuple(float(np.nanmin(f_end[s] - fwd[s])) for s in range(P)))


def assign_shares(timed: Callable[[list[list[int]]], NestedTimes], mbs: Sequence[Sequence[int]],
                  pre: Sequence[float], pp: int, *, fits: Callable[[int, list[int]], bool] = lambda s, share: True,
                  sync: float = 0.0) -> tuple[list[list[int]], NestedTimes]:
    """Per stage, the samples its rank encodes, and their timed program: the planner's rule.

    `timed` times the program of given shares (`simulate_nested` on the replica's costs);
    `mbs` the replica's micro-batches as the rows of its samples with media of a nested tower;
    `pre` each row's encode time. From every sample on stage 0 (a staged tower's work, placed
    the nested way), samples are visited largest encode first, each moved to the stage s >= 1
    whose program is then the shortest, if that is shorter than keeping it (ties: the one
    that leaves stage 0 the least to do, then the lower stage) and whose memory still holds
    its share (`fits(stage, share)`): encode work goes where the pipeline waits, and only
    while the step gets shorter, counting `sync` (the towers' gradient reduce and weight
    broadcast, which a step pays only once a stage s >= 1 encodes)."""
    every = [int(i) for mb in mbs for i in mb]
    shares: list[list[int]] = [sorted(every)] + [[] for _ in range(pp - 1)]
    best = timed(shares)
    span = best.makespan  # with the sync once anything left stage 0
    for i in sorted(every, key=lambda i: (-pre[i], i)):
        pick = None
        for s in range(1, pp):
            trial = [[j for j in shares[0] if j != i]] + [sorted(sh + [i]) if r == s else sh
                                                          for r, sh in enumerate(shares[1:], start=1)]
            if not fits(s, trial[s]):
                continue
            t = timed(trial)
            key = (t.makespan + sync, t.busy[0], s)
            if key[:2] < (span - 1e-12, best.busy[0]) and (pick is None or key < pick[0]):
                pick = (key, trial, t)
        if pick is not None:
            (span, _, _), shares, best = pick
    return shares, best
