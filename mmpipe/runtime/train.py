"""The training worker: one process per rank, DeepSpeed's PipelineEngine executes the steps."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mmpipe.config import RunConfig, eval_interval, hardware_spec
from mmpipe.measure import WARMUP_STEPS, throughput, timed_records
from mmpipe.model.spec import image_blocks, layer_names
from mmpipe.paths import resolve_path
from mmpipe.planner.api import HardwareSpec, StagePlan, StepCalibration
from mmpipe.runtime.batch import MicroBatch
from mmpipe.runtime.checkpoint import (
    Checkpointer,
    Found,
    RunStopped,
    StepVerdict,
    agree_after_step,
    find_checkpoint,
    load_step_fit,
    refuse_other_history,
    truncate_records,
)
from mmpipe.runtime.committed import run_topology
from mmpipe.runtime.dsconfig import deepspeed_clips, deepspeed_config, load_user_config, require_tested_deepspeed
from mmpipe.runtime.evaluate import EvalResult, Evaluator, result_path
from mmpipe.runtime.feed import StepFeeder
from mmpipe.runtime.hardware_file import write_calibrated
from mmpipe.runtime.host import figures_mismatch, resolve_backend, threads_per_rank, training_device
from mmpipe.runtime.nested import NestedTowers
from mmpipe.runtime.pipeline import (
    GlobalGradClip,
    PipelineSpec,
    build_pipeline_module,
    deepspeed_grad_norm,
    describe_training,
    fix_buffer_reuse,
    fix_zero_unused_grads,
    loss_scale,
    lr_lambda,
    make_optimizer,
    media_tokens,
)
from mmpipe.runtime.quiet import held_prints, quiet_deepspeed
from mmpipe.runtime.recut import Recut, measured_line
from mmpipe.runtime.spread import SpreadTowers
from mmpipe.runtime.stage_record import add_to_stage_file, parameter_digest, write_stage_file
from mmpipe.runtime.stages import ChosenStages, choose_stages, format_stage_table, run_problem
from mmpipe.runtime.step import FedStep, TrainedStep
from mmpipe.runtime.step_metrics import StepMetrics
from mmpipe.runtime.telemetry import StepTelemetry, resident_bytes

log = logging.getLogger("mmpipe")


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What rank 0 reports at the end of a run."""

    losses: list[float] = field(default_factory=list)
    """Loss of every step."""
    samples: int = 0
    """Samples trained on, all replicas."""
    tokens: int = 0
    """LLM tokens trained on, all replicas."""
    seconds: float = 0.0
    """Wall time of the steps (after start-up)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Samples dropped, by reason, all replicas."""
    mixture: dict[str, int] = field(default_factory=dict)
    """Samples drawn from each source of a mixture, all replicas."""
    nonfinite_skipped: int = 0
    """Steps whose update was skipped for a non-finite loss or gradient norm (train.on_nonfinite=skip)."""
    stopped: str = ""
    """Why and where the run stopped before train.steps (a signal, a re-cut), with its checkpoint."""
    resumed_at: int = 0
    """The checkpoint's step this launch continued from (0: a fresh run)."""
    steps: list[dict] = field(default_factory=list)
    """Rank 0: every step's step, samples, tokens, step_time and first_of_launch (what
    mmpipe.measure figures the steady-state throughput from, as bench and report do)."""
    calibration: StepCalibration | None = None
    """Rank 0: the step-time re-fit after the last step (what `write_calibrated` writes out)."""
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(step, eval_loss) of every evaluation of the held-out set."""
    eval_seconds: float = 0.0
    """Wall time of those evaluations (part of `seconds`)."""
    peak_memory: list[float] = field(default_factory=list)
    """Rank 0: per stage, the largest peak memory measured in any step, bytes."""
    predicted_memory: list[float] = field(default_factory=list)
    """Rank 0: per stage, the largest peak memory the planner predicted for any step, bytes."""
    memory_measure: str = ""
    """What the measured peaks are (telemetry.PeakMemory.kind)."""
    figures_off: str | None = None
    """Why no step's efficiency or MFU was figured (host.figures_mismatch), else None."""
    efficiency: list[tuple[float, float]] = field(default_factory=list)
    """Rank 0: (fraction of the lower bound, model-FLOPs utilisation) of every step."""


