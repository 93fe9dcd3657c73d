"""`mmpipe plan`: read a trace (or shard metadata), choose the layout when asked
(`parallel.pp=auto` / `parallel.dp=auto`), plan every step, print the report, write the plan
JSON.

`run_plan` takes the run's `PlanProblem` (`config.plan_problem`, as training does) and what the
command reads and writes; its steps are the functions below, in order: the placement and
layout keys checked, the samples read and cut into steps, the layout chosen (planner/layout.py),
the baselines tuned, the cut chosen, every step planned under the policy, the encoder
placements compared (planner/spread.py), then the plan JSON and the report.

The plan JSON follows docs/spec.md section 4; sample ids are 0-based trace line numbers (the
sample's position in the trace), or positions in the shard stream (then `sample_keys` lists
each position's key).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import layer_names
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.baselines import BASELINES, BaselinePlan, tune_baseline
from mmpipe.planner.cost import CostModel, lower_bound_s
from mmpipe.planner.layout import LayoutChoice, equal_bubble, search_layouts
from mmpipe.planner.partition import StagePlan, check_pp, data_aware_stages, stages_from_names
from mmpipe.planner.problem import Placement, PlanProblem, placement_name
from mmpipe.planner.report import (
    encoders_report,
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
    candidate_cuts,
    encode_by_rank,
    encode_costs,
    pipeline_stage_costs,
    plan_spread_step,
    reserve_bytes,
    reserved_pipeline,
    slots_by_rank,
    spread_model,
)
from mmpipe.planner.stage_cost import StageCosts, stage_costs
from mmpipe.planner.stages import check_policy
from mmpipe.planner.step import Replicas, StepEval, evaluate_step
from mmpipe.planner.trace import PlanInput, read_samples

GB = 1e9
SMALL_REPORT = 16
"""The report explains the bubble floor when a replica gets fewer than this x pp samples (32
for 4 stages already costs 1.6-1.7x the lower bound on LLaVA-style data)."""
COMPARE_STEPS = 8
"""Baselines shown next to a data-aware plan are tuned on at most this many steps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOutput:
    """What `mmpipe plan` writes beside the plan dict it returns."""

    out: str | None = None
    """plan.out: the plan JSON's path."""
    plot: str | None = None
    """plan.plot: a PNG timeline of step 0."""
    compare_schedules: bool = False
    """`mmpipe simulate`: the schedules compared on the slowest replica of the slowest step."""
    quiet: bool = False
    """Print nothing (the report is still built)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedSteps:
    """Every step planned on one cut under one placement, and judged."""

    stage_plan: StagePlan
    sc: StageCosts
    """The cut's stage costs (the pipeline's alone under a spread placement)."""
    plans: list[Replicas]
    """Per step, every replica's micro-batches (indices into the whole input)."""
    evals: list[StepEval]
    """Per step, the simulator's judgement of the pipeline."""
    packing: bool
    setting: str
    """How the policy set its micro-batches (the report's `settings` line)."""
    spread: list[SpreadStep] | None = None
    """Per step, the spread placement's price (None: every tower on the stages)."""

    @property
    def times(self) -> list[float]:
        """Per step, the predicted step time, s."""
        return [x.step_time for x in self.spread] if self.spread else [e.step_time for e in self.evals]

    @property
    def fits(self) -> bool:
        return all(x.fits for x in self.spread) if self.spread else all(e.fits for e in self.evals)


