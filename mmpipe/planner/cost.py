"""Cost model of the layers: FLOPs, parameters, activation and boundary bytes of every
pipeline layer, for a model, a hardware, a trainable set and a dp degree.

Each layer reads one stream of a micro-batch (`mmpipe.planner.samples`) with `T` tokens and a
sum of squared sequence lengths `S2`. A layer's forward time is

    overhead(kind) + (lin * T + attn * S2) / (peak_flops * efficiency(kind, T))

with `lin` = 2 x (matmul parameters) FLOPs per token and `attn` = 4h (bidirectional) or 2h
(causal) FLOPs per squared position (docs/spec.md section 6). Backward is 2x forward for a
trainable layer (1x input gradient + 1x weight gradient), 1x for a frozen layer that
gradients cross on their way to a trainable one upstream, 0 for a frozen layer with nothing
trainable upstream (which also keeps no activations). Recompute adds one forward to backward.

Every time constant comes from `HardwareSpec`; the bytes of weights, gradients, optimizer
states and activations follow the run's `TrainingPrecision` (precision, ZeRO stage,
optimizer), and `memory_headroom` is the share of usable memory no plan may fill.
`mmpipe.planner.stage_cost` sums these figures per stage and prices micro-batches; the lower
bound of a step is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.model.spec import NO_LORA, TRAINABLE_PREFIXES, LoraSpec, ModelSpec, VisionSpec, is_trainable, layer_names
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.precision import TrainingPrecision
from mmpipe.planner.samples import STREAMS, SampleTable

DEFAULT_PRECISION = TrainingPrecision()
"""bf16 mixed precision, ZeRO-1, AdamW: the run docs/spec.md section 6 prices."""
DEFAULT_HEADROOM = 0.08
"""plan.memory_headroom's default: the share of usable memory no plan fills (docs/planner.md
says why 8%)."""
KINDS = ("vision.embed", "vision.block", "vision.proj", "audio.embed", "audio.block",
         "audio.proj", "llm.embed", "llm.block", "llm.norm", "llm.head", "vision.window")
"""Layer kinds with a cost; any other layer name is free. `vision.window` is a vision block
that attends within windows (model.vision.window, full_blocks)."""
KIND_STREAM = {"vision.embed": 0, "vision.block": 0, "vision.proj": 1, "audio.embed": 2,
                "audio.block": 2, "audio.proj": 3, "llm.embed": 4, "llm.block": 4,
                "llm.norm": 4, "llm.head": 4, "vision.window": 5}
"""The stream (index into STREAMS) each layer kind reads."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """Cost figures of one pipeline layer, independent of any micro-batch."""

    name: str
    """Layer name, e.g. `llm.block.3`."""
    kind: str
    """`<component>.<kind>` without index (`llm.block`), or `other` for a free layer."""
    params: int
    """Parameter count."""
    lin_flops: float
    """Forward FLOPs per token of the layer's stream."""
    attn_flops: float
    """Forward FLOPs per squared sequence position (0 for non-attention layers)."""
    trainable: bool
    """The layer's weights train (in full)."""
    bwd_factor: float
    """Backward time in forwards: 2 trainable, 1 frozen but crossed, 0 otherwise; a layer with
    adapters 1 plus its adapters' share of the forward (they compute both gradients)."""
    act_bytes: float
    """Activation bytes kept per token of the stream without recompute (0 if none kept)."""
    recompute_bytes: float
    """Activation bytes kept per token under recompute."""
    adapter_params: int = 0
    """LoRA adapter parameters (trained; `params` are then the frozen base weights)."""

    @property
    def learns(self) -> bool:
        """Something in the layer trains: its weights, or its adapters."""
        return self.trainable or self.adapter_params > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """A model's layers costed on a hardware for a trainable set and dp degree."""

    model: ModelSpec
    """The architecture."""
    hardware: HardwareSpec
    """Device figures and every cost constant."""
    trainable: tuple[str, ...]
    """Component prefixes trained in full."""
    lora: LoraSpec
    """Adapters (train.lora): the layers they adapt train only them."""
    dp: int
    """Data-parallel replicas (ZeRO-1 shards optimizer states over them)."""
    precision: TrainingPrecision
    """How the run stores weights, gradients, optimizer states and activations."""
    memory_headroom: float
    """Share of the usable memory no plan may fill (plan.memory_headroom)."""
    layers: tuple[LayerCost, ...]
    """One entry per pipeline layer, in layer_names order."""
    cut_fwd_bytes: np.ndarray
    """[L+1, K] bytes per stream token crossing a cut before layer c, forward."""
    cut_bwd_bytes: np.ndarray
    """[L+1, K] bytes per stream token crossing a cut before layer c, backward."""

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def usable_bytes(self) -> float:
        """Bytes a plan may fill on one device: the hardware's usable memory less the
        headroom."""
        return self.hardware.usable_bytes * (1.0 - self.memory_headroom)

    def usable_text(self) -> str:
        """How much a plan may fill, for messages: `72 GB usable` (and the headroom, if any)."""
        text = f"{max(0.0, self.usable_bytes) / 1e9:.3g} GB usable"  # a size, never negative
        if self.memory_headroom:
            text += f" after plan.memory_headroom={self.memory_headroom:g}"
        return text

    def memory_text(self) -> str:
        """The device memory a plan starts from, for messages: `hardware.memory_gb=40`, and what a
        rank holds before its model where the hardware says (`hardware.reserved_gb`)."""
        hw = self.hardware
        text = f"hardware.memory_gb={hw.memory_gb:g}"
        if hw.reserved_gb:
            text += f", of which a rank holds {hw.reserved_gb:.3g} GB before its model: hardware.reserved_gb"
        return text

    def static_bytes(self, start: int, end: int) -> float:
        """Weights, gradients and optimizer states of layers [start, end), with the hardware's
        measured slack on top."""
        pr = self.precision
        return (1.0 + self.hardware.memory_slack) * sum(
            l.params * pr.param_bytes(trainable=l.trainable, dp=self.dp)
            + l.adapter_params * pr.param_bytes(trainable=True, dp=self.dp) for l in self.layers[start:end])


