"""What a running pipeline costs beyond its layers, measured on a real one for `mmpipe profile`.

A layer benchmark cannot see the engine around the layers: DeepSpeed's instructions for each
micro-batch (loading it, sending and receiving the carrier's tensors and their shapes, the
loss), the optimizer step and the gradient reduction; nor what a rank holds besides the
tensors the planner prices (the interpreter and its libraries, the process group, DeepSpeed's
buffers, the allocator's free blocks, the feeder's decoded steps). So `probe_engine` starts the
run's pipeline for real: `parallel.pp` processes (one replica) built by the training code
itself (`train.build_pipeline`: the run's precision, ZeRO stage, optimizer and the torch threads
a training rank gets), fed by the training feeder from the run's data, each step cut into 1 to
16 equal micro-batches (ds-default's split). Every step reports its measured time beside its
compute as simulated on the layer-profiled hardware, and every rank its resident set before
its model was built and its peak memory in each step beside the planner's static and
activation bytes for it; and before the model is built, stages 0 and 1 time sends between them
(the link). `mmpipe profile` fits the cost model's fixed costs and memory terms to these
figures (runtime/profile.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mmpipe.config import RunConfig
from mmpipe.planner.api import StagePlan

COUNTS = (16, 1, 2, 4, 8)
"""Micro-batches per probed step (capped at the samples of a step); the first step of the
first count warms up (first allocations, kernel choices) and is not counted."""
TIMEOUT_S = 900
"""The probe may take this long before `mmpipe profile` gives up on it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeStep:
    """One step of the probe pipeline."""

    micro_batches: int
    """Its micro-batch count."""
    compute_s: float
    """Its simulated 1F1B makespan on the hardware the probe was given (no fixed costs), s."""
    measured_s: float
    """DeepSpeed's train_batch time, s."""
    peak_bytes: tuple[float, ...]
    """Per stage, the rank's measured peak memory in the step (telemetry.PeakMemory)."""
    planned_bytes: tuple[float, ...]
    """Per stage, the planner's static + in-flight activation bytes for the step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeResult:
    """What the probe pipeline measured."""

    steps: tuple[ProbeStep, ...]
    """Every timed step."""
    before_model: tuple[float, ...]
    """Per stage, the rank's memory before its model was built: its resident set on CPU
    (interpreter, libraries, process group), allocated device bytes on a GPU."""
    measure: str
    """What the peaks are: `peak_rss` (CPU, the process's resident set) or `cuda_max_allocated`."""
    link: tuple[float, float] | None
    """(latency s, bandwidth GB/s) of one send between stages 0 and 1 (None with one stage)."""


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the probe's processes start (they inherit it); restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def probe_engine(rc: RunConfig, stage_plan: StagePlan, hardware: dict, *, threads: int,
                 logs: Path, steps_each: int = 3) -> ProbeResult:
    """Train the probe steps on a real `parallel.pp`-stage pipeline (module docstring).

    Args:
        rc: the run; its model, data, precision, ZeRO stage, optimizer and seed are used.
        stage_plan: the stages the probe pipeline is cut into.
        hardware: the hardware (a `hardware` config mapping) compute is simulated on.
        threads: torch threads per rank (those a training rank of the run gets).
        logs: folder of each rank's output (probe_rank<R>.log).
        steps_each: steps timed for each micro-batch count (profile.engine_steps).
    """
    import torch.multiprocessing as mp

    from mmpipe.runtime.host import accelerator_env, cache_env
    from mmpipe.runtime.launch import free_port

    pp = rc.parallel.pp
    per_replica = rc.train.global_batch // rc.parallel.dp
    counts = tuple(dict.fromkeys(min(c, per_replica) for c in COUNTS))
    with tempfile.TemporaryDirectory(prefix="mmpipe-probe-") as tmp:
        probe = dataclasses.replace(
            rc, run_dir=tmp, hardware=dict(hardware),
            parallel=dataclasses.replace(rc.parallel, dp=1),
            train=dataclasses.replace(rc.train, global_batch=per_replica, resume=None, save_every=0,
                                      save_final=False, record_samples=False),
            plan=dataclasses.replace(rc.plan, policy="ds-default", refit=False, stages=None))
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        env = {**accelerator_env(rc.launcher.backend), **cache_env(rc.launcher.cache_dir),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(pp), "LOCAL_WORLD_SIZE": str(pp), "OMP_NUM_THREADS": str(threads),
               "MMPIPE_THREADS": str(threads)}
        with _environment(env):  # DS_ACCELERATOR must be there before DeepSpeed is imported
            logs.mkdir(parents=True, exist_ok=True)
            procs = [ctx.Process(target=_probe_rank,
                                 args=(r, probe, stage_plan, counts, steps_each, q, logs / f"probe_rank{r}.log"))
                     for r in range(pp)]
            for p in procs:
                p.start()
        try:
            result = q.get(timeout=TIMEOUT_S)
        except queue.Empty:
            result = f"no result within {TIMEOUT_S} s"
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    if isinstance(result, str):
        # one line, as a user error is (the rank's own error names the key where it is one)
        raise ValueError(f"the probe pipeline could not train: {result}; its output is in {logs}/probe_rank*.log")
    return result


