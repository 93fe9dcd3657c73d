"""The training worker: one process per rank, DeepSpeed's PipelineEngine executes the steps."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mmpipe.config import RunConfig, hardware_spec
from mmpipe.model.spec import layer_names
from mmpipe.paths import resolve_path
from mmpipe.planner.api import StagePlan, StepCalibration
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
from mmpipe.runtime.dsconfig import deepspeed_clips, deepspeed_config, load_user_config, require_tested_deepspeed
from mmpipe.runtime.feed import StepFeeder
from mmpipe.runtime.hardware_file import write_calibrated
from mmpipe.runtime.host import resolve_backend, threads_per_rank
from mmpipe.runtime.metrics import MetricsWriter, ProgressBar
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
)
from mmpipe.runtime.quiet import held_prints, quiet_deepspeed
from mmpipe.runtime.stage_record import add_to_stage_file, parameter_digest, write_stage_file
from mmpipe.runtime.stages import choose_stages, format_stage_table
from mmpipe.runtime.telemetry import PeakMemory, StageTimer, gather_stage_times, per_stage, resident_bytes

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
    """Why and where the run stopped before train.steps (a signal), with its checkpoint."""
    calibration: StepCalibration | None = None
    """Rank 0: the step-time re-fit after the last step (what `write_calibrated` writes out)."""
    peak_memory: list[float] = field(default_factory=list)
    """Rank 0: per stage, the largest peak memory measured in any step, bytes."""
    predicted_memory: list[float] = field(default_factory=list)
    """Rank 0: per stage, the largest peak memory the planner predicted for any step, bytes."""
    memory_measure: str = ""
    """What the measured peaks are (telemetry.PeakMemory.kind)."""


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


def build_pipeline(rc: RunConfig, tok, stage_plan: StagePlan) -> _Pipeline:
    """This rank's DeepSpeed engine for the stage plan (also what `mmpipe profile` times steps on)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    pspec = PipelineSpec(model=rc.model, stages=tuple(stage_plan.stages), seed=rc.train.seed,
                         image_token=_token_id(tok.image_id), audio_token=_token_id(tok.audio_id),
                         trainable=rc.train.trainable, recompute=tuple(stage_plan.recompute),
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
    describe = describe_training(t, rc.parallel.dp, engine, optimizer, mmpipe_clips=clip is not None)
    return _Pipeline(engine=engine, scheduler=scheduler, clip=clip, describe=describe, first=engine.is_first_stage(),
                     last=engine.is_last_stage(), dp_rank=engine.grid.data_parallel_id,
                     dp_group=engine.grid.get_data_parallel_group(), load=load)


def _token_id(tid: int | None) -> int:
    return -1 if tid is None else tid  # a checkpoint's templater has no token for a medium the model lacks


