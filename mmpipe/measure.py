"""Which steps a figure counts, and the steady-state throughput over them.

`mmpipe bench`, `mmpipe report` and `mmpipe plan` take their figures from here, so that they
agree on the same runs:
- the warm-up: the first `WARMUP_STEPS` steps of every launch of a run (from step 1, and from
  each step metrics.jsonl marks `first_of_launch`: a resume or a re-cut's relaunch) are not timed;
- the same steps: runs (or policies) are compared over the steps every one of them has, so each
  figure covers the same samples (the same data read in the same order gives step k the same
  samples whatever the policy);
- the steady-state throughput: the samples (tokens) of those steps over their summed step time,
  and the mean step time over them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARMUP_STEPS = 2
"""Steps at the start of every launch left out of every measured figure (start-up, first kernels)."""

Record = Mapping[str, Any]
"""One line of metrics.jsonl (runtime/train.py writes it)."""
METRICS_FILE = "metrics.jsonl"
"""The per-step record in a run directory (runtime/metrics.py writes it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """The steady-state figures of some timed steps."""

    samples_per_s: float
    """Their samples over their summed step time (nan without steps)."""
    tokens_per_s: float
    """Their LLM tokens over their summed step time (nan without steps)."""
    step_time: float
    """Their mean step time, s (nan without steps)."""
    steps: int
    """How many step records it counts (over all runs of a configuration)."""


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """A run directory's metrics.jsonl, one record per logged step."""
    lines = (Path(run_dir) / METRICS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def timed_records(records: Sequence[Record]) -> list[Record]:
    """The records of one run past each launch's warm-up, that carry a step time."""
    out: list[Record] = []
    launch = 1
    for r in records:
        step = r.get("step")
        if not isinstance(step, int):
            continue
        if r.get("first_of_launch"):
            launch = step
        timed = isinstance(r.get("step_time"), (int, float)) and r["step_time"] > 0
        if timed and step >= launch + WARMUP_STEPS:
            out.append(r)
    return out


def shared_steps(steps: Iterable[Iterable[int]]) -> list[int]:
    """The step numbers every one of the lists has, in order."""
    sets = [set(s) for s in steps]
    return sorted(set.intersection(*sets)) if sets else []


def compared_records(configs: Mapping[str, Sequence[Sequence[Record]]]) -> tuple[dict[str, list[Record]], list[int]]:
    """Each configuration's timed records (every run of it: rounds, repeats) on the steps that
    every run of every configuration timed, and those steps. Where the runs share no timed step
    each configuration keeps its own timed records (and the steps are empty)."""
    timed = {name: [timed_records(run) for run in runs] for name, runs in configs.items()}
    common = shared_steps([int(r["step"]) for r in run] for runs in timed.values() for run in runs)
    keep = set(common)
    return {name: [r for run in runs for r in run if not keep or r["step"] in keep]
            for name, runs in timed.items()}, common


def shared_text(common: Sequence[int]) -> str:
    """How the figures' steps read in a table's heading."""
    if not common:
        return "the runs share no timed step: each over its own"
    span = f"step {common[0]}" if len(common) == 1 else f"steps {common[0]}-{common[-1]}"
    return f"each over the same {len(common)} step{'s' if len(common) > 1 else ''} of every run ({span})"


def throughput(records: Sequence[Record]) -> Throughput:
    """Samples/s and tokens/s of the records (their sum over the summed step time), and their
    mean step time."""
    nan = float("nan")
    wall = float(sum(r["step_time"] for r in records))
    if not records or wall <= 0:
        return Throughput(samples_per_s=nan, tokens_per_s=nan, step_time=nan, steps=0)
    return Throughput(samples_per_s=sum(float(r.get("samples", 0)) for r in records) / wall,
                      tokens_per_s=sum(float(r.get("tokens", 0)) for r in records) / wall,
                      step_time=wall / len(records), steps=len(records))


def compare_throughput(configs: Mapping[str, Sequence[Sequence[Record]]]) -> tuple[dict[str, Throughput], list[int]]:
    """Each configuration's steady-state throughput over the steps every run timed
    (`compared_records`), and those steps."""
    records, common = compared_records(configs)
    return {name: throughput(r) for name, r in records.items()}, common


def mean_over_shared(times: Mapping[str, Sequence[float]]) -> tuple[dict[str, float], int]:
    """Each policy's mean predicted step time over the steps every policy planned (the first n,
    n the fewest any planned), and n."""
    common = shared_steps(range(len(t)) for t in times.values())
    n = len(common)
    return {name: (sum(t[:n]) / n if n else float("nan")) for name, t in times.items()}, n


def rank(figures: Mapping[str, float]) -> list[str]:
    """The names, fastest (most samples/s) first, a figure that is not a number last; ties keep
    their order."""
    return sorted(figures, key=lambda name: -figures[name] if not math.isnan(figures[name]) else math.inf)
