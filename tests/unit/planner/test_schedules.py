import numpy as np
import pytest

from mmpipe.planner.schedules import SCHEDULES, interleaved, make_schedule, one_f_one_b
from mmpipe.planner.simulator import chunk_values, simulate


def _run(name, p, m, f=1.0, b=2.0):
    s = make_schedule(name, p, m)
    F = chunk_values(s, np.full((p, m), f))
    A = chunk_values(s, np.ones((p, m)))
    if s.split_backward:
        B = chunk_values(s, np.full((p, m), b / 2))
        return s, simulate(s, fwd=F, bwd=B, wgrad=B, act=A)
    return s, simulate(s, fwd=F, bwd=chunk_values(s, np.full((p, m), b)), act=A)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 24), (3, 7)])
def test_1f1b_bubble_closed_form(p, m):
    _, r = _run("1f1b", p, m)
    for bub in r.bubble:
        assert bub == pytest.approx((p - 1) / (m + p - 1))
    assert r.makespan == pytest.approx(3 * (m + p - 1))


def test_1f1b_is_deepspeed_train_schedule_order():
    s = one_f_one_b(4, 6)
    stage1 = [(a.op, a.mb) for a in s.actions[1]]
    assert stage1 == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                      ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    last = [(a.op, a.mb) for a in s.actions[3]]
    assert last[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_action_exactly_once(name):
    p, m = 4, 8
    s = make_schedule(name, p, m)
    ops = ("F", "B", "W") if s.split_backward else ("F", "B")
    seen = sorted((a.op, a.mb, a.chunk) for seq in s.actions for a in seq)
    assert seen == sorted((o, j, v) for o in ops for j in range(m) for v in range(s.chunks))
    for d, seq in enumerate(s.actions):
        assert all(s.device_of[a.chunk] == d for a in seq)


# Peak in-flight activations per device, in micro-batches (a V-shaped device holds two chunks
# of half a micro-batch each), as the greedy V schedules produce them: V-Half holds p/2, V-Min
# ceil(p/3) (the published p/2 and p/3, Qi et al. 2024), whatever the micro-batch count.
V_PEAKS = {
    4: {"v-half": (2.0, 2.0, 2.0, 2.0), "v-min": (1.0, 1.0, 1.0, 1.5)},
    6: {"v-half": (3.0,) * 6, "v-min": (2.0,) * 6},
    8: {"v-half": (4.0,) * 8, "v-min": (3.0,) * 8},
}


@pytest.mark.parametrize("p", sorted(V_PEAKS))
@pytest.mark.parametrize("k", [1, 3])
def test_activation_memory_exact_per_device(p, k):
    m = k * p
    _, r1 = _run("1f1b", p, m)
    _, rz = _run("zb-h1", p, m)
    assert r1.peak_act == tuple(float(p - s) for s in range(p))  # stage s holds p - s
    assert max(rz.peak_act) == p
    for name, want in V_PEAKS[p].items():
        _, r = _run(name, p, m)
        assert r.peak_act == want, name


def test_zero_bubble_h1_beats_1f1b_at_same_memory():
    _, r1 = _run("1f1b", 4, 16)
    _, rz = _run("zb-h1", 4, 16)
    assert rz.makespan < r1.makespan


def test_gpipe_holds_all_micro_batches_and_interleaving_shrinks_bubble():
    _, g = _run("gpipe", 4, 8)
    assert max(g.peak_act) == 8
    _, i = _run("interleaved", 4, 8)
    _, o = _run("1f1b", 4, 8)
    assert i.makespan < o.makespan
    with pytest.raises(ValueError, match="multiple of parallel.pp=4"):
        interleaved(4, 6)


def test_transfers_and_unequal_stages():
    s = one_f_one_b(2, 2)
    r = simulate(s, fwd=np.array([[1.0, 1.0], [3.0, 3.0]]), bwd=np.array([[2.0, 2.0], [6.0, 6.0]]),
                 send_fwd=np.full((2, 2), 0.5), send_bwd=np.full((2, 2), 0.5))
    # F0 s0 [0,1] -> s1 F0 [1.5,4.5], B0 s1 [4.5,10.5], then s0 B0 starts at 11 after F1;
    # s1 F1 [10.5,13.5], B1 [13.5,19.5] -> s0 B1 [20, 22]
    assert r.makespan == pytest.approx(22.0)
    assert r.busy == (6.0, 18.0)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (4, 4), (4, 17), (8, 30)])
def test_fast_makespan_equals_full_simulation(p, m):
    from mmpipe.planner.simulator import makespan
    rng = np.random.default_rng(p * 100 + m)
    f, b, sf, sb = (rng.random((p, m)) for _ in range(4))
    s = make_schedule("1f1b", p, m)
    assert makespan(s, f, b, 0.1 * sf, 0.1 * sb) == pytest.approx(
        simulate(s, fwd=f, bwd=b, send_fwd=0.1 * sf, send_bwd=0.1 * sb).makespan, rel=1e-12)
