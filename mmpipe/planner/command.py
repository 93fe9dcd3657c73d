"""`mmpipe plan`: read a trace (or shard metadata), choose the layout when asked
(`parallel.pp=auto` / `parallel.dp=auto`), plan every step, print the report, write the plan
JSON.

The plan JSON follows docs/spec.md section 4; sample ids are 0-based trace line numbers (the
sample's position in the trace), or positions in the shard stream (then `sample_keys` lists
each position's key).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmpipe.model.geometry import SampleFeatures, SampleMeta, features
from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec, layer_names
from mmpipe.planner.api import check_policy
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import BASELINES, tune_baseline
from mmpipe.planner.cost import DEFAULT_HEADROOM, DEFAULT_PRECISION, build_cost_model, lower_bound_s
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.layout import costs_by_dp, equal_bubble, search_layouts
from mmpipe.planner.partition import StagePlan, check_pp, data_aware_stages, stages_from_names
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.report import (
    layout_json,
    layout_table,
    plot_timeline,
    schedule_comparison,
    stage_table,
    steps_table,
)
from mmpipe.planner.samples import SampleTable, sample_table
from mmpipe.planner.spread import (
    SpreadStep,
    candidate_placements,
    encode_costs,
    parse_encoders,
    pipeline_stage_costs,
    placement_name,
    plan_spread_step,
    reserve_bytes,
    reserved_pipeline,
    show_encoders,
    spread_model,
)
from mmpipe.planner.stage_cost import StageCosts, stage_costs
from mmpipe.planner.step import Replicas, StepEval, evaluate_step
from mmpipe.planner.trace import read_trace

GB = 1e9
SMALL_REPORT = 16
"""The report explains the bubble floor when a replica gets fewer than this x pp samples (32
for 4 stages already costs 1.6-1.7x the lower bound on LLaVA-style data)."""
COMPARE_STEPS = 8
"""Baselines shown next to a data-aware plan are tuned on at most this many steps."""


def run_plan(*, model: ModelSpec, hardware: HardwareSpec, pp: int | None, dp: int | None,
             global_batch: int, micro_batches: int, trainable: tuple[str, ...], policy: str,
             trace_path: str | None = None, out: str | None = None, steps: int | None = None,
             plot: str | None = None, stages: list[tuple[str, str]] | None = None,
             compare_schedules: bool = False, quiet: bool = False, devices: int | None = None,
             memory_headroom: float = DEFAULT_HEADROOM,
             precision: TrainingPrecision = DEFAULT_PRECISION,
             samples: Sequence[tuple[str, SampleMeta]] | None = None,
             source: str = "", lora: LoraSpec = NO_LORA, encoders: object = "stages") -> dict[str, Any]:
    """Plan the full steps (or the first `steps`) of a trace or of shard metadata and return
    the plan dict.

    Args:
        pp, dp: None is `auto`: the layout search picks it among the splits of `devices`.
        trace_path: a JSONL trace (docs/spec.md section 1); or
        samples: (key, metadata) of each sample in stream order (`mmpipe plan data=shards`),
            named by `source` (the data.path) in messages.
        memory_headroom: plan.memory_headroom; precision: the run's precision, ZeRO stage
            and optimizer.
        encoders: plan.encoders (planner.spread): `stages` (the default here), `spread`, a
            mapping per tower, or `auto`: the data-aware plan of each candidate placement is
            made and the fastest by its simulated step time is kept (ties: stages). The layout
            search (parallel.pp/dp=auto) ranks layouts with the towers on the stages.
    """
    check_policy(policy)
    placement = parse_encoders(encoders, model)
    if policy != "data-aware":
        if isinstance(placement, dict) and "spread" in placement.values():
            raise ValueError(f"plan.encoders={show_encoders(encoders)} spreads a tower, which mmpipe plan "
                             f"plans with plan.policy=data-aware only; use plan.encoders=stages")
        placement = {t: "stages" for t in candidate_placements(model)[0]}
    names = layer_names(model)
    for key, v in (("train.global_batch", global_batch), ("train.micro_batches", micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} must be a positive integer")
    auto = pp is None or dp is None
    if auto and devices is None:
        raise ValueError("parallel.pp=auto / parallel.dp=auto needs parallel.devices=N, the "
                         "devices to split into pipeline stages x replicas")
    if not auto:
        check_pp(pp, len(names), model.name)
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"parallel.dp={dp!r} must be a positive integer")
    feats, labels, where = _read_samples(model, trace_path, samples, source)
    n_full = len(feats) // global_batch
    if n_full == 0:
        raise ValueError(f"data.path={where} holds {len(feats)} samples, fewer than "
                         f"train.global_batch={global_batch}; lower train.global_batch")
    if steps is not None and steps < 1:
        raise ValueError(f"plan.steps={steps} must be >= 1 (or null for every full step)")
    n_steps = min(n_full, steps) if steps else n_full
    table = sample_table(feats)
    step_rows = [list(range(k * global_batch, (k + 1) * global_batch)) for k in range(n_steps)]
    compare_rows = step_rows[:COMPARE_STEPS]
    probe = _probe_steps(step_rows)

    choice = None
    if auto:
        assert devices is not None
        costs = costs_by_dp(model=model, hardware=hardware, trainable=trainable, devices=devices, dp=dp,
                            precision=precision, memory_headroom=memory_headroom, lora=lora)
        choice = search_layouts(costs=costs, table=table, steps=probe, devices=devices,
                                global_batch=global_batch, micro_batches=micro_batches, pp=pp,
                                dp=dp, labels=labels)
        if not choice.best.fits:
            raise ValueError(f"no layout of parallel.devices={devices} fits in memory:\n"
                             + layout_table(choice))
        pp, dp = choice.best.pp, choice.best.dp
    elif devices is not None and pp * dp != devices:
        raise ValueError(f"parallel.pp={pp} x parallel.dp={dp} = {pp * dp} is not "
                         f"parallel.devices={devices}; set one of them to auto")
    cost = build_cost_model(model=model, hardware=hardware, trainable=trainable, dp=dp,
                            precision=precision, memory_headroom=memory_headroom, lora=lora)

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
        chosen = choice.best.stage_plan if choice is not None and choice.best.how == "planned" \
            else None
        stage_plan = chosen or data_aware_stages(cost, table, probe, pp=pp, dp=dp,
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
        chosen_base = baselines[policy]
        packing = chosen_base.packing
        if stages is None:
            stage_plan = chosen_base.stage_plan
        else:
            stage_plan = StagePlan(stages=stage_plan.stages,
                                   recompute=chosen_base.stage_plan.recompute)
        sc = stage_costs(cost, stage_plan.stages, stage_plan.recompute)
        plans = list(chosen_base.steps)
        evals = [evaluate_step(sc, table, p, packing=packing) for p in plans]
        setting = chosen_base.setting
    cands = candidate_placements(model) if placement == "auto" else [placement]
    compared: list[tuple[dict[str, str], float]] = []
    spread_steps: list[SpreadStep] | None = None
    chosen_enc = cands[0]
    if policy == "data-aware":
        best_t = np.inf
        for enc in cands:
            if "spread" not in enc.values():
                t = float(sum(e.step_time for e in evals)) if all(e.fits for e in evals) else np.inf
                if t < best_t:
                    best_t, chosen_enc = t, enc
                compared.append((enc, t))
                continue
            try:
                got = _plan_spread(cost, enc, table, step_rows, probe, stages=stage_plan if stages else None,
                                   pp=pp, dp=dp, micro_batches=micro_batches, labels=labels)
                t = float(sum(x.step_time for x in got[4])) if all(x.fits for x in got[4]) else np.inf
            except ValueError as err:
                if len(cands) == 1:
                    raise
                got, t = None, np.inf
                setting += f"; {placement_name(enc)}: {err}"
            compared.append((enc, t))
            if got is not None and (t < best_t or len(cands) == 1):
                best_t, chosen_enc = t, enc
                stage_plan, sc, plans, evals, spread_steps = got

    lower = [lower_bound_s(cost, table.rows(rows), pp=pp, dp=dp) for rows in step_rows]
    times = [x.step_time for x in spread_steps] if spread_steps else [e.step_time for e in evals]
    peaks = (np.max([np.max(x.peaks, axis=0) for x in spread_steps], axis=0) if spread_steps
             else np.max([e.peak_bytes for e in evals], axis=0))
    fits = all(x.fits for x in spread_steps) if spread_steps else all(e.fits for e in evals)
    plan: dict[str, Any] = {
        "version": 1,
        "model": model.name,
        "layers": names,
        "stages": [[a, b] for a, b in stage_plan.stages],
        "recompute": list(stage_plan.recompute),
        "packing": bool(packing),
        "schedule": "1f1b",
        "encoders": dict(chosen_enc),
        "steps": [{"replicas": [[[int(i) for i in mb] for mb in rep] for rep in p],
                   "encode": encode_by_rank(spread_steps[k].encode if spread_steps else None, pp, dp),
                   **({"encode_recompute": spread_steps[k].mode} if spread_steps else {})}
                  for k, p in enumerate(plans)],
        "predicted": {
            "step_time_s": [round(t, 6) for t in times],
            "lower_bound_s": [round(x, 6) for x in lower],
            "peak_memory_gb": [round(float(x) / GB, 3) for x in peaks],
            "fits": fits,
            "hardware": hardware.name,
            "memory": {"precision": precision.precision, "zero_stage": precision.zero_stage,
                       "optimizer": precision.optimizer, "memory_headroom": memory_headroom,
                       "plannable_gb": round(cost.usable_bytes / GB, 3)},
            "policy": policy,
            "setting": setting,
            "baselines": {b: {"setting": bp.setting, "fits": bp.fits,
                              "step_time_s": [round(e.step_time, 6) for e in bp.evals]}
                          for b, bp in baselines.items()},
        },
    }
    if compared:
        plan["predicted"]["encoders"] = {
            "value": show_encoders(encoders), "chosen": placement_name(chosen_enc),
            "step_time_s": {placement_name(e): (round(t / len(step_rows), 6) if np.isfinite(t) else None)
                            for e, t in compared}}
        if spread_steps:
            plan["predicted"]["encoders"].update(
                encode_s=[[[round(x, 6) for x in rep] for rep in st.loads] for st in spread_steps],
                allreduce_s=round(spread_steps[0].allreduce, 6))
    if choice is not None:
        plan["predicted"]["layout"] = {"devices": devices, "pp": pp, "dp": dp}
        plan["predicted"]["layouts"] = [layout_json(x) for x in choice.layouts]
    if samples is not None:
        plan["sample_keys"] = [str(k) for k, _ in samples][:len(feats)]
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(plan, indent=1) + "\n")
    text = _report(model, hardware, pp, dp, global_batch, micro_batches, policy, sc, evals,
                   setting, baselines, lower, feats, step_rows, precision, times=times, fits=fits)
    if compared:
        text += "\n" + encoders_report(encoders, chosen_enc, compared, spread_steps, len(step_rows))
    if choice is not None:
        text = (f"layouts of parallel.devices={devices} (data-aware, {len(probe)} probe "
                f"step{'s' if len(probe) > 1 else ''}; * chosen):\n{layout_table(choice)}\n\n"
                + text)
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


def _read_samples(model: ModelSpec, trace_path: str | None,
                  samples: Sequence[tuple[str, SampleMeta]] | None, source: str
                  ) -> tuple[list[SampleFeatures], list[str], str]:
    """Features, error labels and a name of the input: a trace, or shard metadata."""
    if (trace_path is None) == (samples is None):
        raise ValueError("give a trace (data=trace data.path=FILE.jsonl) or shards (data=shards)")
    if trace_path is not None:
        trace = Path(trace_path)
        feats = [features(model, meta, where=f"{trace.name} sample {i} (line {i + 1})")
                 for i, meta in enumerate(read_trace(trace))]
        return feats, [f"{trace.name} line {i + 1} (sample {i})" for i in range(len(feats))], \
            trace_path
    assert samples is not None
    feats = [features(model, meta, where=f"shard sample {key!r} (sample {i})")
             for i, (key, meta) in enumerate(samples)]
    return feats, [f"shard sample {key!r} (sample {i})" for i, (key, _) in enumerate(samples)], \
        source or "(shards)"


def _probe_steps(step_rows: list[list[int]], k: int = 2) -> list[list[int]]:
    """A few steps spread over the run to partition on."""
    if len(step_rows) <= k:
        return step_rows
    idx = np.linspace(0, len(step_rows) - 1, k).round().astype(int)
    return [step_rows[i] for i in sorted(set(idx))]


def _report(model, hardware, pp, dp, global_batch, micro_batches, policy, sc, evals, setting,
            baselines, lower, feats, step_rows, precision, *, times, fits) -> str:
    tokens = np.mean([sum(feats[i].llm_len for i in rows) for rows in step_rows])
    head = (f"mmpipe plan: model {model.name} on {hardware.name}, pp={pp} dp={dp}, "
            f"global batch {global_batch} ({tokens:,.0f} LLM tokens per step), "
            f"{len(step_rows)} steps, policy {policy}, memory {precision.describe()}")
    lora = sc.cost.lora
    if lora.active:
        head += (f", LoRA r={lora.r} on {'/'.join(lora.parts)} (base frozen; trained in full: "
                 f"{', '.join(sc.cost.trainable) or 'nothing else'})")
    if micro_batches < pp and policy != "data-aware":
        head += f"\nwarning: train.micro_batches={micro_batches} < parallel.pp={pp}: large bubbles"
    per_replica = global_batch // dp
    if pp > 1 and per_replica < SMALL_REPORT * pp:
        head += (f"\nsmall step: each replica gets {per_replica} samples per step for {pp} stages; "
                 f"1F1B with m equal micro-batches idles (pp-1)/(m+pp-1) of the step, "
                 f"{equal_bubble(pp, per_replica):.1%} even at one sample per micro-batch (which "
                 f"runs far below peak); fewer stages or a larger train.global_batch avoid it "
                 f"(parallel.pp=auto parallel.devices={pp * dp} weighs the layouts)")
    rows = [(policy, list(times), setting)]
    for b, bp in baselines.items():
        if b != policy:
            mark = "" if bp.fits else " (does not fit)"
            rows.append((b, [e.step_time for e in bp.evals], bp.setting + mark))
    mean = np.mean(times)
    summary = (f"predicted mean step time of {policy} over its {len(times)} step{'s' if len(times) > 1 else ''} "
               f"{mean:.3f} s = {mean / np.mean(lower):.2f}x the lower bound; "
               f"fits in memory: {'yes' if fits else 'NO'}")
    return "\n".join([head, "", stage_table(sc, evals), "", steps_table(rows, lower), "", summary])


def _plan_spread(cost, encoders: dict[str, str], table: SampleTable, step_rows: list[list[int]],
                 probe: list[list[int]], *, stages: StagePlan | None, pp: int, dp: int, micro_batches: int,
                 labels: Sequence[str]) -> tuple[StagePlan, StageCosts, list[Replicas], list[StepEval],
                                                 list[SpreadStep]]:
    """The data-aware plan of every step under a placement with a spread tower: the partition
    (or the user's `stages`) of the pipeline's layers, each step's micro-batches balanced with
    the spread towers' memory reserved, and its price (planner.spread)."""
    sm = spread_model(cost, encoders)
    ec = encode_costs(sm, table)
    if stages is None:
        room = max(float(reserve_bytes(sm, ec, rows, pp=pp, dp=dp)[-1]) for rows in probe)
        check_pp(pp, len(sm.keep), f"{cost.model.name} with {placement_name(encoders)} encoders")
        stage_plan = sm.to_full(data_aware_stages(reserved_pipeline(sm, room), table, probe, pp=pp, dp=dp,
                                                  micro_batches=micro_batches, labels=labels))
    else:
        stage_plan = stages
    plans, evals, priced = [], [], []
    sc = pipeline_stage_costs(sm, stage_plan)
    for rows in step_rows:
        sc, rep, ev, sp = plan_spread_step(
            sm, ec, table, rows, stage_plan,
            lambda costs, rows=rows: balance_step(costs, table, rows, dp=dp, micro_batches=micro_batches,
                                                  labels=labels), pp=pp, dp=dp)
        plans.append(rep)
        evals.append(ev)
        priced.append(sp)
    return stage_plan, sc, plans, evals, priced


def encode_by_rank(encode: Sequence[Sequence[Sequence[int]]] | None, pp: int, dp: int) -> list[list[int]]:
    """A step's encode shares (per replica, per stage) in global rank order, rank = stage x dp
    + replica (DeepSpeed's pipe-major PipeModelDataParallelTopology); empty lists when no tower
    is spread."""
    out: list[list[int]] = [[] for _ in range(pp * dp)]
    for r, rep in enumerate(encode or ()):
        for s, share in enumerate(rep):
            out[s * dp + r] = [int(i) for i in share]
    return out


def encoders_report(value: object, chosen: dict[str, str], compared: Sequence[tuple[dict[str, str], float]],
                    spread_steps: Sequence[SpreadStep] | None, n_steps: int, show_steps: int = 4) -> str:
    """The placement chosen, the placements compared (mean simulated step time of each one's
    best plan) and, under a spread placement, each rank's encode load on the first steps."""
    towers = ", ".join(f"{t} {w}" for t, w in chosen.items()) or "none"
    lines = [f"encoders: {towers} (plan.encoders={show_encoders(value)})"]
    if len(compared) > 1:
        cells = [f"{placement_name(e)} {t / n_steps:.3f} s" if np.isfinite(t) else f"{placement_name(e)} does not fit"
                 for e, t in compared]
        lines.append("placements compared (mean simulated step time of each one's best plan): " + "; ".join(cells))
    if spread_steps:
        lines.append(f"encode load per rank (pre-pass forward + post-pass, s; shares keep: {spread_steps[0].mode}; "
                     f"all-reduce of the spread towers {spread_steps[0].allreduce:.3f} s):")
        for k, st in enumerate(spread_steps[:show_steps]):
            loads = [x for rep in st.loads for x in rep]
            pre, post = max(st.pre, default=0.0), max(st.post, default=0.0)
            lines.append(f"  step {k}: max {max(loads, default=0.0):.3f} mean {np.mean(loads) if loads else 0.0:.3f}; "
                         f"slowest pre-pass {pre:.3f}, post-pass {post:.3f}")
    return "\n".join(lines)
