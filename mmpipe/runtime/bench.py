"""`mmpipe bench`: train the same model on the same data and steps once per policy, in one
invocation, alternating policies round by round so machine noise hits all of them alike."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mmpipe.config import RunConfig

SKIP_STEPS = 2
"""Warm-up steps left out of every figure."""
RUN_TIMEOUT_S = 1800
"""One training run of the benchmark may take this long before the benchmark gives up."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyFigures:
    """One policy over all rounds."""

    policy: str
    samples_per_s: float
    tokens_per_s: float
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
    chose: str = ""
    """plan.encoders=auto: the placement the run's planner chose."""


def run_bench(rc: RunConfig, overrides: list[str]) -> list[PolicyFigures]:
    out_dir = Path(rc.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    placed = ("plan.encoders",) if rc.bench.encoders else ()
    passthrough = [o for o in overrides if not o.split("=", 1)[0].startswith(("plan.policy", "train.steps",
                                                                               "hydra.run.dir", "bench.", *placed))]
    variants = {(f"{p}/{e}" if e else p): (p, e) for p in rc.bench.policies for e in rc.bench.encoders or ("",)}
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    chose: dict[str, str] = {}
    for rnd in range(rc.bench.rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for variant in order:
            policy, enc = variants[variant]
            run_dir = out_dir / f"round{rnd}-{variant.replace('/', '-')}"
            cmd = [sys.executable, "-m", "mmpipe", "train", *passthrough, f"plan.policy={policy}",
                   f"train.steps={rc.bench.steps}", f"hydra.run.dir={run_dir}", *([f"plan.encoders={enc}"] * bool(enc))]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"bench run {policy} (round {rnd}) took over {RUN_TIMEOUT_S} s; "
                                   f"see {run_dir} and lower bench.steps") from None
            if proc.returncode != 0:
                raise RuntimeError(f"bench run {policy} (round {rnd}) failed:\n"
                                   f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
            runs[variant].append(metrics)
            found = re.search(r"plan.encoders=auto chose (\S+)", proc.stdout + proc.stderr) if enc == "auto" else None
            if found:
                chose[variant] = found.group(1)
            print(f"round {rnd} {variant:<20} {time.perf_counter() - t0:6.1f}s", flush=True)
    figures = [_figures(v, runs[v], chose.get(v, "")) for v in variants]
    _print_table(rc, figures)
    (out_dir / "bench.json").write_text(json.dumps([_as_dict(f) for f in figures], indent=1))
    return figures


def _as_dict(f: PolicyFigures) -> dict:
    return {k: getattr(f, k) for k in f.__slots__}


def _figures(policy: str, rounds: list[list[dict]], chose: str = "") -> PolicyFigures:
    steps = [m for r in rounds for m in r[SKIP_STEPS:]]
    wall = sum(m["step_time"] for m in steps)
    return PolicyFigures(
        policy=policy,
        samples_per_s=sum(m["samples"] for m in steps) / wall,
        tokens_per_s=sum(m["tokens"] for m in steps) / wall,
        bubble=statistics.median(m["bubble"] for m in steps),
        prediction_error=statistics.median(abs(m["prediction_error"]) for m in steps
                                           if m.get("prediction_error") is not None),
        overhead=statistics.median(m["overhead_s"] / m["step_time"] for m in steps),
        feeder=statistics.median((m["plan_s"] + m["feed_s"]) / m["step_time"] for m in steps),
        loss=statistics.mean(m["loss"] for r in rounds for m in r[-5:]),
        bound_fraction=statistics.median([m["bound_fraction"] for m in steps if m.get("bound_fraction") is not None]
                                         or [float("nan")]),
        chose=chose,
    )


def _print_table(rc: RunConfig, figures: list[PolicyFigures]) -> None:
    ref = next((f for f in figures if f.policy.split("/")[0] == "data-aware"), figures[0])
    print(f"\nmmpipe bench: model {rc.model.name}, pp={rc.parallel.pp} dp={rc.parallel.dp}, "
          f"{rc.train.global_batch} samples/step, {rc.bench.steps} steps x {rc.bench.rounds} rounds "
          f"(first {SKIP_STEPS} steps of each run not timed), hardware {rc.hardware.get('name')}")
    w = max(14, *(len(f.policy) + 2 for f in figures))
    print(f"{'policy':<{w}}{'samples/s':>10}{'tokens/s':>10}{'bubble':>8}{'pred err':>9}{'overhead':>9}"
          f"{'feeder':>8}{'of bound':>9}{'vs ' + ref.policy:>{len(ref.policy) + 5}}")
    for f in figures:
        print(f"{f.policy:<{w}}{f.samples_per_s:>10.1f}{f.tokens_per_s:>10.0f}{f.bubble:>8.1%}"
              f"{f.prediction_error:>9.1%}{f.overhead:>9.1%}{f.feeder:>8.1%}{f.bound_fraction:>9.1%}"
              f"{f.samples_per_s / ref.samples_per_s:>{len(ref.policy) + 4}.2f}x"
              + (f"  (auto chose {f.chose})" if f.chose else ""))
