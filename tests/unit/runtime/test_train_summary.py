"""The run's `done:` line fits the run: the loss means at each end never overlap (a 2-step run
prints no "mean of first 3, last 3", which would be the same two losses twice)."""

from __future__ import annotations

from mmpipe.runtime.train import loss_trend


def test_the_loss_means_cover_as_many_steps_as_the_run_has_at_each_end() -> None:
    assert loss_trend([7.5]) == "loss 7.500"
    assert loss_trend([7.5, 7.0]) == "loss 7.500 -> 7.000"
    assert loss_trend([8.0, 7.0, 6.0]) == "loss 8.000 -> 6.000"
    assert loss_trend([8.0, 7.0, 6.0, 5.0]) == "loss 8.000 -> 5.000 (mean of first 2 7.500, last 2 5.500)"
    losses = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    assert loss_trend(losses) == "loss 9.000 -> 3.000 (mean of first 3 8.000, last 3 4.000)"
