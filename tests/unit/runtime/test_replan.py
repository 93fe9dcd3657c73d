"""Re-planning from what the run measures: once the step-time re-fit has seen its warm-up, the
feeder prices every later step's micro-batches with the run's fit (the stage cut stays); a
resumed run starts from the fit its checkpoint saved."""

from __future__ import annotations

import json

import numpy as np

from mmpipe.cli import load
from mmpipe.config import hardware_spec, tokenizer_source
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.planner.api import StepCalibration
from mmpipe.runtime.checkpoint import STEP_FIT, Found
from mmpipe.runtime.feed import FIT_LAG, StepFeeder
from mmpipe.runtime.stages import choose_stages
from mmpipe.runtime.train import calibration_for

FIT = (1.6, 0.2, 0.05)
"""A run whose every micro-batch costs 200 ms (the cpu preset says 26 ms)."""
WARM = 6
"""Steps the re-fit sees before it is fitted (StepCalibration.min_steps)."""


def _feed(rc, steps: int, *, deliver, first_step: int = 0, fit=None) -> list:
    """Every step a feeder plans, the fit after each step delivered as the training loop does
    (`deliver(step)` -> the fit after that step, or None while unfitted)."""
    tok = load_tokenizer(tokenizer_source(rc)[0])
    feeder = StepFeeder(rc, tokenizer=tok, dp_rank=0, stage_plan=choose_stages(rc, tok).plan, media=False,
                        steps=steps, first_step=first_step, fit=fit)
    out = []
    try:
        for step in range(first_step + 1, first_step + steps + 1):
            out.append(feeder.next_step())
            feeder.deliver_fit(step, deliver(step))
    finally:
        feeder.close()
    return out


def test_the_feeder_plans_with_the_runs_fit_after_the_warm_up():
    rc = load(["train.steps=12"], job="test")
    refit = _feed(rc, 12, deliver=lambda step: FIT if step >= WARM else None)
    fixed = _feed(load(["train.steps=12", "plan.refit=false"], job="test"), 12, deliver=lambda step: FIT)
    switch = WARM + FIT_LAG  # the fit after step 6 plans step 9: the thread may be two steps ahead
    assert [p.fit for p in refit] == [None] * (switch - 1) + [FIT] * (12 - switch + 1)
    assert all(p.fit is None for p in fixed)  # plan.refit=false: the hardware config throughout
    keys = [[sorted(k for mb in p.micro_batches for k in mb.keys) for p in run] for run in (refit, fixed)]
    assert keys[0] == keys[1]  # the same samples every step: only their grouping changes
    # the warm-up: odd steps as the hardware config plans them, every second one with fewer,
    # larger micro-batches, so that the re-fit sees what a micro-batch costs
    counts = [[len(p.micro_batches) for p in run[:switch - 1]] for run in (refit, fixed)]
    assert counts[0][0::2] == counts[1][0::2]
    assert all(a <= b for a, b in zip(counts[0][1::2], counts[1][1::2]))
    assert sum(counts[0][1::2]) < sum(counts[1][1::2])
    after, unfitted = ([len(p.micro_batches) for p in run[switch - 1:]] for run in (refit, fixed))
    assert np.mean(after) < np.mean(unfitted)  # 200 ms a micro-batch: fewer of them
    # the figure the re-fit regresses on is the config's compute, whatever the plan was priced with
    assert all(p.compute_s < p.predicted_s for p in refit[switch - 1:])


def test_a_resumed_run_starts_from_the_fit_it_saved(tmp_path):
    rc = load(["train.steps=16"], job="test")
    saved = StepCalibration.for_hardware(hardware_spec(rc))
    rng = np.random.default_rng(0)
    for _ in range(10):
        compute, m = rng.uniform(0.1, 0.3), int(rng.integers(2, 6))
        saved.observe(compute, m, FIT[0] * compute + FIT[1] * m + FIT[2])
    folder = tmp_path / "checkpoints" / "step10"
    folder.mkdir(parents=True)
    (folder / STEP_FIT).write_text(json.dumps({"hardware": "cpu", "calibration": saved.state_dict()}))
    found = Found(folder=folder, record={"step": 10})

    resumed = calibration_for(rc, found)
    assert resumed.fitted and resumed.coef == saved.coef and resumed.observed == 10
    # fitted on another hardware config's simulated times: not this run's fit
    other = calibration_for(load(["train.steps=16", "hardware=measured-tiny"], job="test"), found)
    assert not other.fitted and other.coef == other.prior
    assert calibration_for(rc, None).coef == (1.0, 0.026, 0.026)  # a fresh run: the cpu preset's costs

    # the resumed run's first steps are planned with the saved fit, before it has fitted any of its own
    new = (1.2, 0.01, 0.03)
    steps = _feed(rc, 6, first_step=10, fit=resumed.coef, deliver=lambda step: new)
    assert [p.fit for p in steps] == [resumed.coef] * FIT_LAG + [new] * 3
