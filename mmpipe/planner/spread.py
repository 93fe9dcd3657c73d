"""The spread placement of encoder towers (plan.encoders): what it costs (the values and their
one parse are planner/problem.py's `Placement`).

Under the `stages` placement an encoder tower (`vision.*`, `audio.*`: its embed, blocks and
projector) runs on the pipeline stages that hold its layers, like any layer. Under `spread`
every rank holds the whole tower, and a step runs in three phases:

1. pre-pass: each rank of a data-parallel replica encodes a share of *that replica's* samples
   (a rank reads only its own replica's shards), every spread tower of a sample on the same
   rank, and sends the features (LLM tokens of the sample's media x LLM width x activation
   bytes, DeepStack features included) point-to-point to the replica's stage-0 rank;
2. the pipeline runs the remaining layers under 1F1B, the features entering at stage 0 and
   riding the stage boundaries up to the stage that holds `llm.embed`;
3. post-pass (only when something in a spread tower learns): stage 0 sends each rank the
   gradients of its share's features, every rank runs its tower backward, and the towers'
   gradients are summed to stage 0 over the replica's pp ranks (DeepSpeed then averages stage
   0's over the replicas, as a staged tower's).

Pricing (docs/spec.md section 6, "Spread encoders"), per replica r:

    pre_r  = when stage 0 holds every feature: each rank s encodes its share (fwd_s, one
             pass per micro-batch part, `UnitCosts`, through the layer cost model: patches, windows, tiles, frames,
             audio chunks, quadratic attention, the efficiency curve at that sample's size),
             then sends its share's features in one transfer; stage 0's incoming link takes
             the transfers one at a time in order of readiness (ties: lower stage first):
             t = max(t, fwd_s) + link_latency_s + bytes_s / link_bytes_per_s;
             pre_r = max(max_s fwd_s, t)
    pipe_r = the replica's simulated 1F1B makespan without the spread layers, plus the
             runtime's cost per micro-batch (HardwareSpec.replica_seconds)
    post_r = stage 0 sends the feature gradients one rank at a time, the rank with the
             longest post-pass first (ties: lower stage first); rank s then runs its share's
             backward: post_r = max(post_0, max_s (arrival_s + post_s)); 0 when nothing learns
    step   = max_r (pre_r + pipe_r + post_r + reduce_r + broadcast_r) + step_overhead_s
    reduce_r = 2 (n - 1) / n x gradient bytes / link_bytes_per_s + 2 (n - 1) x link_latency_s
             over the replica's n = pp ranks (a ring reduce to stage 0), gradient bytes = the
             spread towers' learning parameters x 4 (the runtime sums them in fp32)
    broadcast_r = learning weight bytes / link_bytes_per_s + (n - 1) x link_latency_s: stage 0
             sends the updated weights to the replica's other ranks before they next encode
    both 0 when nothing in the towers learns, or when only stage 0 encodes in replica r (a
    nested step can keep every sample there)

The share of each rank is a longest-processing-time assignment of the replica's samples
that have media of a spread tower (largest pre + post time first, ties by index, to the rank
with the least load so far, ties to the lower stage): deterministic, so every rank that plans
a step gets the same shares.

Memory per rank, on top of what its pipeline stage holds: on stage 0, the spread towers'
weights, gradients and optimizer states as a staged tower's (the runtime keeps them in stage
0's PipelineModule: ZeRO-1 shards the optimizer side over dp); on every other rank, a replica's
weights and gradients only (stage 0 broadcasts the updated weights); on every rank, the fp32
buffer the gradients are reduced in; the activations of its encode share kept from the pre-pass to
the post-pass (all of them at once), and on stage 0 the received features of its replica's
whole step. What a share keeps depends on the step's `encode_recompute` mode, the first of
KEEP_MODES from the one the pipeline's memory was reserved for (`keep_mode`) whose every rank fits:

    none    keep every activation (the layer rules of docs/spec.md section 6); post-pass =
            backward
    blocks  keep each block's input (the recompute rule); post-pass = recompute forward +
            backward, one block's full activations of the sample in backward on top
    tower   keep the tower's input only (the embed's kept bytes); post-pass = each sample's
            forward again (keeping block inputs), then recompute + backward

The pipeline's micro-batches are planned with the usable memory less a reserve for these
(`reserve_bytes`), so the tower mode fits wherever the pipeline does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.cost import CostModel
from mmpipe.planner.hardware import GB
from mmpipe.planner.ladder import Ladder
from mmpipe.planner.nested import NestedTimes, assign_shares, simulate_nested
from mmpipe.planner.nested import slots as nested_slots
from mmpipe.planner.partition import StagePlan
from mmpipe.planner.problem import OFF_STAGE, placement_name
from mmpipe.planner.samples import SampleTable
from mmpipe.planner.stage_cost import StageCosts, micro_batch_costs, stage_costs
from mmpipe.planner.step import Replicas, StepEval, evaluate_step, mb_costs

KEEP_MODES = ("none", "blocks", "tower")
"""What an encode share keeps from the pre-pass to the post-pass, cheapest first."""
TOWER_STREAMS = {"vision": (0, 5), "audio": (2,)}
"""Streams (samples.STREAMS) a tower reads: they never cross a pipeline cut when it is spread."""
FEATURE_STREAM = {"vision": 1, "audio": 3}
"""The stream of a tower's features (its LLM tokens)."""
KEEP_SHARE = 0.25
"""A step's encode shares keep as much as the cheapest mode whose reserve (`reserve_bytes`)
takes at most this share of a rank's usable memory; the rest is the pipeline's (memory
that lets it run fewer, larger micro-batches)."""
RESERVE_MARGIN = 1.25
"""The reserve counts a rank's even share of the step's encode memory this many times over
(the shares are balanced on time, not bytes), plus the largest sample's."""
FP32 = 4
"""Bytes of one element of the fp32 buffer the runtime reduces the towers' gradients in."""

