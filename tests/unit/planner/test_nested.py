"""The nested placement's program, its simulator and the planner's shares (planner/nested.py)."""

import itertools
import json

import numpy as np
import pytest

from mmpipe.model.geometry import features
from mmpipe.planner.api import DEFAULT_HEADROOM, Placement, PlanProblem, StepPlanner
from mmpipe.planner.command import PlanInput, PlanOutput, run_plan
from mmpipe.planner.nested import (
    BACKWARD,
    ENCODE,
    FORWARD,
    TOWER_BACKWARD,
    assign_shares,
    program,
    simulate_nested,
    slots,
    stage0_backward_step,
)
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.schedules import one_f_one_b
from mmpipe.planner.simulator import simulate
from mmpipe.planner.trace import read_trace

from .helpers import WORKLOADS, hardware, model

OMNI = model("omni-7b")
H100 = hardware("h100")
FEATS = [features(OMNI, m, where="t") for m in itertools.islice(read_trace(WORKLOADS / "omni-mix.jsonl"), 32)]
PLAN = StagePlan(stages=[(0, 76), (76, 84), (84, 92), (92, 99)])  # both towers, llm.embed..block.6 on stage 0


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 5), (3, 4), (4, 8), (5, 3)])
def test_the_program_is_deepspeeds_1f1b_with_every_share_encoded_before_and_run_backward_after(pp, m):
    ds = one_f_one_b(pp, m)
    for s in range(pp):
        mine = list(range(0, m, 2)) if s else list(range(m))
        ops = program(pp, m, s, mine)
        pipe = [(o.op, o.mb) for o in ops if o.op in (FORWARD, BACKWARD)]
        assert pipe == [(a.op, a.mb) for a in ds.actions[s]]  # DeepSpeed's own order, untouched
        enc = {o.mb: (n, o) for n, o in enumerate(ops) if o.op == ENCODE}
        back = {o.mb: (n, o) for n, o in enumerate(ops) if o.op == TOWER_BACKWARD}
        assert sorted(enc) == sorted(back) == mine  # each part encoded once, run backward once
        for k in mine:
            if s == 0:  # just before its forward, right after its backward
                assert ops[enc[k][0] + 1] == (FORWARD, k, 2 * k) or (ops[enc[k][0] + 1].op, ops[enc[k][0] + 1].mb) \
                    == (FORWARD, k)
                assert (ops[back[k][0] - 1].op, ops[back[k][0] - 1].mb) == (BACKWARD, k)
            else:  # a step of slack before stage 0's forward of k (step 2k), after its backward
                assert enc[k][1].step <= max(0, 2 * k - 2)
                first_after = [o for o in ops[back[k][0] + 1:] if o.op in (FORWARD, BACKWARD)]
                assert all(o.step >= stage0_backward_step(pp, k) + 2 for o in first_after[:1])
                assert back[k][0] > enc[k][0]


def test_stage0_backward_step_is_deepspeeds():
    from mmpipe.planner.schedules import one_f_one_b_step

    for pp, m in ((2, 3), (4, 8)):
        for k in range(m):
            t = next(t for t in range(2 * (m + pp - 1)) if one_f_one_b_step(t, 0, pp) == (k, False))
            assert t == stage0_backward_step(pp, k)


def _costs(pp, m, seed=0):
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 1.5, (pp, m))
    return dict(fwd=f, bwd=2 * f, send_fwd=np.full((pp, m), 0.05), send_bwd=np.full((pp, m), 0.05))


def test_nothing_to_encode_times_exactly_the_1f1b_simulator():
    for pp, m in ((2, 4), (3, 7), (4, 8)):
        c = _costs(pp, m)
        z = np.zeros((pp, m))
        got = simulate_nested(**c, encode=z, tower_backward=z, transfer=z)
        want = simulate(one_f_one_b(pp, m), fwd=c["fwd"], bwd=c["bwd"], send_fwd=c["send_fwd"],
                        send_bwd=c["send_bwd"])
        assert got.makespan == pytest.approx(want.makespan, rel=1e-12)
        assert got.busy == pytest.approx(want.busy) and got.wait == 0.0