def _init_distributed(rc: RunConfig) -> RunConfig:
    """Join the process group and check it matches the config; agree on one run directory."""
    import deepspeed

    # mmpipe's launcher says both; under another launcher (deepspeed, torchrun) decide them here
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ.get("MMPIPE_THREADS", "0")) or threads_per_rank(local))
    backend = os.environ.get("MMPIPE_BACKEND") or resolve_backend(rc.launcher.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with held_prints():
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    world, pp, dp = dist.get_world_size(), rc.parallel.pp, rc.parallel.dp
    if world != pp * dp:
        raise ValueError(f"parallel.pp * parallel.dp = {pp} * {dp} = {pp * dp} does not equal the {world} processes "
                         f"launched (WORLD_SIZE); launch {pp * dp} processes or set parallel.dp={max(1, world // pp)}")
    # Under an external launcher every rank composed the config itself, and a run directory
    # from the clock may differ by a second between ranks: rank 0's wins.
    chosen = [rc.run_dir]
    dist.broadcast_object_list(chosen, src=0)
    rc = dataclasses.replace(rc, run_dir=chosen[0])
    Path(rc.run_dir).mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 0 and not (Path(rc.run_dir) / "run.yaml").exists():
        from mmpipe.runtime.preflight import write_run_config

        write_run_config(rc)
    return rc


@dataclass(kw_only=True, slots=True)
class _Pipeline:
    """One rank's engine and what the loop needs of it."""

    engine: object
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip: GlobalGradClip | None
    """mmpipe's clipping (fp32 without ZeRO); None where DeepSpeed's optimizer wrapper clips."""
    describe: str
    """Precision, ZeRO stage, optimizer and clipping as they took effect (start-up table)."""
    first: bool
    last: bool
    dp_rank: int
    dp_group: object
    load: dict | None = None
    """A Hugging Face model: what loading this rank's layers cost (runtime/hf_run.load_report)."""
    spec: PipelineSpec | None = None
    """What the stages were built from (a spread tower's replica is built from it too)."""


def build_pipeline(rc: RunConfig, tok, stage_plan: StagePlan) -> _Pipeline:
    """This rank's DeepSpeed engine for the stage plan (also what `mmpipe profile` times steps on)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    pspec = PipelineSpec(model=rc.model, stages=tuple(stage_plan.stages), seed=rc.train.seed,
                         **media_tokens(tok),
                         trainable=rc.train.trainable, lora=rc.train.lora, recompute=tuple(stage_plan.recompute),
                         attention=rc.train.attention)
    torch.manual_seed(rc.train.seed)
    require_tested_deepspeed()
    t = rc.train
    with held_prints():
        module = build_pipeline_module(pspec)
    optimizer = make_optimizer(module.parameters(), lr=t.lr, weight_decay=t.weight_decay, kind=t.optimizer,
                               cuda=get_accelerator().device_name() == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup=t.warmup_steps, total=t.steps))
    user = load_user_config(rc.deepspeed.config) if rc.deepspeed.config else None
    with held_prints():
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(rc, user=user))
    fix_buffer_reuse(engine)
    fix_zero_unused_grads(engine)
    clip = None
    if not deepspeed_clips(t.zero):
        clip = GlobalGradClip(optimizer, max_norm=t.grad_clip, group=engine.grid.get_pipe_parallel_group(),
                              device=engine.device)
    load = None
    if rc.model.hf is not None:
        from mmpipe.runtime.hf_run import load_report

        a, b = stage_plan.stages[engine.stage_id]
        load = {"rank": dist.get_rank(), "stage": engine.stage_id, **load_report(layer_names(rc.model)[a:b])}
    write_stage_file(Path(rc.run_dir), dist.get_rank(), engine.stage_id, engine.grid.data_parallel_id, module,
                      load=load)
    describe = describe_training(t, rc.parallel.dp, engine, optimizer, mmpipe_clips=clip is not None,
                                 blocks=image_blocks(rc.model))
    return _Pipeline(engine=engine, scheduler=scheduler, clip=clip, describe=describe, first=engine.is_first_stage(),
                     last=engine.is_last_stage(), dp_rank=engine.grid.data_parallel_id,
                     dp_group=engine.grid.get_data_parallel_group(), load=load, spec=pspec)


def train(rc: RunConfig, *, stop=None) -> RunResult:
    """Train on this rank; every rank of the job calls this with the same config. `stop` is the
    process's stop event (mmpipe.runtime.worker.STOP): with train.save_on_signal, a stop signal
    during training saves a checkpoint first (then StopRequested ends the rank). The rank's parts
    (pipeline, checkpoints, feeder, evaluation, spread towers, re-cut, metrics) are built here
    once; the loop (`_run_steps`) only calls them."""
    quiet_deepspeed()
    rc = _init_distributed(rc)
    rank, run_dir = dist.get_rank(), Path(rc.run_dir)

    from mmpipe.runtime.hf_run import load_templater

    tok = load_templater(rc)
    stages = choose_stages(rc, tok)
    found = _find_checkpoint(rc, stages.plan)  # a damaged checkpoint is refused before the model is built
    before_model = resident_bytes()
    pipe = build_pipeline(rc, tok, stages.plan)
    if before_model is not None:  # on CPU the measured peak includes this; the prediction does not
        add_to_stage_file(run_dir, rank, rss_before_model_gb=before_model / 1e9)
    ckpt = _checkpointer(rc, pipe, stages.plan, reads=bool(stages.spread))
    start, reader_state = ckpt.resume(found) if found else (0, None)
    calibration = calibration_for(rc, found)
    towers = NestedTowers if stages.placement.nested else SpreadTowers  # the nested schedule, or pre/post-passes
    spread = towers.for_rank(pipe.spec, stages.spread, pipe.engine, dp=rc.parallel.dp) if stages.spread else None
    feeder = _feeder(rc, tok, pipe, stages, start=start, reader_state=reader_state, calibration=calibration,
                     spread=spread is not None)
    hardware = hardware_spec(rc)
    figures_off = figures_mismatch(rc.hardware, training_device(pipe.engine.device))
    telemetry = StepTelemetry(pipe.engine, rc.parallel.pp)
    metrics = (StepMetrics(rc, calibration=calibration, hardware=hardware, start=start,
                           memory_kind=telemetry.memory_kind, figured=figures_off is None) if rank == 0 else None)
    evaluator = _start_up(rc, pipe, tok, stages, metrics)
    # With train.save_on_signal a stop signal only marks stop.requested until this block ends;
    # the ranks agree on it after a step and save, and the block's end raises StopRequested.
    with stop.deferred() if stop is not None and rc.train.save_on_signal else contextlib.nullcontext():
        try:
            loop = _Loop(rc=rc, pipe=pipe, feeder=feeder, metrics=metrics, ckpt=ckpt, stop=stop,
                         evaluator=evaluator, start=start, calibration=calibration, hardware=hardware,
                         telemetry=telemetry, spread=spread,
                         result=RunResult(calibration=calibration if rank == 0 else None, resumed_at=start,
                                          figures_off=figures_off),
                         recut=Recut(rc, problem=run_problem(rc, stages.placement), stage_plan=stages.plan,
                                     calibration=calibration, start=start, rank0=rank == 0))
            if spread is not None:
                spread.install_post_pass()  # after the StageTimer's patch of the same instruction map
                for instruction, kind in spread.timed.items():  # and the nested schedule's own, timed too
                    telemetry.time_instruction(instruction, kind)
            if rc.train.trace:  # after every other patch of the map: the trace sees what runs
                telemetry.trace_to(Path(run_dir) / f"trace_rank{rank}.json", first_step=start + 1)
            result = _run_steps(loop)
        finally:
            telemetry.close()
            if feeder is not None:
                feeder.close()
            if metrics is not None:
                metrics.close()  # the bar before any error line, which would land on the bar's line
        _finish(rc, result, feeder, pipe, spread)
        dist.barrier()
    return result


def _feeder(rc: RunConfig, tok, pipe: _Pipeline, stages: ChosenStages, *, start: int, reader_state,
            calibration: StepCalibration, spread: bool) -> StepFeeder | None:
    """The replica's data on the stages that read it (the first and last, every one with spread
    towers); a resumed run's sample records lose the steps after its checkpoint, fed again."""
    if not (pipe.first or pipe.last or spread):
        return None
    rank = dist.get_rank()
    record = Path(rc.run_dir) / f"samples_rank{rank}.jsonl" if rc.train.record_samples else None
    if record:
        truncate_records(record, start)
    return StepFeeder(rc, tokenizer=tok, dp_rank=pipe.dp_rank, stage_plan=stages.plan,
                      over_memory=bool(stages.warnings), media=pipe.first,
                      reader_state=reader_state, steps=rc.train.steps - start, record=record, first_step=start,
                      fit=calibration.coef if calibration.fitted else None,
                      placement=stages.placement,
                      encode_stage=pipe.engine.stage_id if spread else None,
                      ladder=stages.ladder)


