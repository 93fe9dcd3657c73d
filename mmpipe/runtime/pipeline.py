"""DeepSpeed pipeline assembly: explicit stage boundaries, lazily built layers, the optimizer, and
the workarounds of DeepSpeed internals (each checks the DeepSpeed release it was tested with)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from mmpipe.config import TrainConfig
from mmpipe.model import kernels
from mmpipe.model.layers import build_layer, token_loss
from mmpipe.model.lora import add_adapters, trains
from mmpipe.model.spec import NO_LORA, LoraSpec, ModelSpec, is_trainable, layer_names
from mmpipe.runtime.dsconfig import require_tested_deepspeed


class _LayerFromName(nn.Module):
    """LayerSpec wants an nn.Module class; this one builds the named mmpipe layer instead, so
    each rank constructs only the layers of its own stage (a Hugging Face model's layer also
    reads only its own tensors from the checkpoint)."""

    def __new__(cls, spec: ModelSpec, name: str, seed: int, image_token: int, audio_token: int,  # type: ignore[misc]
                video_token: int = -1, lora: LoraSpec = NO_LORA):
        if spec.hf is not None:
            from mmpipe.model.hf.build import build_layer as build_hf_layer

            layer = build_hf_layer(spec, name, seed=seed)
        else:
            layer = build_layer(spec, name, seed=seed, image_token=image_token, audio_token=audio_token,
                                video_token=video_token)
        add_adapters(layer, spec, name, lora, seed=seed)
        return layer


class StagedPipelineModule(PipelineModule):
    """A PipelineModule whose stage boundaries are given, not computed by DeepSpeed."""

    def __init__(self, *, layers: list[LayerSpec], bounds: list[int], **kwargs):
        self._mmpipe_bounds = list(bounds)
        super().__init__(layers=layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - DeepSpeed hook
        self.parts = list(self._mmpipe_bounds)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def media_tokens(tok) -> dict[str, int]:
    """The placeholder ids the embedding layer replaces, as build_layer takes them
    (`image_token`, `audio_token`, `video_token`); -1 where the tokenizer (a checkpoint's
    templater) has no token for a medium the model lacks."""
    ids = (getattr(tok, "image_id", None), getattr(tok, "audio_id", None), getattr(tok, "video_id", None))
    return {f"{kind}_token": -1 if t is None else t for kind, t in zip(("image", "audio", "video"), ids)}


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
    video_token: int = -1
    """Token id of a video placeholder (-1: none)."""
    trainable: tuple[str, ...] = ("all",)
    """Component prefixes that train in full; the rest is frozen (but for adapters)."""
    lora: LoraSpec = NO_LORA
    """Adapters (train.lora); the layers they adapt keep their base weights frozen."""
    recompute: tuple[bool, ...] = ()
    """Activation recomputation per stage (one layer per checkpoint)."""
    attention: str = "auto"
    """Attention kernel of packed micro-batches (train.attention; model/kernels.py)."""


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
                                       p.video_token, p.lora, forward_fn=None if n == owner else tie.head_forward,
                                       tied_weight_attr=[tie.weight_attr]))
        else:
            specs.append(LayerSpec(_LayerFromName, p.model, n, p.seed, p.image_token, p.audio_token, p.video_token,
                                   p.lora))
    return specs


def build_pipeline_module(p: PipelineSpec) -> StagedPipelineModule:
    kernels.use(p.attention)  # one kernel per process: the layers' attention function reads it
    specs = _layer_specs(p)
    bounds = [s for s, _ in p.stages] + [p.stages[-1][1]]
    module = StagedPipelineModule(
        layers=specs, bounds=bounds, num_stages=len(p.stages), loss_fn=token_loss,
        partition_method="uniform", dynamic_shape=True,
    )
    if p.recompute and p.recompute[module.stage_id]:
        module.activation_checkpoint_interval = 1  # recompute every layer of this stage in backward
        # torch's non-reentrant checkpoint, not DeepSpeed's reentrant default: a reentrant one
        # gives its outputs a gradient only through inputs that require one, so a first stage
        # (its inputs are data) silently got no gradient (the tiny model's global gradient norm
        # 2.83 instead of 4.36) and the last stage's loss had no graph ("loss must be a scalar
        # tensor" in backward); the non-reentrant one keeps the graph as it is without recompute.
        module.activation_checkpoint_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              use_reentrant=False)
    layers = [f for f in module.forward_funcs if isinstance(f, nn.Module)] + list(module.tied_modules.values())
    for layer in layers:
        _set_trainable(layer, p)
    if not any(param.requires_grad for param in module.parameters()):
        _add_frozen_stage_anchor(module)
    return module


def _set_trainable(layer: nn.Module, p: PipelineSpec) -> None:
    """requires_grad of each of a layer's parameters under train.trainable and train.lora."""
    name_of = getattr(layer, "name", "")
    full = is_trainable(name_of, p.trainable)
    fixed = getattr(layer, "frozen_params", frozenset())  # frozen by the transformers module itself
    for name, param in layer.named_parameters():
        param.requires_grad_(trains(name_of, name, full=full, lora=p.lora) and name not in fixed)