def test_encode_work_costs_nothing_in_a_bubble_and_its_excess_where_it_does_not_fit():
    pp, m = 3, 4
    f, z = np.ones((pp, m)), np.zeros((pp, m))
    base = simulate_nested(fwd=f, bwd=2 * f, send_fwd=z, send_bwd=z, encode=z, tower_backward=z, transfer=z)
    assert base.makespan == pytest.approx((m + pp - 1) * 3)  # 1F1B, F=1, B=2
    assert base.first_forward == (0.0, 1.0, 2.0)  # stage s waits s forwards: its warm-up bubble
    small = z.copy()
    small[2, 1] = 0.9  # stage 2 encodes a part of micro-batch 1 first: in its 2 s of warm-up, before stage 0's F(1)
    t = simulate_nested(fwd=f, bwd=2 * f, send_fwd=z, send_bwd=z, encode=small, tower_backward=z, transfer=z)
    assert t.makespan == pytest.approx(base.makespan) and t.wait == 0.0
    big = z.copy()
    big[1, 1] = 2.5  # stage 1 has 1 s of warm-up: its first forward, and so the pipeline, starts 1.5 s late
    t = simulate_nested(fwd=f, bwd=2 * f, send_fwd=z, send_bwd=z, encode=big, tower_backward=z, transfer=z)
    assert t.makespan == pytest.approx(base.makespan + 1.5)
    assert t.wait == pytest.approx(1.5)  # stage 0's forward of micro-batch 1 waited for its features (2.5, not 1)
    late = z.copy()
    late[0, 3] = 0.7  # stage 0 encodes its own part just before the forward: on its critical path
    t = simulate_nested(fwd=f, bwd=2 * f, send_fwd=z, send_bwd=z, encode=late, tower_backward=late * 2,
                        transfer=z)
    assert t.makespan > base.makespan and t.busy[0] == pytest.approx(base.busy[0] + 2.1)


def _bottleneck_stage_0():
    """pp=4, m=8, two samples a micro-batch; stage 0 holds little of the pipeline, so its
    encoding makes it the bottleneck (~5 s of pipeline + ~38 s of tower work, the others ~24 s)."""
    pp, m = 4, 8
    c = _costs(pp, m, seed=1)
    c["fwd"][0] *= 0.2
    c["bwd"][0] *= 0.2
    pre = np.linspace(0.4, 1.2, 2 * m)
    mbs = [[2 * k, 2 * k + 1] for k in range(m)]
    where = {i: k for k, mb in enumerate(mbs) for i in mb}

    def timed(shares):
        enc, back, parts = np.zeros((pp, m)), np.zeros((pp, m)), np.zeros((pp, m), dtype=bool)
        for s, share in enumerate(shares):
            for i in share:
                enc[s, where[i]] += pre[i]
                back[s, where[i]] += 2 * pre[i]
                parts[s, where[i]] = True
        return simulate_nested(**c, encode=enc, tower_backward=back, transfer=np.full((pp, m), 0.01), parts=parts)

    return pp, m, pre, mbs, timed


def test_the_planner_moves_encode_work_off_a_bottleneck_stage_0_and_never_lengthens_the_step():
    pp, m, pre, mbs, timed = _bottleneck_stage_0()

    shares, t = assign_shares(timed, mbs, pre, pp)
    staged = timed([list(range(2 * m)), [], [], []])
    assert sorted(i for sh in shares for i in sh) == list(range(2 * m))
    assert t.makespan < 0.85 * staged.makespan  # the other stages' waits took a good part of it
    assert t == timed(shares) and any(shares[1:])
    held, _ = assign_shares(timed, mbs, pre, pp, fits=lambda s, share: False)  # no room anywhere: all stay
    assert held == [list(range(2 * m)), [], [], []]


def _planner(encoders, trainable=("all",)):
    problem = PlanProblem(model=OMNI, hardware=H100, trainable=trainable, dp=2, policy="data-aware", micro_batches=4,
                          memory_headroom=0.08, placement=Placement.parse(encoders, OMNI))
    return StepPlanner(problem, PLAN)


