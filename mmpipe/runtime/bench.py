"""`mmpipe bench`: train the same model on the same data and steps once per policy, in one
invocation, alternating policies round by round so machine noise hits all of them alike.

Every policy trains with the same encoder placement: plan.encoders (`auto` by default) is
resolved once, for the reference policy (data-aware when benched, else the first), and every run
gets that placement; `bench.encoders` asks for placements instead, each policy once per
placement. The table and bench.json say what placement each row ran with. The figures are
mmpipe.measure's, over the steps every run timed, as `mmpipe report` computes them.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.measure import WARMUP_STEPS, Record, compared_records, read_records, shared_text, throughput
from mmpipe.planner.api import placement_name, show_encoders

RUN_TIMEOUT_S = 1800
"""One training run of the benchmark may take this long before the benchmark gives up."""

Resolve = Callable[[str, object], dict[str, str]]
"""(policy, a plan.encoders value) -> the placement a run of that policy resolves it to
(tower -> stages | spread | nested)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """One row of the benchmark: a policy trained with one encoder placement."""

    name: str
    """The row's name: the policy, or `policy/placement` for a placement bench.encoders asked for."""
    policy: str
    """plan.policy of its runs."""
    encoders: dict[str, str]
    """The placement every run of it trains with (tower -> stages | spread | nested)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyFigures:
    """One policy over all rounds."""

    policy: str
    """The row's name (a Variant's)."""
    encoders: str
    """The encoder placement it ran with: stages, spread, nested or the off-stage towers (`audio spread`)."""
    samples_per_s: float
    tokens_per_s: float
    step_time: float
    """Mean step time, s."""
    steps: int
    """Step records timed, over all rounds (the same steps for every row)."""
    bubble: float
    """Median measured bubble share."""
    prediction_error: float
    """Median |measured / predicted - 1|."""
    overhead: float
    """Median share of the step spent outside DeepSpeed's train_batch (feeding, telemetry)."""
    feeder: float
    """Median share of the step the feeder thread spent planning, reading, decoding, collating."""
    loss: float
    """Mean loss of the last steps."""
    bound_fraction: float
    """Median fraction of the step's lower bound achieved (lower bound / measured step)."""


def planner_placements(rc: RunConfig) -> Resolve:
    """Resolve placements as the runs' stage chooser does (runtime/stages.py), on the first
    steps of the run's data with its tokenizer."""
    from dataclasses import replace

    from mmpipe.runtime.hf_run import load_templater
    from mmpipe.runtime.stages import run_placement

    tokenizer = load_templater(rc)
    return lambda policy, value: run_placement(replace(rc, plan=replace(rc.plan, policy=policy, encoders=value)),
                                               tokenizer)


def reference_policy(policies: Sequence[str]) -> str:
    """The policy the others are compared with (and plan.encoders is resolved for): data-aware
    when benched, else the first."""
    return "data-aware" if "data-aware" in policies else policies[0]


def bench_variants(policies: Sequence[str], listed: Sequence[str], value: object, resolve: Resolve) -> list[Variant]:
    """The rows: with no placements listed, every policy with plan.encoders (`value`) resolved
    once, for the reference policy; else each policy once per listed placement (an `auto`
    resolved for that policy, as its runs would)."""
    if not listed:
        placement = resolve(reference_policy(policies), value)
        return [Variant(name=p, policy=p, encoders=placement) for p in policies]
    return [Variant(name=f"{p}/{e}", policy=p, encoders=resolve(p, e)) for p in policies for e in listed]


def placement_override(encoders: Mapping[str, str]) -> str:
    """The plan.encoders override that trains with this placement and nothing else."""
    name = placement_name(encoders)  # one word unless some towers are off the stages and some not
    return f"plan.encoders={name if ' ' not in name else show_encoders(encoders)}"


