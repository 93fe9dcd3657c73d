"""A replica's sample stream as the run configures it (one home for the feeder, which trains
on it, and the stage choice, which plans on its first steps)."""

from __future__ import annotations

from mmpipe.config import RunConfig
from mmpipe.data.mixture import Mixture, mixture_from_dicts
from mmpipe.data.reader import SampleStream
from mmpipe.data.skips import SkipCounter
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.paths import PACKAGE_ROOT, resolve_path


def make_stream(rc: RunConfig, *, tokenizer: Tokenizer, dp_rank: int, skips: SkipCounter):
    """The replica's reader: one shard list, or a weighted mixture of several. With
    plan.across_replicas every replica reads the whole stream (and keeps its planned share)."""
    d = rc.data
    dp_size = 1 if rc.plan.across_replicas else rc.parallel.dp
    dp_rank = 0 if rc.plan.across_replicas else dp_rank
    common = dict(tokenizer=tokenizer, spec=rc.model, dp_rank=dp_rank, dp_size=dp_size,
                  seed=rc.train.seed, epochs=d.epochs, shuffle_buffer=d.shuffle_buffer, on_error=d.on_error,
                  too_long=d.too_long, num_workers=d.num_workers, caption_prompt=d.caption_prompt, root=PACKAGE_ROOT,
                  skips=skips, limits=d.limits)
    if d.sources:
        sources = [dict(s, path=resolve_path(s["path"])) for s in d.sources]
        per_step = rc.train.global_batch // dp_size  # what a source's schedule counts steps in
        return Mixture(sources=mixture_from_dicts(sources), samples_per_step=per_step, **common)
    return SampleStream(path=resolve_path(d.path), **common)
