"""Feeding the pipeline: a replica's samples, grouped into steps, planned into micro-batches.

The first and the last stage of a replica each run their own StepFeeder over the same shards
with the same seed and the same deterministic planner, so they build identical micro-batches
without talking to each other. Reading and planning run in a background thread,
ahead of the step being trained (one step queued, the next in the making), so they do not
stall the pipeline. Decoding and collating each micro-batch (`StepDecoder`) run in that thread
too, or with data.decode_workers in forked worker processes (runtime/procpool.py): decoding
is most of the feed and is Python that holds the GIL, which in a thread takes turns with the
training loop that launches the kernels. The thread keeps what is cheap and ordered (reading,
planning, counting drops, checking token counts), so the micro-batches, their order, the
skip counts and the reader state are the same either way.

Re-planning from what the run measures (plan.refit): after every step rank 0 re-fits the
step-time model (planner/calibrate.py) and the training loop hands the fit to every feeder
(`deliver_fit`). Step j is planned with the fit made after step j - FIT_LAG: the thread is at
most two steps ahead of training, so that fit is always there when the thread gets to step j
(it never waits), and both feeders of a replica price step j with the same fit, which keeps
their plans identical. Before the fit has seen its warm-up steps, steps are planned with the
hardware config, every second one with a micro-batch priced EXPLORE times higher: the planner
keeps to the count its costs prefer, so without this the warm-up steps would all have about
the same micro-batch count and the re-fit could not tell what a micro-batch costs from what a
step does. A resumed run starts from the fit its checkpoint saved.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.data.loader import loader
from mmpipe.data.media import MediaLimits
from mmpipe.data.records import Record, decode_record
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.template import Templater
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.model.geometry import features
from mmpipe.model.spec import ModelSpec
from mmpipe.planner.api import (
    Coef,
    HardwareSpec,
    Ladder,
    Placement,
    StagePlan,
    StepPlanner,
    StepWork,
    calibrated_hardware,
    step_work,
)
from mmpipe.runtime.batch import MicroBatch, collate_for
from mmpipe.runtime.host import decode_workers
from mmpipe.runtime.procpool import ProcessPool
from mmpipe.runtime.spread import EncodeStep, feature_rows
from mmpipe.runtime.stages import run_problem
from mmpipe.runtime.stream import make_stream

FIT_LAG = 3
"""Step j is planned with the step-time fit made after step j - FIT_LAG (module docstring)."""
EXPLORE = 8.0
"""Before the first fit, every second step is planned with the hardware config's cost of a
micro-batch times this (at least EXPLORE_FLOOR_S): fewer, larger micro-batches."""
EXPLORE_FLOOR_S = 0.02
"""The least per-micro-batch cost such a step is planned with, s (the GPU presets have none)."""


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One replica's step, ready to train."""

    micro_batches: list[MicroBatch]
    """In execution order."""
    plan_seconds: float
    """Time spent planning it (in the background thread)."""
    feed_seconds: float
    """Time spent reading, decoding and collating it (in the background thread)."""
    predicted_s: float
    """The planner's predicted step time of these micro-batches (this replica), under the
    costs it planned with (`fit`, else the hardware config)."""
    compute_s: float
    """Their simulated 1F1B makespan on the hardware config, without its fixed costs (this
    replica): what the step-time re-fit regresses on."""
    fit: Coef | None
    """The step-time fit (a, b, c) these micro-batches were planned with; None: the hardware
    config's costs."""
    predicted_busy: tuple[float, ...]
    """The planner's predicted compute time of each stage (this replica)."""
    predicted_peak_bytes: tuple[float, ...]
    """The planner's predicted peak memory of each stage (static + activations, largest over
    the replicas), under the hardware config's byte costs."""
    reader_state: dict
    """The reader's position after this step's samples (saved with a checkpoint)."""
    features: tuple = ()
    """The features of the samples the planner planned this step with (every replica's when
    planned across replicas, else this replica's): what plan.recut=auto re-plans the cut on."""
    work: StepWork = StepWork(ideal_s=0.0, flops=0.0)
    """What this replica's samples need at the hardware config's rates (the step's lower bound
    and model FLOPs, summed over the replicas by the training loop)."""
    encode: EncodeStep | None = None
    """With spread towers (plan.encoders): the replica's encoder shares and this rank's share
    collated with its media."""


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """Records to decode and collate together (one micro-batch, or a spread tower's share)."""

    records: tuple[Record, ...]
    media: bool
    """Decode their media (the first stage; a spread tower's share on any stage)."""
    collate: bool = True
    """Collate them into one micro-batch (False: only the carriers)."""
    carry: tuple[bool, ...] = ()
    """Per record: also collate the flagged ones together as a spread tower's carrier (this
    rank's part of the micro-batch, runtime/spread.py)."""
    pad_to: int | None = None
    """The micro-batch's planned length with padding (a plan.ladder rung; None: its tokens)."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """A DecodeJob's result."""

    micro_batch: MicroBatch | None
    carriers: tuple
    """The carrier of the records flagged in DecodeJob.carry, collated together (none when
    none is flagged)."""
    drops: tuple[SampleError, ...]
    """Media that failed behind a valid header (zeros of the planned shape took their place)."""


