import numpy as np
import pytest

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.api import PlanProblem, plan_stages, plan_step
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import tune_baseline
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.partition import data_aware_stages
from mmpipe.planner.samples import sample_table
from mmpipe.planner.stage_cost import stage_costs
from mmpipe.planner.step import evaluate_step

from .helpers import hardware, model


def _s(text, images=(), audio=()):
    return SampleFeatures(image_positions=tuple(p for p, _ in images), image_tokens=tuple(t for _, t in images),
                          audio_positions=tuple(p for p, _ in audio), audio_tokens=tuple(t for _, t in audio),
                          text_tokens=text)


def _mixed(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = rng.integers(0, 3)
        if k == 0:
            out.append(_s(int(rng.integers(200, 3000))))
        else:
            g = int(rng.choice([16, 36, 64, 100])) * 4  # patches of a native-resolution image
            out.append(_s(int(rng.integers(20, 300)), images=[(g, g // 4)] * int(k)))
    return out


def _flat(replicas):
    return sorted(i for rep in replicas for mb in rep for i in mb)


def _problem(pp=4, dp=2, trainable=("vision.proj", "llm"), policy="data-aware", micro_batches=4) -> PlanProblem:
    return PlanProblem(model=model("qwen2-vl-7b"), hardware=hardware("h100"), pp=pp, dp=dp, trainable=trainable,
                       policy=policy, micro_batches=micro_batches)


def _setup(feats, pp=4, dp=2, trainable=("vision.proj", "llm")):
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    cost = build_cost_model(model=m, hardware=hw, trainable=trainable, dp=dp)
    sp = plan_stages(_problem(pp, dp, trainable), feats)
    return cost, sp


def test_every_sample_exactly_once_no_empty_micro_batch():
    feats = _mixed(96)
    cost, sp = _setup(feats)
    for policy in ("data-aware", "ds-default", "llava-grouped", "packed-ffd"):
        reps = plan_step(_problem(policy=policy), sp, feats)
        assert len(reps) == 2
        assert _flat(reps) == list(range(96)), policy
        assert all(mb for rep in reps for mb in rep)


def test_single_modality_and_tiny_steps():
    text = [_s(int(t)) for t in np.random.default_rng(1).integers(10, 2000, 40)]
    cost, sp = _setup(text)
    reps = plan_step(_problem(micro_batches=8), sp, text)
    assert _flat(reps) == list(range(40))
    few = text[:3]  # fewer samples than micro-batches (and than dp * micro_batches)
    reps = plan_step(_problem(micro_batches=8), sp, few)
    assert _flat(reps) == [0, 1, 2] and all(mb for rep in reps for mb in rep)


def test_sample_too_large_even_alone_names_sample_and_limit():
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    cost = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    with pytest.raises(ValueError, match=r"stage 1 \(llm.block.5..llm.head\) needs 94.5 GB for weights"):
        balance_step(stage_costs(cost, [(0, 40), (40, 65)]), sample_table([_s(10)]), [0], dp=1,
                     micro_batches=1)
    sc = stage_costs(cost, [(0, 40), (40, 50), (50, 58), (58, 65)])
    feats = [_s(100), _s(400_000)]
    table = sample_table(feats)
    with pytest.raises(ValueError) as err:
        balance_step(sc, table, [0, 1], dp=1, micro_batches=2, labels=["line 1", "line 2"])
    msg = str(err.value)
    assert msg.startswith("line 2 needs") and "GB" in msg and "stage" in msg and "hardware.memory_gb=80" in msg


def test_data_aware_beats_every_tuned_baseline_on_a_mixed_slice():
    feats = _mixed(128, seed=3)
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    cost = build_cost_model(model=m, hardware=hw, trainable=("vision.proj", "llm"), dp=2)
    table = sample_table(feats)
    steps = [list(range(64)), list(range(64, 128))]
    sp = data_aware_stages(cost, table, steps, pp=4, dp=2, micro_batches=4)
    sc = stage_costs(cost, sp.stages, sp.recompute)
    ours = [evaluate_step(sc, table, balance_step(sc, table, rows, dp=2, micro_batches=4), packing=True)
            for rows in steps]
    assert all(e.fits for e in ours)
    mean = np.mean([e.step_time for e in ours])
    for b in ("ds-default", "llava-grouped", "packed-ffd"):
        base = tune_baseline(b, cost, table, steps, pp=4, dp=2, micro_batches=4)
        assert base.fits
        assert mean <= base.mean_step_time, b


def test_short_samples_get_small_edge_micro_batches_and_beat_equal_sizes():
    # llava-pretrain-like: one 336x336 image (576 patches, 144 tokens) and ~80 text tokens each
    feats = [_s(int(t), images=[(576, 144)]) for t in np.random.default_rng(5).integers(40, 120, 256)]
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    cost = build_cost_model(model=m, hardware=hw, trainable=("vision.proj", "llm"), dp=2)
    table = sample_table(feats)
    sc = stage_costs(cost, [(0, 40), (40, 48), (48, 56), (56, 65)])
    rows = list(range(256))
    ours = balance_step(sc, table, rows, dp=2, micro_batches=8)
    plain = balance_step(sc, table, rows, dp=2, micro_batches=8, search=False)
    for rep in ours:
        sizes = [len(mb) for mb in rep]
        assert sizes[0] < max(sizes) and sizes[-1] < max(sizes), sizes
    t_ours = evaluate_step(sc, table, ours, packing=True)
    t_plain = evaluate_step(sc, table, plain, packing=True)
    assert t_ours.fits and t_ours.step_time < t_plain.step_time