def run_plan(problem: PlanProblem, data: PlanInput, *, stages: Sequence[tuple[str, str]] | None = None,
             output: PlanOutput = PlanOutput()) -> dict[str, Any]:
    """Plan the full steps (or the first `data.steps`) of a trace or of shard metadata and
    return the plan dict.

    Args:
        problem: the run (`config.plan_problem`). pp / dp None are `auto`: the layout search
            picks them among the splits of `problem.devices` (it ranks layouts with the towers
            on the stages). Its placement (plan.encoders) may be `auto`: the data-aware plan of
            each candidate placement is made and the fastest by its simulated step time is kept
            (a placement off the stages only by OFF_STAGE_MARGIN). Every step is planned across the
            replicas.
        stages: plan.stages, a (first, last) layer name pair per stage: the cut is the user's.
    """
    placement = _placement(problem)
    _check_layout_keys(problem)
    feats, labels, where = read_samples(problem.model, data)
    step_rows = _step_rows(len(feats), problem, data.steps, where)
    table = sample_table(feats)
    probe = _probe_steps(step_rows)
    choice = None
    if problem.pp is None or problem.dp is None:
        choice = _choose_layout(problem, table, probe, labels)
        problem = dataclasses.replace(problem, pp=choice.best.pp, dp=choice.best.dp)
    elif problem.devices is not None and problem.pp * problem.dp != problem.devices:
        raise ValueError(f"parallel.pp={problem.pp} x parallel.dp={problem.dp} = {problem.pp * problem.dp} is not "
                         f"parallel.devices={problem.devices}; set one of them to auto")
    cost = problem.cost_model()
    pp, dp = problem.fixed_pp, problem.fixed_dp
    baselines = {b: tune_baseline(b, cost, table, step_rows if b == problem.policy else step_rows[:COMPARE_STEPS],
                                  pp=pp, dp=dp, micro_batches=problem.micro_batches) for b in BASELINES}
    user = _user_stages(stages, problem)
    if user is not None:
        cut = user
    elif problem.policy == "data-aware":
        planned_cut = choice.best.stage_plan if choice is not None and choice.best.how == "planned" else None
        cut = planned_cut or data_aware_stages(cost, table, probe, pp=pp, dp=dp,
                                               micro_batches=problem.micro_batches, labels=labels)
    else:
        cut = baselines[problem.policy].stage_plan
    planned = _plan_policy(problem, cost, table, step_rows, labels, cut, user is not None, baselines)
    planned, chosen, compared = _compare_placements(problem, placement, cost, table, step_rows, probe, labels,
                                                    planned, user is not None)
    lower = [lower_bound_s(cost, table.rows(rows), pp=pp, dp=dp) for rows in step_rows]
    plan = _plan_json(problem, planned, chosen, compared, baselines, lower, len(step_rows))
    if choice is not None:
        plan["predicted"]["layout"] = {"devices": problem.devices, "pp": pp, "dp": dp}
        plan["predicted"]["layouts"] = [layout_json(x) for x in choice.layouts]
    if data.samples is not None:
        plan["sample_keys"] = [str(k) for k, _ in data.samples][:len(feats)]
    if output.out:
        Path(output.out).parent.mkdir(parents=True, exist_ok=True)
        Path(output.out).write_text(json.dumps(plan, indent=1) + "\n")
    text = _report(problem, planned, baselines, lower, feats, step_rows)
    if compared:
        text += "\n" + encoders_report(problem.placement.given, chosen.mapping, compared, planned.spread,
                                       len(step_rows))
    if choice is not None:
        text = (f"layouts of parallel.devices={problem.devices} (data-aware, {len(probe)} probe "
                f"step{'s' if len(probe) > 1 else ''}; * chosen):\n{layout_table(choice)}\n\n" + text)
    text += _extras(problem, planned, table, feats, output)
    if not output.quiet:
        print(text)
    return plan


def _placement(problem: PlanProblem) -> Placement:
    """The placements this plan may compare: the problem's (every tower on the stages by
    default), or all on the stages for a baseline policy, which `mmpipe plan` plans staged."""
    check_policy(problem.policy)
    model, placement = problem.model, problem.placement
    staged = Placement.staged(model)
    if problem.policy != "data-aware":
        if placement.spread:
            raise ValueError(f"plan.encoders={placement.given} spreads a tower, which mmpipe plan "
                             f"plans with plan.policy=data-aware only; use plan.encoders=stages")
        return staged
    return placement if placement.auto or placement.towers else staged