def build_layers(p: PipelineSpec, names: list[str], device) -> list[nn.Module]:
    """The named layers as a stage builds them (weights, adapters, what trains), outside any
    PipelineModule: a spread tower's replica on the ranks of stages other than 0."""
    out = []
    for n in names:
        layer = _LayerFromName(p.model, n, p.seed, p.image_token, p.audio_token, p.video_token, p.lora)
        _set_trainable(layer, p)
        out.append(layer.to(device))
    return out


def _add_frozen_stage_anchor(module: nn.Module) -> None:
    """A stage with nothing to train (e.g. frozen encoders under train.trainable=[llm]) still
    steps with the others, because DeepSpeed's optimizer step holds collectives over the
    pipeline and the replicas. Its bf16/fp16/ZeRO wrappers own only trainable, non-empty
    parameters of the module, and BF16_Optimizer's norm fails on a stage without any gradient
    (get_global_norm_of_tensors stacks an empty list). So the stage gets one parameter, 0, that
    no layer uses, with a zero gradient put back before every forward (the step sets gradients
    to None): its update is 0. It is in no layer checkpoint; it is always 0."""
    anchor = nn.Parameter(torch.zeros(1))
    module.register_parameter("frozen_stage_anchor", anchor)

    def zero_grad(*_) -> None:
        if anchor.grad is None:
            anchor.grad = torch.zeros_like(anchor)

    module.register_forward_pre_hook(zero_grad)


