"""`mmpipe plan`: read a trace, plan every step, print the report, write the plan JSON.

The plan JSON follows docs/spec.md section 4; sample ids are 0-based trace line
numbers (the sample's position in the trace).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mmpipe.model.geometry import features
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import check_policy
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import BASELINES, tune_baseline
from mmpipe.planner.cost import build_cost_model, lower_bound_s
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.partition import StagePlan, check_pp, data_aware_stages, stages_from_names
from mmpipe.planner.report import plot_timeline, schedule_comparison, stage_table, steps_table
from mmpipe.planner.samples import sample_table
from mmpipe.planner.stage_cost import stage_costs
from mmpipe.planner.step import evaluate_step
from mmpipe.planner.trace import read_trace

GB = 1e9
COMPARE_STEPS = 8
"""Baselines shown next to a data-aware plan are tuned on at most this many steps."""


def run_plan(*, model: ModelSpec, hardware: HardwareSpec, pp: int, dp: int, global_batch: int,
             micro_batches: int, trainable: tuple[str, ...], policy: str, trace_path: str,
             out: str | None, steps: int | None, plot: str | None,
             stages: list[tuple[str, str]] | None = None, compare_schedules: bool = False,
             quiet: bool = False) -> dict[str, Any]:
    """Plan the trace's full steps (or the first `steps`) and return the plan dict."""
    check_policy(policy)
    names = layer_names(model)
    check_pp(pp, len(names), model.name)
    for key, v in (("parallel.dp", dp), ("train.global_batch", global_batch),
                   ("train.micro_batches", micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} must be a positive integer")
    cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp)
    trace = Path(trace_path)
    feats = [features(model, meta, where=f"{trace.name} sample {i} (line {i + 1})")
             for i, meta in enumerate(read_trace(trace))]
    n_full = len(feats) // global_batch
    if n_full == 0:
        raise ValueError(f"data.path={trace_path} holds {len(feats)} samples, fewer than "
                         f"train.global_batch={global_batch}; lower train.global_batch")
    if steps is not None and steps < 1:
        raise ValueError(f"plan.steps={steps} must be >= 1 (or null for every full step)")
    n_steps = min(n_full, steps) if steps else n_full
    table = sample_table(feats)
    labels = [f"{trace.name} line {i + 1} (sample {i})" for i in range(len(feats))]
    step_rows = [list(range(k * global_batch, (k + 1) * global_batch)) for k in range(n_steps)]
    compare_rows = step_rows[:COMPARE_STEPS]

    baselines = {}
    for b in BASELINES:
        rows = step_rows if b == policy else compare_rows
        baselines[b] = tune_baseline(b, cost, table, rows, pp=pp, dp=dp, micro_batches=micro_batches)

    if stages is not None:
        ranges = stages_from_names(stages, names)
        if len(ranges) != pp:
            raise ValueError(f"plan.stages gives {len(ranges)} stages but parallel.pp={pp}; "
                             f"give one [first, last] pair per stage")
        stage_plan = StagePlan(stages=ranges, recompute=[False] * pp)
    elif policy == "data-aware":
        probe = _probe_steps(step_rows)
        stage_plan = data_aware_stages(cost, table, probe, pp=pp, dp=dp,
                                       micro_batches=micro_batches, labels=labels)
    else:
        stage_plan = baselines[policy].stage_plan

    if policy == "data-aware":
        packing = True
        sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
        plans = [balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches, labels=labels)
                 for rows in step_rows]
        evals = [evaluate_step(sc, table, p, packing=True) for p in plans]
        if stages is not None and not all(e.fits for e in evals):
            stage_plan = StagePlan(stages=stage_plan.stages, recompute=[True] * pp)
            sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
            plans = [balance_step(sc, table, rows, dp=dp, micro_batches=micro_batches,
                                  labels=labels) for rows in step_rows]
            evals = [evaluate_step(sc, table, p, packing=True) for p in plans]
        setting = "own micro-batch counts, packed"
    else:
        chosen = baselines[policy]
        packing = chosen.packing
        if stages is None:
            stage_plan = chosen.stage_plan
        else:
            stage_plan = StagePlan(stages=stage_plan.stages, recompute=chosen.stage_plan.recompute)
        sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
        plans = list(chosen.steps)
        evals = [evaluate_step(sc, table, p, packing=packing) for p in plans]
        setting = chosen.setting

    lower = [lower_bound_s(cost, sample_table([feats[i] for i in rows]), pp=pp, dp=dp)
             for rows in step_rows]
    plan = {
        "version": 1,
        "model": model.name,
        "layers": names,
        "stages": [[a, b] for a, b in stage_plan.stages],
        "recompute": list(stage_plan.recompute),
        "packing": bool(packing),
        "schedule": "1f1b",
        "steps": [{"replicas": [[[int(i) for i in mb] for mb in rep] for rep in p]} for p in plans],
        "predicted": {
            "step_time_s": [round(e.step_time, 6) for e in evals],
            "lower_bound_s": [round(x, 6) for x in lower],
            "peak_memory_gb": [round(float(x) / GB, 3) for x in
                               np.max([e.peak_bytes for e in evals], axis=0)],
            "fits": all(e.fits for e in evals),
            "hardware": hardware.name,
            "policy": policy,
            "setting": setting,
            "baselines": {b: {"setting": bp.setting, "fits": bp.fits,
                              "step_time_s": [round(e.step_time, 6) for e in bp.evals]}
                          for b, bp in baselines.items()},
        },
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(plan, indent=1) + "\n")
    text = _report(model, hardware, pp, dp, global_batch, micro_batches, policy, sc, evals,
                   setting, baselines, lower, feats, step_rows)
    if compare_schedules:
        k = int(np.argmax([e.step_time for e in evals]))
        r = evals[k].slowest
        text += (f"\n\nschedules on step {k}, replica {r} ({len(plans[k][r])} micro-batches):\n"
                 + schedule_comparison(sc, table, plans[k][r], packing=packing))
    if plot:
        modality = [f.modality for f in feats]
        plot_timeline(plot, sc, table, plans[0], packing=packing, modality=modality,
                      title=f"{model.name} {policy} step 0 on {hardware.name}")
        text += f"\ntimeline of step 0 written to {plot}"
    if out:
        text += f"\nplan written to {out}"
    if not quiet:
        print(text)
    return plan