def _start_up(rc: RunConfig, pipe: _Pipeline, tok, stages: ChosenStages,
              metrics: StepMetrics | None) -> Evaluator | None:
    """The evaluator (when the run evaluates), then rank 0's start-up lines: the stage table, the
    training set-up, the plan's warnings, what loading a Hugging Face model cost, the evaluation;
    then the progress bar starts."""
    loads: list = [None] * dist.get_world_size() if pipe.load is not None else []
    if loads:
        dist.all_gather_object(loads, pipe.load)
    evaluator = _evaluator(rc, pipe, tok, stages) if eval_interval(rc) else None
    if metrics is None:
        return evaluator
    print(format_stage_table(rc, stages, layer_names(rc.model)), flush=True)
    print(pipe.describe, flush=True)
    for w in stages.warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)
    if loads:
        from mmpipe.runtime.hf_run import format_load_line

        print(format_load_line(loads), flush=True)
    if evaluator is not None:
        print(evaluator.describe(), flush=True)
    metrics.begin()
    return evaluator


def _finish(rc: RunConfig, result: RunResult, feeder: StepFeeder | None, pipe: _Pipeline,
            spread: SpreadTowers | None) -> None:
    """After the loop: the data report summed over the replicas, each rank's final weights in
    its stage file (train.record_samples), and rank 0's summary and calibrated hardware file."""
    run_dir = Path(rc.run_dir)
    result.skipped, result.mixture = _gather_data_report(feeder, pipe.first, pipe.dp_group,
                                                         shared=rc.plan.across_replicas)
    if rc.train.record_samples:  # what each replica ended with: every replica of a stage must agree
        add_to_stage_file(run_dir, dist.get_rank(), param_sha256=parameter_digest(pipe.engine.module),
                          **({"encoded_samples": spread.encoded} if spread is not None else {}))
    if dist.get_rank() == 0:
        _summary(rc, result, run_dir)
        print(write_calibrated(rc, result.calibration), flush=True)


