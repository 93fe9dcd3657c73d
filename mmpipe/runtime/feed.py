"""Feeding the pipeline: a replica's samples, grouped into steps, planned into micro-batches.

The first and the last stage of a replica each run their own StepFeeder over the same shards
with the same seed and the same deterministic planner, so they build identical micro-batches
without talking to each other. Planning, decoding and collation run in a background thread,
ahead of the step being trained (one step queued, the next in the making), so they do not
stall the pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmpipe.config import PROJECT_ROOT, RunConfig, hardware_spec, resolve_path
from mmpipe.data.mixture import Mixture, mixture_from_dicts
from mmpipe.data.reader import Record, SampleStream, loader
from mmpipe.data.records import decode_record
from mmpipe.data.skips import SkipCounter
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.planner.api import PACKED_POLICIES, plan_step
from mmpipe.planner.cost import build_cost_model, sample_table, stage_costs
from mmpipe.model.geometry import SampleFeatures, features
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.step import evaluate_step
from mmpipe.runtime.batch import MicroBatch, collate

if TYPE_CHECKING:
    from mmpipe.runtime.stages import StageChoice



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
    """The planner's predicted step time of these micro-batches (this replica)."""
    predicted_busy: tuple[float, ...]
    """The planner's predicted compute time of each stage (this replica)."""
    predicted_peak_bytes: tuple[float, ...]
    """The planner's predicted peak memory of each stage (static + activations, largest over
    the replicas), under the hardware config's byte costs."""
    reader_state: dict
    """The reader's position after this step's samples (saved with a checkpoint)."""


def make_stream(rc: RunConfig, *, tokenizer: Tokenizer, dp_rank: int, skips: SkipCounter):
    """The replica's reader: one shard list, or a weighted mixture of several. With
    plan.across_replicas every replica reads the whole stream (and keeps its planned share)."""
    d = rc.data
    dp_size = 1 if rc.plan.across_replicas else rc.parallel.dp
    dp_rank = 0 if rc.plan.across_replicas else dp_rank
    common = dict(tokenizer=tokenizer, spec=rc.model, dp_rank=dp_rank, dp_size=dp_size,
                  seed=rc.train.seed, epochs=d.epochs, shuffle_buffer=d.shuffle_buffer, on_error=d.on_error,
                  too_long=d.too_long, num_workers=d.num_workers, root=PROJECT_ROOT, skips=skips)
    if d.sources:
        sources = [dict(s, path=resolve_path(s["path"])) for s in d.sources]
        return Mixture(sources=mixture_from_dicts(sources), **common)
    return SampleStream(path=resolve_path(d.path), **common)


class StepFeeder:
    """Yields, step after step, the planned micro-batches of one data-parallel replica."""

    def __init__(self, rc: RunConfig, *, tokenizer: Tokenizer, dp_rank: int, stage_plan: StageChoice,
                 media: bool = True,
                 record: Path | None = None, prefetch: int = 1, reader_state: dict | None = None,
                 steps: int | None = None):
        self.rc = rc
        self.tokenizer = tokenizer
        self.skips = SkipCounter()
        self.dp_rank = dp_rank
        self.across = rc.plan.across_replicas
        self.per_read = rc.train.global_batch if self.across else rc.train.global_batch // rc.parallel.dp
        self.packed = rc.plan.policy in PACKED_POLICIES
        self.stage_plan = StagePlan(stages=list(stage_plan.stages), recompute=list(stage_plan.recompute))
        hw = hardware_spec(rc)
        if stage_plan.warnings:
            # The user's stages exceed memory under the cost model and were accepted with a
            # warning: plan their micro-batches without the memory limit rather than refuse.
            hw = dataclasses.replace(hw, memory_gb=max(hw.memory_gb, 1e6))
        self.cost = build_cost_model(model=rc.model, hardware=hw, trainable=rc.train.trainable, dp=rc.parallel.dp)
        self.stage_costs = stage_costs(self.cost, self.stage_plan.stages, self.stage_plan.recompute)
        self._record = record.open("w") if record else None
        self.media = media
        self.steps = rc.train.steps if steps is None else steps
        self.stream = make_stream(rc, tokenizer=tokenizer, dp_rank=dp_rank, skips=self.skips)
        if reader_state is not None:
            self.stream.load_state_dict(reader_state)
        self._records = loader(self.stream, records=True)
        v = rc.model.vision
        self.patch = v.patch if v is not None else 1
        self.steps_made = 0
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

    def _make_step(self) -> PlannedStep:
        t0 = time.perf_counter()
        records = self._take()
        state = self.stream.state_dict()
        t1 = time.perf_counter()
        feats = [features(self.rc.model, r.meta) for r in records]
        replicas = self.split(feats)
        t2 = time.perf_counter()
        predicted = evaluate_step(self.stage_costs, sample_table(feats), replicas, packing=self.packed)
        mine = 0 if not self.across else self.dp_rank
        groups, sim = replicas[mine], predicted.replicas[mine]
        if not groups:
            raise RuntimeError(f"the planner gave replica {self.dp_rank} no samples this step; raise "
                               f"train.global_batch (now {self.rc.train.global_batch}) above parallel.dp")
        t3 = time.perf_counter()
        samples = {i: self._decode(records[i]) for g in groups for i in g}  # only this replica's
        mbs = [collate([samples[i] for i in g], patch=self.patch, packed=self.packed,
                       pad_id=self.tokenizer.pad_id) for g in groups]
        self.steps_made += 1
        if self._record:
            self._record.write(json.dumps({"step": self.steps_made,
                                           "micro_batches": [list(m.keys) for m in mbs]}) + "\n")
            self._record.flush()
        t4 = time.perf_counter()
        return PlannedStep(micro_batches=mbs, plan_seconds=t2 - t1, feed_seconds=(t1 - t0) + (t4 - t3),
                           predicted_s=predicted.step_time, predicted_busy=tuple(sim.busy) if sim else (),
                           predicted_peak_bytes=tuple(float(b) for b in predicted.peak_bytes), reader_state=state)

    def _decode(self, rec: Record):
        """The first stage decodes media; the last stage needs only ids and labels. Media that
        fail behind a valid header become zeros of the planned shape (and are counted), so
        both stages keep the same samples in the same micro-batches."""
        sample = decode_record(rec, self.tokenizer, self.rc.model, media=self.media, blank=True)
        if self.media:
            for err in sample.dropped[len(rec.dropped):]:  # new here; earlier drops are counted
                if self.rc.data.on_error == "raise":
                    raise err
                self.skips.add(err)
        return sample

    def split(self, feats: list[SampleFeatures]) -> list[list[list[int]]]:
        """Per replica its micro-batches (indices into `feats`, in execution order): every
        replica's when the step is planned across replicas, else this replica's alone."""
        dp = self.rc.parallel.dp if self.across else 1
        replicas = plan_step(policy=self.rc.plan.policy, features=feats, stage_plan=self.stage_plan,
                             cost=self.cost, dp=dp, micro_batches=self.rc.train.micro_batches)
        return [[list(mb) for mb in rep] for rep in replicas]

    # -- training thread ---------------------------------------------------------------

    def close(self) -> None:
        """Stop reading: release the record file; the daemon thread ends with the process."""
        if self._record:
            self._record.close()
            self._record = None

    def next_step(self) -> PlannedStep:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item