def train(rc: RunConfig, *, stop=None) -> RunResult:
    """Train on this rank; every rank of the job calls this with the same config. `stop` is the
    process's stop event (mmpipe.runtime.worker.STOP): with train.save_on_signal, a stop signal
    during training saves a checkpoint first (then StopRequested ends the rank)."""
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
    ckpt = _checkpointer(rc, pipe, stages.plan)
    start, reader_state = ckpt.resume(found) if found else (0, None)
    calibration = calibration_for(rc, found)

    feeder = None
    if pipe.first or pipe.last:
        record = run_dir / f"samples_rank{rank}.jsonl" if rc.train.record_samples else None
        if record:
            truncate_records(record, start)  # steps after the checkpoint are fed again
        feeder = StepFeeder(rc, tokenizer=tok, dp_rank=pipe.dp_rank, stage_plan=stages.plan,
                            over_memory=bool(stages.warnings), media=pipe.first,
                            reader_state=reader_state, steps=rc.train.steps - start, record=record, first_step=start,
                            fit=calibration.coef if calibration.fitted else None)
    if rank == 0 and rc.train.resume:
        truncate_records(run_dir / "metrics.jsonl", start)
    writer = (MetricsWriter(run_dir / "metrics.jsonl", append=bool(rc.train.resume), loggers=rc.train.loggers)
              if rank == 0 else None)
    loads: list = [None] * dist.get_world_size() if pipe.load is not None else []
    if loads:
        dist.all_gather_object(loads, pipe.load)
    bar = None
    if rank == 0:
        print(format_stage_table(rc, stages, layer_names(rc.model)), flush=True)
        print(pipe.describe, flush=True)
        for w in stages.warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
        if loads:
            from mmpipe.runtime.hf_run import format_load_line

            print(format_load_line(loads), flush=True)
        bar = ProgressBar(rc.train.steps - start)
    # With train.save_on_signal a stop signal only marks stop.requested until this block ends;
    # the ranks agree on it after a step and save, and the block's end raises StopRequested.
    with stop.deferred() if stop is not None and rc.train.save_on_signal else contextlib.nullcontext():
        try:
            result = _run_steps(rc, pipe, feeder, writer, bar, start, ckpt, stop, calibration)
        finally:
            if feeder is not None:
                feeder.close()
            if writer is not None:
                writer.close()
            if bar is not None:
                bar.close()  # before any error line, which would land on the bar's line
        result.skipped, result.mixture = _gather_data_report(feeder, pipe.first, pipe.dp_group,
                                                             shared=rc.plan.across_replicas)
        if rc.train.record_samples:  # what each replica ended with: every replica of a stage must agree
            add_to_stage_file(run_dir, rank, param_sha256=parameter_digest(pipe.engine.module))
        if rank == 0:
            _summary(rc, result, run_dir)
            print(write_calibrated(rc, result.calibration), flush=True)
        dist.barrier()
    return result


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