Encoders = Mapping[str, str]
"""A resolved placement: tower -> `stages` | `spread`, for every tower of the model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpreadModel:
    """A cost model split by a placement: the spread towers' own costs, and the pipeline's."""

    cost: CostModel
    """Every layer, as `build_cost_model` costs it."""
    encoders: Mapping[str, str]
    """The placement of every tower of the model."""
    spread: tuple[int, ...]
    """Indices (into cost.layers) of the spread layers."""
    keep: tuple[int, ...]
    """Indices of the layers the pipeline stages run."""
    pipeline: CostModel
    """The stages' cost model: only the `keep` layers, with the features of spread towers
    crossing every cut up to `llm.embed` and their inputs crossing none."""
    ranges: tuple[tuple[int, int], ...]
    """The spread layers as contiguous [start, end) runs of layer indices."""
    nested: bool = False
    """The off-stage towers run nested in the pipeline's bubbles (planner/nested.py), not
    before and after it."""
    learns: bool
    """Something in a spread tower learns (weights or adapters): there is a post-pass, a
    gradient send back and a reduce to stage 0."""
    static: float
    """Bytes stage 0's rank holds for the spread towers (their parameters are stage 0's in the
    runtime's PipelineModule): weights, and for learning parameters their gradients, optimizer
    states as the precision shards them over dp, and the fp32 reduce buffer, with the
    hardware's slack."""
    static_rest: float
    """Bytes every other rank holds for its replica of the towers: weights, and for learning
    parameters their gradients and the fp32 reduce buffer (no optimizer state: stage 0
    broadcasts the updated weights), with the hardware's slack."""
    grad_bytes: float
    """Bytes of the spread towers' gradient reduce (learning parameters x 4: the runtime
    sums them in fp32)."""
    weight_bytes: float
    """Bytes of the learning weights rank 0 broadcasts after every step (element bytes each)."""
    feature_bytes: np.ndarray
    """[K] bytes per stream token sent to stage 0 (each spread tower's feature stream)."""

    @property
    def active(self) -> bool:
        """Some tower is spread."""
        return bool(self.spread)

    def to_pipeline(self, plan: StagePlan) -> StagePlan:
        """A stage plan over every layer (docs/spec.md section 4) as ranges of the pipeline
        cost model's layers; ValueError when a spread layer lies outside stage 0's range or a
        stage would hold spread layers only."""
        pos = {full: j for j, full in enumerate(self.keep)}
        if self.spread and self.spread[-1] >= plan.stages[0][1]:
            names = self.cost.names
            raise ValueError(f"plan.stages ends stage 0 at {names[plan.stages[0][1] - 1]}, but the spread "
                             f"encoder layers run up to {names[self.spread[-1]]}, which stage 0's range must "
                             f"hold; end stage 0 after it, or keep that tower on the stages")
        out = []
        for s, (a, b) in enumerate(plan.stages):
            kept = [pos[i] for i in range(a, b) if i in pos]
            if not kept:
                raise ValueError(f"plan.stages: stage {s} holds only layers of spread encoder towers "
                                 f"({placement_name(self.encoders)}), which run on every rank; give it "
                                 f"a layer of the pipeline too")
            out.append(kept[0])
        bounds = [0] + out[1:] + [len(self.keep)]
        return StagePlan(stages=[(bounds[s], bounds[s + 1]) for s in range(plan.pp)],
                         recompute=plan.recompute)

    def to_full(self, plan: StagePlan) -> StagePlan:
        """A stage plan of the pipeline cost model as ranges over every layer: each stage
        starts at its first pipeline layer (stage 0 at 0), and stage 0 reaches at least past
        the last spread layer, so every spread layer lies in stage 0's range (with a spread
        audio tower after a vision tower on the stages, stage 0 then holds that vision tower:
        later cuts move on as far as needed, one pipeline layer per stage at least)."""
        n = len(self.cost.layers)
        cuts = [a for a, _ in plan.stages[1:]]
        if cuts and self.spread:
            low = sum(1 for i in self.keep if i < self.spread[-1])  # pipeline layers before the last spread one
            for c in range(len(cuts)):
                cuts[c] = max(cuts[c], low + c + (1 if low == 0 else 0))
            if cuts[-1] >= len(self.keep):
                raise ValueError(f"{len(plan.stages)} stages do not fit after the spread encoder layers, which "
                                 f"stage 0 must hold; use fewer stages or keep that tower on the stages")
        starts = [0] + [self.keep[a] for a in cuts] + [n]
        return StagePlan(stages=[(starts[s], starts[s + 1]) for s in range(plan.pp)],
                         recompute=plan.recompute)

    def allreduce_s(self, ranks: int) -> float:
        """The spread towers' gradients summed to stage 0 over a replica's `ranks` pipeline
        ranks (a ring reduce: reduce-scatter, then gather to stage 0, 2 (n - 1) / n of the
        bytes), then stage 0's broadcast of the updated weights to them before the next step
        that encodes off stage 0 (pipelined: the bytes once, a latency per hop), s (0 when
        nothing learns or one rank)."""
        if ranks <= 1 or self.grad_bytes <= 0:
            return 0.0
        hw = self.cost.hardware
        k = 2.0 * (ranks - 1)
        reduce = k / ranks * self.grad_bytes / hw.link_bytes_per_s + k * hw.link_latency_s
        return reduce + self.weight_bytes / hw.link_bytes_per_s + (ranks - 1) * hw.link_latency_s