def _probe_rank(rank: int, rc: RunConfig, stage_plan: StagePlan, counts: tuple[int, ...], steps_each: int, q,
                log: Path) -> None:
    """One rank of the probe pipeline; rank 0 puts the ProbeResult (or an error line) on `q`.
    Its output (the libraries' start-up lines, the feeder's skipped samples) goes to `log`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        result = _probe(rc, stage_plan, counts, steps_each)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which names it
        if rank == 0:
            q.put(f"rank {rank}: {type(err).__name__}: {err}")
        raise
    if rank == 0:
        q.put(result)


def _probe(rc: RunConfig, stage_plan: StagePlan, counts: tuple[int, ...], steps_each: int) -> ProbeResult | None:
    import deepspeed
    import torch.distributed as dist

    from mmpipe.runtime.feed import StepFeeder
    from mmpipe.runtime.hf_run import load_templater
    from mmpipe.runtime.quiet import held_prints, quiet_deepspeed
    from mmpipe.runtime.telemetry import PeakMemory, resident_bytes
    from mmpipe.runtime.train import agree_on_micro_batches, build_pipeline

    quiet_deepspeed()
    torch.set_num_threads(int(os.environ["MMPIPE_THREADS"]))
    backend = os.environ["MMPIPE_BACKEND"]
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    with held_prints():
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    cuda = backend == "nccl"
    link = None
    if dist.get_world_size() > 1:  # the steps' compute is then simulated with the measured link
        link = _ping_pong(torch.device("cuda") if cuda else torch.device("cpu"))
        rc = dataclasses.replace(rc, hardware={**rc.hardware, "link_latency_s": link[0], "link_gbps": link[1]})
    before = float(torch.cuda.memory_allocated()) if cuda else float(resident_bytes() or 0.0)
    tok = load_templater(rc)
    pipe = build_pipeline(rc, tok, stage_plan)
    engine, dev = pipe.engine, pipe.engine.device
    memory = PeakMemory(dev)
    world = dist.get_world_size()
    steps: list[ProbeStep] = []
    warm = True
    for count in counts:
        run = dataclasses.replace(rc, train=dataclasses.replace(rc.train, micro_batches=count))
        feeder = None
        if pipe.first or pipe.last:
            feeder = StepFeeder(run, tokenizer=tok, dp_rank=0, stage_plan=stage_plan, media=pipe.first,
                                steps=steps_each + warm)
        for _ in range(steps_each + warm):
            planned = feeder.next_step() if feeder else None
            mbs = planned.micro_batches if planned else []
            agree_on_micro_batches(engine, len(mbs), 1)
            scale = engine.micro_batches / max(1, sum(m.label_tokens for m in mbs))
            memory.start()
            t0 = time.perf_counter()
            engine.train_batch(data_iter=iter([m.for_engine(scale) for m in mbs]) if mbs else None)
            seconds = time.perf_counter() - t0
            mine = torch.tensor([seconds, memory.peak()], dtype=torch.float64, device=dev)
            rows = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
            if planned is not None and dist.get_rank() == 0 and not warm:
                steps.append(ProbeStep(micro_batches=len(mbs), compute_s=planned.compute_s,
                                       measured_s=max(float(r[0]) for r in rows),
                                       peak_bytes=tuple(float(r[1]) for r in rows),
                                       planned_bytes=tuple(planned.predicted_peak_bytes)))
            warm = False
        if feeder is not None:
            feeder.close()
    befores = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(world)]
    dist.all_gather(befores, torch.tensor([before], dtype=torch.float64, device=dev))
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    # pp ranks of one replica: rank r is stage r
    return ProbeResult(steps=tuple(steps), before_model=tuple(float(b) for b in befores),
                       measure=memory.kind, link=link)


def _ping_pong(device, *, sizes=(1 << 10, 1 << 20), repeats: int = 20) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) of one send from rank 0 to rank 1 and back, on the run's
    backend: the median half round trip of a small and of a large message, fitted as
    latency + bytes / bandwidth (rank 0's figures, on every rank)."""
    import statistics

    import torch.distributed as dist

    rank = dist.get_rank()
    times = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32, device=device)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            runs.append((time.perf_counter() - t0) / 2)
        times.append((n, statistics.median(runs)))
    (n0, t0), (n1, t1) = times
    bandwidth = (n1 - n0) / max(t1 - t0, 1e-9) / 1e9
    figures = torch.tensor([max(t0 - n0 / (bandwidth * 1e9), 1e-6), bandwidth], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0)  # every rank plans with rank 0's figures
    return float(figures[0]), float(figures[1])