def _run_steps(rc: RunConfig, pipe: _Pipeline, feeder, writer, bar, start: int, ckpt: Checkpointer,
               stop, calibration: StepCalibration) -> RunResult:
    engine, rank, run_dir = pipe.engine, dist.get_rank(), Path(rc.run_dir)
    result = RunResult(calibration=calibration if rank == 0 else None)
    announced = False
    timer = StageTimer(engine)
    memory = PeakMemory(engine.device)
    world = dist.get_world_size()
    dev = engine.device  # collectives run on the backend's device (CUDA under NCCL)
    stage_of_rank = _stage_of_every_rank(engine.stage_id, world, dev)
    t_start = time.perf_counter()
    last_state: dict | None = None
    for step in range(start + 1, rc.train.steps + 1):
        t0 = time.perf_counter()
        planned = feeder.next_step() if feeder else None
        mbs: list[MicroBatch] = planned.micro_batches if planned else []
        agree_on_micro_batches(engine, len(mbs), rc.parallel.dp)
        counts = torch.tensor([sum(m.label_tokens for m in mbs), sum(len(m.keys) for m in mbs),
                               sum(m.tokens for m in mbs)], dtype=torch.float64, device=dev)
        planned_fig = torch.tensor([planned.predicted_s, planned.compute_s, len(mbs)] if planned else [0.0] * 3,
                                   dtype=torch.float64, device=dev)
        if pipe.first or pipe.last:
            dist.all_reduce(counts, group=pipe.dp_group)  # whole-step figures, all replicas
            planned_fig = _slowest_replica(planned_fig, pipe.dp_group)
        scale = engine.micro_batches * rc.parallel.dp / max(1.0, counts[0].item())
        it: Iterator | None = iter([m.for_engine(scale) for m in mbs]) if mbs else None
        if step == start + 1 and rank == 0:
            said = (f"tokens per step: {int(counts[2])} LLM tokens, {int(counts[0])} label tokens, "
                    f"{int(counts[1])} samples (first step)")
            bar.note(said) if bar is not None else print(said, flush=True)
        lr = pipe.scheduler.get_last_lr()[0]  # the rate this step trains with
        fp16_scale = loss_scale(engine)  # the scale this step's backward runs with (fp16)
        memory.start()
        t1 = time.perf_counter()
        loss = float(engine.train_batch(data_iter=it))
        t2 = time.perf_counter()
        last_state = planned.reader_state if planned else None
        grad_norm = pipe.clip.last_norm if pipe.clip else deepspeed_grad_norm(engine)
        nonfinite = _nonfinite(loss, pipe, rc.train.precision)
        stages = per_stage(gather_stage_times(timer.take(), world=world, device=dev, peak_mem=memory.peak()).cpu(),
                           stage_of_rank, rc.parallel.pp)
        dt = time.perf_counter() - t0
        result.losses.append(loss)
        result.samples += int(counts[1])
        result.tokens += int(counts[2])
        if rank == 0:
            busy = [st["fwd"] + st["bwd"] for st in stages]
            compute, m_slow = float(planned_fig[1]), int(planned_fig[2])
            raw = calibration.simulated(compute, m_slow)  # the hardware config's prediction
            pred = calibration.predict(compute, m_slow)  # fitted on earlier steps only
            calibration.observe(compute, m_slow, t2 - t1)
            if planned.fit is not None and not announced:
                announced = True
                bar.note(f"step {step}: micro-batches are planned with this run's step-time fit from now on "
                         f"(a={planned.fit[0]:.3g}, b={planned.fit[1] * 1e3:.3g} ms per micro-batch, "
                         f"c={planned.fit[2] * 1e3:.3g} ms per step; hardware {rc.hardware.get('name')} said "
                         f"b={calibration.prior[1] * 1e3:.3g} ms, c={calibration.prior[2] * 1e3:.3g} ms)")
            rec = {"step": step, "loss": round(loss, 6), "samples_per_s": counts[1].item() / dt,
                   "tokens_per_s": counts[2].item() / dt, "step_time": dt,
                   "lr": lr, "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                   "samples": int(counts[1]),
                   "tokens": int(counts[2]), "label_tokens": int(counts[0]), "micro_batches": len(mbs),
                   "engine_time": t2 - t1, "stage_busy_s": busy,
                   "stage_comm_s": [st["comm"] for st in stages], "optim_s": max(st["optim"] for st in stages),
                   "bubble": 1.0 - sum(busy) / (len(busy) * (t2 - t1)),
                   "predicted_step_time": pred, "simulated_step_time": raw,
                   "calibration": list(calibration.coef), "planned_with_fit": planned.fit is not None,
                   "predicted_busy_s": list(planned.predicted_busy),
                   "prediction_error": (t2 - t1) / pred - 1.0 if pred > 0 else None,
                   "overhead_s": dt - (t2 - t1), "plan_s": planned.plan_seconds, "feed_s": planned.feed_seconds,
                   "stage_peak_mem_gb": [st["mem"] / 1e9 for st in stages], "peak_mem_measure": memory.kind,
                   "predicted_peak_mem_gb": [b / 1e9 for b in planned.predicted_peak_bytes], "nonfinite": nonfinite}
            _track_memory(result, [st["mem"] for st in stages], planned.predicted_peak_bytes, memory.kind)
            if rc.train.precision == "fp16":
                rec["loss_scale"] = fp16_scale  # a step that overflowed was skipped: grad_norm null
            if step % rc.train.log_every == 0 or step == rc.train.steps or nonfinite:
                writer.write(rec)
            bar.update(loss=loss, samples_per_s=rec["samples_per_s"], tokens_per_s=rec["tokens_per_s"])
        fit = _share_fit(calibration, dev)
        if feeder is not None:
            feeder.deliver_fit(step, fit)
        requested = stop.requested if stop is not None and stop.defer else None
        verdict = agree_after_step(nonfinite=nonfinite, stop=requested is not None, device=dev)
        _on_nonfinite(rc, verdict, step, loss, grad_norm, ckpt, result, bar)
        stopping = verdict.stop and step != rc.train.steps  # at the last step the run ends anyway
        every = rc.train.save_every and step % rc.train.save_every == 0
        if stopping or every or (rc.train.save_final and step == rc.train.steps):
            folder = ckpt.save(step, last_state, step_fit=({"hardware": hardware_spec(rc).name,
                                                            "calibration": calibration.state_dict()}
                                                           if rank == 0 else None))
        if stopping:
            why = signal.Signals(requested).name if requested else "another rank's stop signal"
            result.stopped = (f"stopped on {why} after step {step}: checkpoint {folder} committed; continue with "
                              f"train.resume={run_dir}")
            break
    result.seconds = time.perf_counter() - t_start
    return result


