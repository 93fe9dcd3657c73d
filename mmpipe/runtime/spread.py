"""Spread encoders (plan.encoders=spread): a tower encoded by every rank of a replica, off the pipeline.

A spread tower (its embed, blocks and projector) keeps its place on stage 0 of the DeepSpeed
PipelineModule: its weights are stage 0's parameters, so DeepSpeed's optimizer (ZeRO-1
sharding, global-norm clipping, mmpipe's GlobalGradClip), its checkpoints, the resharding resume
and the export treat them exactly as a staged tower's. What changes is where they run:

1. pre-pass (before `train_batch`): every rank of the replica encodes the share of the step's
   samples the planner gave its stage (`StepPlan.encode`): stage 0 with the PipelineModule's own
   tower layers, every other stage with a replica of them (same builder, weights broadcast from
   stage 0 at start and after optimizer steps, see 4). The projected features go point-to-point
   to the replica's stage-0 rank, which holds them as leaf tensors, one per micro-batch.
2. pipeline: stage 0's tower layers pass the carrier through; a forward pre-hook of the
   PipelineModule puts the micro-batch's features (found by the index the data iterator carries
   in the tower's slot) into the carrier, so llm.embed reads them as a staged projector's output.
3. post-pass (DeepSpeed's ReduceGrads instruction, after the last backward, before the
   gradient reduction, clipping and step): stage 0 sends every rank the gradients of the
   features it encoded; each rank runs its tower backward; a reduce over the replica's
   pipeline ranks sums the towers' gradients into stage 0's parameters (skipped when only
   stage 0 encoded), and DeepSpeed's data-parallel averaging of stage 0's gradients then does
   for them what it does for a staged tower's.
4. before the next step in which a rank other than stage 0 encodes: stage 0 broadcasts the
   updated tower weights to its replica's ranks (every replica's stage 0 holds the same).

Written by hand: DeepSpeed's PipelineEngine has no hook for work outside its stage chain (its
schedule is fixed per stage), and no library gives a replicated module whose optimizer lives on
one pipeline stage; the instruction map is the engine's own dispatch (as runtime/telemetry.py).

Why the feature order is what it is: model/carrier.py (IMAGE holds a micro-batch's image
embeddings in sample order, then its videos'; AUDIO its clips in sample order; DEEPSTACK
[k, tokens, D] follows IMAGE's token order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from mmpipe.model import carrier as C
from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.runtime.pipeline import PipelineSpec, build_layers

TOWER_SLOTS = {"vision": C.IMAGE, "audio": C.AUDIO}
"""The carrier slot a tower's projector fills (the index travels there on stage 0)."""


def spread_layer_names(model: ModelSpec, towers: Sequence[str]) -> list[str]:
    """The layers of the spread towers, in the model's order."""
    return [n for n in layer_names(model) if n.split(".")[0] in towers]


@dataclass(frozen=True, slots=True)
class EncodeStep:
    """One replica's step as the spread towers see it (the same on every rank of the replica)."""

    shares: tuple[tuple[int, ...], ...]
    """Per pipeline stage, the samples (indices into the step's records) its rank encodes."""
    groups: tuple[tuple[int, ...], ...]
    """The replica's micro-batches, in execution order, as the same indices."""
    rows: dict[int, tuple[int, int, int]]
    """Per sample of the replica: its image, video and audio feature rows (LLM tokens)."""
    carriers: tuple[tuple[torch.Tensor, ...], ...]
    """This rank's share as its `units`: each micro-batch's part collated together with its
    media (the towers run a part at once, as a staged tower runs a micro-batch)."""
    mode: str = "none"
    """What the pre-pass keeps for the post-pass (the planner's StepPlan.encode_recompute):
    `none` every activation, `blocks` each layer's input (torch's checkpoint per layer),
    `tower` only the tower's input (the post-pass encodes each sample again, per layer
    checkpointed, then runs its backward)."""

    def part(self, stage: int, mb: int) -> tuple[int, ...]:
        """`stage`'s samples of micro-batch `mb`, in the micro-batch's order (what one carrier
        holds, one tower pass runs and, under nested, one message carries)."""
        mine = set(self.shares[stage])
        return tuple(i for i in self.groups[mb] if i in mine)

    def units(self, stage: int) -> list[tuple[int, ...]]:
        """`stage`'s non-empty parts, micro-batch by micro-batch in execution order."""
        return [u for u in (self.part(stage, k) for k in range(len(self.groups))) if u]

    def order(self, stage: int) -> list[int]:
        """`stage`'s share in the order its joined features travel: its units one after another."""
        return [i for u in self.units(stage) for i in u]