def test_a_nested_step_encodes_each_media_sample_once_on_its_own_replica_and_is_deterministic():
    planner = _planner("nested")
    plan = planner.plan(FEATS[:16])
    assert plan == planner.plan(FEATS[:16])  # every rank plans the same shares
    for rep, shares in zip(plan.replicas, plan.encode):
        media = sorted(i for mb in rep for i in mb if FEATS[i].image_tokens or FEATS[i].audio_tokens
                       or FEATS[i].video_tokens)
        assert sorted(i for share in shares for i in share) == media


def test_the_plan_json_says_in_which_slot_each_rank_encodes_its_parts(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = (WORKLOADS / "omni-mix.jsonl").read_text().splitlines()[:32]
    trace.write_text("\n".join(lines) + "\n")
    problem = PlanProblem(model=OMNI, hardware=H100, pp=4, dp=2, global_batch=32, micro_batches=4, trainable=("all",),
                          policy="data-aware", memory_headroom=DEFAULT_HEADROOM,
                          placement=Placement.parse("nested", OMNI))
    plan = run_plan(problem, PlanInput(trace_path=str(trace)), output=PlanOutput(quiet=True))
    assert plan["encoders"] == {"vision": "nested", "audio": "nested"}
    step = plan["steps"][0]
    assert len(step["encode_slots"]) == 8
    for rank, (share, got) in enumerate(zip(step["encode"], step["encode_slots"])):
        stage, replica = divmod(rank, 2)
        mbs = step["replicas"][replica]
        parts = [k for k, mb in enumerate(mbs) if set(mb) & set(share)]
        assert [k for k, _, _ in got] == parts  # one slot per micro-batch it encodes part of
        assert got == slots(4, len(mbs), [parts if s == stage else [] for s in range(4)])[stage]
    media = [i for i, line in enumerate(lines) if any(json.loads(line).get(k) for k in ("images", "video",
                                                                                          "audio_seconds"))]
    assert sorted(i for share in step["encode"] for i in share) == sorted(media)


def test_nested_and_spread_are_one_schedule_per_step():
    with pytest.raises(ValueError, match="mixes spread and nested towers"):
        Placement.parse({"vision": "spread", "audio": "nested"}, OMNI)
    p = Placement.parse({"audio": "nested"}, OMNI)
    assert p.nested and p.spread == ("audio",) and p.name == "audio nested"
    assert Placement.parse("nested", OMNI).name == "nested"
    assert {c.name for c in Placement.parse("auto", OMNI).candidates(OMNI)} == {
        "stages", "spread", "vision spread", "audio spread", "nested", "vision nested", "audio nested"}


def test_a_part_of_a_micro_batch_is_priced_as_one_tower_pass():
    from mmpipe.planner.cost import build_cost_model
    from mmpipe.planner.samples import sample_table
    from mmpipe.planner.spread import encode_costs, spread_model

    sm = spread_model(build_cost_model(model=OMNI, hardware=H100, trainable=("all",), dp=2), {"vision": "nested",
                                                                                               "audio": "nested"})
    ec = encode_costs(sm, sample_table(FEATS[:16]))
    media = [i for i in range(16) if ec.media[i]][:6]
    one = ec.units([media[0]])
    assert one[0] == pytest.approx(ec.pre[media[0]]) and one[1]["none"] == pytest.approx(ec.post["none"][media[0]])
    pre, post, _ = ec.units(media)
    assert 0 < pre < sum(ec.pre[i] for i in media)  # each op's fixed cost once, a better efficiency point
    assert 0 < post["blocks"] < sum(ec.post["blocks"][i] for i in media)
    assert ec.units.share([media[:3], media[3:]], media[1:5], "none")[0] == pytest.approx(
        ec.units(media[1:3])[0] + ec.units(media[3:5])[0])  # a share is one pass per micro-batch part


def test_nothing_leaves_stage_0_when_the_towers_sync_costs_more_than_the_bubbles_give():
    pp, m, pre, mbs, timed = _bottleneck_stage_0()

    staged = timed([list(range(2 * m)), [], [], []])
    moved, t = assign_shares(timed, mbs, pre, pp, sync=1.0)
    assert any(moved[1:]) and t.makespan + 1.0 < staged.makespan  # worth its 1 s sync
    kept, t = assign_shares(timed, mbs, pre, pp, sync=staged.makespan)  # never worth it
    assert kept == [list(range(2 * m)), [], [], []] and t == staged