def spread_model(cost: CostModel, encoders: Encoders | None) -> SpreadModel:
    """Split `cost` by a resolved placement (None or no spread tower: the pipeline is `cost`)."""
    encoders = dict(encoders or {})
    towers = [t for t, w in encoders.items() if w in OFF_STAGE]
    L = len(cost.layers)
    spread = tuple(i for i, l in enumerate(cost.layers) if l.name.split(".")[0] in towers)
    keep = tuple(i for i in range(L) if i not in set(spread))
    if not spread:
        return SpreadModel(cost=cost, encoders=encoders, spread=(), keep=keep, pipeline=cost, ranges=(),
                           learns=False, static=0.0, static_rest=0.0, grad_bytes=0.0, weight_bytes=0.0,
                           feature_bytes=np.zeros(cost.cut_fwd_bytes.shape[1]))
    m, pr = cost.model, cost.precision
    b = pr.element_bytes
    layers = [cost.layers[i] for i in spread]
    learns = any(l.learns for l in layers)
    feat = np.zeros(cost.cut_fwd_bytes.shape[1])
    for t in towers:
        ds = len(m.vision.deepstack) if t == "vision" and m.vision is not None else 0
        feat[FEATURE_STREAM[t]] = b * m.llm.hidden * (1 + ds)
    rows = list(keep) + [L]
    fwd = cost.cut_fwd_bytes[rows].copy()
    bwd = cost.cut_bwd_bytes[rows].copy()
    embed = cost.names.index("llm.embed")
    for t in towers:
        fwd[:, list(TOWER_STREAMS[t])] = 0.0
        bwd[:, list(TOWER_STREAMS[t])] = 0.0
        k = FEATURE_STREAM[t]
        for j, full in enumerate(rows):
            if 0 < full <= embed:  # received by stage 0, carried to the stage of llm.embed
                fwd[j, k] = max(fwd[j, k], feat[k])
                bwd[j, k] = max(bwd[j, k], feat[k] if any(
                    l.learns for l in layers if l.name.startswith(t + ".")) else 0.0)
    pipeline = dataclasses.replace(cost, layers=tuple(cost.layers[i] for i in keep),
                                   cut_fwd_bytes=fwd, cut_bwd_bytes=bwd)
    ranges = []
    for i in spread:
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    slack = 1.0 + cost.hardware.memory_slack
    learning = sum((l.params if l.trainable else 0) + l.adapter_params for l in layers)
    static = slack * (sum(l.params * pr.param_bytes(trainable=l.trainable, dp=cost.dp)
                          + l.adapter_params * pr.param_bytes(trainable=True, dp=cost.dp) for l in layers)
                      + FP32 * learning)
    rest = slack * (b * sum(l.params + l.adapter_params for l in layers) + (b + FP32) * learning)
    return SpreadModel(cost=cost, encoders=encoders, spread=spread, keep=keep, pipeline=pipeline,
                       nested=any(w == "nested" for w in encoders.values()),
                       ranges=tuple((a, c) for a, c in ranges), learns=learns, static=static, static_rest=rest,
                       grad_bytes=float(FP32 * learning), weight_bytes=float(b * learning), feature_bytes=feat)


@dataclass(frozen=True, kw_only=True, slots=True)
class EncodeCosts:
    """Per sample (rows of a table): what encoding it alone on one rank costs, per keep mode."""

    pre: np.ndarray
    """[n] pre-pass forward, s."""
    post: dict[str, np.ndarray]
    """Per KEEP_MODES entry, [n] post-pass time (recompute and backward), s."""
    kept: dict[str, np.ndarray]
    """Per mode, [n] bytes kept from the pre-pass to the post-pass."""
    transient: dict[str, np.ndarray]
    """Per mode, [n] bytes the sample's post-pass needs on top while it runs."""
    feature: np.ndarray
    """[n] feature bytes sent to stage 0 (and, when a spread tower learns, their gradients
    back)."""
    media: np.ndarray
    """[n] whether the sample has media of a spread tower (only those are encoded)."""
    units: UnitCosts | None = None
    """Several samples in one tower pass (a rank's part of a micro-batch, as the runtime runs it)."""


