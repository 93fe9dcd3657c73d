"""Cost model: time and memory of every pipeline layer for a micro-batch, from FLOPs.

Each layer reads one *stream* of a micro-batch (vision patches, vision LLM tokens, audio
positions, audio LLM tokens, LLM tokens). For a micro-batch a stream has `T` tokens and a sum
of squared sequence lengths `S2` (packed: per sequence; padded: every sequence padded to the
longest, so padding is paid for in both). A layer's forward time is

    overhead(kind) + (lin * T + attn * S2) / (peak_flops * efficiency(kind, T))

with `lin` = 2 x (matmul parameters) FLOPs per token and `attn` = 4h (bidirectional) or 2h
(causal) FLOPs per squared position (shared/spec/PLANNING.md section 6). Backward is 2x forward
for a trainable layer (1x input gradient + 1x weight gradient), 1x for a frozen layer that
gradients cross on their way to a trainable one upstream, 0 for a frozen layer with nothing
trainable upstream (which also keeps no activations). Recompute adds one forward to backward.

Every constant comes from `HardwareSpec`. Stage times are a matrix product of per-stage
coefficients with per-micro-batch features, so thousands of micro-batches cost microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mmpipe.model.spec import TRAINABLE_PREFIXES, ModelSpec, is_trainable, layer_names
from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.hardware import HardwareSpec

STREAMS = ("vpos", "vtok", "apos", "atok", "llm")
"""Per-micro-batch token streams: vision positions, vision LLM tokens, audio positions,
audio LLM tokens, LLM sequence."""
KINDS = ("vision.embed", "vision.block", "vision.proj", "audio.embed", "audio.block",
         "audio.proj", "llm.embed", "llm.block", "llm.norm", "llm.head")
"""Layer kinds with a cost; any other layer name is free."""
_KIND_STREAM = {"vision.embed": 0, "vision.block": 0, "vision.proj": 1, "audio.embed": 2,
                "audio.block": 2, "audio.proj": 3, "llm.embed": 4, "llm.block": 4,
                "llm.norm": 4, "llm.head": 4}


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
    """The layer's weights train."""
    bwd_factor: float
    """Backward time in forwards: 2 trainable, 1 frozen but crossed, 0 otherwise."""
    act_bytes: float
    """Activation bytes kept per token of the stream without recompute (0 if none kept)."""
    recompute_bytes: float
    """Activation bytes kept per token under recompute."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """A model's layers costed on a hardware for a trainable set and dp degree."""

    model: ModelSpec
    """The architecture."""
    hardware: HardwareSpec
    """Device figures and every cost constant."""
    trainable: tuple[str, ...]
    """Trainable component prefixes."""
    dp: int
    """Data-parallel replicas (ZeRO-1 shards optimizer states over them)."""
    layers: tuple[LayerCost, ...]
    """One entry per pipeline layer, in layer_names order."""
    cut_fwd_bytes: np.ndarray
    """[L+1, K] bytes per stream token crossing a cut before layer c, forward."""
    cut_bwd_bytes: np.ndarray
    """[L+1, K] bytes per stream token crossing a cut before layer c, backward."""

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def static_bytes(self, start: int, end: int) -> float:
        """Weights, gradients and optimizer states of layers [start, end)."""
        hw = self.hardware
        return sum(l.params * hw.param_bytes(trainable=l.trainable, dp=self.dp)
                   for l in self.layers[start:end])


def validate_trainable(trainable: Sequence[str], model: ModelSpec) -> tuple[str, ...]:
    """Check train.trainable against the model's layers; returns it as a tuple.

    Raises ValueError for an empty list or a name that matches no layer of the model.
    """
    names = layer_names(model)
    valid = [p for p in TRAINABLE_PREFIXES
             if p == "all" or any(is_trainable(n, (p,)) for n in names)]
    trainable = tuple(str(t) for t in trainable)
    if not trainable:
        raise ValueError(f"train.trainable=[] trains nothing; use {_or_list(valid)}")
    for t in trainable:
        if t != "all" and not any(is_trainable(n, (t,)) for n in names):
            raise ValueError(f"train.trainable=[{','.join(trainable)}] names {t!r}, which matches "
                             f"no layer of model {model.name}; use {_or_list(valid)}")
    return trainable