def _track_memory(result: RunResult, measured: list[float], predicted, kind: str) -> None:
    """Keep each stage's largest measured and predicted peak for the summary."""
    result.peak_memory = [max(a, b) for a, b in zip(result.peak_memory or [0.0] * len(measured), measured)]
    result.predicted_memory = [max(a, b) for a, b in zip(result.predicted_memory or [0.0] * len(predicted),
                                                         predicted)]
    result.memory_measure = kind


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
                  ckpt: Checkpointer, result: RunResult, bar: ProgressBar | None) -> None:
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
    if bar is not None:
        bar.note(f"warning: {what}: update skipped (train.on_nonfinite=skip)")


def _stage_of_every_rank(stage: int, world: int, device) -> list[int]:
    mine = torch.tensor([stage], dtype=torch.long, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [int(t) for t in out]


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


def _topology(rc: RunConfig, stage_plan: StagePlan) -> dict:
    """What a checkpoint must match to load: DeepSpeed's files are per stage (and, under ZeRO, per
    replica), their layout depends on the precision; reader positions are per replica."""
    return {"pp": rc.parallel.pp, "dp": rc.parallel.dp, "stages": [list(s) for s in stage_plan.stages],
            "precision": rc.train.precision, "zero": rc.train.zero}


def _find_checkpoint(rc: RunConfig, stage_plan: StagePlan) -> Found | None:
    """The checked checkpoint named by train.resume; without it None, once the run directory
    is known to hold no other run's checkpoints."""
    if not rc.train.resume:
        refuse_other_history(Path(rc.run_dir))
        return None
    return find_checkpoint(Path(resolve_path(rc.train.resume)), given=rc.train.resume, run_dir=Path(rc.run_dir),
                           topology=_topology(rc, stage_plan), steps=rc.train.steps)


def _checkpointer(rc: RunConfig, pipe: _Pipeline, stage_plan: StagePlan) -> Checkpointer:
    t = rc.train
    return Checkpointer(engine=pipe.engine, run_dir=Path(rc.run_dir), first=pipe.first,
                        reads_data=pipe.first or pipe.last, dp_rank=pipe.dp_rank, keep_last=t.keep_last,
                        resume_unsafe=t.resume_unsafe, topology=_topology(rc, stage_plan),
                        schedule={"lr": t.lr, "warmup_steps": t.warmup_steps, "steps": t.steps})


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


def _summary(rc: RunConfig, r: RunResult, run_dir: Path) -> None:
    skipped = sum(r.skipped.values())
    why = ", ".join(f"{v} {k}" for k, v in sorted(r.skipped.items())) or "none"
    head = sum(r.losses[:3]) / len(r.losses[:3])
    tail = sum(r.losses[-3:]) / len(r.losses[-3:])
    print(
        f"done: {len(r.losses)} steps in {r.seconds:.1f}s | loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f} "
        f"(mean of first 3 {head:.3f}, last 3 {tail:.3f}) | {r.samples / r.seconds:.1f} samples/s, "
        f"{r.tokens / r.seconds:.0f} tokens/s | skipped {skipped} samples ({why}) | "
        f"metrics {run_dir / 'metrics.jsonl'} | "
        + (f"checkpoint {run_dir / 'checkpoints'}" if rc.train.save_every or rc.train.save_final else "no checkpoint")
        + (f" | {r.nonfinite_skipped} updates skipped (non-finite)" if r.nonfinite_skipped else ""),
        flush=True,
    )
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
