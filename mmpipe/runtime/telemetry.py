"""What each rank measures of itself: the time of every forward and backward of every
micro-batch, of encoder tower work run off the stage chain (nested towers), of communication,
and of the optimizer step; and its peak memory in the step.

DeepSpeed's PipelineEngine executes a schedule of instructions; the timer wraps the engine's
own instruction handlers on this one engine instance, so nothing else changes.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

KINDS = ("fwd", "bwd", "tower", "comm", "optim", "load")
_HANDLERS = {
    "_exec_forward_pass": "fwd",
    "_exec_backward_pass": "bwd",
    "_exec_send_activations": "comm",
    "_exec_recv_activations": "comm",
    "_exec_send_grads": "comm",
    "_exec_recv_grads": "comm",
    "_exec_reduce_grads": "comm",
    "_exec_reduce_tied_grads": "comm",
    "_exec_optimizer_step": "optim",
    "_exec_load_micro_batch": "load",
}


def on_cuda(device) -> bool:
    """Whether torch device `device` (a torch.device or its name) is a GPU's: its kernels run
    asynchronously, so a host clock around them measures their launch."""
    return getattr(device, "type", str(device)) == "cuda"


def busy_s(kinds) -> float:
    """A rank's compute of a step from its seconds by kind: the pipeline's forward and backward
    passes and the tower work the nested schedule runs beside them (a rank's bubble is the rest)."""
    return kinds["fwd"] + kinds["bwd"] + kinds["tower"]


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """Seconds spent by one rank in one step, by kind, and per micro-batch."""

    totals: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    """Seconds per kind."""
    fwd: list[float] = field(default_factory=list)
    """Forward time of each micro-batch, in execution order."""
    bwd: list[float] = field(default_factory=list)
    """Backward time of each micro-batch, in execution order."""

    @property
    def busy(self) -> float:
        return busy_s(self.totals)


class StageTimer:
    """Times the engine's schedule instructions on this rank."""

    def __init__(self, engine) -> None:
        self.current = StepTimes()
        self._cuda = on_cuda(engine.device)
        self._marks: list[tuple[str, object, object]] = []
        """On a GPU: (kind, start, end) CUDA events of the step's instructions, in order, read at
        take(). The host returns from an instruction once its kernels are queued, so host time
        would count a pass as done when it was launched and its running as bubble."""
        # The engine dispatches through a class-level map of plain functions; an instance-level
        # copy with timed wrappers changes this engine only.
        engine._INSTRUCTION_MAP = {
            instr: self._timed(fn, _HANDLERS[fn.__name__]) if fn.__name__ in _HANDLERS else fn
            for instr, fn in type(engine)._INSTRUCTION_MAP.items()
        }

    def _timed(self, fn, kind: str):
        def run(engine, *args, **kwargs):
            if self._cuda:  # the device's own time between two events on the stream
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return fn(engine, *args, **kwargs)
                finally:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._marks.append((kind, start, end))
            t0 = time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self._add(kind, time.perf_counter() - t0)

        return run

    def _add(self, kind: str, dt: float) -> None:
        self.current.totals[kind] += dt
        if kind in ("fwd", "bwd"):
            getattr(self.current, kind).append(dt)

    def time(self, engine, instruction, kind: str) -> None:
        """Also time `instruction` (one mmpipe added to the map after this timer wrapped it) as
        `kind`."""
        patched = dict(engine._INSTRUCTION_MAP)
        patched[instruction] = self._timed(patched[instruction], kind)
        engine._INSTRUCTION_MAP = patched

    def take(self) -> StepTimes:
        """This step's times; the timer starts a new step (on a GPU: once the step's work is done)."""
        if self._marks:
            torch.cuda.synchronize()
            for kind, start, end in self._marks:
                self._add(kind, start.elapsed_time(end) / 1e3)
            self._marks = []
        done, self.current = self.current, StepTimes()
        return done


def _status_bytes(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes, or None where there is none."""
    status = Path("/proc/self/status")
    m = re.search(rf"{field}:\s+(\d+) kB", status.read_text()) if status.is_file() else None
    return float(m.group(1)) * 1024 if m else None


def resident_bytes() -> float | None:
    """This process's resident set now (VmRSS), or None where /proc is not there."""
    return _status_bytes("VmRSS")


class PeakMemory:
    """This process's peak memory during one step, in bytes.

    On CUDA: torch's peak of allocated tensor bytes on the device (reset each step). On CPU torch
    keeps no allocator statistics, so the measure is the process's peak resident set size in
    the step: Linux resets the high-water mark when "5" is written to /proc/self/clear_refs,
    and /proc/self/status reports it as VmHWM. That counts everything resident in the
    process (the Python runtime and libraries, weights, gradients, optimizer state,
    activations, the feeder thread's next step, allocator slack), not tensor bytes alone.
    Where the reset is not allowed, it falls back to the peak over the process's whole life.
    """

    def __init__(self, device) -> None:
        self.cuda = on_cuda(device)
        self.kind = "cuda_max_allocated" if self.cuda else "peak_rss"
        if not self.cuda and not self._reset_rss():
            self.kind = "lifetime_peak_rss"

    def start(self) -> None:
        """Begin a step's measurement."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.kind == "peak_rss":
            self._reset_rss()

    def peak(self) -> float:
        """Peak bytes since start()."""
        if self.cuda:
            return float(torch.cuda.max_memory_allocated())
        high = _status_bytes("VmHWM")
        if high is not None:
            return high
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux

    @staticmethod
    def _reset_rss() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False


def gather_stage_times(times: StepTimes, *, world: int, device=None, peak_mem: float = 0.0) -> torch.Tensor:
    """[world, len(KINDS) + 1] seconds of every rank for this step by kind, and its peak memory
    in bytes (one all-gather)."""
    mine = torch.tensor([times.totals[k] for k in KINDS] + [peak_mem], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out)


def per_stage(table: torch.Tensor, stage_of_rank: list[int], pp: int) -> list[dict[str, float]]:
    """Each stage's seconds by kind (mean over replicas) and its peak memory (`mem`, bytes, the
    largest over replicas)."""
    out = []
    for s in range(pp):
        rows = [r for r, st in enumerate(stage_of_rank) if st == s]
        mean = table[rows].mean(dim=0)
        out.append({k: float(mean[i]) for i, k in enumerate(KINDS)})
        out[-1]["mem"] = float(table[rows, len(KINDS)].max())
    return out


class InstructionTrace:
    """Every instruction this rank's engine runs, as a Chrome trace (`train.trace`): one complete
    event per instruction, named by its class (ForwardPass, SendActivation, EncodeFeatures, ...)
    with its micro-batch or buffer and the step, and one per step around them, on this rank's own
    row (pid = rank). The file is the trace event format's JSON array, closed at the end of the
    run and readable before (Perfetto and chrome://tracing accept an array left open), so the
    timelines of every rank open together: `ui.perfetto.dev`, open each trace_rank*.json.
    Times are the wall clock (time.time), comparable across the ranks of a machine. On a GPU
    each instruction ends with a device synchronize, so that its bar covers its kernels, not
    only their launch (a traced run is slower there: measure speed without it).

    Written by hand: torch.profiler traces kernels and Python calls, not the pipeline's
    instructions, and DeepSpeed's wall-clock breakdown prints sums, not a timeline."""

    def __init__(self, engine, path: Path, *, rank: int, stage: int, first_step: int) -> None:
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._rank = rank
        self._sync = torch.cuda.synchronize if on_cuda(engine.device) else None
        self.step = first_step - 1
        self._step_start = 0.0
        self._write({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (stage {stage})"}},
                    first=True)
        engine._INSTRUCTION_MAP = {instr: self._traced(fn, instr.__name__)
                                   for instr, fn in engine._INSTRUCTION_MAP.items()}

    def _traced(self, fn, name: str):
        def run(engine, *args, **kwargs):
            t0 = time.time()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                if self._sync is not None:
                    self._sync()
                self._event(name, t0, time.time(), {**kwargs, "step": self.step})

        return run

    def _event(self, name: str, t0: float, t1: float, args: dict) -> None:
        self._write({"name": name, "ph": "X", "ts": round(t0 * 1e6, 1), "dur": round((t1 - t0) * 1e6, 1),
                     "pid": self._rank, "tid": 0, "args": args})

    def _write(self, event: dict, *, first: bool = False) -> None:
        self._file.write(("[\n" if first else ",\n") + json.dumps(event))

    def begin_step(self) -> None:
        """A training step starts (its instructions, and anything before train_batch, follow)."""
        self.step += 1
        self._step_start = time.time()

    def end_step(self) -> None:
        """The step's optimizer update is done: its own event, on the row beside its instructions."""
        t1 = time.time()
        self._write({"name": f"step {self.step}", "ph": "X", "ts": round(self._step_start * 1e6, 1),
                     "dur": round((t1 - self._step_start) * 1e6, 1), "pid": self._rank, "tid": 1,
                     "args": {"step": self.step}})
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.write("\n]\n")
            self._file.close()


class StepTelemetry:
    """One rank's telemetry of the training steps, gathered from every rank: each stage's busy,
    communication and optimizer seconds and peak memory. It owns the engine's timer, the peak
    memory measure and which stage each rank holds, so the loop asks for a step's stages and
    nothing else."""

    def __init__(self, engine, pp: int) -> None:
        self._engine = engine
        self._pp = pp
        self._timer = StageTimer(engine)
        self._memory = PeakMemory(engine.device)
        self._stage_of_rank = _stage_of_every_rank(engine.stage_id, dist.get_world_size(), engine.device)
        self._trace: InstructionTrace | None = None

    @property
    def memory_kind(self) -> str:
        """What the measured peaks are (PeakMemory.kind)."""
        return self._memory.kind

    def start(self) -> None:
        """Begin a step's peak memory (and its traced events, with train.trace)."""
        self._memory.start()
        if self._trace is not None:
            self._trace.begin_step()

    def trace_to(self, path: Path, *, first_step: int) -> None:
        """train.trace: every instruction of this rank into `path` (InstructionTrace); call after
        every other patch of the engine's instruction map, so that the trace sees what runs."""
        self._trace = InstructionTrace(self._engine, path, rank=dist.get_rank(), stage=self._engine.stage_id,
                                       first_step=first_step)

    def close(self) -> None:
        """The run is over: the trace file, if any, is closed."""
        if self._trace is not None:
            self._trace.close()

    def stages(self) -> list[dict[str, float]]:
        """The step's figures by stage (per_stage), gathered from every rank (a collective)."""
        if self._trace is not None:
            self._trace.end_step()
        times = gather_stage_times(self._timer.take(), world=dist.get_world_size(), device=self._engine.device,
                                   peak_mem=self._memory.peak())
        return per_stage(times.cpu(), self._stage_of_rank, self._pp)

    def time_instruction(self, instruction, kind: str) -> None:
        """Time an instruction mmpipe added to the engine's map (StageTimer.time)."""
        self._timer.time(self._engine, instruction, kind)

    def drop(self) -> None:
        """Forget what ran since the last step (an evaluation's instructions are no step's)."""
        self._timer.take()


def _stage_of_every_rank(stage: int, world: int, device) -> list[int]:
    mine = torch.tensor([stage], dtype=torch.long, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [int(t) for t in out]