def _tower_costs(sm: SpreadModel, tokens: np.ndarray, squares: np.ndarray) -> tuple:
    """Per item (a row of `tokens` / `squares`: one sample, or several packed into one tower
    pass): its pre-pass forward, and per keep mode its post-pass, kept and transient bytes."""
    zero = np.zeros(len(tokens))
    R = len(sm.ranges)
    off = micro_batch_costs(stage_costs(sm.cost, sm.ranges, [False] * R), tokens, squares)
    on = micro_batch_costs(stage_costs(sm.cost, sm.ranges, [True] * R), tokens, squares)
    fwd = off.fwd.sum(axis=0)
    bwd = off.bwd.sum(axis=0)
    recomp = on.bwd.sum(axis=0) - bwd
    keep_all = off.act.sum(axis=0)
    keep_in = on.act.sum(axis=0)
    block = on.transient.max(axis=0)
    embeds = [i for i in sm.spread if sm.cost.layers[i].kind.endswith(".embed")]
    inputs = micro_batch_costs(stage_costs(sm.cost, [(i, i + 1) for i in embeds], [False] * len(embeds)),
                               tokens, squares).act.sum(axis=0)
    if sm.learns:
        post = {"none": bwd, "blocks": recomp + bwd, "tower": fwd + recomp + bwd}
        kept = {"none": keep_all, "blocks": keep_in, "tower": np.minimum(inputs, keep_in)}
        transient = {"none": zero, "blocks": block, "tower": keep_in + block}
    else:
        post = kept = transient = {k: zero for k in KEEP_MODES}
    return fwd, post, kept, transient


class UnitCosts:
    """What one tower pass over several samples costs: the runtime encodes a rank's part of a
    micro-batch at once (runtime/spread.py, EncodeStep.units), packed as a staged tower runs a
    micro-batch, so its time is the part's, not the sum of its samples' alone (which pays
    every op's fixed cost and the efficiency curve's small-size penalty once per sample)."""

    def __init__(self, sm: SpreadModel, table: SampleTable) -> None:
        self.sm, self.table = sm, table
        self._seen: dict[tuple[int, ...], tuple[float, dict[str, float], dict[str, float]]] = {}

    def __call__(self, rows: Sequence[int]) -> tuple[float, dict[str, float], dict[str, float]]:
        """(pre-pass forward s, post-pass s per keep mode, transient bytes per keep mode) of the
        samples `rows` in one pass; zeros for none."""
        key = tuple(sorted(int(i) for i in rows))
        if key not in self._seen:
            if not key or not self.sm.active:
                self._seen[key] = (0.0, {m: 0.0 for m in KEEP_MODES}, {m: 0.0 for m in KEEP_MODES})
            else:
                idx = list(key)
                t = self.table.tokens[idx].sum(axis=0, keepdims=True)
                q = self.table.squares[idx].sum(axis=0, keepdims=True)
                fwd, post, _, transient = _tower_costs(self.sm, t, q)
                self._seen[key] = (float(fwd[0]), {m: float(v[0]) for m, v in post.items()},
                                   {m: float(v[0]) for m, v in transient.items()})
        return self._seen[key]

    def share(self, rep: Sequence[Sequence[int]], share: Sequence[int], mode: str) -> tuple[float, float, float]:
        """A rank's share of replica `rep` (its micro-batches) cut into units: summed pre-pass,
        summed post-pass under `mode`, and the largest unit's transient bytes."""
        mine = set(int(i) for i in share)
        units = [[i for i in mb if i in mine] for mb in rep]
        got = [self(u) for u in units if u]
        return (float(sum(g[0] for g in got)), float(sum(g[1][mode] for g in got)),
                max((g[2][mode] for g in got), default=0.0))


def encode_costs(sm: SpreadModel, table: SampleTable) -> EncodeCosts:
    """Each sample of `table` alone through the spread towers' layers (`units`: several at once)."""
    n = len(table)
    zero = np.zeros(n)
    if not sm.active:
        none = {k: zero for k in KEEP_MODES}
        return EncodeCosts(pre=zero, post=none, kept=none, transient=none, feature=zero,
                           media=np.zeros(n, dtype=bool), units=UnitCosts(sm, table))
    fwd, post, kept, transient = _tower_costs(sm, table.tokens, table.squares)
    streams = sorted({k for t, w in sm.encoders.items() if w in OFF_STAGE
                      for k in TOWER_STREAMS[t] + (FEATURE_STREAM[t],)})
    return EncodeCosts(pre=fwd, post=post, kept=kept, transient=transient,
                       feature=table.tokens @ sm.feature_bytes,
                       media=table.tokens[:, streams].sum(axis=1) > 0, units=UnitCosts(sm, table))