def feature_rows(f: SampleFeatures) -> tuple[int, int, int]:
    """Image, video and audio feature rows of a sample: the LLM tokens its media become."""
    return sum(f.image_tokens), sum(f.video_tokens), sum(f.audio_tokens)


def split_parts(x: torch.Tensor, order: Sequence[int], rows: dict[int, tuple[int, int, int]], tower: str,
            axis: int) -> dict[tuple[int, str], torch.Tensor]:
    """Split a tower's output over `order` (samples in share order) into per-sample parts:
    vision's images of every sample, then their videos; audio's clips."""
    kinds = (("image", 0), ("video", 1)) if tower == "vision" else (("audio", 2),)
    out, start = {}, 0
    for kind, k in kinds:
        for i in order:
            n = rows[i][k]
            out[(i, kind)] = x.narrow(axis, start, n)
            start += n
    if start != x.shape[axis]:
        raise RuntimeError(f"the spread {tower} tower made {x.shape[axis]} feature rows for samples {list(order)}, "
                           f"the planner counted {start}")
    return out


def parts_of_slot(per: list[list[torch.Tensor]], j: int, units: Sequence[Sequence[int]],
                  rows: dict[int, tuple[int, int, int]], tower: str, axis: int) -> dict[tuple[int, str], torch.Tensor]:
    """The outputs of slot j (`per[n][j]`: the unit `units[n]` encoded together) as per-sample parts."""
    out = {}
    for n, unit in enumerate(units):
        out.update(split_parts(per[n][j], unit, rows, tower, axis))
    return out


def feature_leaf(x: torch.Tensor, trains: bool, dtype: torch.dtype) -> torch.Tensor:
    """A micro-batch's features as stage 0's pipeline takes them: a leaf that collects their
    gradient when the tower learns (a layer hands features without a gradient on as bits, as
    the `tower` mode's pre-pass makes them: floats of `dtype` again), frozen ones as they came."""
    if not trains:
        return x.detach()
    return C.from_wire(x.detach(), dtype).requires_grad_(True)


def _rng_state(device) -> tuple:
    """The random state a tower pass starts from (CPU, and the device's where it has one)."""
    cuda = torch.device(device).type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None


@contextlib.contextmanager
def _rng_restored(state: tuple, device):
    """Run with `state` (from _rng_state), then go on from the random state before."""
    cuda = torch.device(device).type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1], device)
        yield


def join_parts(pieces: dict[tuple[int, str], torch.Tensor], order: Sequence[int], tower: str,
               axis: int) -> torch.Tensor:
    kinds = ("image", "video") if tower == "vision" else ("audio",)
    return torch.cat([pieces[(i, kind)] for kind in kinds for i in order], dim=axis)


WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int16, torch.int64, torch.uint8]


def _refuse_gradient_hooks(engine) -> None:
    """DeepSpeed options that move gradients out of `.grad` as backward makes them would take
    stage 0's own tower gradients before the spread towers' reduce: refused, naming the key."""
    cfg = engine._config
    if getattr(getattr(cfg, "bfloat16_config", None), "immediate_grad_update", False) and engine.bfloat16_enabled():
        raise ValueError("deepspeed.config sets bf16.immediate_grad_update=true, which plan.encoders' spread towers "
                         "cannot train with (their gradients are summed over every rank after the pipeline); "
                         "remove it or set plan.encoders=stages")
    if engine.zero_optimization_stage() and getattr(cfg.zero_config, "overlap_comm", False):
        raise ValueError("deepspeed.config sets zero_optimization.overlap_comm=true, which plan.encoders' spread "
                         "towers cannot train with (their gradients are summed over every rank after the "
                         "pipeline); remove it or set plan.encoders=stages")