def layer_stream(name: str) -> int | None:
    """The stream (index into samples.STREAMS) layer `name` reads, None for a layer the cost
    model treats as free."""
    return KIND_STREAM.get(".".join(name.split(".")[:2]))


def validate_trainable(trainable: Sequence[str], model: ModelSpec, lora: LoraSpec = NO_LORA) -> tuple[str, ...]:
    """Check train.trainable against the model's layers; returns it as a tuple.

    Raises ValueError for an empty list without adapters, a name that matches no layer of the
    model, or adapters on a component the model lacks.
    """
    names = layer_names(model)
    valid = [p for p in TRAINABLE_PREFIXES
             if p == "all" or any(is_trainable(n, (p,)) for n in names)]
    trainable = tuple(str(t) for t in trainable)
    lora.check_parts(model)
    if not trainable and not lora.active:
        raise ValueError(f"train.trainable=[] trains nothing; use {_or_list(valid)}")
    for t in trainable:
        if t != "all" and not any(is_trainable(n, (t,)) for n in names):
            raise ValueError(f"train.trainable=[{','.join(trainable)}] names {t!r}, which matches "
                             f"no layer of model {model.name}; use {_or_list(valid)}")
    return trainable


def build_cost_model(*, model: ModelSpec, hardware: HardwareSpec, trainable: Sequence[str],
                     dp: int = 1, precision: TrainingPrecision = DEFAULT_PRECISION,
                     memory_headroom: float = 0.0, lora: LoraSpec = NO_LORA) -> CostModel:
    """Cost every layer of `model` on `hardware` with the given trainable prefixes.

    Args:
        lora: adapters (train.lora); an adapted layer's base weights are frozen (no weight
            gradient, no optimizer state), its adapters train (adapter_params).
        dp: data-parallel replicas (ZeRO-1 shards the optimizer side over them).
        precision: the run's precision, ZeRO stage and optimizer (default: the spec's bf16,
            ZeRO-1, AdamW).
        memory_headroom: share of the usable memory left unplanned (0 <= x < 1).
    """
    trainable = validate_trainable(trainable, model, lora)
    if dp < 1:
        raise ValueError(f"parallel.dp={dp} must be >= 1")
    check_headroom(memory_headroom)
    scale = precision.activation_scale * (1.0 + hardware.memory_slack)  # slack: a measured share on top
    names = layer_names(model)
    flags = [is_trainable(n, trainable) and not lora.adapts(n) for n in names]
    kinds = [_kind(n, model) for n in names]
    # A gradient crosses a layer when something trainable lies upstream in the data flow:
    # earlier layers of the same encoder, or (for the LLM) any encoder or earlier LLM layer.
    seen = {"vision": False, "audio": False, "llm": False}
    layers: list[LayerCost] = []
    for name, kind, train in zip(names, kinds, flags):
        comp = kind.split(".")[0]
        if comp == "llm":
            upstream = seen["vision"] or seen["audio"] or seen["llm"]
        else:
            upstream = seen.get(comp, False)
        factor = 2.0 if train else (1.0 if upstream else 0.0)
        params, lin, attn, width, is_block = _layer_figures(model, kind)
        adapter = adapter_params(model, kind, lora) if lora.adapts(name) else 0
        if adapter:  # base x + (alpha / r) B A x: the adapters' FLOPs on top; backward through the
            # frozen base once (the input gradient), through the adapters twice
            lin += 2.0 * adapter
            factor = 1.0 + 2.0 * adapter / lin
        if kind == "llm.head":
            act = scale * hardware.logits_bytes_per_vocab * model.llm.vocab
            rec = act
        elif is_block:
            act = scale * hardware.act_bytes_per_hidden * width
            rec = scale * hardware.recompute_bytes_per_hidden * width
        else:
            act = rec = scale * hardware.io_bytes_per_hidden * width if kind != "llm.embed" else 0.0
        keeps = factor > 0
        layers.append(LayerCost(name=name, kind=kind, params=params, lin_flops=lin,
                                attn_flops=attn, trainable=train, bwd_factor=factor,
                                act_bytes=act if keeps else 0.0,
                                recompute_bytes=rec if keeps else 0.0, adapter_params=adapter))
        if comp in seen and (train or adapter):
            seen[comp] = True
    fwd, bwd = _cut_bytes(model, precision.element_bytes, kinds, layers)
    return CostModel(model=model, hardware=hardware, trainable=trainable, lora=lora, dp=dp,
                     precision=precision, memory_headroom=float(memory_headroom),
                     layers=tuple(layers), cut_fwd_bytes=fwd, cut_bwd_bytes=bwd)


