"""Static memory of a run, per pipeline stage, before anything is launched.

Parameter counts are exact: they are the element counts of each layer's tensors in the
meta-device model (no memory used). Bytes per parameter default to an fp32 run with AdamW
under ZeRO-0 (fp32 weights, fp32 gradients, two fp32 moments); the runtime passes the run's
own (`planner.precision.TrainingPrecision`: precision, ZeRO sharding over the replicas,
optimizer). Activations depend on the micro-batches and are the planner's
part (`planner/cost.py`); add its figure for the whole picture.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from mmpipe.model.hf.build import tied_embedding
from mmpipe.model.hf.skeleton import owned_keys, skeleton
from mmpipe.model.lora import layer_modules, matched_modules, tied_head
from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec, is_trainable, layer_names


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Static bytes one pipeline stage holds."""

    stage: int
    """Stage index."""
    layers: tuple[str, ...]
    """Its layers."""
    params: int
    """Parameters it holds (a tied embedding counts on every stage that holds a copy)."""
    trainable: int
    """Of which train."""
    bytes: int
    """Weights + gradients + optimizer states."""
    largest_layer_bytes: int
    """Weights of its largest layer (what loading holds in flight beyond the weights)."""


def layer_params(spec: ModelSpec) -> dict[str, int]:
    """Exact parameter count of every pipeline layer (a tied head counts its embedding)."""
    model = skeleton(spec.hf)
    sizes = {k: v.numel() for k, v in model.state_dict().items()}
    out = {name: sum(sizes[k] for k in owned_keys(spec, name).values()) for name in layer_names(spec)}
    if tied_embedding(spec) is not None:
        out["llm.head"] = out["llm.embed"]
    return out


def estimate_memory(spec: ModelSpec, *, stages: Sequence[tuple[int, int]], trainable: Sequence[str] = ("all",),
                    weight_bytes: float = 4, grad_bytes: float = 4, optimizer_bytes: float = 8,
                    lora: LoraSpec = NO_LORA) -> list[StageMemory]:
    """Static memory of each stage ([start, end) layer ranges, as plan.stages); a layer with
    adapters (`lora`) trains only them."""
    names = layer_names(spec)
    counts = layer_params(spec)
    frozen = _frozen_params(spec)
    adapters = adapter_counts(spec, lora)
    trainable = tuple(trainable)
    out = []
    for i, (start, end) in enumerate(stages):
        layers = names[start:end]
        params = sum(counts[n] + adapters.get(n, 0) for n in layers)
        train = sum(counts[n] - frozen.get(n, 0) for n in layers
                    if is_trainable(n, trainable) and not lora.adapts(n)) + sum(adapters.get(n, 0) for n in layers)
        if tied_embedding(spec) is not None and "llm.embed" in layers and "llm.head" in layers:
            params -= counts["llm.head"]  # one module on the stage
            if is_trainable("llm.head", trainable) and not lora.adapts("llm.head"):
                train -= counts["llm.head"]
        total = params * weight_bytes + train * (grad_bytes + optimizer_bytes)
        out.append(StageMemory(stage=i, layers=tuple(layers), params=params, trainable=train, bytes=int(total),
                               largest_layer_bytes=int(max((counts[n] for n in layers), default=0) * weight_bytes)))
    return out


@functools.lru_cache(maxsize=8)
def adapter_counts(spec: ModelSpec, lora: LoraSpec) -> dict[str, int]:
    """Adapter parameters of each layer LoRA adapts: r x (in + out) of each matched Linear, found
    on the meta-device model as the runtime finds them on a layer (cached: the pre-launch check
    estimates several partitions; read it, do not change it)."""
    if not lora.active:
        return {}
    out = {}
    for name in layer_names(spec):
        if not lora.adapts(name) or (name == "llm.head" and tied_head(spec)):  # a tied head is the embedding
            continue
        holder = layer_modules(spec, name)
        out[name] = sum(lora.r * (holder.get_submodule(local).in_features + holder.get_submodule(local).out_features)
                        for local in matched_modules(holder, spec, name, lora))
    return out


def _frozen_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters transformers' modules keep frozen (e.g. Qwen2-Audio's position table), per layer."""
    model = skeleton(spec.hf)
    fixed = {k: p.numel() for k, p in model.named_parameters() if not p.requires_grad}
    return {n: sum(fixed.get(k, 0) for k in owned_keys(spec, n).values()) for n in layer_names(spec)}


def check_memory(estimates: Sequence[StageMemory], *, budget_bytes: int, what: str = "per process") -> None:
    """Raise a one-line ValueError when a stage's static memory exceeds the budget."""
    for e in estimates:
        if e.bytes > budget_bytes:
            raise ValueError(
                f"stage {e.stage} ({e.layers[0]}..{e.layers[-1]}) needs {e.bytes / 2**30:.1f} GiB for weights, "
                f"gradients and optimizer states ({e.params / 1e9:.2f} B parameters, {e.trainable / 1e9:.2f} B "
                f"training) but {budget_bytes / 2**30:.1f} GiB is available {what}; use more pipeline stages "
                f"(parallel.pp) or train fewer layers (train.trainable)")