def score_checkpoint(rc: RunConfig, folder: Path) -> EvalResult:
    """`mmpipe eval` on this rank: the run's pipeline (rc's stages are the checkpoint's), the
    model weights of the committed checkpoint `folder` (checked file by file), then one
    evaluation of data.eval_path. Every rank of the job calls this; rank 0 writes the result
    (runtime/evaluate.result_path) into rc.run_dir, the job's own folder."""

    quiet_deepspeed()
    rc = _init_distributed(rc)
    from mmpipe.runtime.hf_run import load_templater

    tok = load_templater(rc)
    stages = choose_stages(rc, tok)
    found = find_checkpoint(folder, given=str(folder), run_dir=Path(rc.run_dir),
                            topology=run_topology(rc, stages.plan.stages), steps=sys.maxsize,
                            key=f"mmpipe eval {folder}")
    pipe = build_pipeline(rc, tok, stages.plan)
    _checkpointer(rc, pipe, stages.plan).load_weights(found)
    result = _evaluator(rc, pipe, tok, stages, journal=False).run()
    if dist.get_rank() == 0:
        result_path(rc.run_dir).write_text(json.dumps({"step": found.step, **result.record()}))
    dist.barrier()
    return result


@dataclass(kw_only=True, slots=True)
class _Loop:
    """One rank's training loop: the parts train() built once, and what the loop itself carries
    from step to step. What a part measures or decides is the part's own state (StepMetrics,
    Recut, StepTelemetry, the Checkpointer, the Evaluator, SpreadTowers)."""

    rc: RunConfig
    pipe: _Pipeline
    feeder: StepFeeder | None
    """The replica's data (first and last stage, every stage with spread towers; else None)."""
    metrics: StepMetrics | None
    """Rank 0: the steps' metrics.jsonl, progress bar and summary figures."""
    ckpt: Checkpointer
    stop: object
    """The process's stop signal (worker.STOP), or None."""
    evaluator: Evaluator | None
    """The held-out loss (data.eval_path), or None."""
    recut: Recut
    """plan.recut=auto: the check at checkpoints, its request, the gain measured after a relaunch."""
    telemetry: StepTelemetry
    """Every stage's times and peak memory of each step."""
    spread: SpreadTowers | None
    """This rank's part of the spread encoder towers (plan.encoders), or None."""
    start: int
    """The step the run starts after (a resumed checkpoint's, else 0)."""
    calibration: StepCalibration
    """The step-time re-fit (rank 0's counts and is saved; a resumed run's starts from its checkpoint's)."""
    hardware: HardwareSpec
    """The hardware config (the name a checkpoint's saved fit belongs to)."""
    result: RunResult
    last_state: dict | None = None
    """The reader's position after the last step trained (saved with a checkpoint)."""