def build_cost_model(*, model: ModelSpec, hardware: HardwareSpec, trainable: Sequence[str],
                     dp: int = 1) -> CostModel:
    """Cost every layer of `model` on `hardware` with the given trainable prefixes."""
    trainable = validate_trainable(trainable, model)
    if dp < 1:
        raise ValueError(f"parallel.dp={dp} must be >= 1")
    names = layer_names(model)
    flags = [is_trainable(n, trainable) for n in names]
    kinds = [_kind(n) for n in names]
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
        if kind == "llm.head":
            act = hardware.logits_bytes_per_vocab * model.llm.vocab
            rec = act
        elif is_block:
            act = hardware.act_bytes_per_hidden * width
            rec = hardware.recompute_bytes_per_hidden * width
        else:
            act = rec = hardware.io_bytes_per_hidden * width if kind != "llm.embed" else 0.0
        keeps = factor > 0
        layers.append(LayerCost(name=name, kind=kind, params=params, lin_flops=lin,
                                attn_flops=attn, trainable=train, bwd_factor=factor,
                                act_bytes=act if keeps else 0.0,
                                recompute_bytes=rec if keeps else 0.0))
        if comp in seen and train:
            seen[comp] = True
    fwd, bwd = _cut_bytes(model, hardware, names, kinds, layers)
    return CostModel(model=model, hardware=hardware, trainable=trainable, dp=dp,
                     layers=tuple(layers), cut_fwd_bytes=fwd, cut_bwd_bytes=bwd)


def _kind(name: str) -> str:
    parts = name.split(".")
    kind = ".".join(parts[:2])
    return kind if kind in _KIND_STREAM else "other"


