"""Validation: the loss of held-out samples, scored through the training pipeline.

While training (`train.eval_every`, `data.eval_path`) and in `mmpipe eval`, every rank of the
job scores the same held-out set with DeepSpeed's `PipelineEngine.eval_batch`:

- **The same samples every time.** The set is the first `train.eval_samples` samples of
  `data.eval_path` in stream order: never shuffled, one pass, one loader worker, so it does
  not depend on the seed's shuffle, `data.num_workers` or `parallel.dp`. Each evaluation opens
  a fresh reader of its own; the training reader is never touched.
- **The planner's micro-batches.** The set is read and planned as one step by the training
  feeder's own code (`StepFeeder`, the run's `StepPlanner`, the same stage plan), with every
  replica reading the whole set and scoring the share the planner deals it
  (`plan.across_replicas`), in micro-batches of about a training step's size.
- **The per-token mean.** A micro-batch's loss is its summed cross-entropy times
  `M * dp / label tokens of the whole set` (what `token_loss` does for a training step), and
  `eval_batch(reduce_output="avg")` divides by the M micro-batches and averages the replicas: the
  result is the summed cross-entropy over every label token of the set divided by their count,
  however the planner cut it.
- **Training untouched.** `eval_batch` runs the stages in eval mode (dropout off) under
  `torch.no_grad`, so it consumes no random numbers, and the next `train_batch` switches back to
  train mode; the engine's micro-batch count for training is left as it was.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist

from mmpipe.config import RunConfig, eval_interval
from mmpipe.data.skips import ECHO_PER_REASON, SkipCounter
from mmpipe.paths import PACKAGE_ROOT, resolve_path
from mmpipe.planner.api import StagePlan
from mmpipe.runtime.feed import StepFeeder


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalResult:
    """One evaluation of the held-out set (every replica's share together)."""

    loss: float
    """Mean cross-entropy per label token of the whole set."""
    samples: int
    """Samples scored."""
    tokens: int
    """LLM tokens of those samples."""
    label_tokens: int
    """Tokens that carry a label (what the loss is the mean over)."""
    micro_batches: int
    """Micro-batches of the largest replica share."""
    seconds: float
    """Wall time of the evaluation, reading included."""

    def record(self) -> dict:
        """The figures as metrics.jsonl and `mmpipe eval` write them."""
        return {"eval_loss": round(self.loss, 6) if math.isfinite(self.loss) else None,
                "eval_samples": self.samples, "eval_tokens": self.tokens, "eval_label_tokens": self.label_tokens,
                "eval_micro_batches": self.micro_batches, "eval_s": self.seconds}


def eval_config(rc: RunConfig) -> RunConfig:
    """The run as its held-out set is read and planned: data.eval_path once, in stream order
    (no shuffle, one loader worker), read whole by every replica (plan.across_replicas), and
    all train.eval_samples samples as one step whose micro-batches hold about as many samples
    as a training step's (the count a fixed-count policy uses; data-aware chooses its own)."""
    t, n, dp = rc.train, rc.train.eval_samples, rc.parallel.dp
    per_micro_batch = t.global_batch / (dp * t.micro_batches)
    micro = max(1, min(n // dp, math.ceil(n / dp / per_micro_batch)))
    return replace(rc, data=replace(rc.data, path=rc.data.eval_path, sources=None, shuffle_buffer=0, epochs=1,
                                    num_workers=1),
                   plan=replace(rc.plan, across_replicas=True),
                   train=replace(t, global_batch=n, micro_batches=micro))


def check_eval_data(rc: RunConfig) -> int:
    """Before launch: data.eval_path resolves and holds train.eval_samples usable samples
    (their metadata is read, no media decoded). Returns the samples dropped while reading them.
    Raises ValueError naming the key."""
    from mmpipe.data.reader import iter_meta
    from mmpipe.data.shards import check_shards
    from mmpipe.runtime.hf_run import load_templater

    path, n = rc.data.eval_path, rc.train.eval_samples
    check_shards(resolve_path(path), root=PACKAGE_ROOT, key="data.eval_path")
    skips = SkipCounter()
    d = rc.data
    metas = iter_meta(path=resolve_path(path), seed=rc.train.seed, epochs=1, shuffle_buffer=0, on_error=d.on_error,
                      root=PACKAGE_ROOT, spec=rc.model, skips=skips, too_long=d.too_long, tokenizer=load_templater(rc),
                      caption_prompt=d.caption_prompt)
    found = sum(1 for _ in islice(metas, n))
    if found < n:
        dropped = f" ({skips.summary()})" if skips.total else ""
        raise ValueError(f"train.eval_samples={n}: data.eval_path={path} holds {found} usable samples{dropped}; "
                         f"lower train.eval_samples to {found} or add held-out shards")
    return skips.total


def eval_due(step: int, *, every: int, steps: int) -> bool:
    """Whether a run evaluates after `step`: every `every` steps counted from the run's first
    step (so a resumed run evaluates where an uninterrupted one does), and after its last step
    (`steps`); never when `every` is 0."""
    return bool(every) and (step % every == 0 or step == steps)


class Evaluator:
    """One rank's side of scoring the held-out set; `run` is collective over every rank."""

    def __init__(self, rc: RunConfig, *, engine, tokenizer, stage_plan: StagePlan, over_memory: bool,
                 dp_rank: int, dp_group, journal: bool = True):
        """Args:
            rc: the run (data.eval_path, train.eval_samples, train.eval_every).
            engine: this rank's DeepSpeed PipelineEngine.
            tokenizer, stage_plan, over_memory: what the training feeder of this rank got.
            dp_rank, dp_group: this rank's replica and the group of its stage's replicas.
            journal: log the drops of the first evaluation to RUN_DIR/skips.jsonl (else only
                print the first few).
        """
        self.rc = eval_config(rc)
        self.every = eval_interval(rc)
        self.steps = rc.train.steps
        self.engine = engine
        self.tokenizer = tokenizer
        self.stage_plan = stage_plan
        self.over_memory = over_memory
        self.dp_rank = dp_rank
        self.dp_group = dp_group
        self.first, self.last = engine.is_first_stage(), engine.is_last_stage()
        self.journal = journal
        self.runs = 0

    def due(self, step: int) -> bool:
        """Whether the run evaluates after `step` (`eval_due`)."""
        return eval_due(step, every=self.every, steps=self.steps)

    def describe(self) -> str:
        """The start-up line."""
        when = f"every {self.every} steps and after the last" if self.every else "never"
        return (f"eval: {when}, on the first {self.rc.train.global_batch} samples of data.eval_path="
                f"{self.rc.data.path} (the same each time)")

    def run(self) -> EvalResult:
        """Score the held-out set once; every rank of the job calls this together."""
        t0 = time.perf_counter()
        feeder = None
        if self.first or self.last:  # they read; middle stages learn the micro-batch count
            feeder = StepFeeder(self.rc, tokenizer=self.tokenizer, dp_rank=self.dp_rank, stage_plan=self.stage_plan,
                                over_memory=self.over_memory, media=self.first, steps=1, skips=self._skips())
        try:
            mbs = feeder.next_step().micro_batches if feeder is not None else []
        finally:
            if feeder is not None:
                feeder.close()
        engine, dp = self.engine, self.rc.parallel.dp
        count = _pipeline_count(engine, len(mbs))
        counts = torch.tensor([sum(m.label_tokens for m in mbs), sum(len(m.keys) for m in mbs),
                               sum(m.tokens for m in mbs)], dtype=torch.float64, device=engine.device)
        largest = torch.tensor([count], dtype=torch.long, device=engine.device)
        if self.first or self.last:  # the whole set's figures: label tokens are the mean's denominator
            dist.all_reduce(counts, group=self.dp_group)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.dp_group)
        # DeepSpeed's "avg" divides by the micro-batches and averages over the replicas; this scale
        # undoes both, leaving the sum over every label token of the set divided by their count.
        scale = count * dp / max(1.0, counts[0].item())
        it = iter([m.for_engine(scale) for m in mbs]) if mbs else None
        loss = float(engine.eval_batch(it, num_micro_batches=count, reduce_output="avg", bcast_loss=True))
        self.runs += 1
        return EvalResult(loss=loss, samples=int(counts[1]), tokens=int(counts[2]), label_tokens=int(counts[0]),
                          micro_batches=int(largest), seconds=time.perf_counter() - t0)

    def _skips(self) -> SkipCounter:
        """Drops of the first evaluation are logged (skips.jsonl, marked as the held-out set's) and
        the first few printed; later evaluations drop the same samples, counted only."""
        if self.runs or not self.first:
            return SkipCounter()
        if self.journal:
            return SkipCounter.for_run(self.rc.run_dir, dp_rank=self.dp_rank, set="eval")
        return SkipCounter(echo=ECHO_PER_REASON)


def _pipeline_count(engine, mine: int) -> int:
    """This replica's micro-batch count, as its first stage planned it (middle stages read no
    data), checked against its last stage's plan."""
    m = torch.tensor([mine], dtype=torch.long, device=engine.device)
    dist.broadcast(m, src=engine.grid.stage_to_global(0), group=engine.grid.get_pipe_parallel_group())
    count = int(m.item())
    if engine.is_last_stage() and mine != count:
        raise RuntimeError(f"first and last stage planned different held-out sets ({count} vs {mine} micro-batches)")
    return count


def result_path(run_dir: str | Path) -> Path:
    """Where `mmpipe eval`'s rank 0 leaves its result for the command (the job's own folder)."""
    return Path(run_dir) / "eval.json"


# -- mmpipe eval ------------------------------------------------------------------------


