"""parallel.devices=N with parallel.pp / parallel.dp = auto: the candidate layouts, the choice,
the table, and the config side the runtime calls before launch."""

import dataclasses
import json

import numpy as np
import pytest

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.api import DEFAULT_HEADROOM, PlanProblem, choose_layout
from mmpipe.planner.command import PlanInput, PlanOutput, run_plan
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.layout import Layout, candidates, plan_layout, rank_layouts
from mmpipe.planner.samples import sample_table

from .helpers import hardware, model
from .test_command import _trace


def _img(text, tok=576, pos=577):
    return SampleFeatures(image_positions=(pos,), image_tokens=(tok,), audio_positions=(), audio_tokens=(),
                          text_tokens=text)


def _short(n, seed=0):  # llava-pretrain-like: one 336-px image and a short caption each
    return [_img(int(t)) for t in np.random.default_rng(seed).integers(20, 120, n)]


def test_candidates_are_the_valid_splits_and_the_rest_say_why():
    ok, out = candidates(devices=12, n_layers=15, global_batch=16, micro_batches=4)
    assert ok == [(3, 4), (6, 2), (12, 1)]
    assert [(x.pp, x.dp, x.note) for x in out] == [
        (1, 12, "train.global_batch=16 is not divisible by parallel.dp=12"),
        (2, 6, "train.global_batch=16 is not divisible by parallel.dp=6"),
        (4, 3, "train.global_batch=16 is not divisible by parallel.dp=3")]
    ok, out = candidates(devices=32, n_layers=15, global_batch=64, micro_batches=8)
    assert (16, 2) not in ok and (4, 8) in ok and (2, 16) not in ok
    notes = {(x.pp, x.dp): x.note for x in out}
    assert notes[(32, 1)] == "parallel.pp=32 exceeds the 15 layers"
    assert notes[(2, 16)] == "train.micro_batches=8 exceeds the 4 samples per replica"
    assert candidates(devices=8, n_layers=15, global_batch=16, micro_batches=1, pp=2)[0] == [(2, 4)]
    with pytest.raises(ValueError, match=r"parallel.pp=3 does not divide parallel.devices=8; use one of "
                                         r"1, 2, 4, 8 or auto"):
        candidates(devices=8, n_layers=15, global_batch=16, micro_batches=1, pp=3)


def test_memory_decides_the_pipeline_depth():
    # everything trainable on 4 devices of 60 GB: one replica of the whole 8.3B model cannot
    # hold its weights, gradients and optimizer states (7 bytes a parameter with dp=4)
    hw = dataclasses.replace(hardware("h100"), memory_gb=60)
    choice = choose_layout(PlanProblem(model=model("qwen2-vl-7b"), hardware=hw, trainable=("all",), devices=4,
                                       global_batch=16, micro_batches=1, memory_headroom=0.08), _short(16))
    assert choice.best.pp >= 2 and choice.best.fits and choice.best.how == "planned"
    (one,) = [x for x in choice.layouts if x.pp == 1]
    assert not one.fits and one.note == ("weights, gradients and optimizer states alone need 58 GB on the fullest "
                                         "stage, more than the 49.7 GB usable after plan.memory_headroom=0.08")


def test_the_chosen_layout_is_the_fastest_when_each_is_planned_in_full():
    m, hw, tr = model("llava-1.5-7b"), hardware("h100"), ("vision.proj", "llm")
    sample = _short(32)
    choice = choose_layout(PlanProblem(model=m, hardware=hw, trainable=tr, devices=4, global_batch=32,
                                       micro_batches=1, memory_headroom=0.08), sample)
    best = choice.best
    assert best.how == "planned" and best.fits
    assert [x.step_time for x in choice.layouts[1:] if x.how == "estimated"] == sorted(
        x.step_time for x in choice.layouts[1:] if x.how == "estimated")
    table = sample_table(sample)
    for x in choice.layouts[1:]:
        cost = build_cost_model(model=m, hardware=hw, trainable=tr, dp=x.dp, memory_headroom=0.08)
        full = plan_layout(cost, table, [list(range(32))], pp=x.pp, dp=x.dp, micro_batches=1)
        assert best.step_time <= full.step_time, (x.pp, x.dp)
        if x.how == "bounded":  # a bound is a bound
            assert x.step_time <= full.step_time


