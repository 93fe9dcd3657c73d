"""NestedSchedule's instruction stream (runtime/nested.py): DeepSpeed's TrainSchedule with the
nested program's four instructions where planner/nested.py's `program` puts them, per stage."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds

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
            if k in mine:
                assert _named(cmds[i - 2:i - 1]) == [("EncodeFeatures", {"mb": k})], (t, cmds[i - 2:i + 1])
            else:
                assert not isinstance(cmds[i - 2], EncodeFeatures), (t, cmds[i - 2:i + 1])
        if isinstance(c, ds.BackwardPass):  # its feature gradients leave right after it
            backwards += 1
            assert _named(cmds[i + 1:i + 2]) == [("SendFeatureGrads", {"mb": k})], (t, cmds[i:i + 2])
    assert forwards == backwards == M
    assert sorted(c.mb for c in cmds if isinstance(c, EncodeFeatures)) == sorted(mine)  # each once
    assert sorted(c.mb for c in cmds if isinstance(c, RecvFeatures)) == list(range(M))
    assert sorted(c.mb for c in cmds if isinstance(c, SendFeatureGrads)) == list(range(M))
    # its own share's tower backward: in the last step, after the last backward's gradients left,
    # right before DeepSpeed's reductions
    last = 2 * (M + PP - 1) - 1
    tail = [c for t, c in flat if t == last]
    names = [type(c).__name__ for c in tail]
    r = names.index("ReduceTiedGrads")
    assert names[r - len(mine) - 2:r + 3] == (["BackwardPass", "SendFeatureGrads"] + ["TowerBackward"] * len(mine)
                                              + ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"])
    assert [c.mb for c in tail if isinstance(c, TowerBackward)] == sorted(mine)
    assert sum(isinstance(c, TowerBackward) for c in cmds) == len(mine)


@pytest.mark.parametrize("case", list(SHARES))
@pytest.mark.parametrize("stage", range(1, PP))
def test_a_later_stage_encodes_first_and_runs_the_tower_backward_in_its_cool_down(case, stage):
    mine = SHARES[case][stage]
    flat = _flat(stage, SHARES[case])
    cmds = [c for _, c in flat]
    # every share encoded at step 0, in execution order, before anything of DeepSpeed's
    assert _named(cmds[:len(mine)]) == [("EncodeFeatures", {"mb": k}) for k in sorted(mine)]
    assert all(t == 0 for t, c in flat[:len(mine)])
    assert not any(isinstance(c, (EncodeFeatures, RecvFeatures, SendFeatureGrads)) for c in cmds[len(mine):])
    back = [i for i, c in enumerate(cmds) if isinstance(c, TowerBackward)]
    assert [cmds[i].mb for i in back] == sorted(mine)
    if not mine:
        return
    last_b = max(i for i, c in enumerate(cmds) if isinstance(c, ds.BackwardPass))
    last_send = max(i for i, c in enumerate(cmds) if isinstance(c, ds.SendGrad))  # the last backward's gradient
    reduce = [i for i, c in enumerate(cmds) if isinstance(c, (ds.ReduceTiedGrads, ds.ReduceGrads))]
    assert last_b < last_send < back[0] and back[-1] < min(reduce)  # stage 0 never waits on a tower backward
    assert back == list(range(back[0], back[0] + len(mine)))  # together
    assert flat[back[0]][0] == flat[last_b][0] + 1  # in the step right after its last backward (its cool-down)