def _check_layout_keys(problem: PlanProblem) -> None:
    """train.global_batch, train.micro_batches and a fixed layout checked before the data is read."""
    for key, v in (("train.global_batch", problem.global_batch), ("train.micro_batches", problem.micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} must be a positive integer")
    auto = problem.pp is None or problem.dp is None
    if auto and problem.devices is None:
        raise ValueError("parallel.pp=auto / parallel.dp=auto needs parallel.devices=N, the "
                         "devices to split into pipeline stages x replicas")
    if not auto:
        check_pp(problem.pp, len(layer_names(problem.model)), problem.model.name)
        if not isinstance(problem.dp, int) or problem.dp < 1:
            raise ValueError(f"parallel.dp={problem.dp!r} must be a positive integer")


def _step_rows(n: int, problem: PlanProblem, steps: int | None, where: str) -> list[list[int]]:
    """The rows of each full step planned (the first `steps`, or all)."""
    global_batch = problem.global_batch or 0
    n_full = n // global_batch
    if n_full == 0:
        raise ValueError(f"data.path={where} holds {n} samples, fewer than "
                         f"train.global_batch={global_batch}; lower train.global_batch")
    if steps is not None and steps < 1:
        raise ValueError(f"plan.steps={steps} must be >= 1 (or null for every full step)")
    n_steps = min(n_full, steps) if steps else n_full
    return [list(range(k * global_batch, (k + 1) * global_batch)) for k in range(n_steps)]


def _choose_layout(problem: PlanProblem, table: SampleTable, probe: list[list[int]],
                   labels: Sequence[str]) -> LayoutChoice:
    """parallel.pp / parallel.dp = auto: the layout search on the probe steps; ValueError when
    no layout fits."""
    choice = search_layouts(problem, table, probe, labels=labels)
    if not choice.best.fits:
        raise ValueError(f"no layout of parallel.devices={problem.devices} fits in memory:\n" + layout_table(choice))
    return choice


def _user_stages(stages: Sequence[tuple[str, str]] | None, problem: PlanProblem) -> StagePlan | None:
    """plan.stages as a cut (no recompute), None when not given."""
    if stages is None:
        return None
    ranges = stages_from_names(stages, layer_names(problem.model))
    if len(ranges) != problem.fixed_pp:
        raise ValueError(f"plan.stages gives {len(ranges)} stages but parallel.pp={problem.pp}; "
                         f"give one [first, last] pair per stage")
    return StagePlan(stages=ranges, recompute=[False] * problem.fixed_pp)


def _plan_policy(problem: PlanProblem, cost: CostModel, table: SampleTable, step_rows: list[list[int]],
                 labels: Sequence[str], cut: StagePlan, user: bool,
                 baselines: dict[str, BaselinePlan]) -> PlannedSteps:
    """Every step under the policy with every tower on the stages: data-aware balances each
    step on the cut (a user's cut that overflows memory gets recompute on every stage); a
    baseline keeps its tuned steps (on the user's ranges with its recompute)."""
    if problem.policy == "data-aware":
        planned = _balanced(problem, cost, table, step_rows, labels, cut)
        if user and not planned.fits:
            everywhere = StagePlan(stages=cut.stages, recompute=[True] * problem.fixed_pp)
            planned = _balanced(problem, cost, table, step_rows, labels, everywhere)
        return planned
    tuned = baselines[problem.policy]
    plan = StagePlan(stages=cut.stages, recompute=tuned.stage_plan.recompute) if user else tuned.stage_plan
    sc = stage_costs(cost, plan.stages, plan.recompute)
    plans = list(tuned.steps)
    return PlannedSteps(stage_plan=plan, sc=sc, plans=plans, packing=tuned.packing, setting=tuned.setting,
                        evals=[evaluate_step(sc, table, p, packing=tuned.packing) for p in plans])


def _balanced(problem: PlanProblem, cost: CostModel, table: SampleTable, step_rows: list[list[int]],
              labels: Sequence[str], cut: StagePlan) -> PlannedSteps:
    """The data-aware micro-batches of every step on `cut`, every tower on the stages."""
    sc = stage_costs(cost, cut.stages, cut.recompute)
    plans = [balance_step(sc, table, rows, dp=problem.fixed_dp, micro_batches=problem.micro_batches, labels=labels)
             for rows in step_rows]
    return PlannedSteps(stage_plan=cut, sc=sc, plans=plans, packing=True, setting="own micro-batch counts, packed",
                        evals=[evaluate_step(sc, table, p, packing=True) for p in plans])


def _compare_placements(problem: PlanProblem, placement: Placement, cost: CostModel, table: SampleTable,
                        step_rows: list[list[int]], probe: list[list[int]], labels: Sequence[str],
                        staged: PlannedSteps, user: bool
                        ) -> tuple[PlannedSteps, Placement, list[tuple[Placement, float]]]:
    """The data-aware plan of each placement `placement` asks for (the staged one is `staged`),
    the fastest by summed simulated step time kept (one off the stages only by OFF_STAGE_MARGIN;
    ties: the earlier, so stages); a placement
    that fails is noted in the setting, or raised when it is the only one. A baseline policy
    compares nothing."""
    cands = placement.candidates(problem.model)
    if problem.policy != "data-aware":
        return staged, cands[0], []
    compared: list[tuple[Placement, float]] = []
    chosen, best_t, current, setting = cands[0], np.inf, staged, staged.setting
    for enc in cands:
        if not enc.spread:
            t = float(sum(e.step_time for e in current.evals)) if all(e.fits for e in current.evals) else np.inf
            if enc.ranking_time(t) < best_t:
                best_t, chosen = enc.ranking_time(t), enc
            compared.append((enc, t))
            continue
        try:
            got: PlannedSteps | None = _plan_spread(problem, cost, enc, table, step_rows, probe, labels,
                                                    current.stage_plan if user else None,
                                                    staged=staged.stage_plan)
            assert got is not None
            t = float(sum(x.step_time for x in got.spread or ())) if got.fits else np.inf
        except ValueError as err:
            if len(cands) == 1:
                raise
            got, t = None, np.inf
            setting += f"; {enc.name}: {err}"
        compared.append((enc, t))
        if got is not None and (enc.ranking_time(t) < best_t or len(cands) == 1):
            best_t, chosen, current = enc.ranking_time(t), enc, got
    return dataclasses.replace(current, setting=setting), chosen, compared


def _plan_json(problem: PlanProblem, planned: PlannedSteps, chosen: Placement,
               compared: list[tuple[Placement, float]], baselines: dict[str, BaselinePlan],
               lower: list[float], n_steps: int) -> dict[str, Any]:
    """The plan of docs/spec.md section 4, with the predictions."""
    pp, dp, spread = problem.fixed_pp, problem.fixed_dp, planned.spread
    peaks = (np.max([np.max(x.peaks, axis=0) for x in spread], axis=0) if spread
             else np.max([e.peak_bytes for e in planned.evals], axis=0))
    precision = problem.precision
    plan: dict[str, Any] = {
        "version": 1,
        "model": problem.model.name,
        "layers": layer_names(problem.model),
        "stages": [[a, b] for a, b in planned.stage_plan.stages],
        "recompute": list(planned.stage_plan.recompute),
        "packing": bool(planned.packing),
        "schedule": "1f1b",
        "encoders": chosen.mapping,
        "steps": [{"replicas": [[[int(i) for i in mb] for mb in rep] for rep in p],
                   "encode": encode_by_rank(spread[k].encode if spread else None, pp, dp),
                   **({"encode_recompute": spread[k].mode} if spread else {}),
                   **({"encode_slots": slots_by_rank(spread[k].slots, pp, dp)} if spread and chosen.nested else {})}
                  for k, p in enumerate(planned.plans)],
        "predicted": {
            "step_time_s": [round(t, 6) for t in planned.times],
            "lower_bound_s": [round(x, 6) for x in lower],
            "peak_memory_gb": [round(float(x) / GB, 3) for x in peaks],
            "fits": planned.fits,
            "hardware": problem.hardware.name,
            "memory": {"precision": precision.precision, "zero_stage": precision.zero_stage,
                       "optimizer": precision.optimizer, "memory_headroom": problem.memory_headroom,
                       "plannable_gb": round(planned.sc.cost.usable_bytes / GB, 3)},
            "policy": problem.policy,
            "setting": planned.setting,
            "baselines": {b: {"setting": bp.setting, "fits": bp.fits,
                              "step_time_s": [round(e.step_time, 6) for e in bp.evals]}
                          for b, bp in baselines.items()},
        },
    }
    if not spread:  # every tower on the stages: each rank's compute in the simulated step
        plan["predicted"]["busy_s"] = [[[round(float(x), 6) for x in r.busy] if r is not None else [0.0] * pp
                                        for r in e.replicas] for e in planned.evals]
    if compared:
        plan["predicted"]["encoders"] = {
            "value": problem.placement.given, "chosen": chosen.name,
            "step_time_s": {e.name: (round(t / n_steps, 6) if np.isfinite(t) else None) for e, t in compared}}
        if spread:
            plan["predicted"]["encoders"].update(
                encode_s=[[[round(x, 6) for x in rep] for rep in st.loads] for st in spread],
                allreduce_s=round(spread[0].allreduce, 6))
    return plan


def _extras(problem: PlanProblem, planned: PlannedSteps, table: SampleTable, feats: list[SampleFeatures],
            output: PlanOutput) -> str:
    """The schedule comparison and the timeline plot when asked, and where the plan went."""
    text = ""
    if output.compare_schedules:
        k = int(np.argmax([e.step_time for e in planned.evals]))
        r = planned.evals[k].slowest
        text += (f"\n\nschedules on step {k}, replica {r} ({len(planned.plans[k][r])} micro-batches):\n"
                 + schedule_comparison(planned.sc, table, planned.plans[k][r], packing=planned.packing))
    if output.plot:
        modality = [f.modality for f in feats]
        plot_timeline(output.plot, planned.sc, table, planned.plans[0], packing=planned.packing, modality=modality,
                      title=f"{problem.model.name} {problem.policy} step 0 on {problem.hardware.name}")
        text += f"\ntimeline of step 0 written to {output.plot}"
    if output.out:
        text += f"\nplan written to {output.out}"
    return text


def _probe_steps(step_rows: list[list[int]], k: int = 2) -> list[list[int]]:
    """A few steps spread over the run to partition on."""
    if len(step_rows) <= k:
        return step_rows
    idx = np.linspace(0, len(step_rows) - 1, k).round().astype(int)
    return [step_rows[i] for i in sorted(set(idx))]


def _report(problem: PlanProblem, planned: PlannedSteps, baselines: dict[str, BaselinePlan], lower: list[float],
            feats: list[SampleFeatures], step_rows: list[list[int]]) -> str:
    """The printed report: the run, the stage table, each step under every policy, the summary."""
    pp, dp, policy, micro_batches = problem.fixed_pp, problem.fixed_dp, problem.policy, problem.micro_batches
    global_batch = problem.global_batch or 0
    sc, times = planned.sc, planned.times
    tokens = np.mean([sum(feats[i].llm_len for i in rows) for rows in step_rows])
    head = (f"mmpipe plan: model {problem.model.name} on {problem.hardware.name}, pp={pp} dp={dp}, "
            f"global batch {global_batch} ({tokens:,.0f} LLM tokens per step), "
            f"{len(step_rows)} steps, policy {policy}, memory {problem.precision.describe()}")
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
    rows = [(policy, list(times), planned.setting)]
    for b, bp in baselines.items():
        if b != policy:
            mark = "" if bp.fits else " (does not fit)"
            rows.append((b, [e.step_time for e in bp.evals], bp.setting + mark))
    mean = np.mean(times)
    summary = (f"predicted mean step time of {policy} over its {len(times)} step{'s' if len(times) > 1 else ''} "
               f"{mean:.3f} s = {mean / np.mean(lower):.2f}x the lower bound; "
               f"fits in memory: {'yes' if planned.fits else 'NO'}")
    return "\n".join([head, "", stage_table(sc, planned.evals), "", steps_table(rows, lower), "", summary])


def _plan_spread(problem: PlanProblem, cost: CostModel, placement: Placement, table: SampleTable,
                 step_rows: list[list[int]], probe: list[list[int]], labels: Sequence[str],
                 stages: StagePlan | None, staged: StagePlan | None = None) -> PlannedSteps:
    """The data-aware plan of every step under a placement with a spread tower: the partition
    (or the user's `stages`) of the pipeline's layers, each step's micro-batches balanced with
    the spread towers' memory reserved, and its price (planner.spread). A nested placement also
    prices `staged` (the cut with the towers on stage 0, where stage 0 encodes what no bubble
    holds) and keeps the faster cut."""
    pp, dp, micro_batches = problem.fixed_pp, problem.fixed_dp, problem.micro_batches
    encoders = placement.mapping
    sm = spread_model(cost, encoders)
    ec = encode_costs(sm, table)
    if stages is None:
        room = max(float(reserve_bytes(sm, ec, rows, pp=pp, dp=dp)[-1]) for rows in probe)
        check_pp(pp, len(sm.keep), f"{cost.model.name} with {placement_name(encoders)} encoders")
        cuts = candidate_cuts(sm, sm.to_full(data_aware_stages(reserved_pipeline(sm, room), table, probe, pp=pp,
                                                               dp=dp, micro_batches=micro_batches, labels=labels)),
                              staged)
    else:
        cuts = [stages]
    best = None
    for stage_plan in cuts:
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
        got = PlannedSteps(stage_plan=stage_plan, sc=sc, plans=plans, evals=evals, packing=True, setting="",
                           spread=priced)
        t = float(sum(x.step_time for x in priced)) if got.fits else np.inf
        if best is None or t < best[0]:
            best = (t, got)
    assert best is not None
    return best[1]
