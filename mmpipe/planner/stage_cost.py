"""What a partition's stages cost: per-stage coefficients, and the times and memory of
micro-batches on them.

`stage_costs` sums the layer costs of `mmpipe.planner.cost` over each stage's layers into
coefficient matrices over per-kind features of a micro-batch (overhead, linear and attention
work at the stream's point of the efficiency curve, `time_features`), so the stage times of
thousands of micro-batches are one matrix product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.cost import KIND_STREAM, KINDS, CostModel
from mmpipe.planner.hardware import HardwareSpec
from mmpipe.planner.ladder import Ladder
from mmpipe.planner.samples import STREAMS, SampleTable


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
    """[P, 3G] forward coefficients over micro-batch features (see `time_features`)."""
    bwd_in: np.ndarray
    """[P, 3G] input-gradient (and frozen-crossed) backward coefficients."""
    bwd_w: np.ndarray
    """[P, 3G] weight-gradient backward coefficients."""
    recomp: np.ndarray
    """[P, 3G] recompute forward coefficients (zero where recompute is off)."""
    bwd_all: np.ndarray
    """[P, 3G] the whole backward: bwd_in + recomp + bwd_w."""
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
    ladder: Ladder | None = None
    """The lengths packed LLM rows are padded to (plan.ladder; None: not padded). The prices of
    whole micro-batches (`step.mb_costs`, `bins.BinCosts`) use the padded length; per-sample
    work (`sample_work`) and the fluid profiles do not."""

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
            k = KIND_STREAM[layer.kind]
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
                      recompute=recompute, fwd=fwd, bwd_in=bin_, bwd_w=bw, recomp=rc,
                      bwd_all=bin_ + rc + bw, act=act,
                      transient=tr, xfer_fwd=xf, xfer_bwd=xb, static=static)


def _kind_constants(hw: HardwareSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per kind: its stream index, 1 / (peak * max_efficiency), and its per-pass overhead."""
    key = (hw.peak_flops, hw.max_efficiency, hw.op_overhead_s,
           tuple(sorted(hw.kind_efficiency.items())), tuple(sorted(hw.kind_overhead_s.items())))
    hit = _KIND_CONST.get(key)
    if hit is None:
        stream = np.array([KIND_STREAM[k] for k in KINDS])
        inv_top = np.array([1.0 / (hw.peak_flops * hw.efficiency_max(k)) for k in KINDS])
        ovh = np.array([hw.overhead(k) for k in KINDS])
        hit = _KIND_CONST[key] = (stream, inv_top, ovh)
    return hit


_KIND_CONST: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def time_features(hw: HardwareSpec, T: np.ndarray, S2: np.ndarray, *,
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
    X = time_features(hw, T, S2)
    fwd = sc.fwd @ X
    bin_ = sc.bwd_in @ X + sc.recomp @ X
    bw = sc.bwd_w @ X
    act = sc.act @ T.T
    tr = (sc.transient[:, None, :] * T[None, :, :]).max(axis=2)
    return MicroBatchCosts(fwd=fwd, bwd_in=bin_, bwd_w=bw, act=act, transient=tr,
                           send_fwd=send_seconds(hw, sc.xfer_fwd @ T.T),
                           send_bwd=send_seconds(hw, sc.xfer_bwd @ T.T))


def stage_times(sc: StageCosts, T: np.ndarray, S2: np.ndarray) -> tuple[np.ndarray, ...]:
    """[P, n_mb] forward, whole backward, forward send and backward send times of
    micro-batches with stream figures T, S2: what `simulator.makespan` takes (the planner's
    inner loop; `micro_batch_costs` splits backward and adds memory for the full simulator)."""
    hw = sc.cost.hardware
    X = time_features(hw, T, S2)
    return (sc.fwd @ X, sc.bwd_all @ X, send_seconds(hw, sc.xfer_fwd @ T.T),
            send_seconds(hw, sc.xfer_bwd @ T.T))


def send_seconds(hw: HardwareSpec, nbytes: np.ndarray) -> np.ndarray:
    """Time of point-to-point transfers of `nbytes` each to a neighbouring stage (0 where
    nothing is sent)."""
    return np.where(nbytes > 0, hw.link_latency_s + nbytes / hw.link_bytes_per_s, 0.0)


def sample_work(sc: StageCosts, table: SampleTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample and stage: marginal forward+backward time [n, P], kept activation bytes
    [n, P] and transient bytes [n, P] (packed micro-batches add these up)."""
    X = time_features(sc.cost.hardware, table.tokens, table.squares, marginal=True)
    work = ((sc.fwd + sc.bwd_in + sc.recomp + sc.bwd_w) @ X).T
    act = table.tokens @ sc.act.T
    tr = (sc.transient[None, :, :] * table.tokens[:, None, :]).max(axis=2)
    return work, act, tr

