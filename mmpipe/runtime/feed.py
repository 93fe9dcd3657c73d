"""Feeding the pipeline: a replica's samples, grouped into steps, cut into micro-batches.

The first and the last stage of a replica each run their own StepFeeder over the same shards
with the same seed and the same (deterministic) policy, so they build identical micro-batches
without talking to each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from mmpipe.config import PROJECT_ROOT, RunConfig, resolve_path
from mmpipe.data.reader import Sample, iter_samples
from mmpipe.data.skips import SkipCounter
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.runtime.batch import MicroBatch, collate


def split_contiguous(n: int, parts: int) -> list[list[int]]:
    """Stream order cut into `parts` consecutive groups of near-equal count."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_balanced(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Longest-first greedy: each sample to the group with the fewest tokens so far."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda g: (load[g], len(groups[g]), g))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


class StepFeeder:
    """Yields, step after step, the micro-batches of one data-parallel replica."""

    def __init__(self, rc: RunConfig, *, tokenizer: Tokenizer, dp_rank: int, stage_plan,
                 record: Path | None = None):
        self.rc = rc
        self.tokenizer = tokenizer
        self.stage_plan = stage_plan
        self.skips = SkipCounter()
        self.per_replica = rc.train.global_batch // rc.parallel.dp
        self.steps_done = 0
        self._record = record.open("w") if record else None
        self._samples = iter_samples(
            path=resolve_path(rc.data.path), tokenizer=tokenizer, spec=rc.model, dp_rank=dp_rank,
            dp_size=rc.parallel.dp, seed=rc.train.seed, epochs=rc.data.epochs,
            shuffle_buffer=rc.data.shuffle_buffer, on_error=rc.data.on_error, root=PROJECT_ROOT,
            skips=self.skips,
        )
        v = rc.model.vision
        self.patch = v.patch if v is not None else 1

    def _take(self) -> list[Sample]:
        out = []
        for s in self._samples:
            out.append(s)
            if len(out) == self.per_replica:
                return out
        raise RuntimeError(
            f"data ran out after {self.steps_done} steps ({len(out)} samples left, {self.per_replica} needed "
            f"per replica per step); set data.epochs=null to repeat the shards, or lower train.steps"
        )

    def next_step(self) -> list[MicroBatch]:
        samples = self._take()
        groups, packed = self.split(samples)
        mbs = [collate([samples[i] for i in g], patch=self.patch, packed=packed, pad_id=self.tokenizer.pad_id)
               for g in groups]
        self.steps_done += 1
        if self._record:
            self._record.write(json.dumps({"step": self.steps_done, "micro_batches": [list(m.keys) for m in mbs]}) + "\n")
            self._record.flush()
        return mbs

    def split(self, samples: list[Sample]) -> tuple[list[list[int]], bool]:
        """Micro-batches (indices into `samples`, in execution order) and whether they are packed."""
        m = self.rc.train.micro_batches
        if self.rc.plan.policy == "ds-default":
            return split_contiguous(len(samples), m), False
        return split_balanced([s.llm_len for s in samples], m), True