def _bf16_master_grads(engine):
    """Under DeepSpeed's BF16_Optimizer, a function adding an fp32 gradient to a parameter's
    fp32 accumulation buffer (what its `_update_hp_grad` does with a bf16 `.grad` after each
    backward pass of a stage that is not the last); None under any other optimizer."""
    if not getattr(engine, "using_bf16_optimizer", False):
        return None
    from mmpipe.runtime.dsconfig import require_tested_deepspeed

    require_tested_deepspeed()
    opt = engine.optimizer
    where = {id(lp): (i, j) for i, group in enumerate(opt.bf16_groups) for j, lp in enumerate(group)}

    def add(lp: torch.Tensor, g: torch.Tensor) -> None:
        i, j = where[id(lp)]
        hp = opt.fp32_groups_gradients[i][j]
        hp.add_(g.to(hp.dtype).view(hp.shape))
        lp._hp_grad = hp
        opt.fp32_groups_has_gradients[i][j] = True

    return add


FEATURE_TAG = 73
"""The point-to-point tag of feature traffic (DeepSpeed's pipeline sends with tag 0)."""


def send_tensor(x: torch.Tensor, dst: int, *, group=None, wait: bool = True) -> list:
    """A tensor of any dtype and up to 4 dimensions, with a header saying which. With
    wait=False nothing blocks: the (work, tensor) pairs in flight are returned, and both must
    stay alive until every work is waited for."""
    head = torch.tensor([WIRE_DTYPES.index(x.dtype), x.dim(), *x.shape] + [0] * (4 - x.dim()),
                        dtype=torch.long).to(x.device)
    sent = [head] + ([x.contiguous()] if x.numel() else [])
    if wait:
        for t in sent:
            dist.send(t, dst, group=group, tag=FEATURE_TAG)
        return []
    return [(dist.isend(t, dst, group=group, tag=FEATURE_TAG), t) for t in sent]


def recv_tensor(src: int, device, group=None) -> torch.Tensor:
    head = torch.zeros(6, dtype=torch.long, device=device)
    dist.recv(head, src, group=group, tag=FEATURE_TAG)
    dtype, dim = WIRE_DTYPES[int(head[0])], int(head[1])
    x = torch.empty([int(n) for n in head[2:2 + dim]], dtype=dtype, device=device)
    if x.numel():
        dist.recv(x, src, group=group, tag=FEATURE_TAG)
    return x