def _run_steps(loop: _Loop) -> RunResult:
    """The loop of named steps: feed, train, evaluate when due, consider a re-cut, log, then agree
    and checkpoint."""
    t_start = time.perf_counter()
    for step in range(loop.start + 1, loop.rc.train.steps + 1):
        fed = _feed(loop, step)
        trained = _train_step(loop, fed)
        evaluated = _evaluate(loop, step)
        recut = loop.recut.consider(step)
        if loop.metrics is not None:
            loop.metrics.log(step, fed, trained, evaluated, recut, loop.recut.measured, measured_line)
        if _after_step(loop, step, trained, recut):
            break
    loop.result.seconds = time.perf_counter() - t_start
    if loop.metrics is not None:
        loop.metrics.report(loop.result)
    return loop.result


def _feed(loop: _Loop, step: int) -> FedStep:
    """The step's planned micro-batches; the pipeline agrees on their count, the replicas on
    the step's totals (the loss is the mean over all its label tokens)."""
    t0 = time.perf_counter()
    pipe, dev = loop.pipe, loop.pipe.engine.device  # collectives run on the backend's device (CUDA under NCCL)
    planned = loop.feeder.next_step() if loop.feeder else None
    encode = planned.encode if planned else None
    if not (pipe.first or pipe.last):  # a middle stage reads the data only for its spread towers' share
        planned = None
    mbs: list[MicroBatch] = planned.micro_batches if planned else []
    agree_on_micro_batches(pipe.engine, len(mbs), loop.rc.parallel.dp)
    work = planned.work if planned else None
    counts = torch.tensor([sum(m.label_tokens for m in mbs), sum(len(m.keys) for m in mbs),
                           sum(m.tokens for m in mbs), work.ideal_s if work else 0.0, work.flops if work else 0.0,
                           sum(m.pad_tokens for m in mbs)],
                          dtype=torch.float64, device=dev)
    planned_fig = torch.tensor([planned.predicted_s, planned.compute_s, len(mbs)] if planned else [0.0] * 3,
                               dtype=torch.float64, device=dev)
    if pipe.first or pipe.last:
        dist.all_reduce(counts, group=pipe.dp_group)  # whole-step figures, all replicas
        planned_fig = _slowest_replica(planned_fig, pipe.dp_group)
    if planned is not None:
        loop.recut.note(planned.features)
    fed = FedStep(planned=planned, micro_batches=mbs, encode=encode, label_tokens=int(counts[0]),
                  samples=int(counts[1]), tokens=int(counts[2]), pad_tokens=int(counts[5]), ideal_s=float(counts[3]),
                  flops=float(counts[4]), predicted_s=float(planned_fig[0]), compute_s=float(planned_fig[1]),
                  slow_micro_batches=int(planned_fig[2]), started=t0)
    if step == loop.start + 1 and loop.metrics is not None:
        pad = f" (+{fed.pad_tokens} padding, plan.ladder)" if fed.pad_tokens else ""
        loop.metrics.note(f"tokens per step: {fed.tokens} LLM tokens{pad}, {fed.label_tokens} label tokens, "
                          f"{fed.samples} samples (first step)")
    return fed


def _train_step(loop: _Loop, fed: FedStep) -> TrainedStep:
    """One optimizer step through DeepSpeed's 1F1B schedule, and its telemetry."""
    rc, pipe, engine = loop.rc, loop.pipe, loop.pipe.engine
    scale = engine.micro_batches * rc.parallel.dp / max(1.0, float(fed.label_tokens))
    batches = [m.for_engine(scale) for m in fed.micro_batches]
    if loop.spread is not None and pipe.first:  # the towers' slots carry the micro-batch's index
        batches = [(loop.spread.tag(carrier, j), labels) for j, (carrier, labels) in enumerate(batches)]
    it: Iterator | None = iter(batches) if batches else None
    lr = pipe.scheduler.get_last_lr()[0]  # the rate this step trains with
    fp16_scale = loss_scale(engine)  # the scale this step's backward runs with (fp16)
    loop.telemetry.start()
    t1 = time.perf_counter()
    if loop.spread is not None:
        loop.spread.forward(fed.encode)
    loss = float(engine.train_batch(data_iter=it))
    if loop.spread is not None:
        loop.spread.stepped()
    engine_s = time.perf_counter() - t1
    loop.last_state = fed.planned.reader_state if fed.planned else None
    grad_norm = pipe.clip.last_norm if pipe.clip else deepspeed_grad_norm(engine)
    nonfinite = _nonfinite(loss, pipe, rc.train.precision)
    stages = loop.telemetry.stages()
    result = loop.result
    result.losses.append(loss)
    result.samples += fed.samples
    result.tokens += fed.tokens
    return TrainedStep(loss=loss, grad_norm=grad_norm, nonfinite=nonfinite, lr=lr, loss_scale=fp16_scale,
                       engine_s=engine_s, step_s=time.perf_counter() - fed.started, stages=stages)


