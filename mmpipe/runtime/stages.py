"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmpipe.config import PROJECT_ROOT, RunConfig, hardware_spec, resolve_path
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import plan_stages
from mmpipe.planner.features import SampleFeatures, features


@dataclass(frozen=True, kw_only=True, slots=True)
class StageChoice:
    """Stage boundaries of a run and where they came from."""

    stages: list[tuple[int, int]]
    """[start, end) layer indices per stage."""
    recompute: list[bool]
    """Activation recomputation per stage."""
    source: str
    """`override` (plan.stages) or `planner (<policy>)`."""


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of each layer, counted on the meta device (no memory, any model size)."""
    from mmpipe.model.layers import build_layer

    counts = []
    with torch.device("meta"):
        for name in layer_names(spec):
            layer = build_layer(spec, name, seed=0, image_token=0, audio_token=0)
            counts.append(sum(p.numel() for p in layer.parameters()))
    return counts


def balance_by_parameters(counts: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous non-empty split minimising the largest stage's parameter count (DeepSpeed's
    `parameters` method, solved exactly by dynamic programming)."""
    n = len(counts)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-stage sum covering layers [0, i) with k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def workload_sample(rc: RunConfig, *, steps: int = 4) -> list[SampleFeatures]:
    """Features of the first `steps` global steps, read from the shards' metadata only.

    Every rank computes the same list (same shards, same order), so every rank derives the
    same stage plan without talking to the others.
    """
    from mmpipe.data.reader import iter_meta

    per_replica = rc.train.global_batch // rc.parallel.dp
    out: list[SampleFeatures] = []
    for r in range(rc.parallel.dp):
        metas = iter_meta(path=resolve_path(rc.data.path), dp_rank=r, dp_size=rc.parallel.dp,
                          seed=rc.train.seed, epochs=1, shuffle_buffer=rc.data.shuffle_buffer,
                          root=PROJECT_ROOT, spec=rc.model)
        for n, (_, meta) in enumerate(metas):
            if n >= per_replica * steps:
                break
            out.append(features(rc.model, meta))
    return out


def choose_stages(rc: RunConfig) -> StageChoice:
    """The user's override when given (it always wins), else the policy's partition, planned
    on the first steps of the real data with the configured hardware's cost model."""
    pp = rc.parallel.pp
    if rc.stage_bounds is not None:
        return StageChoice(stages=rc.stage_bounds, recompute=[False] * pp, source="override")
    plan = plan_stages(model=rc.model, hardware=hardware_spec(rc), pp=pp, dp=rc.parallel.dp,
                       trainable=rc.train.trainable, sample=workload_sample(rc),
                       micro_batches=rc.train.micro_batches, policy=rc.plan.policy)
    return StageChoice(stages=list(plan.stages), recompute=list(plan.recompute),
                       source=f"planner ({rc.plan.policy})")


def format_stage_table(rc: RunConfig, choice: StageChoice, names: list[str]) -> str:
    counts = layer_param_counts(rc.model)
    lines = [f"pipeline: {len(choice.stages)} stages x {rc.parallel.dp} replicas, "
             f"stages from {choice.source}"]
    lines.append(f"{'stage':>5}  {'layers':<36} {'count':>5} {'params':>10}  recompute")
    for s, (a, b) in enumerate(choice.stages):
        span = f"{names[a]} .. {names[b - 1]}" if b - a > 1 else names[a]
        lines.append(f"{s:>5}  {span:<36} {b - a:>5} {sum(counts[a:b]):>10,}  {choice.recompute[s]}")
    return "\n".join(lines)