def run_bench(rc: RunConfig, overrides: list[str], resolve: Resolve) -> list[PolicyFigures]:
    out_dir = Path(rc.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = bench_variants(rc.bench.policies, rc.bench.encoders, rc.plan.encoders, resolve)
    passthrough = [o for o in overrides if not o.split("=", 1)[0].startswith(
        ("plan.policy", "plan.encoders", "train.steps", "hydra.run.dir", "bench."))]
    runs: dict[str, list[list[Record]]] = {v.name: [] for v in variants}
    for rnd in range(rc.bench.rounds):
        order = variants if rnd % 2 == 0 else list(reversed(variants))
        for v in order:
            run_dir = out_dir / f"round{rnd}-{v.name.replace('/', '-')}"
            cmd = [sys.executable, "-m", "mmpipe", "train", *passthrough, f"plan.policy={v.policy}",
                   f"train.steps={rc.bench.steps}", f"hydra.run.dir={run_dir}", placement_override(v.encoders)]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"bench run {v.name} (round {rnd}) took over {RUN_TIMEOUT_S} s; "
                                   f"see {run_dir} and lower bench.steps") from None
            if proc.returncode != 0:
                raise RuntimeError(f"bench run {v.name} (round {rnd}) failed:\n"
                                   f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            runs[v.name].append(read_records(run_dir))
            print(f"round {rnd} {v.name:<20} {time.perf_counter() - t0:6.1f}s", flush=True)
    figures, common = bench_figures(variants, runs)
    print_table(rc, figures, common, resolved_once=not rc.bench.encoders)
    (out_dir / "bench.json").write_text(json_text(figures))
    return figures


def bench_figures(variants: Sequence[Variant], runs: Mapping[str, Sequence[Sequence[Record]]]
                  ) -> tuple[list[PolicyFigures], list[int]]:
    """Each row's figures over its rounds, on the steps every run timed (mmpipe.measure), and
    those steps."""
    records, common = compared_records(runs)
    return [_figures(v, records[v.name], runs[v.name]) for v in variants], common


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _figures(v: Variant, steps: list[Record], rounds: Sequence[Sequence[Record]]) -> PolicyFigures:
    t = throughput(steps)
    return PolicyFigures(
        policy=v.name,
        encoders=placement_name(v.encoders),
        samples_per_s=t.samples_per_s,
        tokens_per_s=t.tokens_per_s,
        step_time=t.step_time,
        steps=t.steps,
        bubble=_median([m["bubble"] for m in steps]),
        prediction_error=_median([abs(m["prediction_error"]) for m in steps if m.get("prediction_error") is not None]),
        overhead=_median([m["overhead_s"] / m["step_time"] for m in steps]),
        feeder=_median([(m["plan_s"] + m["feed_s"]) / m["step_time"] for m in steps]),
        loss=statistics.mean(m["loss"] for r in rounds for m in r[-5:]),
        bound_fraction=_median([m["bound_fraction"] for m in steps if m.get("bound_fraction") is not None]),
    )


def json_text(figures: Sequence[PolicyFigures]) -> str:
    """bench.json: one object per row (nan as null)."""

    def clean(x: object) -> object:
        return None if isinstance(x, float) and math.isnan(x) else x

    return json.dumps([{k: clean(getattr(f, k)) for k in f.__slots__} for f in figures], indent=1)


def print_table(rc: RunConfig, figures: Sequence[PolicyFigures], common: Sequence[int], *,
                resolved_once: bool) -> None:
    ref_name = reference_policy([f.policy.split("/")[0] for f in figures])
    ref = next(f for f in figures if f.policy.split("/")[0] == ref_name)
    placed = (f"encoders {figures[0].encoders} for every policy (plan.encoders={show_encoders(rc.plan.encoders)} "
              f"resolved once, for {ref_name})" if resolved_once else "encoders as bench.encoders lists them")
    print(f"\nmmpipe bench: model {rc.model.name}, pp={rc.parallel.pp} dp={rc.parallel.dp}, "
          f"{rc.train.global_batch} samples/step, {rc.bench.steps} steps x {rc.bench.rounds} rounds "
          f"(first {WARMUP_STEPS} steps of each run not timed; {shared_text(common)}), "
          f"hardware {rc.hardware.get('name')}; {placed}")
    w = max(14, *(len(f.policy) + 2 for f in figures))
    e = max(10, *(len(f.encoders) + 2 for f in figures))
    print(f"{'policy':<{w}}{'encoders':<{e}}{'samples/s':>10}{'tokens/s':>10}{'step s':>8}{'bubble':>8}"
          f"{'pred err':>9}{'overhead':>9}{'feeder':>8}{'of bound':>9}{'vs ' + ref.policy:>{len(ref.policy) + 5}}")
    for f in figures:
        print(f"{f.policy:<{w}}{f.encoders:<{e}}{f.samples_per_s:>10.1f}{f.tokens_per_s:>10.0f}{f.step_time:>8.3f}"
              f"{f.bubble:>8.1%}{f.prediction_error:>9.1%}{f.overhead:>9.1%}{f.feeder:>8.1%}{f.bound_fraction:>9.1%}"
              f"{f.samples_per_s / ref.samples_per_s:>{len(ref.policy) + 4}.2f}x")