def _probe_steps(step_rows: list[list[int]], k: int = 2) -> list[list[int]]:
    """A few steps spread over the run to partition on."""
    if len(step_rows) <= k:
        return step_rows
    idx = np.linspace(0, len(step_rows) - 1, k).round().astype(int)
    return [step_rows[i] for i in sorted(set(idx))]


def _report(model, hardware, pp, dp, global_batch, micro_batches, policy, sc, evals, setting,
            baselines, lower, feats, step_rows) -> str:
    tokens = np.mean([sum(feats[i].llm_len for i in rows) for rows in step_rows])
    head = (f"mmpipe plan: model {model.name} on {hardware.name}, pp={pp} dp={dp}, "
            f"global batch {global_batch} ({tokens:,.0f} LLM tokens per step), "
            f"{len(step_rows)} steps, policy {policy}")
    if micro_batches < pp:
        head += f"\nwarning: train.micro_batches={micro_batches} < parallel.pp={pp}: large bubbles"
    rows = [(policy, [e.step_time for e in evals], setting)]
    for b, bp in baselines.items():
        if b != policy:
            mark = "" if bp.fits else " (does not fit)"
            rows.append((b, [e.step_time for e in bp.evals], bp.setting + mark))
    mean = np.mean([e.step_time for e in evals])
    summary = (f"predicted mean step time {mean:.3f} s = {mean / np.mean(lower):.2f}x the lower "
               f"bound; fits in memory: {'yes' if all(e.fits for e in evals) else 'NO'}")
    return "\n".join([head, "", stage_table(sc, evals), "", steps_table(rows, lower), "", summary])