def lpt_shares(work: Sequence[float], ranks: int) -> list[list[int]]:
    """Longest processing time first: items (indices into `work`) by decreasing work, ties by
    index, each to the rank with the least load so far, ties to the lower rank. Each share
    is returned in increasing index order."""
    loads = [0.0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(work)), key=lambda i: (-float(work[i]), i)):
        s = min(range(ranks), key=lambda s: (loads[s], s))
        out[s].append(i)
        loads[s] += float(work[i])
    return [sorted(o) for o in out]


def _share(x: np.ndarray, parts: int) -> float:
    """RESERVE_MARGIN x an even share of x over `parts` plus its largest entry (at most the
    whole)."""
    return float(min(x.sum(), RESERVE_MARGIN * x.sum() / parts + x.max())) if len(x) else 0.0


def keep_mode(sm: SpreadModel, ec: EncodeCosts, rows: Sequence[int], *, pp: int, dp: int) -> str:
    """The cheapest KEEP_MODES entry whose reserve for a step of `rows` takes at most
    KEEP_SHARE of the usable memory (else `tower`, which keeps the least)."""
    if not sm.active or not sm.learns or not len(rows):
        return "none"
    idx = np.asarray(list(rows), dtype=np.int64)
    for mode in KEEP_MODES:
        if sm.static + _share(ec.kept[mode][idx], pp * dp) <= KEEP_SHARE * sm.cost.usable_bytes:
            return mode
    return "tower"


def reserve_bytes(sm: SpreadModel, ec: EncodeCosts, rows: Sequence[int], *, pp: int, dp: int) -> np.ndarray:
    """[pp] bytes each stage's rank leaves to the spread towers while the pipeline runs, when
    a step of `rows` (rows of the table `ec` was made from) is planned: their static bytes,
    a rank's share of kept bytes under `keep_mode` and, on stage 0, its replica's features,
    each share as RESERVE_MARGIN x an even share plus the largest sample's (never more than
    the whole). The post-pass's transient bytes are not reserved: the pipeline's activations
    are freed by then (`price_step` checks that phase on its own)."""
    out = np.full(pp, sm.static_rest)
    out[0] = sm.static
    if not sm.active or not len(rows):
        return out
    idx = np.asarray(list(rows), dtype=np.int64)
    out += _share(ec.kept[keep_mode(sm, ec, rows, pp=pp, dp=dp)][idx], pp * dp)
    out[0] += _share(ec.feature[idx], dp)
    return out


def reserved_pipeline(sm: SpreadModel, reserve: float) -> CostModel:
    """The pipeline cost model with `reserve` bytes of every rank's usable memory taken (the
    partition search's uniform form of `reserve_bytes`: its largest entry)."""
    if not sm.active:
        return sm.pipeline
    hw = sm.pipeline.hardware
    return dataclasses.replace(sm.pipeline, hardware=dataclasses.replace(
        hw, reserved_gb=hw.reserved_gb + reserve / GB))


def pipeline_stage_costs(sm: SpreadModel, plan: StagePlan, reserve: np.ndarray | None = None) -> StageCosts:
    """Stage costs of the pipeline's layers under a stage plan over every layer, with
    `reserve` ([pp] bytes, `reserve_bytes`) counted as static bytes of each stage, so the
    balancer leaves that room; `price_step` takes it out again."""
    p = sm.to_pipeline(plan) if sm.active else plan
    sc = stage_costs(sm.pipeline, p.stages, p.recompute)
    if reserve is None:
        return sc
    return dataclasses.replace(sc, static=sc.static + np.asarray(reserve, dtype=float))


@dataclass(frozen=True, kw_only=True, slots=True)
class SpreadStep:
    """One step priced under a spread placement."""

    step_time: float
    """max over replicas of pre-pass + pipeline + post-pass + the towers' reduce and broadcast, plus the
    per-step overhead, s."""
    encode: tuple[tuple[tuple[int, ...], ...], ...]
    """Per replica, per stage: the rows its rank encodes."""
    mode: str
    """What the shares keep from the pre-pass to the post-pass (KEEP_MODES)."""
    replica_times: tuple[float, ...]
    """Per replica: pre-pass + pipeline (with its per-micro-batch cost) + post-pass, s."""
    compute: tuple[float, ...]
    """Per replica: pre-pass + 1F1B makespan + post-pass, s (0 without samples)."""
    pre: tuple[float, ...]
    """Per replica, its pre-pass (encode and feature transfers), s."""
    post: tuple[float, ...]
    """Per replica, its post-pass (gradient transfers and backward), s."""
    loads: tuple[tuple[float, ...], ...]
    """Per replica, per stage: its rank's encode time (pre-pass forward + post-pass), s."""
    allreduce: float
    """The slowest replica's gradient reduce and weight broadcast (`allreduce_s`; 0 where only
    stage 0 encoded), s."""
    peaks: tuple[tuple[float, ...], ...]
    """Per replica, per stage: its rank's peak bytes (pipeline stage + spread towers)."""
    fits: bool
    """Every rank within the usable memory less the headroom."""
    slots: tuple = ()
    """Nested: per replica, per stage, (micro-batch, encode step, tower-backward step) of each
    micro-batch its rank encodes part of (planner/nested.py `slots`); empty under spread."""