def _evaluate(loop: _Loop, step: int) -> EvalResult | None:
    """The held-out loss after this step, when due (every rank together)."""
    if loop.evaluator is None or not loop.evaluator.due(step):
        return None
    evaluated = loop.evaluator.run()
    loop.telemetry.drop()  # the evaluation's instructions are no part of the next step's telemetry
    loop.result.evals.append((step, evaluated.loss))
    loop.result.eval_seconds += evaluated.seconds
    return evaluated


def _after_step(loop: _Loop, step: int, trained: TrainedStep, recut: dict | None = None) -> bool:
    """Every rank agrees on a non-finite step and on a stop request, then saves when due.
    Returns whether the run stops here (a stop signal, or a re-cut, after its checkpoint)."""
    rc, stop = loop.rc, loop.stop
    fit = _share_fit(loop.calibration, loop.pipe.engine.device)
    if loop.feeder is not None:
        loop.feeder.deliver_fit(step, fit)
    requested = stop.requested if stop is not None and stop.defer else None
    verdict = agree_after_step(nonfinite=trained.nonfinite, stop=requested is not None, device=loop.pipe.engine.device)
    _on_nonfinite(rc, verdict, step, trained.loss, trained.grad_norm, loop.ckpt, loop.result, loop.metrics)
    stopping = verdict.stop and step != rc.train.steps  # at the last step the run ends anyway
    every = rc.train.save_every and step % rc.train.save_every == 0
    if stopping or every or (rc.train.save_final and step == rc.train.steps):
        folder = loop.ckpt.save(step, loop.last_state, step_fit=({"hardware": loop.hardware.name,
                                                                  "calibration": loop.calibration.state_dict()}
                                                                 if dist.get_rank() == 0 else None))
    if stopping:
        why = signal.Signals(requested).name if requested else "another rank's stop signal"
        loop.result.stopped = (f"stopped on {why} after step {step}: checkpoint {folder} committed; continue with "
                               f"train.resume={Path(rc.run_dir)}")
    elif recut is not None and recut["recut"]:
        loop.result.stopped = loop.recut.request(step, recut, folder)
        return True
    return stopping


def calibration_for(rc: RunConfig, found: Found | None) -> StepCalibration:
    """The run's step-time re-fit: the one a resumed run's checkpoint saved (when it was fitted
    on the same hardware config: its regressors are that hardware's simulated times), else a
    new one whose prior is the hardware config's own fixed costs."""
    hw = hardware_spec(rc)
    saved = load_step_fit(found) if found is not None else None
    if saved is not None and saved.get("hardware") == hw.name:
        return StepCalibration.from_state(saved["calibration"])
    return StepCalibration.for_hardware(hw)


def _slowest_replica(mine: torch.Tensor, group) -> torch.Tensor:
    """The (predicted, compute, micro-batches) row of the replica predicted slowest."""
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(rows, mine, group=group)
    return max(rows, key=lambda r: float(r[0]))


