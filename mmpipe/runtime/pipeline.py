"""DeepSpeed pipeline assembly: explicit stage boundaries, lazily built layers, one config dict."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from mmpipe.model.layers import build_layer, token_loss
from mmpipe.model.spec import ModelSpec, is_trainable, layer_names


class _LayerFromName(nn.Module):
    """LayerSpec wants an nn.Module class; this one builds the named mmpipe layer instead, so
    each rank constructs only the layers of its own stage (a Hugging Face model's layer also
    reads only its own tensors from the checkpoint)."""

    def __new__(cls, spec: ModelSpec, name: str, seed: int, image_token: int, audio_token: int):  # type: ignore[misc]
        if spec.hf is not None:
            from mmpipe.model.hf.build import build_layer as build_hf_layer

            return build_hf_layer(spec, name, seed=seed)
        return build_layer(spec, name, seed=seed, image_token=image_token, audio_token=audio_token)


class StagedPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries are given, not computed by DeepSpeed."""

    def __init__(self, *, layers: list[LayerSpec], bounds: list[int], **kwargs):
        self._mmpipe_bounds = list(bounds)
        super().__init__(layers=layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - DeepSpeed hook
        self.parts = list(self._mmpipe_bounds)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec:
    """Everything needed to build the pipeline on one rank."""

    model: ModelSpec
    """Architecture."""
    stages: tuple[tuple[int, int], ...]
    """[start, end) layer indices of each stage."""
    seed: int
    """Initial weights depend on (seed, layer name) only."""
    image_token: int
    """Token id of an image placeholder."""
    audio_token: int
    """Token id of an audio placeholder."""
    trainable: tuple[str, ...] = ("all",)
    """Component prefixes that train; the rest is frozen."""
    recompute: tuple[bool, ...] = ()
    """Activation recomputation per stage (one layer per checkpoint)."""


def _layer_specs(p: PipelineSpec) -> list[LayerSpec]:
    """One LayerSpec per layer; a tied LM head and input embedding (transformers'
    tie_word_embeddings) become DeepSpeed TiedLayerSpecs of one module: built once per stage that
    holds either, its weight broadcast at start and its gradient all-reduced between those stages."""
    tie = None
    if p.model.hf is not None:
        from mmpipe.model.hf.build import tied_embedding

        tie = tied_embedding(p.model)
    specs: list[LayerSpec] = []
    for n in layer_names(p.model):
        if tie is not None and n in tie.layers:
            owner = tie.layers[0]
            specs.append(TiedLayerSpec(tie.key, _LayerFromName, p.model, owner, p.seed, p.image_token, p.audio_token,
                                       forward_fn=None if n == owner else tie.head_forward,
                                       tied_weight_attr=[tie.weight_attr]))
        else:
            specs.append(LayerSpec(_LayerFromName, p.model, n, p.seed, p.image_token, p.audio_token))
    return specs


def build_pipeline_module(p: PipelineSpec) -> StagedPipelineModule:
    specs = _layer_specs(p)
    bounds = [s for s, _ in p.stages] + [p.stages[-1][1]]
    module = StagedPipelineModule(
        layers=specs, bounds=bounds, num_stages=len(p.stages), loss_fn=token_loss,
        partition_method="uniform", dynamic_shape=True,
    )
    if p.recompute and p.recompute[module.stage_id]:
        module.activation_checkpoint_interval = 1  # recompute every layer of this stage in backward
    layers = [f for f in module.forward_funcs if isinstance(f, nn.Module)] + list(module.tied_modules.values())
    for layer in layers:
        train = is_trainable(getattr(layer, "name", ""), p.trainable)
        fixed = getattr(layer, "frozen_params", frozenset())  # frozen by the transformers module itself
        for name, param in layer.named_parameters():
            param.requires_grad_(train and name not in fixed)
    return module


def deepspeed_config(*, micro_batches: int, dp: int) -> dict:
    """The one DeepSpeed config dict of a run (fp32; the optimizer is passed in; clipping is
    done by GlobalGradClip across stages, so DeepSpeed's own per-stage clipping stays off)."""
    return {
        "train_batch_size": micro_batches * dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
    }


def lr_lambda(step: int, *, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params, *, lr: float, weight_decay: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """The optimizer of one stage. A stage with nothing to train (e.g. frozen encoders under
    train.trainable=[llm]) still steps with the others, over an empty placeholder parameter."""
    trainable = [p for p in params if p.requires_grad] or [torch.nn.Parameter(torch.zeros(0))]
    if kind == "sgd":
        return torch.optim.SGD(trainable, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8)


def fix_buffer_reuse(engine) -> None:
    """Make the engine's receive buffers dtype-aware.

    PipelineEngine._allocate_or_extend_buffers caches one buffer per tuple index and reuses it
    whenever it is large enough, whatever its dtype. A middle stage receives both activations
    (index 0 is our int64 token ids) and gradients (index 0 is a float) through that cache, so
    with three or more stages it would receive ids into a float buffer and gloo aborts with
    "Received data size doesn't match expected size". Keying the cache by (index, dtype) keeps
    DeepSpeed's reuse while never handing out a buffer of the wrong type.
    """
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def allocate(idx: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape) if shape else 1
        buf = cache.get((idx, dtype))
        if buf is None or buf.numel() < numel:
            buf = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
            cache[(idx, dtype)] = buf
            return buf
        return buf.flatten()[:numel].view(shape)

    engine._allocate_or_extend_buffers = allocate


class GlobalGradClip:
    """Clip by the gradient norm of the whole model, across all pipeline stages.

    DeepSpeed's fp32 path clips each stage by its own norm (its model-parallel group is the
    tensor-slice group, not the pipeline), which is not what a single-process run would do.
    This runs as an optimizer step pre-hook, after the data-parallel gradient reduction: each
    stage sums its squared gradients, one all-reduce over the pipeline group gives the norm.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_norm: float, group, device=None) -> None:
        self.max_norm = max_norm
        self.group = group
        self.device = device
        self.last_norm = 0.0
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.register_step_pre_hook(lambda *_: self())

    def __call__(self) -> None:
        import torch.distributed as dist

        grads = [p.grad for p in self._params if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self._params:  # a tied weight's copies on later stages count once (DeepSpeed marks them)
            if p.grad is not None and not getattr(p, "ds_pipe_replicated", False):
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self.group)
        norm = float(sq.sqrt())
        self.last_norm = norm
        if self.max_norm > 0 and norm > self.max_norm:
            coef = self.max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