def price_step(sm: SpreadModel, ec: EncodeCosts, replicas: Replicas, ev: StepEval, sc: StageCosts,
               reserve: np.ndarray, *, table: SampleTable | None = None,
               packing: bool = True) -> SpreadStep:
    """Price a step whose pipeline part `ev` (`evaluate_step` on `sc`, the pipeline's stage
    costs with `reserve` counted in their static bytes) ran the micro-batches `replicas`
    (rows of the table `ec` was made from). A nested placement
    (`sm.nested`) needs `table` and `packing` too: its program is timed per micro-batch
    (planner/nested.py).

    A rank's peak is the larger of two phases: while the pipeline runs, its stage's static
    bytes and in-flight peak + the spread towers' static bytes + its share's kept bytes (+ on
    stage 0 the replica's features); in the post-pass, its stage's static bytes + the
    towers' static bytes + its share's kept bytes + the largest transient of its share."""
    pp = sc.pp
    dp = len(replicas)
    usable = sm.cost.usable_bytes
    static = sc.static - np.asarray(reserve, dtype=float)
    members = [[i for mb in rep for i in mb if ec.media[i]] for rep in replicas]
    rows = [i for rep in replicas for mb in rep for i in mb]
    # nested: stage 0 keeps only its in-flight micro-batches' share, so every mode is tried
    first = 0 if sm.nested else KEEP_MODES.index(keep_mode(sm, ec, rows, pp=pp, dp=len(replicas)))
    if sm.nested and table is None:
        raise ValueError("price_step: a nested placement is timed per micro-batch; pass the step's table")
    best = None
    for mode in KEEP_MODES[first:] if sm.learns else ("none",):
        if sm.nested:
            got = [nested_replica(sm, ec, table, rep, sc, mode, packing=packing,
                                  room=[usable - _pipeline_bytes(sm, ec, rep, ev, sc, static, r, s) for s in range(pp)])
                   if rep else ([[]] * pp, None) for r, rep in enumerate(replicas)]
            shares, sims = [g[0] for g in got], [g[1] for g in got]
        else:
            shares = [[[rows[j] for j in share] for share in lpt_shares(
                [ec.pre[i] + ec.post[mode][i] for i in rows], pp)] for rows in members]
            sims = [None] * dp
        peaks = []
        for r, rep in enumerate(replicas):
            row = []
            for s in range(pp):
                held = _held(sm, rep, set(shares[r][s]), ec.kept[mode], pp if s == 0 else pp + 2)
                kept = (sm.static if s == 0 else sm.static_rest) + held
                during = _pipeline_bytes(sm, ec, rep, ev, sc, static, r, s) + held
                after = static[s] + kept + ec.units.share(rep, shares[r][s], mode)[2]
                row.append(max(during, after))
            peaks.append(tuple(row))
        fits = all(p <= usable * (1 + 1e-9) for rep in peaks for p in rep)
        best = (mode, shares, sims, peaks, fits)
        if fits:
            break
    assert best is not None
    mode, shares, sims, peaks, fits = best
    # the reduce to stage 0 and the weights' broadcast, per replica, only where a rank of stage
    # s >= 1 encoded (runtime/spread.py `_reduce`, `_sync_if_used`)
    syncs = [sm.allreduce_s(pp) if any(shares[r][1:]) else 0.0 for r in range(dp)]
    ar = max(syncs, default=0.0)
    parts = (_nested_parts if sm.nested else _spread_parts)(sm, ec, replicas, ev, shares, sims, mode)
    times, compute, pres, posts, loads = parts
    step = (sm.cost.hardware.step_seconds(max((t + x for t, x in zip(times, syncs)), default=0.0))
            if any(replicas) else 0.0)
    slots_ = tuple(tuple(tuple(tuple(x) for x in st) for st in nested_slots(
        pp, len(rep), [[k for k, mb in enumerate(rep) if set(mb) & set(shares[r][s])] for s in range(pp)]))
        if sm.nested else () for r, rep in enumerate(replicas))
    return SpreadStep(step_time=step, encode=tuple(tuple(tuple(sh) for sh in rep) for rep in shares),
                      mode=mode, replica_times=tuple(times), compute=tuple(compute), pre=tuple(pres),
                      post=tuple(posts), loads=tuple(loads), allreduce=ar,
                      peaks=tuple(tuple(p) for p in peaks), fits=bool(fits), slots=slots_)


def _pipeline_bytes(sm: SpreadModel, ec: EncodeCosts, rep: Sequence[Sequence[int]], ev: StepEval,
                    sc: StageCosts, static: np.ndarray, r: int, s: int) -> float:
    """Replica r's stage s while the pipeline runs, without its encode share's kept bytes: the
    stage's static bytes and in-flight peak, the towers' static bytes and, on stage 0, the
    replica's features it holds."""
    feat = _held(sm, rep, set(i for mb in rep for i in mb), ec.feature, sc.pp) if s == 0 else 0.0
    return ev.replica_peaks[r][s] - sc.static[s] + static[s] + (sm.static if s == 0 else sm.static_rest) + feat


