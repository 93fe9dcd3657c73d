"""The stage chooser's memory check of a user's override, priced as the run trains (fp32 here,
AdamW, the default headroom): the warning says which limit the override breaks."""

from __future__ import annotations

import re

import pytest

from mmpipe.cli import load
from mmpipe.config import tokenizer_source
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.runtime.stages import choose_stages

OVERRIDE = "plan.stages=[[vision.embed,llm.block.2],[llm.block.3,llm.head]]"


def _warnings(*overrides: str) -> tuple[str, ...]:
    # the planner's own bytes against a few MB: no resident set or slack on top
    rc = load(["train.steps=1", OVERRIDE, "hardware.reserved_gb=0", "hardware.memory_slack=0", *overrides],
              job="test")
    chosen = choose_stages(rc, load_tokenizer(tokenizer_source(rc)[0]))
    assert chosen.source == "override"
    return chosen.warnings


@pytest.mark.parametrize("overrides, says", [
    # the weights, gradients and AdamW moments of stage 0 alone overflow 0.92 x 0.02 GB
    (["hardware.memory_gb=0.02"], r"stage 0 \(vision\.embed\.\.llm\.block\.2\) needs [\d.]+ GB for weights, "
                                  r"gradients and optimizer states alone, more than the [\d.]+ GB usable after "
                                  r"plan\.memory_headroom=0\.08 \(hardware\.memory_gb=0\.02\)"),
    # they fit, but one sample's activations do not: no micro-batching can help
    (["hardware.memory_gb=0.025"], r"sample \d+ needs [\d.e-]+ GB of activations on stage 0 "
                                   r"\(vision\.embed\.\.llm\.block\.2\) even alone"),
    # a baseline keeps its padded micro-batches: the stage overflows by a figure
    (["hardware.memory_gb=0.025", "plan.policy=ds-default"],
     r"stage 0 \(vision\.embed\.\.llm\.block\.2\) needs [\d.e-]+ GB under the cost model, [\d.e-]+ GB more than"),
])
def test_an_override_over_memory_is_named(overrides, says):
    found = _warnings(*overrides)
    assert any(re.search(r"^plan\.stages: " + says, w) for w in found), found


def test_an_override_that_fits_gets_no_warning():
    assert _warnings("hardware.memory_gb=0.05") == ()


def _static_gb(*overrides: str) -> float:
    found = [w for w in _warnings("hardware.memory_gb=0.01", *overrides) if "alone" in w]
    return float(re.search(r"needs ([\d.]+) GB for weights", found[0]).group(1))


def test_memory_is_priced_in_the_runs_precision():
    """The runtime passes the run's precision, ZeRO stage and optimizer to the planner. Per
    trainable parameter on 2 replicas (docs/planner.md): fp32 + AdamW 16 bytes; fp32 under ZeRO-1
    8 + 8/2 = 12; bf16 under ZeRO-1 in DeepSpeed's BF16_Optimizer 4 + 4 (its fp32 gradient
    buffer) + 12/2 = 14; fp32 + SGD 8."""
    two = ("parallel.dp=2", "train.global_batch=16")
    fp32 = _static_gb(*two)
    assert _static_gb(*two, "train.zero_stage=1") == pytest.approx(fp32 * 12 / 16, rel=0.03)
    assert _static_gb(*two, "train.precision=bf16") == pytest.approx(fp32 * 14 / 16, rel=0.03)
    assert _static_gb(*two, "train.optimizer=sgd") == pytest.approx(fp32 * 8 / 16, rel=0.03)


def test_the_feeder_plans_every_step_in_the_runs_precision_and_headroom():
    """The per-step planner (the feeder's) prices memory as the stage chooser does."""
    from mmpipe.config import training_precision
    from mmpipe.runtime.feed import StepFeeder

    rc = load(["train.steps=1", "train.optimizer=sgd", "plan.memory_headroom=0.2"], job="test")  # not the defaults
    tok = load_tokenizer(tokenizer_source(rc)[0])
    feeder = StepFeeder(rc, tokenizer=tok, dp_rank=0, stage_plan=choose_stages(rc, tok).plan, media=False, steps=1)
    try:
        assert feeder.planner.cost.precision == training_precision(rc)
        assert (feeder.planner.cost.precision.precision, feeder.planner.cost.precision.zero_stage,
                feeder.planner.cost.precision.optimizer) == ("fp32", 0, "sgd")
        assert feeder.planner.cost.memory_headroom == 0.2
        assert feeder.next_step().micro_batches  # and it plans (its thread is done after the one step)
    finally:
        feeder.close()


def test_a_spread_tower_stays_on_stage_0_and_one_stage_cannot_spread():
    """plan.encoders=spread keeps the towers' weights on stage 0 (runtime/spread.py): the
    planner's cut holds them there, a user's cut that does not is refused naming both keys, and
    one stage has no other rank to spread over (refused with the config)."""
    rc = load(["train.steps=1", "plan.encoders=spread"], job="test")
    chosen = choose_stages(rc, load_tokenizer(tokenizer_source(rc)[0]))
    assert chosen.spread == ("vision", "audio")
    assert chosen.plan.stages[0][1] > rc.layers.index("audio.proj")
    auto = load(["train.steps=1"], job="test")  # the default: the planner compares the placements
    said = choose_stages(auto, load_tokenizer(tokenizer_source(auto)[0]))
    assert set(said.placements) == {"stages", "spread", "vision spread", "audio spread", "nested", "vision nested",
                                    "audio nested"}
    assert said.placement.mapping == {"vision": "stages", "audio": "stages"}  # measured faster (in-the-loop.md)
    bad = load(["train.steps=1", "plan.encoders={vision: stages, audio: spread}",
                "plan.stages=[[vision.embed,vision.proj],[audio.embed,llm.head]]"], job="test")
    with pytest.raises(ValueError, match=r"plan\.stages ends stage 0 at vision\.proj, but plan\.encoders spreads "
                                         r"audio, whose layers stage 0 must hold \(up to audio\.proj\)"):
        choose_stages(bad, load_tokenizer(tokenizer_source(bad)[0]))
    with pytest.raises(ValueError, match=r"plan\.encoders=spread needs parallel\.pp >= 2"):
        load(["parallel.pp=1", "plan.encoders=spread"], job="test")


def test_a_placement_that_does_not_fit_is_said_so_not_priced_at_infinity() -> None:
    """plan.encoders=auto prices a placement that cannot hold a step as infinitely slow; the
    start-up line says it does not fit rather than `spread inf s`."""
    import math

    from mmpipe.model.spec import layer_names
    from mmpipe.planner.api import Placement, StagePlan
    from mmpipe.runtime.stages import ChosenStages, format_stage_table

    rc = load(["train.steps=1"], job="test")
    names = layer_names(rc.model)
    plan = StagePlan(stages=[(0, 12), (12, len(names))], recompute=[False, False])
    chosen = ChosenStages(plan=plan, source="planner (data-aware)",
                          placement=Placement.of({"vision": "stages", "audio": "stages"}),
                          placements={"stages": 1.47, "spread": math.inf})
    line = format_stage_table(rc, chosen, names).splitlines()[-1]
    assert line == ("plan.encoders=auto chose stages (simulated time of the first steps: stages 1.47 s, "
                    "spread: does not fit in memory)")