class SpreadTowers:
    """One rank's part of the spread towers (module docstring)."""

    timed: dict = {}
    """Instructions of mmpipe's in the engine's map -> the telemetry kind they are timed as
    (none here: the pre-pass runs before the engine's step, the post-pass inside ReduceGrads)."""

    def __init__(self, *, model: ModelSpec, towers: tuple[str, ...], engine, layers: list[nn.Module],
                 dp: int) -> None:
        """`layers`: the spread layers in order; on stage 0 the PipelineModule's own modules,
        elsewhere this rank's replica (built like them, on the engine's device)."""
        self.model = model
        self.towers = towers
        self.engine = engine
        self.layers = layers
        self.dp = dp
        self.stage = engine.stage_id
        grid = engine.grid
        self.stage_ranks = [grid.stage_to_global(stage_id=s) for s in range(engine.num_stages)]  # this replica's
        self.pipe_group = grid.get_pipe_parallel_group()
        self._stale = False
        self.params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        deepstack = model.vision is not None and bool(model.vision.deepstack)
        self.keys = [(tower, slot, axis) for tower in towers
                     for slot, axis in (((C.IMAGE, 0), (C.DEEPSTACK, 1)) if tower == "vision" and deepstack
                                        else ((TOWER_SLOTS[tower], 0),))]
        """What each rank sends stage 0, in this order: (tower, carrier slot, row axis)."""
        self._bank: list[dict[int, torch.Tensor]] = []
        self._per: list = []
        self._rng: list = []
        self._outputs: dict[int, torch.Tensor] = {}
        self._step: EncodeStep | None = None
        self._active = False
        """Stage 0's tower layers pass the pipeline's carrier through (the features are in it)."""
        self._encoding = False
        """This rank runs its share through the tower layers (their real forward, also while
        the pipeline passes through them: the nested schedule encodes between its passes)."""
        self.encoded = 0
        """Samples this rank encoded so far (recorded in its stage file)."""
        _refuse_gradient_hooks(engine)
        if self.stage == 0:
            self._install(engine)
        self.sync_weights(everything=True)

    @classmethod
    def for_rank(cls, spec: PipelineSpec, towers: tuple[str, ...], engine, *, dp: int) -> SpreadTowers:
        """This rank's part of the `towers` (plan.encoders resolved to spread). Stage 0 runs the
        PipelineModule's own tower layers (their first stage must hold them whole: the config
        check and the planner keep them there), the other stages a replica built from `spec`,
        the stages' own recipe."""
        names = spread_layer_names(spec.model, towers)  # all on stage 0: choose_stages checked the cut
        every = layer_names(spec.model)
        index = [every.index(n) for n in names]
        if engine.is_first_stage():
            layers = [engine.module.forward_funcs[i] for i in index]
        else:
            layers = build_layers(spec, names, engine.device)
            dtype = next(engine.module.parameters()).dtype  # DeepSpeed casts a bf16/fp16 stage's parameters
            for p in (p for layer in layers for p in layer.parameters()):  # (not its buffers)
                p.data = p.data.to(dtype)
        return cls(model=spec.model, towers=towers, engine=engine, layers=layers, dp=dp)

    # -- set-up ----------------------------------------------------------------------

    def _install(self, engine) -> None:
        """Stage 0: the tower layers pass through while a step trains, and the features enter
        the carrier before the stage's first layer."""
        for layer in self.layers:
            real = layer.forward
            layer.forward = lambda carrier, _real=real: (carrier if self._active and not self._encoding
                                                         else _real(carrier))

        def put_features(_module, args):
            if not self._active:
                return None
            slots = list(args[0])
            mb = int(slots[TOWER_SLOTS[self.towers[0]]].reshape(-1)[0])
            for slot, x in self._bank[mb].items():
                slots[slot] = x
            return (tuple(slots),)

        engine.module.register_forward_pre_hook(put_features)

    def install_post_pass(self) -> None:
        """Run the post-pass at DeepSpeed's ReduceGrads instruction, before its own reduction;
        call after any other patch of the engine's instruction map (StageTimer's)."""
        from deepspeed.runtime.pipe import schedule

        patched = dict(self.engine._INSTRUCTION_MAP)  # an instance-level copy: this engine only
        reduce = patched[schedule.ReduceGrads]

        def reduce_after_towers(eng, *args, **kwargs):
            self.backward()
            return reduce(eng, *args, **kwargs)

        patched[schedule.ReduceGrads] = reduce_after_towers
        self.engine._INSTRUCTION_MAP = patched

    # -- per step ----------------------------------------------------------------------

    def tag(self, carrier: tuple[torch.Tensor, ...], mb: int) -> tuple[torch.Tensor, ...]:
        """Stage 0's carrier of micro-batch `mb` with the spread towers' slots holding its index."""
        slots = list(carrier)
        for tower in self.towers:
            slots[TOWER_SLOTS[tower]] = torch.tensor([mb], dtype=torch.long)
        return tuple(slots)

    def _encode(self, carrier: tuple[torch.Tensor, ...], *, checkpointed: bool) -> list[torch.Tensor]:
        """One unit (a micro-batch's part) through the tower layers (each layer under torch's non-reentrant
        checkpoint when `checkpointed`: only its input kept, recomputed in backward)."""
        slots = tuple(t.to(self.engine.device) for t in carrier)
        with self._own_pass():
            for layer in self.layers:
                slots = (torch.utils.checkpoint.checkpoint(layer, slots, use_reentrant=False) if checkpointed
                         else layer(slots))
        return [slots[slot] for _, slot, _ in self.keys]

    @contextlib.contextmanager
    def _own_pass(self):
        """The tower layers run for real inside (an encode, a checkpointed layer's recompute)."""
        before, self._encoding = self._encoding, True
        try:
            yield
        finally:
            self._encoding = before

    def _encode_one(self, step: EncodeStep, n: int) -> tuple[tuple, list[torch.Tensor]]:
        """The n-th unit of this rank's share (EncodeStep.units) through the towers as the
        step's keep mode says (EncodeStep.mode); the random state it started from too."""
        rng = _rng_state(self.engine.device)
        if step.mode == "tower" and self.params:
            with torch.no_grad():
                return rng, self._encode(step.carriers[n], checkpointed=False)
        return rng, self._encode(step.carriers[n], checkpointed=step.mode == "blocks" and bool(self.params))

    def _begin(self, step: EncodeStep) -> list[tuple[int, ...]]:
        """What every step starts with (spread's pre-pass, nested's announcement): the replicas'
        weights synced if this step needs them, the towers in train mode, a replica's scratch
        gradients cleared; this rank's units, checked against the carriers collated for them."""
        self._sync_if_used(step)
        self._step, self._outputs = step, {}
        for layer in self.layers:  # stage 0's after an evaluation are in eval mode until train_batch
            layer.train()
        if self.stage != 0:  # a replica's gradients are scratch (stage 0's: the engine zeroes them)
            for p in self.params:
                p.grad = None
        units = step.units(self.stage)
        if len(step.carriers) != len(units):
            raise RuntimeError(f"stage {self.stage} has {len(units)} micro-batch parts to encode but "
                               f"{len(step.carriers)} collated")
        self.encoded += len(step.shares[self.stage])
        return units

    def _leaves(self, step: EncodeStep, group: Sequence[int], pieces: dict[int, dict]) -> dict[int, torch.Tensor]:
        """Stage 0: the leaves micro-batch `group`'s forward reads, joined from the per-sample
        parts in `pieces[slot]`; a sample without a tower's media gets empty parts (it is in no
        share), one with media but no part is an error."""
        trains = bool(self.params)
        dtype = self.params[0].dtype if trains else torch.float32
        entry = {}
        for tower, slot, axis in self.keys:
            held = pieces[slot]
            like = next(iter(held.values()), None)
            empty = self._empty(slot) if like is None else like.narrow(axis, 0, 0)
            for i in group:
                for kind, k in (("image", 0), ("video", 1)) if tower == "vision" else (("audio", 2),):
                    if (i, kind) not in held:
                        if step.rows[i][k]:
                            raise RuntimeError(f"sample {i} has {step.rows[i][k]} {kind} feature rows but no rank "
                                               f"encoded it")
                        held[(i, kind)] = empty
            entry[slot] = feature_leaf(join_parts(held, group, tower, axis), trains, dtype)
        return entry

    def forward(self, step: EncodeStep) -> None:
        """The pre-pass: encode this rank's share unit by unit, send the features to stage 0
        (stage 0: receive every stage's and make each micro-batch's leaves)."""
        units = self._begin(step)
        device = self.engine.device
        mine, order = step.shares[self.stage], step.order(self.stage)
        self._rng, per = [], []
        for n in range(len(step.carriers)):
            rng, out = self._encode_one(step, n)
            self._rng.append(rng)
            per.append(out)
        self._per = per
        if mine:  # the share's features in the carrier's order, one tensor per slot
            self._outputs = {slot: join_parts(parts_of_slot(per, j, units, step.rows, tower, axis), order, tower, axis)
                             for j, (tower, slot, axis) in enumerate(self.keys)}
        if self.stage != 0:
            for _, slot, _ in self.keys if mine else ():
                send_tensor(self._outputs[slot].detach(), self.stage_ranks[0])
            return
        pieces: dict[int, dict] = {slot: {} for _, slot, _ in self.keys}
        for s, share in enumerate(step.shares):
            for tower, slot, axis in self.keys if share else ():
                x = self._outputs[slot].detach() if s == 0 else recv_tensor(self.stage_ranks[s], device)
                pieces[slot].update(split_parts(x, step.order(s), step.rows, tower, axis))
        self._bank = [self._leaves(step, group, pieces) for group in step.groups]
        self._active = True

    def _empty(self, slot: int) -> torch.Tensor:
        """No features: [0, D] (DEEPSTACK: [k, 0, D]) in the towers' dtype."""
        d = self.model.llm.hidden
        shape = (len(self.model.vision.deepstack), 0, d) if slot == C.DEEPSTACK else (0, d)
        dtype = next((p.dtype for layer in self.layers for p in layer.parameters()), torch.float32)
        return torch.zeros(shape, dtype=dtype, device=self.engine.device)

    def backward(self) -> None:
        """The post-pass (every rank, at ReduceGrads): feature gradients back to the ranks that
        encoded them, the towers' backward, their gradients summed over every rank into this
        rank's tower parameters (divided by dp)."""
        step, device = self._step, self.engine.device
        self._active = False
        if step is None or not self.params:
            self._step, self._outputs, self._bank, self._per = None, {}, [], []
            return
        mine = step.shares[self.stage]
        received: dict[int, torch.Tensor] = {}
        if self.stage == 0:
            grads: dict[int, dict] = {slot: {} for _, slot, _ in self.keys}
            for group, entry in zip(step.groups, self._bank):
                for tower, slot, axis in self.keys:
                    leaf = entry[slot]
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    grads[slot].update(split_parts(g, group, step.rows, tower, axis))
            for s, share in enumerate(step.shares):
                for tower, slot, axis in self.keys if share else ():
                    g = join_parts(grads[slot], step.order(s), tower, axis).contiguous()
                    if s == 0:
                        received[slot] = g
                    else:
                        send_tensor(g, self.stage_ranks[s])
        elif mine:
            received = {slot: recv_tensor(self.stage_ranks[0], device) for _, slot, _ in self.keys}
        if mine:
            self._backward_part(step, step.order(self.stage), received)
        self._step, self._outputs, self._bank, self._per = None, {}, [], []
        self._reduce(step)

    def _backward_part(self, step: EncodeStep, part: Sequence[int], received: dict[int, torch.Tensor]) -> None:
        """The feature gradients of `part` (whole units of this rank's share, `received` joined in
        that order) through each unit's tower pass; in `tower` mode its forward runs again first
        (per layer checkpointed, with the random state its first pass started from)."""
        grads = [split_parts(received[slot], part, step.rows, tower, axis) for tower, slot, axis in self.keys]
        inside = set(part)
        for n, unit in enumerate(step.units(self.stage)):
            if not inside.issuperset(unit):
                continue
            g = [join_parts(grads[j], unit, tower, axis) for j, (tower, _, axis) in enumerate(self.keys)]
            if step.mode == "tower":
                with _rng_restored(self._rng[n], self.engine.device), torch.enable_grad():
                    out = self._encode(step.carriers[n], checkpointed=True)
            else:
                out = self._per[n]
            pairs = [(o, x) for o, x in zip(out, g) if o.requires_grad]
            if pairs:
                with self._own_pass():  # a checkpointed layer recomputes its forward in here
                    torch.autograd.backward([o for o, _ in pairs], [x.to(o.dtype) for o, x in pairs])
            self._per[n] = None  # this unit's activations go now

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's tower gradients of the step, one per learning parameter."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def _reduce(self, step: EncodeStep) -> None:
        """The replica's tower gradients summed into its stage 0's parameters: a reduce over the
        replica's pipeline ranks (skipped when only stage 0 encoded this step). DeepSpeed then
        averages stage 0's gradients over the replicas, as a staged tower's: each sample was
        encoded once, on a rank of its own replica."""
        flat = torch.cat([g.reshape(-1).float() for g in self._local_grads()])
        if any(step.shares[1:]):
            dist.reduce(flat, dst=self.stage_ranks[0], group=self.pipe_group)
        if self.stage != 0:
            return
        hp = _bf16_master_grads(self.engine)
        start = 0
        for p in self.params:
            n = p.numel()
            g = flat[start:start + n].view_as(p)
            start += n
            if hp is None:
                p.grad = g.to(p.dtype).clone()
            else:  # bf16: into the fp32 gradient the step reads, not through a bf16 copy
                hp(p, g)

    def stepped(self) -> None:
        """The optimizer stepped: the replicas' trained weights are stale until the next step
        that encodes off stage 0 (`forward` syncs them then)."""
        self._stale = True

    def _sync_if_used(self, step: EncodeStep) -> None:
        """Stage 0's trained weights to the replica's other ranks before a step in which one of
        them encodes (every rank of the replica plans the same shares, so all take part)."""
        if self._stale and any(step.shares[1:]):
            self.sync_weights()
            self._stale = False

    def sync_weights(self, *, everything: bool = False) -> None:
        """Stage 0's tower weights to every rank of its replica (each replica's stage 0 holds the
        same, DeepSpeed keeps them in step): the trained ones when a step needs them; at start
        every tensor, so that a resumed or loaded stage 0 is what every replica runs."""
        with torch.no_grad():
            tensors = [t for layer in self.layers
                       for t in (list(layer.parameters()) + [b for b in layer.buffers() if b.is_floating_point()]
                                 if everything else [p for p in layer.parameters() if p.requires_grad])]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():  # one broadcast per dtype, not one per tensor
                flat = torch.cat([t.data.reshape(-1) for t in group])
                dist.broadcast(flat, src=self.stage_ranks[0], group=self.pipe_group)
                start = 0
                for t in group:
                    t.data.copy_(flat[start:start + t.numel()].view_as(t))
                    start += t.numel()
