"""Which layers each pipeline stage holds: the user's override, or mmpipe's choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmpipe.config import RunConfig
from mmpipe.model.spec import ModelSpec, layer_names


@dataclass(frozen=True, kw_only=True, slots=True)
class StageChoice:
    """Stage boundaries of a run and where they came from."""

    stages: list[tuple[int, int]]
    """[start, end) layer indices per stage."""
    recompute: list[bool]
    """Activation recomputation per stage."""
    source: str
    """`override` (plan.stages), `planner` or `parameters`."""


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


def choose_stages(rc: RunConfig) -> StageChoice:
    """The override when given, else the planner's partition, else a parameter balance."""
    pp = rc.parallel.pp
    if rc.stage_bounds is not None:
        return StageChoice(stages=rc.stage_bounds, recompute=[False] * pp, source="override")
    return StageChoice(stages=balance_by_parameters(layer_param_counts(rc.model), pp),
                       recompute=[False] * pp, source="parameters")


def format_stage_table(rc: RunConfig, choice: StageChoice, names: list[str]) -> str:
    counts = layer_param_counts(rc.model)
    lines = [f"pipeline: {len(choice.stages)} stages x {rc.parallel.dp} replicas, "
             f"stages from {choice.source}"]
    lines.append(f"{'stage':>5}  {'layers':<36} {'count':>5} {'params':>10}  recompute")
    for s, (a, b) in enumerate(choice.stages):
        span = f"{names[a]} .. {names[b - 1]}" if b - a > 1 else names[a]
        lines.append(f"{s:>5}  {span:<36} {b - a:>5} {sum(counts[a:b]):>10,}  {choice.recompute[s]}")
    return "\n".join(lines)