def _share_fit(calibration: StepCalibration, device) -> tuple[float, float, float] | None:
    """Rank 0's fit after this step, on every rank (None while it has not seen its warm-up)."""
    t = torch.tensor([*calibration.coef, float(calibration.fitted)], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return (float(t[0]), float(t[1]), float(t[2])) if t[3] > 0 else None


def _nonfinite(loss: float, pipe: _Pipeline, precision: str) -> bool:
    """Whether this step's loss or gradient norm was NaN or infinite. Under fp16 an infinite
    norm is a loss-scale overflow, which DeepSpeed's scaler skips and handles itself."""
    if not math.isfinite(loss):
        return True
    if pipe.clip is not None:
        return not math.isfinite(pipe.clip.last_norm)
    norm = pipe.engine.get_global_grad_norm()  # None where the wrapper computed none
    return precision != "fp16" and norm is not None and not math.isfinite(float(norm))


def _on_nonfinite(rc: RunConfig, verdict: StepVerdict, step: int, loss: float, grad_norm: float,
                  ckpt: Checkpointer, result: RunResult, metrics: StepMetrics | None) -> None:
    """A step whose loss or gradient norm was not finite (on some rank): stop before anything
    is saved, or (fp32 without ZeRO, where GlobalGradClip withheld its update) count the skip
    and go on."""
    if not verdict.nonfinite:
        return
    what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
    if rc.train.on_nonfinite == "stop":
        newest = f"the newest checkpoint is {ckpt.newest}" if ckpt.newest else "no checkpoint was saved"
        skip = " or set train.on_nonfinite=skip to drop such steps" if rc.train.zero == 0 else ""
        raise RunStopped(f"{what}: stopped without saving (train.on_nonfinite=stop); {newest}; lower train.lr "
                         f"(now {rc.train.lr}){skip}")
    result.nonfinite_skipped += 1
    if metrics is not None:
        metrics.note(f"warning: {what}: update skipped (train.on_nonfinite=skip)")


def agree_on_micro_batches(engine, mine: int, dp: int) -> None:
    """The planner may choose a different micro-batch count each step; the first stage tells
    the rest of its pipeline (middle stages read no data), and DeepSpeed's schedule follows."""
    m = torch.tensor([mine], dtype=torch.long, device=engine.device)
    dist.broadcast(m, src=engine.grid.stage_to_global(0), group=engine.grid.get_pipe_parallel_group())
    count = int(m.item())
    if engine.is_last_stage() and mine != count:
        raise RuntimeError(f"first and last stage planned different steps ({count} vs {mine} micro-batches)")
    if count != engine.micro_batches:
        engine.set_train_batch_size(count * dp)


def _find_checkpoint(rc: RunConfig, stage_plan: StagePlan) -> Found | None:
    """The checked checkpoint named by train.resume; without it None, once the run directory
    is known to hold no other run's checkpoints."""
    if not rc.train.resume:
        refuse_other_history(Path(rc.run_dir))
        return None
    return find_checkpoint(Path(resolve_path(rc.train.resume)), given=rc.train.resume, run_dir=Path(rc.run_dir),
                           topology=run_topology(rc, stage_plan.stages), steps=rc.train.steps)


def _checkpointer(rc: RunConfig, pipe: _Pipeline, stage_plan: StagePlan, *, reads: bool = False) -> Checkpointer:
    """`reads`: every stage reads the data (spread towers), so every one resumes a reader."""
    t = rc.train
    return Checkpointer(engine=pipe.engine, run_dir=Path(rc.run_dir), first=pipe.first,
                        reads_data=pipe.first or pipe.last or reads, dp_rank=pipe.dp_rank,
                        keep_last=t.keep_last,
                        resume_unsafe=t.resume_unsafe, topology=run_topology(rc, stage_plan.stages),
                        schedule={"lr": t.lr, "warmup_steps": t.warmup_steps, "steps": t.steps},
                        optimizer_settings={"weight_decay": t.weight_decay})


def _evaluator(rc: RunConfig, pipe: _Pipeline, tok, stages, *, journal: bool = True) -> Evaluator:
    return Evaluator(rc, engine=pipe.engine, tokenizer=tok, stage_plan=stages.plan, over_memory=bool(stages.warnings),
                     dp_rank=pipe.dp_rank, dp_group=pipe.dp_group, journal=journal)


def _gather_data_report(feeder, first: bool, dp_group, *, shared: bool = False
                        ) -> tuple[dict[str, int], dict[str, int]]:
    """Skips by reason and mixture counts, summed over the replicas (first stages only); when
    every replica reads the same stream (`shared`), replica 0's count is the count."""
    if not first:
        return {}, {}
    stream = feeder.stream if feeder else None
    mine = (feeder.skips.as_dict() if feeder else {},
            stream.realised() if stream is not None and hasattr(stream, "realised") else {})
    parts: list = [None] * dist.get_world_size(group=dp_group)
    dist.all_gather_object(parts, mine, group=dp_group)
    if shared:
        parts = parts[:1]
    skipped: dict[str, int] = {}
    mixture: dict[str, int] = {}
    for part in parts:
        for total, d in zip((skipped, mixture), part or ({}, {})):
            for k, v in d.items():
                total[k] = total.get(k, 0) + v
    return skipped, mixture


def steady_throughput(steps: list[dict], samples_per_s: float, tokens_per_s: float) -> str:
    """The launch's throughput as `mmpipe bench` and `mmpipe report` figure it (mmpipe.measure:
    the steps after its first WARMUP_STEPS, samples over summed step time); a launch too short
    for that gives its whole-run figures (`samples_per_s`, `tokens_per_s`), start-up included,
    and says so."""
    timed = timed_records(steps)
    if not timed:
        return (f"{samples_per_s:.1f} samples/s, {tokens_per_s:.0f} tokens/s (all {len(steps)} steps, start-up "
                f"included: too few for the steady state, which leaves out each launch's first {WARMUP_STEPS})")
    tp = throughput(timed)
    span = f"step {timed[0]['step']}" if len(timed) == 1 else f"steps {timed[0]['step']}-{timed[-1]['step']}"
    return (f"{tp.samples_per_s:.1f} samples/s, {tp.tokens_per_s:.0f} tokens/s (steady: {span}, after the "
            f"launch's first {WARMUP_STEPS})")


def loss_trend(losses: list[float]) -> str:
    """`loss 7.629 -> 2.440 (mean of first 3 7.343, last 3 2.558)`: the means over up to 3 steps
    at each end, never overlapping (on 4 or 5 steps, 2 at each end; fewer steps: no means)."""
    if not losses:
        return "no loss"
    if len(losses) == 1:
        return f"loss {losses[0]:.3f}"
    k = min(3, len(losses) // 2)
    ends = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    if k < 2:
        return ends
    return f"{ends} (mean of first {k} {sum(losses[:k]) / k:.3f}, last {k} {sum(losses[-k:]) / k:.3f})"


def _summary(rc: RunConfig, r: RunResult, run_dir: Path) -> None:
    skipped = sum(r.skipped.values())
    why = ", ".join(f"{v} {k}" for k, v in sorted(r.skipped.items())) or "none"
    training = r.seconds - r.eval_seconds  # throughput is the training's; evaluations are timed apart
    evals = ""
    if r.evals:
        evals = (f" | eval_loss {r.evals[0][1]:.3f} -> {r.evals[-1][1]:.3f} ({len(r.evals)} evaluations, the last "
                 f"after step {r.evals[-1][0]}; {r.eval_seconds:.1f}s)")
    # One `done:` line per run: a launch that stops early (a signal, a re-cut whose relaunch goes
    # on) reports its steps so far, and the launch after a checkpoint says which steps it trained.
    steps = f"{len(r.losses)} steps in {r.seconds:.1f}s"
    if r.resumed_at:
        last = r.resumed_at + len(r.losses)
        steps += f" (steps {r.resumed_at + 1}-{last}, from the checkpoint of step {r.resumed_at})"
    print(
        f"{'so far' if r.stopped else 'done'}: {steps} | {loss_trend(r.losses)}{evals} | "
        f"{steady_throughput(r.steps, r.samples / training, r.tokens / training)} | "
        f"skipped {skipped} samples ({why}) | "
        f"metrics {run_dir / 'metrics.jsonl'} | "
        + (f"checkpoint {run_dir / 'checkpoints'}" if rc.train.save_every or rc.train.save_final else "no checkpoint")
        + (f" | {r.nonfinite_skipped} updates skipped (non-finite)" if r.nonfinite_skipped else ""),
        flush=True,
    )
    if r.efficiency:
        bound = statistics.median(b for b, _ in r.efficiency)
        mfu = statistics.median(m for _, m in r.efficiency)
        ranks = rc.parallel.pp * rc.parallel.dp
        print(f"efficiency (median over the steps; hardware {hardware_spec(rc).name}'s peak rates): {bound:.1%} of "
              f"the step's lower bound (its samples' compute at peak, spread over the {ranks} ranks), model-FLOPs "
              f"utilisation {mfu:.2%} with the encoders' FLOPs", flush=True)
    if r.figures_off:
        print(f"efficiency: not figured: {r.figures_off}", flush=True)
    if r.peak_memory and r.predicted_memory:
        print("memory per stage, peak of the run (" + r.memory_measure + "): "
              + ", ".join(f"stage {s} {m / 1e9:.3g} GB measured, {p / 1e9:.3g} GB predicted ({m / p - 1:+.0%})"
                          for s, (m, p) in enumerate(zip(r.peak_memory, r.predicted_memory))), flush=True)
    if r.stopped:
        print(r.stopped, flush=True)
    if r.mixture:
        total = sum(r.mixture.values())
        print("mixture realised: " + ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in r.mixture.items()),
              flush=True)
