"""Nested encoders (plan.encoders=nested): the spread towers' work inside DeepSpeed's 1F1B steps.

The towers are held, shared out and summed exactly as spread towers (runtime/spread.py: stage 0
owns their weights, every other rank of a replica runs a replica, the gradients are reduced
into stage 0's parameters before the optimizer step, the weights broadcast before a step that
needs them); only the
order differs, and it is planner/nested.py's `program` (the one home of it; `nested_program` in
the planner's api):

- `NestedSchedule` is DeepSpeed's `TrainSchedule` with four instructions of mmpipe's inserted
  where the program puts them: `EncodeFeatures(mb)` (this rank encodes its share of a
  micro-batch; a rank of stage s >= 1 sends the features to stage 0 without waiting),
  `RecvFeatures(mb)` (stage 0, before that micro-batch's forward: the other ranks' features of
  it, joined into the leaves its forward reads), `SendFeatureGrads(mb)` (stage 0, after that
  micro-batch's backward: the leaves' gradients to the ranks that encoded them, without
  waiting) and `TowerBackward(mb)` (the share's tower backward: on stage 0 right there, on
  every other rank in its cool-down).
- `NestedTowers` runs them; the engine's instruction map (an instance-level copy, as
  runtime/telemetry.py patches it) dispatches them, and `engine._train_schedule` (what
  `PipelineEngine.train_batch` asks for its schedule) returns a NestedSchedule for the step.

Feature traffic runs on a process group of its own, so that its point-to-point order never
interleaves with DeepSpeed's activation and gradient traffic between the same two ranks (NCCL
matches sends and receives by order per pair and communicator), and every send is
non-blocking (waited for before the gradient reduction): a rank never waits on a send, only
stage 0 on the features of the micro-batch it is about to run, and a rank on the gradients of
the share it is about to run backward, both made earlier in every other rank's program.
DeepSpeed's own activation and gradient sends are made non-blocking too (runtime/sends.py), so
that a stage never waits for a neighbour busy with tower work to post its receive.

Written by hand: DeepSpeed's pipeline engine takes a schedule as a class and runs whatever
instructions its map knows, but ships no schedule that runs work outside the stage chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from mmpipe.planner.api import BACKWARD, ENCODE, FORWARD, TOWER_BACKWARD, nested_program
from mmpipe.runtime.sends import PendingSends
from mmpipe.runtime.spread import EncodeStep, SpreadTowers, join_parts, recv_tensor, send_tensor, split_parts


class EncodeFeatures(ds_schedule.PipeInstruction):
    """Encode this rank's share of micro-batch `mb` (stage s >= 1: and send it to stage 0)."""


class RecvFeatures(ds_schedule.PipeInstruction):
    """Stage 0: receive micro-batch `mb`'s features and make the leaves its forward reads."""


class SendFeatureGrads(ds_schedule.PipeInstruction):
    """Stage 0: send micro-batch `mb`'s feature gradients to the ranks that encoded them."""


class TowerBackward(ds_schedule.PipeInstruction):
    """Run the tower backward of this rank's share of micro-batch `mb`."""