def check_headroom(memory_headroom: float) -> None:
    """plan.memory_headroom must be a fraction in [0, 1)."""
    if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, (int, float)) \
            or not 0.0 <= memory_headroom < 1.0:
        raise ValueError(f"plan.memory_headroom={memory_headroom!r} must be a fraction of usable "
                         f"memory in [0, 1), e.g. 0.08")


def _kind(name: str, model: ModelSpec) -> str:
    parts = name.split(".")
    kind = ".".join(parts[:2])
    if kind == "vision.block" and model.vision is not None and model.vision.windowed(int(parts[2])):
        return "vision.window"  # same weights and FLOPs per token; attention over its windows
    return kind if kind in KIND_STREAM else "other"


def _layer_figures(m: ModelSpec, kind: str) -> tuple[int, float, float, int, bool]:
    """(params, lin FLOPs/token, attn FLOPs/position^2, activation width, is a block)."""
    if kind.startswith("vision."):
        v = m.vision
        assert v is not None
        h = v.hidden
        if kind == "vision.embed":
            conv = v.channels * v.patch * v.patch * h
            fixed = v.resize in ("fixed", "anyres", "tiles")  # a learned table of one tile's positions
            pos = ((v.image_size // v.patch) ** 2 + int(v.cls_token)) * h if fixed else 0
            return conv + h + pos + v.position_table * h, 2.0 * conv, 0.0, h, False
        if kind in ("vision.block", "vision.window"):
            mlp = (3 if v.mlp_gated else 2) * h * v.mlp  # SwiGLU: gate, up, down
            mat = 4 * h * h + mlp
            return mat + 9 * h + v.mlp, 2.0 * mat, 4.0 * h, h, True
        # the projector, and Qwen3-VL's DeepStack mergers beside it (each as wide, with a norm over
        # its merged input), all reading the image-token stream
        mat, bias = _mlp(v.proj_in, v.proj)
        n = 1 + len(v.deepstack)
        return (n * (mat + bias) + 2 * v.proj_in * len(v.deepstack), n * 2.0 * mat, 0.0,
                n * m.llm.hidden, False)
    if kind.startswith("audio."):
        a = m.audio
        assert a is not None
        h = a.hidden
        if kind == "audio.embed":
            conv1, conv2 = 3 * a.mel_bins * h, 3 * h * h
            # conv1 runs at the mel frame rate (conv_stride frames per encoder position); a chunked
            # tower (Qwen2.5-Omni) adds fixed sinusoidal positions per chunk: no learned table
            positions = 0 if a.window else int(a.max_seconds * a.frames_per_s / a.conv_stride)
            return (conv1 + conv2 + 2 * h + positions * h,
                    2.0 * (conv1 * a.conv_stride + conv2), 0.0, h, False)
        if kind == "audio.block":
            mat = 4 * h * h + 2 * h * a.mlp
            return mat + 9 * h + a.mlp, 2.0 * mat, 4.0 * h, h, True
        mat, bias = _mlp(h, a.proj)
        return mat + bias, 2.0 * mat, 0.0, m.llm.hidden, False
    l = m.llm
    h = l.hidden
    if kind == "llm.embed":
        return l.vocab * h, 0.0, 0.0, h, False
    if kind == "llm.block":
        kvd = h // l.heads * l.kv_heads
        mat = 2 * h * h + 2 * h * kvd + 3 * h * l.mlp
        return mat + 2 * h + h + 2 * kvd, 2.0 * mat, 2.0 * h, h, True
    if kind == "llm.norm":
        return h, 0.0, 0.0, h, False
    if kind == "llm.head":
        return l.vocab * h, 2.0 * h * l.vocab, 0.0, h, False
    return 0, 0.0, 0.0, 0, False


def adapter_params(m: ModelSpec, kind: str, lora: LoraSpec) -> int:
    """LoRA parameters of one layer of `kind` whose component train.lora adapts: r x (in + out)
    of each adapted Linear. A decoder block's projections are named as in every supported
    decoder (q_proj ... down_proj) and counted where target_modules names them, an untied LM
    head where it names lm_head; a tower block is priced as if all its Linear layers (attention
    and MLP) were adapted, as the planner does not know each tower's module names; embeddings,
    norms and projectors carry none."""
    def picked(name: str) -> bool:
        if "all-linear" in lora.target_modules:  # PEFT's shorthand: every Linear but the output layer
            return name != "lm_head"
        return any(t == name or t.endswith("." + name) for t in lora.target_modules)

    r = lora.r
    if kind == "llm.block":
        l = m.llm
        h, kvd = l.hidden, l.hidden // l.heads * l.kv_heads
        shapes = {"q_proj": (h, h), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (h, h),
                  "gate_proj": (h, l.mlp), "up_proj": (h, l.mlp), "down_proj": (l.mlp, h)}
        return sum(r * (i + o) for n, (i, o) in shapes.items() if picked(n))
    if kind == "llm.head":
        return r * (m.llm.hidden + m.llm.vocab) if picked("lm_head") and not m.llm.tie_embeddings else 0
    if kind in ("vision.block", "vision.window") and m.vision is not None:
        v = m.vision
        return r * (4 * 2 * v.hidden + (3 if v.mlp_gated else 2) * (v.hidden + v.mlp))
    if kind == "audio.block" and m.audio is not None:
        a = m.audio
        return r * (4 * 2 * a.hidden + 2 * (a.hidden + a.mlp))
    return 0


def _mlp(width_in: int, widths: Sequence[int]) -> tuple[int, int]:
    mat = bias = 0
    for w in widths:
        mat += width_in * w
        bias += w
        width_in = w
    return mat, bias


def _cut_bytes(m: ModelSpec, b: int, kinds: list[str],
               layers: list[LayerCost]) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per stream token crossing the cut before each layer index, fwd and bwd, with `b`
    bytes per element (the run's precision)."""
    n = len(kinds)
    fwd = np.zeros((n + 1, len(STREAMS)))
    bwd = np.zeros((n + 1, len(STREAMS)))

    def span(prefix: str) -> tuple[int, int]:
        idx = [i for i, k in enumerate(kinds) if k.startswith(prefix)]
        return (idx[0], idx[-1]) if idx else (-1, -1)

    llm_embed = kinds.index("llm.embed")
    llm_head = kinds.index("llm.head")
    for comp, enc, s_pos, s_tok in (("vision", m.vision, 0, 1), ("audio", m.audio, 2, 3)):
        if enc is None:
            continue
        first, last = span(comp + ".")
        proj = kinds.index(comp + ".proj")
        train_upto = [any(l.learns for l in layers[first:c]) for c in range(n + 1)]
        for c in range(n + 1):
            if comp == "audio" and c <= first:
                # raw log-mel frames travel from the data-loading first stage to the encoder
                fwd[c, s_pos] += b * m.audio.mel_bins * m.audio.conv_stride if c > 0 else 0.0
            elif first < c <= proj:
                fwd[c, s_pos] += b * enc.hidden
                bwd[c, s_pos] += b * enc.hidden if train_upto[c] else 0.0
            elif proj < c <= llm_embed:
                fwd[c, s_tok] += b * m.llm.hidden
                bwd[c, s_tok] += b * m.llm.hidden if train_upto[c] else 0.0
    for c in range(llm_embed + 1, llm_head + 1):
        fwd[c, 4] += b * m.llm.hidden
        if any(l.learns for l in layers[:c]):
            bwd[c, 4] += b * m.llm.hidden
    if m.vision is not None and m.vision.deepstack:
        _deepstack_cut_bytes(m.vision, m.llm.hidden, b, [l.name for l in layers], layers, fwd, bwd)
    return fwd, bwd


def _deepstack_cut_bytes(v: VisionSpec, llm_hidden: int, b: int, names: list[str], layers: list[LayerCost],
                         fwd: np.ndarray, bwd: np.ndarray) -> None:
    """Qwen3-VL's DeepStack features in the carrier (model/hf/families/qwen3_vl.py): the output of block i
    ([patches, hidden]) from vision.block.i to vision.proj, then its merged feature ([image
    tokens, LLM hidden]) from vision.proj to the decoder block that adds it (the j-th feature:
    llm.block.j). Each crosses every cut on its way, forward; its gradient comes back where it
    requires one (a trainable layer of the tower up to where it was made)."""
    first, proj = names.index("vision.embed"), names.index("vision.proj")
    for j, i in enumerate(v.deepstack):
        made = names.index(f"vision.block.{i}")
        grad = any(l.learns for l in layers[first:made + 1])
        for c in range(made + 1, proj + 1):
            fwd[c, 0] += b * v.hidden
            bwd[c, 0] += b * v.hidden if grad else 0.0
        grad = any(l.learns for l in layers[first:proj + 1])
        for c in range(proj + 1, names.index(f"llm.block.{j}") + 1):
            fwd[c, 1] += b * llm_hidden
            bwd[c, 1] += b * llm_hidden if grad else 0.0


def _or_list(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def ideal_compute_s(cost: CostModel, table: SampleTable) -> float:
    """Forward + backward compute of all samples at the top of the efficiency curve, no
    overhead, no padding, no recompute: the numerator of the spec's lower bound."""
    hw = cost.hardware
    total = 0.0
    tok = table.tokens.sum(axis=0)
    sq = table.squares.sum(axis=0)
    for layer in cost.layers:
        if layer.kind == "other":
            continue
        k = KIND_STREAM[layer.kind]
        flops = layer.lin_flops * tok[k] + layer.attn_flops * sq[k]
        total += (1.0 + layer.bwd_factor) * flops / (hw.peak_flops * hw.efficiency_max(layer.kind))
    return total


def model_flops(cost: CostModel, table: SampleTable) -> float:
    """The FLOPs the step's samples need through the model, encoders included: each layer's
    forward and the backward it must run (2 forwards trained, 1 crossed frozen, plus adapters),
    no recompute, no padding: the numerator of the model-FLOPs utilisation."""
    tok = table.tokens.sum(axis=0)
    sq = table.squares.sum(axis=0)
    return float(sum((1.0 + layer.bwd_factor) * (layer.lin_flops * tok[KIND_STREAM[layer.kind]]
                                                  + layer.attn_flops * sq[KIND_STREAM[layer.kind]])
                     for layer in cost.layers if layer.kind != "other"))


def lower_bound_s(cost: CostModel, table: SampleTable, *, pp: int, dp: int) -> float:
    """Spec section 7: total compute of the step at peak efficiency / (pp * dp)."""
    return ideal_compute_s(cost, table) / (pp * dp)
