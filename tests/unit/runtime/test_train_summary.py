"""The run's `done:` line fits the run: the loss means at each end never overlap (a 2-step run
prints no "mean of first 3, last 3", which would be the same two losses twice)."""

from __future__ import annotations

from mmpipe.runtime.train import loss_trend, steady_throughput


def test_the_loss_means_cover_as_many_steps_as_the_run_has_at_each_end() -> None:
    assert loss_trend([7.5]) == "loss 7.500"
    assert loss_trend([7.5, 7.0]) == "loss 7.500 -> 7.000"
    assert loss_trend([8.0, 7.0, 6.0]) == "loss 8.000 -> 6.000"
    assert loss_trend([8.0, 7.0, 6.0, 5.0]) == "loss 8.000 -> 5.000 (mean of first 2 7.500, last 2 5.500)"
    losses = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    assert loss_trend(losses) == "loss 9.000 -> 3.000 (mean of first 3 8.000, last 3 4.000)"


def test_the_done_line_figures_throughput_as_bench_and_report_do() -> None:
    """One measurement path: the `done:` line's samples/s is mmpipe.measure's steady state (the
    steps after the launch's first two, samples over summed step time), the figure `mmpipe bench`
    and `mmpipe report` give for the same run; a run too short for it says what it gives instead."""
    from mmpipe.measure import throughput, timed_records

    steps = [{"step": s, "samples": 16, "tokens": 1000, "step_time": t, "first_of_launch": s == 5}
             for s, t in zip(range(5, 11), [9.0, 3.0, 0.5, 0.5, 1.0, 0.5])]  # a launch resumed after step 4
    want = throughput(timed_records(steps))
    assert round(want.samples_per_s, 1) == 25.6
    assert steady_throughput(steps, 1.0, 2.0) == ("25.6 samples/s, 1600 tokens/s (steady: steps 7-10, after the "
                                                  "launch's first 2)")
    assert steady_throughput(steps[:2], 2.7, 166.0) == (
        "2.7 samples/s, 166 tokens/s (all 2 steps, start-up included: too few for the steady state, which leaves "
        "out each launch's first 2)")
