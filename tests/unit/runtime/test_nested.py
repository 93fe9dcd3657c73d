"""NestedSchedule's instruction stream (runtime/nested.py): DeepSpeed's TrainSchedule with the
nested program's four instructions where planner/nested.py's `program` puts them, per stage."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

from mmpipe.planner.nested import BACKWARD, ENCODE, FORWARD, TOWER_BACKWARD, program, stage0_backward_step
from mmpipe.runtime.nested import EncodeFeatures, NestedSchedule, RecvFeatures, SendFeatureGrads, TowerBackward

OURS = (EncodeFeatures, RecvFeatures, SendFeatureGrads, TowerBackward)
PP, M = 3, 4
SHARES = {  # per stage, the micro-batches its rank encodes part of
    "every stage": ([1, 3], [0, 1, 2], [2, 3]),
    "a stage without media": ([0, 1, 2, 3], [], [3]),
}


def _named(cmds) -> list[tuple[str, dict]]:
    return [(type(c).__name__, dict(c.kwargs)) for c in cmds]


def _flat(stage: int, shares) -> list[tuple[int, ds.PipeInstruction]]:
    """(step, instruction) of the stage's whole stream, in execution order."""
    steps = NestedSchedule(micro_batches=M, stages=PP, stage_id=stage, shares=shares[stage]).steps()
    return [(t, c) for t, cmds in enumerate(steps) for c in cmds]


@pytest.mark.parametrize("case", list(SHARES))
@pytest.mark.parametrize("stage", range(PP))
def test_deepspeeds_instructions_are_unchanged(case, stage):
    nested = list(NestedSchedule(micro_batches=M, stages=PP, stage_id=stage, shares=SHARES[case][stage]).steps())
    plain = list(ds.TrainSchedule(micro_batches=M, stages=PP, stage_id=stage).steps())
    assert len(nested) == len(plain) == 2 * (M + PP - 1)
    for t, (a, b) in enumerate(zip(nested, plain)):
        assert _named(c for c in a if not isinstance(c, OURS)) == _named(b), t


@pytest.mark.parametrize("case", list(SHARES))
@pytest.mark.parametrize("stage", range(PP))
def test_the_stream_runs_the_programs_ops_in_its_order(case, stage):
    """The one home of the order is planner/nested.py's `program`: the compute of the stream
    (forwards and backwards by micro-batch, encodes and tower backwards) is the program's."""
    sched = NestedSchedule(micro_batches=M, stages=PP, stage_id=stage, shares=SHARES[case][stage])
    ran = []
    for t, c in _flat(stage, SHARES[case]):
        k, _ = sched._step_to_micro_batch(t)
        if isinstance(c, ds.ForwardPass):
            ran.append((FORWARD, k))
        elif isinstance(c, ds.BackwardPass):
            ran.append((BACKWARD, k))
        elif isinstance(c, EncodeFeatures):
            ran.append((ENCODE, c.mb))
        elif isinstance(c, TowerBackward):
            ran.append((TOWER_BACKWARD, c.mb))
    assert ran == [(o.op, o.mb) for o in program(PP, M, stage, SHARES[case][stage])]


@pytest.mark.parametrize("case", list(SHARES))
def test_stage_0_encodes_receives_and_sends_around_each_pass(case):
    mine = SHARES[case][0]
    sched = NestedSchedule(micro_batches=M, stages=PP, stage_id=0, shares=mine)
    flat = _flat(0, SHARES[case])
    cmds = [c for _, c in flat]
    forwards = backwards = 0
    for i, (t, c) in enumerate(flat):
        k, _ = sched._step_to_micro_batch(t)
        if isinstance(c, ds.ForwardPass):  # its features joined just before it, its own share encoded before that
            forwards += 1
            assert _named(cmds[i - 1:i]) == [("RecvFeatures", {"mb": k})], (t, cmds[i - 2:i + 1])
            before = [x for t2, x in flat[:i] if t2 == t]
            assert any(isinstance(x, EncodeFeatures) and x.mb == k for x in before) == (k in mine)
        if isinstance(c, ds.BackwardPass):  # its feature gradients leave right after it, then its own backward
            backwards += 1
            assert _named(cmds[i + 1:i + 2]) == [("SendFeatureGrads", {"mb": k})], (t, cmds[i:i + 2])
            if k in mine:
                assert _named(cmds[i + 2:i + 3]) == [("TowerBackward", {"mb": k})], (t, cmds[i:i + 3])
    assert forwards == backwards == M
    assert sorted(c.mb for c in cmds if isinstance(c, EncodeFeatures)) == sorted(mine)  # each once
    assert sorted(c.mb for c in cmds if isinstance(c, RecvFeatures)) == list(range(M))
    assert sorted(c.mb for c in cmds if isinstance(c, SendFeatureGrads)) == list(range(M))
    assert sorted(c.mb for c in cmds if isinstance(c, TowerBackward)) == sorted(mine)


@pytest.mark.parametrize("case", list(SHARES))
@pytest.mark.parametrize("stage", range(1, PP))
def test_a_later_stage_works_on_the_tower_between_its_sends_and_its_waits(case, stage):
    """A stage s >= 1 never holds up a neighbour: its encodes and tower backwards come after the
    step's sends (SendActivation / SendGrad) and before the step's first receive; each encode of
    micro-batch k is in a step before stage 0's forward of k (step 2k), each tower backward in a
    step after stage 0's backward of k."""
    mine = SHARES[case][stage]
    flat = _flat(stage, SHARES[case])
    for i, (t, c) in enumerate(flat):
        if not isinstance(c, (EncodeFeatures, TowerBackward)):
            continue
        same = [x for t2, x in flat if t2 == t]
        j = same.index(c)
        assert not any(isinstance(x, (ds.SendActivation, ds.SendGrad)) for x in same[j:]), (t, same)
        assert not any(isinstance(x, (ds.RecvActivation, ds.RecvGrad)) for x in same[:j]), (t, same)
        if isinstance(c, EncodeFeatures):
            assert t < 2 * c.mb or t == 0 or c.mb == 0
        else:
            assert t > stage0_backward_step(PP, c.mb) or t == 2 * (M + PP - 1) - 1
    assert sorted(c.mb for _, c in flat if isinstance(c, EncodeFeatures)) == sorted(mine)
    assert sorted(c.mb for _, c in flat if isinstance(c, TowerBackward)) == sorted(mine)
    assert not any(isinstance(c, (RecvFeatures, SendFeatureGrads)) for _, c in flat)