@dataclass(frozen=True, slots=True)
class StepDecoder:
    """Turns a DecodeJob into tensors: the same code in the feeder thread and in a worker."""

    spec: ModelSpec
    tokenizer: Tokenizer | Templater
    limits: MediaLimits
    packed: bool

    def __call__(self, job: DecodeJob) -> Decoded:
        """Media that fail behind a valid header become zeros of the planned shape (and are
        returned as drops), so both stages keep the same samples in the same micro-batches."""
        samples = [decode_record(r, self.tokenizer, self.spec, media=job.media, blank=True, limits=self.limits)
                   for r in job.records]
        drops = tuple(err for r, s in zip(job.records, samples) for err in s.dropped[len(r.dropped):])
        pad = self.tokenizer.pad_id
        mb = (collate_for(self.spec, samples, packed=self.packed, pad_id=pad, media=job.media, pad_to=job.pad_to)
              if job.collate else None)
        unit = [s for s, c in zip(samples, job.carry) if c]  # a rank's part of one micro-batch
        carriers = (collate_for(self.spec, unit, packed=True, pad_id=pad).carrier,) if unit else ()
        return Decoded(micro_batch=mb, carriers=carriers, drops=drops)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # as DataLoader workers: N workers x the rank's threads would oversubscribe


class StepFeeder:
    """Yields, step after step, the planned micro-batches of one data-parallel replica."""

    def __init__(self, rc: RunConfig, *, tokenizer: Tokenizer | Templater, dp_rank: int, stage_plan: StagePlan,
                 over_memory: bool = False, media: bool = True,
                 record: Path | None = None, prefetch: int = 1, reader_state: dict | None = None,
                 steps: int | None = None, first_step: int = 0, skips: SkipCounter | None = None,
                 fit: Coef | None = None, placement: Placement | None = None,
                 encode_stage: int | None = None, ladder: Ladder | None = None):
        """`fit`: the step-time fit a resumed run's checkpoint saved (None: none yet); it plans
        the steps until this run's own fits take over (only with plan.refit). `encode_stage`:
        with spread towers, this rank's pipeline stage (its share of the media is decoded and
        collated for the towers' pre-pass, runtime/spread.py); `placement`: the run's resolved
        plan.encoders (the planner deals each stage its share; None: every tower on the stages).
        `ladder`: the run's plan.ladder
        (ChosenStages.ladder): packed micro-batches are planned at, and padded to, its rungs."""
        self.encode_stage = encode_stage
        self.rc = rc
        self.tokenizer = tokenizer
        if skips is None:  # the first stage logs the run's drops
            skips = SkipCounter.for_run(rc.run_dir, dp_rank=dp_rank) if media else SkipCounter()
        self.skips = skips
        self.dp_rank = dp_rank
        self.across = rc.plan.across_replicas
        self.per_read = rc.train.global_batch if self.across else rc.train.global_batch // rc.parallel.dp
        self.problem = run_problem(rc, placement if placement is not None else Placement())
        self.hardware = self.problem.hardware
        self._stage_plan, self._ladder, self._memory_limit = stage_plan, ladder, not over_memory
        self.planner = self._step_planner(self.hardware)
        self._rates = self.planner.cost  # the hardware config's: what the efficiency figures are priced at
        self._priced: Coef | None = None  # the costs the planner prices with (None: the config's)
        self.planned_with: Coef | None = None
        self.packed = self.planner.packing
        self.refit = rc.plan.refit
        self._resumed_fit = fit if self.refit else None
        self._fits: dict[int, Coef | None] = {}  # after step k (global), delivered by the training loop
        self._fits_ready = threading.Condition()
        self._record = record.open("a") if record else None  # a resumed run continues the record
        self.first_step = first_step
        self.media = media
        self.steps = rc.train.steps if steps is None else steps
        self.stream = make_stream(rc, tokenizer=tokenizer, dp_rank=dp_rank, skips=self.skips)
        if reader_state is not None:
            self.stream.load_state_dict(reader_state)
        self._records = loader(self.stream, records=True)
        self.steps_made = 0
        # Forked here, by the thread that makes the feeder, before the feeder thread exists.
        import torch

        self.decode_workers = decode_workers(rc.data.decode_workers, torch.get_num_threads())
        self._pool = ProcessPool(StepDecoder(spec=rc.model, tokenizer=tokenizer, limits=self.stream.limits,
                                             packed=self.packed), self.decode_workers, name="mmpipe-decode",
                                 init=_one_thread)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._thread = threading.Thread(target=self._produce, name="mmpipe-feeder", daemon=True)
        self._thread.start()

    # -- background thread -------------------------------------------------------------

    def _produce(self) -> None:
        try:
            for _ in range(self.steps):
                self._queue.put(self._make_step())
        except BaseException as err:  # noqa: BLE001 - handed to the training thread
            self._queue.put(err)

    def _take(self) -> list[Record]:
        out = []
        for r in self._records:
            out.append(r)
            if len(out) == self.per_read:
                return out
        raise RuntimeError(
            f"data ran out after {self.steps_made} steps ({len(out)} samples left, {self.per_read} needed "
            f"per step); set data.epochs=null to repeat the shards, or lower train.steps"
        )

    def _fit_for(self, step: int) -> Coef | None:
        """The fit step `step` (global, 1-based) is planned with: the one delivered after step
        step - FIT_LAG, or the resumed run's saved fit before this run has made one."""
        if not self.refit:
            return None
        after = step - FIT_LAG
        if after <= self.first_step:
            return self._resumed_fit
        with self._fits_ready:
            self._fits_ready.wait_for(lambda: after in self._fits)
            for k in [k for k in self._fits if k < after]:
                del self._fits[k]
            return self._fits[after]

    def _use_fit(self, fit: Coef | None, step: int) -> None:
        """Plan step `step` with `fit` (None: the hardware config, or on every second step before
        the first fit, its exploring variant); the stage cut stays."""
        self.planned_with = fit
        if fit is None and self.refit and step % 2 == 0:
            hw = self.hardware
            fit = (1.0, max(EXPLORE * hw.micro_batch_overhead_s, EXPLORE_FLOOR_S), hw.step_overhead_s)
        if fit == self._priced:
            return
        hw = self.hardware if fit is None else calibrated_hardware(self.hardware, fit)
        self.planner = self._step_planner(hw)
        self._priced = fit

    def _step_planner(self, hardware: HardwareSpec) -> StepPlanner:
        """The run's StepPlanner priced with `hardware` (the config's, or a fit's)."""
        return StepPlanner(dataclasses.replace(self.problem, hardware=hardware), self._stage_plan,
                           ladder=self._ladder, memory_limit=self._memory_limit)

    def _make_step(self) -> PlannedStep:
        t0 = time.perf_counter()
        records = self._take()
        state = self.stream.state_dict()
        t1 = time.perf_counter()
        feats = [features(self.rc.model, r.meta) for r in records]
        step = self.first_step + self.steps_made + 1
        self._use_fit(self._fit_for(step), step)
        planned = self.planner.plan(feats)  # every replica's when planned across replicas, else this one's
        t2 = time.perf_counter()
        mine = 0 if not self.across else self.dp_rank
        groups = planned.replicas[mine]
        if not groups:
            raise RuntimeError(f"the planner gave replica {self.dp_rank} no samples this step; raise "
                               f"train.global_batch (now {self.rc.train.global_batch}) above parallel.dp")
        t3 = time.perf_counter()
        share = planned.encode[mine][self.encode_stage] if self.encode_stage is not None else []
        rungs = planned.padded[mine] if planned.padded else [None] * len(groups)  # plan.ladder's lengths
        mbs, carriers = self._build(records, groups, rungs, share)  # only this replica's
        for g, mb, n in zip(groups, mbs, rungs):  # what the planner costs is what the model gets
            planned_len = sum(feats[i].llm_len for i in g)
            if mb.tokens != planned_len or mb.tokens + mb.pad_tokens != (planned_len if n is None else n):
                raise RuntimeError(f"micro-batch {list(mb.keys)} holds {mb.tokens} LLM tokens and {mb.pad_tokens} "
                                   f"padding but the planner counted {planned_len}, padded to {n or planned_len}")
        encode = self._encode_step(planned, mine, groups, feats, carriers)
        self.steps_made += 1
        if self._record:
            self._record.write(json.dumps({"step": self.first_step + self.steps_made,
                                           "micro_batches": [list(m.keys) for m in mbs]}) + "\n")
            self._record.flush()
        t4 = time.perf_counter()
        # calibrated_hardware scales every compute time by the fit's a exactly: back to the config's
        scale = self._priced[0] if self._priced is not None else 1.0
        return PlannedStep(micro_batches=mbs, plan_seconds=t2 - t1, feed_seconds=(t1 - t0) + (t4 - t3),
                           predicted_s=planned.step_time, compute_s=planned.compute[mine] / scale,
                           fit=self.planned_with, predicted_busy=planned.busy[mine],
                           predicted_peak_bytes=planned.peak_bytes[mine], reader_state=state,
                           features=tuple(feats), work=step_work(self._rates, [feats[i] for g in groups for i in g]),
                           encode=encode)

    def _build(self, records: list[Record], groups, rungs, share) -> tuple[list[MicroBatch], tuple]:
        """The micro-batches of `groups` (each padded to its rung) and the carriers of the spread
        towers' `share`, one per micro-batch it has samples of (its part, collated together: what
        EncodeStep.units orders), decoded and collated by the pool (in worker processes with
        data.decode_workers); drops are counted here, in sample order, as the thread path always did."""
        keep = set(share)
        units = [[i for i in g if i in keep] for g in groups]
        jobs = [DecodeJob(records=tuple(records[i] for i in g), media=self.media,
                          carry=tuple(self.media and i in keep for i in g), pad_to=n) for g, n in zip(groups, rungs)]
        if share and not self.media:  # the last stage decodes its share's media for the towers alone
            jobs += [DecodeJob(records=tuple(records[i] for i in u), media=True, collate=False, carry=(True,) * len(u))
                     for u in units if u]
        done = self._pool.map(jobs, what=lambda j: f"samples {[r.key for r in j.records]}")
        if self.media:
            for d in done:
                for err in d.drops:
                    if self.rc.data.on_error == "raise":
                        raise err
                    self.skips.add(err)
        found = [d.carriers[0] for d in (done[:len(groups)] if self.media else done[len(groups):]) if d.carriers]
        if len(found) != sum(1 for u in units if u):
            raise RuntimeError(f"the spread towers' share {sorted(share)} collated into {len(found)} carriers, "
                               f"not one per micro-batch it has samples of")
        return [d.micro_batch for d in done[:len(groups)]], tuple(found)

    def _encode_step(self, planned, mine: int, groups, feats: list, carriers: tuple) -> EncodeStep | None:
        """The spread towers' view of the step: every stage's share, and this rank's share
        collated with its media (a stage that decoded them for its micro-batches reuses them)."""
        if self.encode_stage is None:
            return None
        shares = planned.encode[mine]
        return EncodeStep(shares=tuple(tuple(x) for x in shares), groups=tuple(tuple(g) for g in groups),
                          rows={i: feature_rows(feats[i]) for g in groups for i in g}, carriers=carriers,
                          mode=planned.encode_recompute)

    # -- training thread ---------------------------------------------------------------

    def close(self) -> None:
        """Stop reading: end the decode workers, release the record file; the daemon thread ends
        with the process."""
        self._pool.close()
        if self._record:
            self._record.close()
            self._record = None

    def deliver_fit(self, step: int, fit: Coef | None) -> None:
        """The step-time fit after step `step` (global), None while it is not fitted: call it
        after every step, before taking the next one."""
        with self._fits_ready:
            self._fits[step] = fit
            self._fits_ready.notify_all()

    def next_step(self) -> PlannedStep:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item