def _held(sm: SpreadModel, rep: Sequence[Sequence[int]], rows: set, per: np.ndarray, window: int) -> float:
    """Bytes a rank holds at once of `per` over the samples `rows` of a replica: all of them
    under spread (pre-pass to post-pass); under nested those of `window` consecutive
    micro-batches, the largest such window (planner/nested.py's program: stage 0 holds its
    part of a micro-batch from just before its forward to just after its backward, 1F1B keeps
    at most pp in flight; a rank of stage s >= 1 from about step 2k - 2 to 2k + 2pp + 1, pp + 2
    micro-batches)."""
    each = [float(sum(per[i] for i in mb if i in rows)) for mb in rep]
    if not sm.nested or len(each) <= window:
        return float(sum(each))
    return max(sum(each[k:k + window]) for k in range(len(each) - window + 1))


def _spread_parts(sm: SpreadModel, ec: EncodeCosts, replicas: Replicas, ev: StepEval, shares, _sims, mode: str):
    """Per replica: time, compute, pre-pass, post-pass and per-stage loads under spread."""
    hw = sm.cost.hardware
    pp = len(shares[0]) if shares else 0
    times, compute, pres, posts, loads = [], [], [], [], []
    for r, rep in enumerate(replicas):
        costs = [ec.units.share(rep, sh, mode) for sh in shares[r]]  # a micro-batch's part per pass
        fwd = [c[0] for c in costs]
        post = [c[1] for c in costs]
        nbytes = [float(sum(ec.feature[i] for i in sh)) for sh in shares[r]]
        t = 0.0
        for s in sorted((s for s in range(1, pp) if shares[r][s]), key=lambda s: (fwd[s], s)):
            t = max(t, fwd[s]) + hw.link_latency_s + nbytes[s] / hw.link_bytes_per_s
        pre = max(max(fwd, default=0.0), t)
        back = post[0]
        if sm.learns:
            t = 0.0
            for s in sorted((s for s in range(1, pp) if shares[r][s]), key=lambda s: (-post[s], s)):
                t += hw.link_latency_s + nbytes[s] / hw.link_bytes_per_s
                back = max(back, t + post[s])
        else:
            back = 0.0
        span = float(ev.replicas[r].makespan) if ev.replicas[r] is not None else 0.0
        times.append(pre + ev.replica_times[r] + back if rep else 0.0)
        compute.append(pre + span + back if rep else 0.0)
        pres.append(pre)
        posts.append(back)
        loads.append(tuple(f + p for f, p in zip(fwd, post)))
    return times, compute, pres, posts, loads


def _nested_parts(sm: SpreadModel, ec: EncodeCosts, replicas: Replicas, _ev: StepEval, shares, sims, mode: str):
    """Per replica under nested: time, compute (the program's makespan), `pre` = stage 0's wait
    for features, `post` = the tower backward after the pipeline's last backward, loads."""
    hw = sm.cost.hardware
    times, compute, pres, posts, loads = [], [], [], [], []
    for r, rep in enumerate(replicas):
        sim = sims[r]
        span = sim.makespan if sim is not None else 0.0
        times.append(hw.replica_seconds(span, len(rep)) if rep else 0.0)
        compute.append(span)
        pres.append(sim.wait if sim is not None else 0.0)
        posts.append(sim.makespan - sim.pipeline_end if sim is not None else 0.0)
        loads.append(tuple(sum(ec.units.share(rep, sh, mode)[:2]) for sh in shares[r]))
    return times, compute, pres, posts, loads


def nested_replica(sm: SpreadModel, ec: EncodeCosts, table: SampleTable, rep: Sequence[Sequence[int]],
                   sc: StageCosts, mode: str, *, packing: bool, room: Sequence[float]
                   ) -> tuple[list[list[int]], NestedTimes]:
    """One replica's nested shares and their timed program (`simulate_nested`): the planner's
    rule (`assign_shares`, from every sample on stage 0, moving a sample only where the rank's
    kept bytes stay within its `room`), or spread's longest-first shares where they time
    shorter."""
    hw = sm.cost.hardware
    c = mb_costs(sc, table, rep, packing=packing)
    pp, m = c.fwd.shape

    def timed(shares: list[list[int]]) -> NestedTimes:
        enc, back, tr = np.zeros((pp, m)), np.zeros((pp, m)), np.zeros((pp, m))
        parts = np.zeros((pp, m), dtype=bool)
        for s, share in enumerate(shares):
            mine = set(share)
            for k, mb in enumerate(rep):
                unit = [i for i in mb if i in mine]  # one tower pass (runtime/spread.py EncodeStep.units)
                if unit:
                    pre_k, post_k, _ = ec.units(unit)
                    enc[s, k], back[s, k] = pre_k, post_k[mode] if sm.learns else 0.0
                    tr[s, k] = hw.link_latency_s + float(sum(ec.feature[i] for i in unit)) / hw.link_bytes_per_s
                    parts[s, k] = True
        return simulate_nested(fwd=c.fwd, bwd=c.bwd_in + c.bwd_w, send_fwd=c.send_fwd, send_bwd=c.send_bwd,
                               encode=enc, tower_backward=back, transfer=tr, parts=parts)

    media = [[int(i) for i in mb if ec.media[i]] for mb in rep]
    every = [i for mb in media for i in mb]
    kept = ec.kept[mode]

    def fits(stage: int, share: list[int]) -> bool:
        held = _held(sm, rep, set(share), kept, pp if stage == 0 else pp + 2)
        return held + ec.units.share(rep, share, mode)[2] <= room[stage]

    sync = sm.allreduce_s(pp)  # paid once a stage s >= 1 encodes (price_step adds it)
    best = assign_shares(timed, media, ec.pre, pp, fits=fits, sync=sync)
    lpt = [sorted(every[j] for j in share)
           for share in lpt_shares([ec.pre[i] + ec.post[mode][i] for i in every], pp)]
    t = timed(lpt)
    if t.makespan + (sync if any(lpt[1:]) else 0.0) < best[1].makespan + (sync if any(best[0][1:]) else 0.0) - 1e-12:
        return lpt, t
    return best


