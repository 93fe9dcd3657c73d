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
- stage 0 sends the feature gradients of micro-batch k right after k's backward;
- stage s >= 1 runs its shares' tower backward after its own last backward (its cool-down
  bubble), micro-batch by micro-batch as their gradients arrive; stage 0 its own share's
  before the gradient reduction; then the towers' gradients are all-reduced (as spread).

So a rank's encode work costs nothing where it fits the time its stage waits anyway; the
planner (`assign_shares`) gives each rank of stage s >= 1 the samples whose encoding fits its
warm-up bubble and whose features arrive before stage 0 needs them, and stage 0 the rest.

`program` is the one home of this order: the runtime inserts its instructions into DeepSpeed's
steps from it, the simulator executes it, and the plan JSON records its slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    encodes part of) where the nested schedule puts them (module docstring)."""
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
        last = total - 1
        return tuple(out + [Op(TOWER_BACKWARD, k, last) for k in mine])
    last_b = max(op.step for op in pipe if op.op == BACKWARD)
    cool = min(last_b + 1, total - 1)
    return tuple([Op(ENCODE, k, 0) for k in mine] + pipe + [Op(TOWER_BACKWARD, k, cool) for k in mine])


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