def _long(n, seed=0):  # long answers after one image of 576, 1200 or 2400 tokens
    rng = np.random.default_rng(seed)
    return [_img(int(t), tok=int(k)) for t, k in zip(rng.integers(200, 1500, n), rng.choice([576, 1200, 2400], n))]


def test_a_deeper_layout_that_is_faster_is_chosen_over_the_first_that_fits():
    """Everything trainable, long image samples, 4 H100s: one stage per replica (pp=1 x dp=4)
    fits, but two stages (pp=2 x dp=2) are predicted faster. The search ranks by predicted step
    time; taking the first layout that fits would pick pp=1."""
    choice = choose_layout(PlanProblem(model=model("llava-1.5-7b"), hardware=hardware("h100"), trainable=("all",),
                                       devices=4, global_batch=32, micro_batches=4, memory_headroom=0.08), _long(32))
    (one,) = [x for x in choice.layouts if (x.pp, x.dp) == (1, 4)]
    assert one.fits and not one.small_step
    best = choice.best
    assert (best.pp, best.dp, best.how) == (2, 2, "planned")
    assert best.step_time < 0.92 * one.step_time, (best.step_time, one.step_time)  # 1.48 s vs 1.67 s


def test_small_steps_rank_after_every_layout_that_is_not_one():
    choice = choose_layout(PlanProblem(model=model("llava-1.5-7b"), hardware=hardware("h100"),
                                       trainable=("vision.proj", "llm"), devices=8, global_batch=8, micro_batches=1),
                           _short(8))
    ranked = [x for x in choice.layouts if x.how != "excluded"]
    assert (choice.best.pp, choice.best.dp) == (1, 8) and not choice.best.small_step
    small = [x for x in ranked if x.small_step]
    assert {(x.pp, x.dp) for x in small} == {(2, 4), (4, 2), (8, 1)}
    assert ranked[-len(small):] == small
    (two,) = [x for x in small if x.pp == 2]
    assert two.note == "2 samples per replica for 2 stages: equal micro-batches idle 33% even at one sample each"


def test_a_small_step_is_chosen_only_when_nothing_else_fits():
    def lay(pp, dp, t, small, fits=True):
        return Layout(pp=pp, dp=dp, how="planned", step_time=t, lower_bound=0.1, samples_per_s=1 / t,
                      peak_bytes=(), bubble=0.2, fits=fits, small_step=small)

    fast_small, slow = lay(4, 2, 1.0, True), lay(2, 4, 1.2, False)
    assert rank_layouts([fast_small, slow]) == [slow, fast_small]
    assert rank_layouts([fast_small, lay(2, 4, 1.2, False, fits=False)])[0] == fast_small


def test_plan_command_with_auto_layout_writes_the_ranked_table(tmp_path, capsys):
    problem = PlanProblem(model=model("tiny"), hardware=hardware("cpu"), pp=None, dp=None, devices=4, global_batch=16,
                          micro_batches=1, trainable=("all",), policy="data-aware", memory_headroom=DEFAULT_HEADROOM)
    plan = run_plan(problem, PlanInput(trace_path=_trace(tmp_path / "t.jsonl", 48), steps=2),
                    output=PlanOutput(out=str(tmp_path / "plan.json")))
    pred = plan["predicted"]
    layouts = pred["layouts"]
    assert {(x["pp"], x["dp"]) for x in layouts} == {(1, 4), (2, 2), (4, 1)}
    chosen = (pred["layout"]["pp"], pred["layout"]["dp"])
    assert (layouts[0]["pp"], layouts[0]["dp"]) == chosen and layouts[0]["priced"] == "planned"
    assert len(plan["stages"]) == chosen[0] and all(len(s["replicas"]) == chosen[1] for s in plan["steps"])
    assert plan["schedule"] == "1f1b"
    timed = [x["step_time_s"] for x in layouts if x["priced"] == "planned"]
    assert layouts[0]["step_time_s"] == min(timed)
    assert json.loads((tmp_path / "plan.json").read_text()) == plan
    out = capsys.readouterr().out
    assert "layouts of parallel.devices=4" in out and f"* {chosen[0]}x{chosen[1]}" in out