def plan_spread_step(sm: SpreadModel, ec: EncodeCosts, table: SampleTable, rows: Sequence[int], plan: StagePlan,
                     balance: Callable[[StageCosts], Replicas], *, pp: int, dp: int, packing: bool = True,
                     ladder: Ladder | None = None) -> tuple[StageCosts, Replicas, StepEval,
                                                                                        SpreadStep]:
    """One step of `rows` (rows of `table`, which `ec` was made from) under a spread placement:
    the pipeline's stage costs with the spread towers' memory reserved (`reserve_bytes`), the
    micro-batches `balance` deals on them, their 1F1B evaluation and the step's price
    (`price_step`; `ladder`: what packed micro-batches are padded
    to, ladder.py)."""
    reserve = reserve_bytes(sm, ec, rows, pp=pp, dp=dp)
    sc = dataclasses.replace(pipeline_stage_costs(sm, plan, reserve), ladder=ladder)
    reps = balance(sc)
    ev = evaluate_step(sc, table, reps, packing=packing)
    return sc, reps, ev, price_step(sm, ec, reps, ev, sc, reserve, table=table, packing=packing)


def encode_by_rank(encode: Sequence[Sequence[Sequence[int]]] | None, pp: int, dp: int) -> list[list[int]]:
    """A step's encode shares (per replica, per stage) in global rank order, rank = stage x dp
    + replica (DeepSpeed's pipe-major PipeModelDataParallelTopology); empty lists when no tower
    is spread."""
    out: list[list[int]] = [[] for _ in range(pp * dp)]
    for r, rep in enumerate(encode or ()):
        for s, share in enumerate(rep):
            out[s * dp + r] = [int(i) for i in share]
    return out


def slots_by_rank(slots: Sequence[Sequence[Sequence[Sequence[int]]]], pp: int, dp: int) -> list[list[list[int]]]:
    """A nested step's slots (per replica, per stage: [micro-batch, encode step, tower-backward
    step]) in global rank order, as `encode_by_rank` orders the shares."""
    out: list[list[list[int]]] = [[] for _ in range(pp * dp)]
    for r, rep in enumerate(slots):
        for s, st in enumerate(rep):
            out[s * dp + r] = [[int(x) for x in e] for e in st]
    return out


def candidate_cuts(sm: SpreadModel, own: StagePlan, staged: StagePlan | None) -> list[StagePlan]:
    """The cuts a placement off the stages is priced on: its own; a nested one also the staged
    cut `staged` made runnable (`nested_cut`: stage 0 encodes what no bubble holds), when it
    differs and fits."""
    cuts = [own]
    if sm.nested and staged is not None:
        with contextlib.suppress(ValueError):
            cut = nested_cut(sm, staged)
            cuts += [cut] if cut != own else []
    return cuts


def nested_cut(sm: SpreadModel, plan: StagePlan) -> StagePlan:
    """A cut over every layer made runnable off the stages: each stage starts at its first
    pipeline layer, stage 0 reaches past the off-stage towers (`SpreadModel.to_full`): the
    staged cut with its tower stage joined to the next pipeline layer, for a nested placement
    whose stage 0 encodes what no bubble holds. ValueError when the stages do not fit."""
    keep = list(sm.keep)
    starts = [0] + [next((j for j, full in enumerate(keep) if full >= a), len(keep)) for a, _ in plan.stages[1:]]
    for s in range(1, len(starts)):
        starts[s] = max(starts[s], starts[s - 1] + 1)
    if starts[-1] >= len(keep):
        raise ValueError(f"{plan.pp} stages do not fit after the off-stage encoder layers")
    bounds = starts + [len(keep)]
    return sm.to_full(StagePlan(stages=[(bounds[s], bounds[s + 1]) for s in range(plan.pp)],
                                recompute=plan.recompute))