def _layer_figures(m: ModelSpec, kind: str) -> tuple[int, float, float, int, bool]:
    """(params, lin FLOPs/token, attn FLOPs/position^2, activation width, is a block)."""
    if kind.startswith("vision."):
        v = m.vision
        assert v is not None
        h = v.hidden
        if kind == "vision.embed":
            conv = v.channels * v.patch * v.patch * h
            pos = ((v.image_size // v.patch) ** 2 + int(v.cls_token)) * h if v.resize == "fixed" else 0
            return conv + h + pos, 2.0 * conv, 0.0, h, False
        if kind == "vision.block":
            mat = 4 * h * h + 2 * h * v.mlp
            return mat + 9 * h + v.mlp, 2.0 * mat, 4.0 * h, h, True
        mat, bias = _mlp(v.proj_in, v.proj)
        return mat + bias, 2.0 * mat, 0.0, m.llm.hidden, False
    if kind.startswith("audio."):
        a = m.audio
        assert a is not None
        h = a.hidden
        if kind == "audio.embed":
            conv1, conv2 = 3 * a.mel_bins * h, 3 * h * h
            # conv1 runs at the mel frame rate (conv_stride frames per encoder position)
            positions = int(a.max_seconds * a.frames_per_s / a.conv_stride)
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


def _mlp(width_in: int, widths: Sequence[int]) -> tuple[int, int]:
    mat = bias = 0
    for w in widths:
        mat += width_in * w
        bias += w
        width_in = w
    return mat, bias


def _cut_bytes(m: ModelSpec, hw: HardwareSpec, names: list[str], kinds: list[str],
               layers: list[LayerCost]) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per stream token crossing the cut before each layer index, fwd and bwd."""
    n = len(names)
    fwd = np.zeros((n + 1, len(STREAMS)))
    bwd = np.zeros((n + 1, len(STREAMS)))
    b = hw.boundary_bytes_per_hidden

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
        train_upto = [any(l.trainable for l in layers[first:c]) for c in range(n + 1)]
        for c in range(n + 1):
            if comp == "audio" and c <= first:
                # raw log-mel frames travel from the data-loading first stage to the encoder
                fwd[c, s_pos] += 2.0 * m.audio.mel_bins * m.audio.conv_stride if c > 0 else 0.0
            elif first < c <= proj:
                fwd[c, s_pos] += b * enc.hidden
                bwd[c, s_pos] += b * enc.hidden if train_upto[c] else 0.0
            elif proj < c <= llm_embed:
                fwd[c, s_tok] += b * m.llm.hidden
                bwd[c, s_tok] += b * m.llm.hidden if train_upto[c] else 0.0
    for c in range(llm_embed + 1, llm_head + 1):
        fwd[c, 4] += b * m.llm.hidden
        if any(l.trainable for l in layers[:c]):
            bwd[c, 4] += b * m.llm.hidden
    return fwd, bwd


def _or_list(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


# ---------------------------------------------------------------------------- samples


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleTable:
    """Per-sample stream figures of a list of samples, as arrays over (sample, stream)."""

    tokens: np.ndarray
    """[n, K] tokens of each stream."""
    squares: np.ndarray
    """[n, K] sum of squared sequence lengths of each stream."""
    seqs: np.ndarray
    """[n, K] number of sequences (images, clips, 1 for the LLM)."""
    longest: np.ndarray
    """[n, K] longest sequence of each stream."""

    def __len__(self) -> int:
        return self.tokens.shape[0]


def sample_table(samples: Sequence[SampleFeatures]) -> SampleTable:
    n = len(samples)
    tok = np.zeros((n, len(STREAMS)))
    sq = np.zeros_like(tok)
    cnt = np.zeros_like(tok)
    mx = np.zeros_like(tok)
    for i, f in enumerate(samples):
        for k, seqs in enumerate((f.image_positions, f.image_tokens, f.audio_positions,
                                  f.audio_tokens, (f.llm_len,))):
            if seqs:
                tok[i, k] = sum(seqs)
                sq[i, k] = sum(s * s for s in seqs)
                cnt[i, k] = len(seqs)
                mx[i, k] = max(seqs)
    return SampleTable(tokens=tok, squares=sq, seqs=cnt, longest=mx)


def mb_streams(table: SampleTable, mbs: Sequence[Sequence[int]], *,
               packing: bool) -> tuple[np.ndarray, np.ndarray]:
    """Stream tokens and squared lengths [n_mb, K] of micro-batches (lists of row indices)."""
    n = len(mbs)
    K = len(STREAMS)
    if n == 0:
        return np.zeros((0, K)), np.zeros((0, K))
    sizes = np.fromiter((len(mb) for mb in mbs), dtype=np.int64, count=n)
    if np.any(sizes == 0):
        raise ValueError("a micro-batch is empty; every micro-batch needs at least one sample")
    idx = np.fromiter((i for mb in mbs for i in mb), dtype=np.int64, count=int(sizes.sum()))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if packing:
        return (np.add.reduceat(table.tokens[idx], starts, axis=0),
                np.add.reduceat(table.squares[idx], starts, axis=0))
    cnt = np.add.reduceat(table.seqs[idx], starts, axis=0)
    mx = np.maximum.reduceat(table.longest[idx], starts, axis=0)
    return cnt * mx, cnt * mx * mx


# ---------------------------------------------------------------------------- stages


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Per-stage coefficients of a cost model under one partition and recompute choice."""

    cost: CostModel
    """The layer costs."""
    stages: tuple[tuple[int, int], ...]
    """[start, end) layer ranges."""
    recompute: tuple[bool, ...]
    """Activation recomputation per stage."""
    fwd: np.ndarray
    """[P, 3G] forward coefficients over micro-batch features (see `_features`)."""
    bwd_in: np.ndarray
    """[P, 3G] input-gradient (and frozen-crossed) backward coefficients."""
    bwd_w: np.ndarray
    """[P, 3G] weight-gradient backward coefficients."""
    recomp: np.ndarray
    """[P, 3G] recompute forward coefficients (zero where recompute is off)."""
    act: np.ndarray
    """[P, K] activation bytes kept per stream token."""
    transient: np.ndarray
    """[P, K] one block's full activations per stream token (recompute stages only)."""
    xfer_fwd: np.ndarray
    """[P, K] bytes per stream token sent forward to the next stage (last row zero)."""
    xfer_bwd: np.ndarray
    """[P, K] bytes per stream token sent backward to the previous stage (first row zero)."""
    static: np.ndarray
    """[P] static bytes (weights, grads, optimizer states) per stage."""

    @property
    def pp(self) -> int:
        return len(self.stages)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchCosts:
    """Times (s) and memory (bytes) of a list of micro-batches on every stage, [P, n_mb]."""

    fwd: np.ndarray
    """Forward time."""
    bwd_in: np.ndarray
    """Backward time for the input gradient, including any recompute forward."""
    bwd_w: np.ndarray
    """Backward time for weight gradients."""
    act: np.ndarray
    """Activation bytes held from forward until backward."""
    transient: np.ndarray
    """Extra bytes during backward (a recomputed block's full activations)."""
    send_fwd: np.ndarray
    """Transfer time of the activation to the next stage."""
    send_bwd: np.ndarray
    """Transfer time of the gradient to the previous stage."""

    @property
    def bwd(self) -> np.ndarray:
        return self.bwd_in + self.bwd_w


def stage_costs(cost: CostModel, stages: Sequence[tuple[int, int]],
                recompute: Sequence[bool] | None = None) -> StageCosts:
    """Aggregate layer costs per stage (stages tile the layers; checked by the caller)."""
    P = len(stages)
    recompute = tuple(bool(r) for r in (recompute or [False] * P))
    G = len(KINDS)
    fwd = np.zeros((P, 3 * G))
    bin_ = np.zeros_like(fwd)
    bw = np.zeros_like(fwd)
    rc = np.zeros_like(fwd)
    act = np.zeros((P, len(STREAMS)))
    tr = np.zeros_like(act)
    xf = np.zeros_like(act)
    xb = np.zeros_like(act)
    static = np.zeros(P)
    for s, (a, b) in enumerate(stages):
        for layer in cost.layers[a:b]:
            if layer.kind == "other":
                continue
            g = KINDS.index(layer.kind)
            k = _KIND_STREAM[layer.kind]
            row = np.zeros(3 * G)
            row[3 * g:3 * g + 3] = (1.0, layer.lin_flops, layer.attn_flops)
            fwd[s] += row
            if layer.bwd_factor >= 1:
                bin_[s] += row
            if layer.bwd_factor >= 2:
                bw[s] += row * (layer.bwd_factor - 1)
            if recompute[s] and layer.bwd_factor > 0 and layer.act_bytes != layer.recompute_bytes:
                rc[s] += row
                act[s, k] += layer.recompute_bytes
                tr[s, k] = max(tr[s, k], layer.act_bytes)
            else:
                act[s, k] += layer.act_bytes
        static[s] = cost.static_bytes(a, b)
        if s + 1 < P:
            xf[s] = cost.cut_fwd_bytes[b]
        if s > 0:
            xb[s] = cost.cut_bwd_bytes[a]
    return StageCosts(cost=cost, stages=tuple((int(a), int(b)) for a, b in stages),
                      recompute=recompute, fwd=fwd, bwd_in=bin_, bwd_w=bw, recomp=rc, act=act,
                      transient=tr, xfer_fwd=xf, xfer_bwd=xb, static=static)


def _kind_constants(hw: HardwareSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per kind: its stream index, 1 / (peak * max_efficiency), and its per-pass overhead."""
    key = (hw.peak_flops, hw.max_efficiency, hw.op_overhead_s,
           tuple(sorted(hw.kind_efficiency.items())), tuple(sorted(hw.kind_overhead_s.items())))
    hit = _KIND_CONST.get(key)
    if hit is None:
        stream = np.array([_KIND_STREAM[k] for k in KINDS])
        inv_top = np.array([1.0 / (hw.peak_flops * hw.efficiency_max(k)) for k in KINDS])
        ovh = np.array([hw.overhead(k) for k in KINDS])
        hit = _KIND_CONST[key] = (stream, inv_top, ovh)
    return hit


_KIND_CONST: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _features(hw: HardwareSpec, T: np.ndarray, S2: np.ndarray, *,
              marginal: bool = False) -> np.ndarray:
    """[3G, n_mb] features: per kind (overhead, seconds per lin FLOP*T, per attn FLOP*S2).

    `marginal`: what a sample adds to a large micro-batch (top of the curve, no overhead)."""
    stream, inv_top, ovh = _kind_constants(hw)
    t = T[:, stream]  # [n, G]
    s2 = S2[:, stream]
    on = t > 0
    if marginal:
        spf = np.broadcast_to(inv_top, t.shape)
        o = np.zeros_like(t)
    else:
        # seconds per FLOP at this stream size: 1 / (peak * eff_max * T / (T + half))
        safe = np.where(on, t, 1.0)
        spf = (safe + hw.half_tokens) / safe * inv_top
        o = on * ovh
    X = np.empty((T.shape[0], len(KINDS), 3))
    X[:, :, 0] = o
    X[:, :, 1] = np.where(on, t * spf, 0.0)
    X[:, :, 2] = np.where(on, s2 * spf, 0.0)
    return X.reshape(T.shape[0], 3 * len(KINDS)).T


def micro_batch_costs(sc: StageCosts, T: np.ndarray, S2: np.ndarray) -> MicroBatchCosts:
    """Times and memory of micro-batches with stream figures T, S2 ([n_mb, K]) on each stage."""
    hw = sc.cost.hardware
    X = _features(hw, T, S2)
    fwd = sc.fwd @ X
    bin_ = sc.bwd_in @ X + sc.recomp @ X
    bw = sc.bwd_w @ X
    act = sc.act @ T.T
    tr = (sc.transient[:, None, :] * T[None, :, :]).max(axis=2)
    bf = sc.xfer_fwd @ T.T
    bb = sc.xfer_bwd @ T.T
    lat = hw.link_latency_s
    sf = np.where(bf > 0, lat + bf / hw.link_bytes_per_s, 0.0)
    sb = np.where(bb > 0, lat + bb / hw.link_bytes_per_s, 0.0)
    return MicroBatchCosts(fwd=fwd, bwd_in=bin_, bwd_w=bw, act=act, transient=tr,
                           send_fwd=sf, send_bwd=sb)


def sample_work(sc: StageCosts, table: SampleTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample and stage: marginal forward+backward time [n, P], kept activation bytes
    [n, P] and transient bytes [n, P] (packed micro-batches add these up)."""
    X = _features(sc.cost.hardware, table.tokens, table.squares, marginal=True)
    work = ((sc.fwd + sc.bwd_in + sc.recomp + sc.bwd_w) @ X).T
    act = table.tokens @ sc.act.T
    tr = (sc.transient[None, :, :] * table.tokens[:, None, :]).max(axis=2)
    return work, act, tr


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
        k = _KIND_STREAM[layer.kind]
        flops = layer.lin_flops * tok[k] + layer.attn_flops * sq[k]
        total += (1.0 + layer.bwd_factor) * flops / (hw.peak_flops * hw.efficiency_max(layer.kind))
    return total


def lower_bound_s(cost: CostModel, table: SampleTable, *, pp: int, dp: int) -> float:
    """Spec section 7: total compute of the step at peak efficiency / (pp * dp)."""
    return ideal_compute_s(cost, table) / (pp * dp)
