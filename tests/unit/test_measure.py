"""mmpipe.measure: which steps a figure counts (each launch's warm-up out, the steps every run
has) and the steady-state throughput over them."""

from __future__ import annotations

import math

import pytest

from mmpipe.measure import WARMUP_STEPS, compare_throughput, mean_over_shared, rank, timed_records


def _run(times: dict[int, float], *, relaunched: int | None = None) -> list[dict]:
    return [{"step": s, "samples": 10, "tokens": 1000, "step_time": t, "first_of_launch": s in (1, relaunched)}
            for s, t in times.items()]


def test_the_warm_up_of_every_launch_is_left_out():
    assert WARMUP_STEPS == 2
    run = _run({s: 1.0 for s in range(1, 11)}, relaunched=6)  # a re-cut relaunched the ranks before step 6
    assert [r["step"] for r in timed_records(run)] == [3, 4, 5, 8, 9, 10]


def test_runs_are_compared_over_the_steps_every_one_timed():
    long = _run({s: 0.5 for s in range(1, 21)} | {s: 0.1 for s in range(11, 21)})  # faster after step 10
    short = _run({s: 0.25 for s in range(1, 11)})
    figures, common = compare_throughput({"long": [long], "short": [short, short]})
    assert common == list(range(3, 11))
    assert figures["long"].samples_per_s == pytest.approx(20.0) and figures["long"].steps == 8
    assert figures["short"].samples_per_s == pytest.approx(40.0) and figures["short"].steps == 16
    assert figures["short"].step_time == pytest.approx(0.25) and figures["short"].tokens_per_s == pytest.approx(4000)
    # runs that share no timed step keep their own
    alone, none = compare_throughput({"a": [_run({1: 1.0, 2: 1.0, 3: 0.5})], "b": [_run({1: 1.0, 2: 1.0})]})
    assert none == [] and alone["a"].samples_per_s == pytest.approx(20.0) and math.isnan(alone["b"].samples_per_s)


def test_policies_are_compared_over_the_steps_every_one_planned():
    means, n = mean_over_shared({"data-aware": [1.0, 2.0, 3.0, 9.0], "ds-default": [2.0, 2.0, 2.0]})
    assert n == 3 and means == {"data-aware": 2.0, "ds-default": 2.0}


def test_rank_puts_the_fastest_first_and_no_figure_last():
    assert rank({"a": 30.0, "b": float("nan"), "c": 60.0, "d": 30.0}) == ["c", "a", "d", "b"]