def test_auto_without_devices_and_a_split_that_does_not_divide_name_the_keys(tmp_path):
    common = dict(model=model("tiny"), hardware=hardware("cpu"), global_batch=16, micro_batches=1,
                  trainable=("all",), policy="data-aware", memory_headroom=DEFAULT_HEADROOM)
    data = PlanInput(trace_path=_trace(tmp_path / "t.jsonl", 32))
    with pytest.raises(ValueError, match=r"parallel.pp=auto / parallel.dp=auto needs parallel.devices=N"):
        run_plan(PlanProblem(pp=None, dp=2, **common), data)
    with pytest.raises(ValueError, match=r"parallel.dp=3 does not divide parallel.devices=4"):
        run_plan(PlanProblem(pp=None, dp=3, devices=4, **common), data)


def test_the_config_resolves_auto_before_launch():
    from mmpipe.cli import load
    from mmpipe.config import ParallelConfig, resolve_layout

    with pytest.raises(ValueError, match=r"parallel.pp=auto parallel.dp=1: auto needs parallel.devices=N"):
        ParallelConfig(pp="auto")
    with pytest.raises(ValueError, match=r"parallel.pp=2 x parallel.dp=2 = 4 is not parallel.devices=8; set one "
                                         r"of them to auto"):
        ParallelConfig(pp=2, dp=2, devices=8)
    with pytest.raises(ValueError, match=r"parallel.dp=3 does not divide parallel.devices=8"):
        ParallelConfig(pp="auto", dp=3, devices=8)
    with pytest.raises(ValueError, match=r"parallel.pp='x' must be a positive integer or auto"):
        ParallelConfig(pp="x")
    rc = load(["parallel.pp=auto", "parallel.dp=auto", "parallel.devices=4", "train.global_batch=8",
               "train.micro_batches=1"], job="test")
    assert rc.parallel.auto
    sample = [SampleFeatures(image_positions=(16,), image_tokens=(4,), audio_positions=(), audio_tokens=(),
                             text_tokens=int(t)) for t in np.random.default_rng(0).integers(5, 60, 16)]
    out = resolve_layout(rc, sample)
    assert not out.parallel.auto and out.parallel.pp * out.parallel.dp == 4 and out.parallel.devices == 4
    assert resolve_layout(out, sample) is out


def _text(n):
    return SampleFeatures(image_positions=(), image_tokens=(), audio_positions=(), audio_tokens=(), text_tokens=n)


def test_a_deeper_layout_that_needs_no_recompute_beats_the_shallow_one_and_is_chosen():
    """One 4000-token sample among 15 short ones, 4 devices, the LLM trainable: one replica of the
    whole 7B model per device must recompute to hold that sample's activations beside its weights
    and optimizer states (1x4), two stages need not (2x2), and the deeper layout is faster: the
    search must price it, plan it and choose it."""
    m, hw, tr = model("llava-1.5-7b"), hardware("h100"), ("llm",)
    sample = [_text(4000)] + [_text(int(t)) for t in np.random.default_rng(0).integers(30, 80, 15)]
    choice = choose_layout(PlanProblem(model=m, hardware=hw, trainable=tr, devices=4, global_batch=16,
                                       micro_batches=1, memory_headroom=0.08), sample)
    assert (choice.best.pp, choice.best.dp) == (2, 2) and choice.best.how == "planned"
    assert choice.best.stage_plan.recompute == (False, False)
    table = sample_table(sample)
    full = {}
    for pp, dp in ((1, 4), (2, 2), (4, 1)):
        cost = build_cost_model(model=m, hardware=hw, trainable=tr, dp=dp, memory_headroom=0.08)
        full[pp, dp] = plan_layout(cost, table, [list(range(16))], pp=pp, dp=dp, micro_batches=1)
    assert full[1, 4].fits and full[1, 4].stage_plan.recompute == (True,)  # it fits only by recomputing
    assert full[2, 2].step_time < 0.8 * full[1, 4].step_time  # and pays for it
    assert choice.best.step_time == pytest.approx(min(x.step_time for x in full.values()), rel=1e-9)