class NestedSchedule(ds_schedule.TrainSchedule):
    """DeepSpeed's TrainSchedule with the nested program's instructions (module docstring)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, shares: Sequence[int]) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.ops = nested_program(stages, micro_batches, stage_id, shares)

    def steps(self):
        first = self.stage_id == 0
        before: dict[int, list] = {}  # step -> mmpipe's instructions before its pipeline op
        after: dict[int, list] = {}  # step -> after its backward (stage 0's tower backward)
        tail: list = []  # after the last pipeline op: before the gradient reduction
        pending: list = []
        for o in self.ops:
            if o.op in (FORWARD, BACKWARD):
                before[o.step], pending = pending, []
            elif first and o.op == TOWER_BACKWARD:
                after.setdefault(o.step, []).append(TowerBackward(mb=o.mb))
            else:
                pending.append(EncodeFeatures(mb=o.mb) if o.op == ENCODE else TowerBackward(mb=o.mb))
        tail = pending
        waits = (ds_schedule.RecvActivation, ds_schedule.RecvGrad, ds_schedule.LoadMicroBatch,
                 ds_schedule.ForwardPass, ds_schedule.BackwardPass)
        for step_id, cmds in enumerate(super().steps()):
            mb, _ = self._step_to_micro_batch(step_id)
            pre = before.get(step_id, [])
            out = []
            for cmd in cmds:
                if pre and isinstance(cmd, waits):  # after this step's sends, before its first wait
                    out += pre
                    pre = []
                if first and isinstance(cmd, ds_schedule.ForwardPass):
                    out.append(RecvFeatures(mb=mb))
                if isinstance(cmd, ds_schedule.ReduceTiedGrads):
                    out += tail
                    tail = []
                out.append(cmd)
                if first and isinstance(cmd, ds_schedule.BackwardPass):
                    out.append(SendFeatureGrads(mb=mb))
                    out += after.get(step_id, [])
            yield out + pre


class NestedTowers(SpreadTowers):
    """One rank's part of nested towers: SpreadTowers' shares, weights and reduction, run at the
    NestedSchedule's instructions instead of a pre-pass and a post-pass."""

    timed = {EncodeFeatures: "tower", TowerBackward: "tower", RecvFeatures: "comm", SendFeatureGrads: "comm"}
    """The telemetry kinds of the four instructions: a rank's encoder work is compute, not bubble."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.group = dist.new_group(backend=dist.get_backend())  # every rank creates it, in the same order
        self._sending: list = []
        self._pieces: dict[int, dict] = {}
        self._grads: dict[int, dict] = {}
        self._own: list[torch.Tensor | None] = [None] * len(self.params)
        """Stage 0: its own share's tower gradients of the step, fp32, taken out of `.grad` after
        each TowerBackward (DeepSpeed's bf16 optimizer clears a stage's `.grad` before each of
        its backward passes)."""

    def install_post_pass(self) -> None:
        """The four instructions and the gradient reduction into this engine's instruction map,
        and its schedule: call after any other patch of the map (StageTimer's)."""
        super().install_post_pass()
        patched = dict(self.engine._INSTRUCTION_MAP)
        patched[EncodeFeatures] = lambda _eng, mb: self.encode(mb)
        patched[RecvFeatures] = lambda _eng, mb: self.receive(mb)
        patched[SendFeatureGrads] = lambda _eng, mb: self.send_grads(mb)
        patched[TowerBackward] = lambda _eng, mb: self.tower_backward(mb)
        self.engine._INSTRUCTION_MAP = patched
        self.engine._train_schedule = self._schedule
        PendingSends(self.engine)  # DeepSpeed's sends: not waiting for a receiver at tower work (kept by the map)

    def _schedule(self) -> ds_schedule.TrainSchedule:
        eng = self.engine
        if self._step is None:  # no step announced (nothing to encode): DeepSpeed's own
            return ds_schedule.TrainSchedule(micro_batches=eng.micro_batches, stages=eng.num_stages,
                                             stage_id=eng.stage_id)
        mbs = [k for k in range(len(self._step.groups)) if self._step.part(self.stage, k)]
        return NestedSchedule(eng.micro_batches, eng.num_stages, eng.stage_id, mbs)

    # -- per step ------------------------------------------------------------------

    def forward(self, step: EncodeStep) -> None:
        """Announce the step (before train_batch): nothing is encoded yet."""
        units = self._begin(step)
        self._sending = []
        if len(step.groups) != self.engine.micro_batches:
            raise RuntimeError(f"the step has {len(step.groups)} micro-batches to encode for, the engine runs "
                               f"{self.engine.micro_batches}")
        self._per = [None] * len(units)
        self._rng = [None] * len(units)
        self._pieces = {slot: {} for _, slot, _ in self.keys}
        self._grads = {slot: {} for _, slot, _ in self.keys}
        self._bank = [None] * len(step.groups)
        self._active = self.stage == 0

    def encode(self, mb: int) -> None:
        """EncodeFeatures: this rank's part of micro-batch `mb`, in one tower pass."""
        step = self._step
        part = step.part(self.stage, mb)
        n = step.units(self.stage).index(part)
        self._rng[n], self._per[n] = self._encode_one(step, n)
        for j, (tower, slot, axis) in enumerate(self.keys):
            out = self._per[n][j]
            if self.stage == 0:
                self._pieces[slot].update(split_parts(out, part, step.rows, tower, axis))
            else:  # a unit's output is already in the order its part travels
                self._sending += send_tensor(out.detach(), self.stage_ranks[0], group=self.group, wait=False)

    def receive(self, mb: int) -> None:
        """RecvFeatures (stage 0): the other ranks' parts of micro-batch `mb`, then its leaves."""
        step, device = self._step, self.engine.device
        for s in range(1, len(step.shares)):
            part = step.part(s, mb)
            for tower, slot, axis in self.keys if part else ():
                x = recv_tensor(self.stage_ranks[s], device, group=self.group)
                self._pieces[slot].update(split_parts(x, part, step.rows, tower, axis))
        self._bank[mb] = self._leaves(step, step.groups[mb], self._pieces)
        for pieces in self._pieces.values():  # joined: the parts go
            for i in step.groups[mb]:
                for kind in ("image", "video", "audio"):
                    pieces.pop((i, kind), None)

    def send_grads(self, mb: int) -> None:
        """SendFeatureGrads (stage 0): micro-batch `mb`'s feature gradients to their encoders."""
        step = self._step
        if not self.params:
            self._bank[mb] = None
            return
        group = step.groups[mb]
        for tower, slot, axis in self.keys:
            leaf = self._bank[mb][slot]
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            pieces = split_parts(g, group, step.rows, tower, axis)
            for s in range(len(step.shares)):
                part = step.part(s, mb)
                if not part:
                    continue
                if s == 0:
                    self._grads[slot].update({key: pieces[key] for key in pieces if key[0] in set(part)})
                else:
                    self._sending += send_tensor(join_parts(pieces, part, tower, axis), self.stage_ranks[s],
                                                 group=self.group, wait=False)
        self._bank[mb] = None  # the leaves go; their gradients travel

    def tower_backward(self, mb: int) -> None:
        """TowerBackward: this rank's share of micro-batch `mb` through its tower backward."""
        if not self.params:
            return
        step, device = self._step, self.engine.device
        part = step.part(self.stage, mb)
        if self.stage == 0:
            received = {slot: join_parts(self._grads[slot], part, tower, axis) for tower, slot, axis in self.keys}
        else:
            received = {slot: recv_tensor(self.stage_ranks[0], device, group=self.group) for _, slot, _ in self.keys}
        self._backward_part(step, part, received)
        if self.stage == 0:  # between DeepSpeed's backward passes: out of .grad (see _own)
            for n, p in enumerate(self.params):
                if p.grad is not None:
                    g = p.grad.detach().float()
                    self._own[n] = g if self._own[n] is None else self._own[n].add_(g)
                    p.grad = None

    def _local_grads(self) -> list[torch.Tensor]:
        if self.stage != 0:
            return super()._local_grads()
        return [g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                for g, p in zip(self._own, self.params)]

    def backward(self) -> None:
        """At ReduceGrads: every send arrived; the towers' gradients summed into stage 0's."""
        for work, _ in self._sending:
            work.wait()
        self._active = False
        step = self._step
        self._step, self._outputs, self._bank, self._per, self._sending = None, {}, [], [], []
        self._pieces, self._grads = {}, {}
        if step is not None and self.params:
            self._reduce(step)
        self._own = [None] * len(self.params)