def lr_lambda(step: int, *, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


ADAMW_WHY = ("shipped with torch, no JIT build; not DeepSpeed's FusedAdam, which is compiled at start-up "
             "and fails on CUDA arch lists such as '9.0a' (Hopper)")
"""Why adamw is torch's fused AdamW on every device (said in the start-up line)."""


def make_optimizer(params, *, lr: float, weight_decay: float, kind: str = "adamw",
                   cuda: bool = False) -> torch.optim.Optimizer:
    """The optimizer of one stage, handed to deepspeed.initialize (which wraps it for bf16,
    fp16 and ZeRO-1). adamw: torch AdamW's fused update, on CUDA too; sgd: torch SGD without
    momentum.

    Not DeepSpeed's FusedAdam on CUDA: it is a JIT-built extension whose build parses
    TORCH_CUDA_ARCH_LIST and fails on Hopper's "9.0a" (`invalid literal for int() with base 10:
    '0a'`), costs minutes of compiling per machine and needs nvcc. torch's fused AdamW is one
    multi-tensor kernel shipped with torch, and under bf16/fp16/ZeRO-1 DeepSpeed hands it a single
    flat fp32 partition per group, so the two do the same work. On CPU the fused update is a
    quarter of the multi-tensor foreach update's time (5 against 22 ms for 4.5 M parameters on
    one thread). `cuda` is kept for callers; the choice no longer depends on it."""
    del cuda
    trainable = [p for p in params if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(trainable, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), eps=1e-8,
                             fused=True)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MASTER_COPIES = ("fp32_groups_flat_partition", "single_partition_of_fp32_groups", "fp32_groups_flat")
"""Where DeepSpeed's wrappers keep the master copy of the weights (BF16_Optimizer,
DeepSpeedZeroOptimizer, FP16_Optimizer)."""


def describe_precision(engine) -> str:
    """The precision as the engine really trains, read from it (not from the config): the
    weights' dtype, the optimizer wrapper's master copy, DeepSpeed's gradient-accumulation dtype
    (`engine.get_data_types()`, which chooses its optimizer wrapper) and an fp16 loss scale."""
    weights = next((p.dtype for p in engine.module.parameters()), torch.float32)
    _, accumulation = engine.get_data_types()
    master = None
    for attr in _MASTER_COPIES:
        copies = [t for t in getattr(engine.optimizer, attr, None) or [] if torch.is_tensor(t)]
        if copies:
            master = copies[0].dtype
            break
    if weights == accumulation == torch.float32 and master in (None, torch.float32):
        return "fp32"
    parts = [f"{_DTYPE_NAMES.get(master, master)} master weights" if master is not None else "no master copy",
             f"{_DTYPE_NAMES.get(accumulation, accumulation)} gradient accumulation"]
    if engine.fp16_enabled():
        parts.append("dynamic loss scale" if engine.dynamic_loss_scale() else f"loss scale {engine.loss_scale():g}")
    return f"{_DTYPE_NAMES.get(weights, weights)} ({', '.join(parts)})"


def describe_training(train: TrainConfig, dp: int, engine, basic: torch.optim.Optimizer, *,
                      mmpipe_clips: bool, blocks: bool = False) -> str:
    """One start-up line: precision, ZeRO stage, optimizer and clipping as they took effect (`blocks`:
    the model's image blocks, which the `auto` kernel runs without flash-attn)."""
    precision = describe_precision(engine)
    stage = engine.zero_optimization_stage()
    zero = f"ZeRO-{stage}"
    if stage == 1:
        zero += f" (optimizer state sharded over {dp} replicas)" if dp > 1 else " (one replica: nothing to shard)"
    kind = type(basic)
    opt = f"{kind.__module__.split('.')[0]} {kind.__name__}" + next(
        (f" ({flag})" for flag in ("fused", "foreach") if basic.defaults.get(flag)), "")
    if engine.optimizer is not basic:
        opt += f" in DeepSpeed {type(engine.optimizer).__name__}"
    clip = "off"
    if train.grad_clip > 0:
        clip = f"global norm {train.grad_clip:g} ({'mmpipe' if mmpipe_clips else 'DeepSpeed'})"
    attention = kernels.describe(train.attention, cuda=str(engine.device).startswith("cuda"), precision=train.precision,
                                 blocks=blocks)
    line = f"precision: {precision} | {zero} | optimizer: {opt} | clipping: {clip} | attention: {attention}"
    if isinstance(basic, torch.optim.AdamW) and basic.defaults.get("fused"):
        line += f"\nAdamW: torch's fused kernel ({ADAMW_WHY})"
    lora = train.lora
    if lora.active:
        line += (f"\nLoRA (peft): r={lora.r}, alpha={lora.alpha:g}, dropout={lora.dropout:g} on "
                 f"{', '.join(lora.parts)} modules {', '.join(lora.target_modules)} (base weights frozen); "
                 f"trained in full: {', '.join(train.trainable) or 'nothing else'}")
    return line


def fix_buffer_reuse(engine) -> None:
    """Make the engine's receive buffers dtype-aware.

    PipelineEngine._allocate_or_extend_buffers caches one buffer per tuple index and reuses it
    whenever it is large enough, whatever its dtype. A middle stage receives both activations
    (index 0 is our int64 token ids) and gradients (index 0 is a float) through that cache, so
    with three or more stages it would receive ids into a float buffer and gloo aborts with
    "Received data size doesn't match expected size". Keying the cache by (index, dtype) keeps
    DeepSpeed's reuse while never handing out a buffer of the wrong type.
    """
    require_tested_deepspeed()
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


def fix_zero_unused_grads(engine) -> None:
    """Give every trainable parameter a gradient before ZeRO-1 reduces them over the replicas.

    Under a pipeline, DeepSpeedZeroOptimizer.reduce_gradients (zero/stage_1_and_2.py, called
    by PipelineEngine._exec_reduce_grads) buckets only the parameters that have a gradient.
    Which ones do depends on the data: a replica whose step held no audio clip has none for
    the audio encoder, so the replicas' all-reduce buckets differ in size and gloo aborts with
    "Received data size doesn't match expected size" (NCCL would hang or mix buffers).
    DeepSpeed's own ZeRO-0 reduction gives such parameters zero gradients first
    (DeepSpeedEngine._get_gradients_for_reduction); this does the same for ZeRO-1, on this
    engine's optimizer instance only. (BF16_Optimizer reduces whole flat buffers: no issue.)
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    require_tested_deepspeed()
    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        return
    params = [p for group in opt.bit16_groups for p in group]
    reduce = opt.reduce_gradients

    def reduce_all(*args, **kwargs):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return reduce(*args, **kwargs)

    opt.reduce_gradients = reduce_all


class GlobalGradClip:
    """Clip by the gradient norm of the whole model, across all pipeline stages (fp32 without
    ZeRO, the one mode in which DeepSpeed steps the bare torch optimizer).

    DeepSpeed's own clipping in that mode (DeepSpeedEngine.clip_fp32_gradients ->
    runtime/utils.py clip_grad_norm_) counts a gradient only on the rank whose
    `mpu.get_model_parallel_rank()` is 0. That test is meant to skip tensor-parallel copies, but
    the pipeline grid's "model-parallel" group is the whole pipeline, so only stage 0's
    gradients enter the norm, and every stage is clipped by stage 0's norm. mmpipe sets
    DeepSpeed's clipping to 0 in this mode and runs this instead, as an optimizer step pre-hook
    after the data-parallel gradient reduction: each stage sums its squared gradients, one
    all-reduce over the pipeline group gives the norm. A non-finite norm (a non-finite loss
    makes one) withholds the step's update on every stage.

    (DeepSpeed's ZeRO-1 wrappers, which bf16 and fp16 always use, test the tensor-parallel rank
    instead and clip globally; see dsconfig.deepspeed_clips.)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_norm: float, group, device=None) -> None:
        require_tested_deepspeed()
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
        if not math.isfinite(norm):
            # Withhold the whole update. torch optimizers pass over parameters without a
            # gradient, so weights, moments and step counts stay exactly as they were; zeroed
            # gradients would not do that (AdamW still moves by its momentum and decay).
            for p in self._params:
                p.grad = None
            return
        if self.max_norm > 0 and norm > self.max_norm:
            coef = self.max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)


def loss_scale(engine) -> float:
    """The loss scale the next backward runs with (1 outside fp16)."""
    scale = getattr(engine.optimizer, "loss_scale", None) if engine.fp16_enabled() else None
    return float(scale) if scale else 1.0


def deepspeed_grad_norm(engine) -> float:
    """The global pre-clip gradient norm DeepSpeed's optimizer wrapper computed in its last
    step (BF16_Optimizer, DeepSpeedZeroOptimizer; loss scale divided out); inf after an fp16
    overflow, when the step was skipped."""
    norm = engine.get_global_grad_norm()
    return float("nan") if norm is None else float(norm)
