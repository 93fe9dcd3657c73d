"""The stage timer (runtime/telemetry.py): what a rank's busy time counts."""

from __future__ import annotations

import time
import types

from deepspeed.runtime.pipe import schedule as ds

from mmpipe.runtime.nested import EncodeFeatures, NestedTowers, TowerBackward
from mmpipe.runtime.telemetry import StageTimer


class _Engine:
    """The engine's instruction dispatch as DeepSpeed's PipelineEngine does it: a class-level map of
    plain functions called with the engine."""

    device = "cpu"

    def _exec_forward_pass(self, buffer_id):
        time.sleep(0.02)

    def _exec_send_activations(self, buffer_id):
        time.sleep(0.01)

    _INSTRUCTION_MAP = {ds.ForwardPass: _exec_forward_pass, ds.SendActivation: _exec_send_activations}

    def run(self, cmd):
        types.MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)


def test_a_nested_towers_encoder_work_is_busy_time_not_bubble():
    eng = _Engine()
    timer = StageTimer(eng)
    patched = dict(eng._INSTRUCTION_MAP)  # as NestedTowers.install_post_pass adds its instructions
    patched[EncodeFeatures] = lambda _eng, mb: time.sleep(0.03)
    patched[TowerBackward] = lambda _eng, mb: time.sleep(0.04)
    eng._INSTRUCTION_MAP = patched
    for instruction, kind in NestedTowers.timed.items():
        if instruction in patched:
            timer.time(eng, instruction, kind)
    for cmd in (EncodeFeatures(mb=1), ds.ForwardPass(buffer_id=0), ds.SendActivation(buffer_id=0), TowerBackward(mb=1)):
        eng.run(cmd)
    step = timer.take()
    assert 0.07 <= step.totals["tower"] < 0.2 and 0.02 <= step.totals["fwd"] < 0.1
    assert 0.01 <= step.totals["comm"] < 0.05
    assert step.busy == step.totals["fwd"] + step.totals["bwd"] + step.totals["tower"]
    assert len(step.fwd) == 1  # the per-micro-batch forwards the step-time fit reads: the pipeline's only


def test_the_trace_has_every_instruction_of_every_step_on_its_ranks_row(tmp_path):
    import json

    from mmpipe.runtime.telemetry import InstructionTrace

    eng = _Engine()
    StageTimer(eng)
    patched = dict(eng._INSTRUCTION_MAP)
    patched[EncodeFeatures] = lambda _eng, mb: time.sleep(0.03)
    eng._INSTRUCTION_MAP = patched
    path = tmp_path / "trace_rank3.json"
    trace = InstructionTrace(eng, path, rank=3, stage=1, first_step=5)  # a run resumed after step 4
    for _ in range(2):
        trace.begin_step()
        for cmd in (EncodeFeatures(mb=2), ds.ForwardPass(buffer_id=1), ds.SendActivation(buffer_id=1)):
            eng.run(cmd)
        trace.end_step()
    partial = path.read_text()  # readable before the run ends: an array left open, as the format allows
    assert partial.startswith("[\n") and json.loads(partial + "\n]")
    trace.close()
    events = json.loads(path.read_text())
    assert events[0] == {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "rank 3 (stage 1)"}}
    ran = [(e["name"], e["args"]) for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert ran == [(name, {key: n, "step": step}) for step in (5, 6)
                   for name, key, n in (("EncodeFeatures", "mb", 2), ("ForwardPass", "buffer_id", 1),
                                        ("SendActivation", "buffer_id", 1))]
    steps = [e for e in events if e.get("tid") == 1]
    assert [e["name"] for e in steps] == ["step 5", "step 6"]
    encode, forward = (e for e in events[1:3])
    assert encode["dur"] >= 0.03e6 and forward["dur"] >= 0.02e6 and forward["ts"] >= encode["ts"] + encode["dur"]
    assert steps[0]["ts"] <= encode["ts"] and steps[0]["ts"] + steps[0]["dur"] >= forward["ts"] + forward["dur"]


def test_on_a_gpu_each_instruction_is_timed_by_the_device_not_the_host(monkeypatch):
    """The host returns from a pass once its kernels are queued: the timer reads CUDA events at
    the step's end instead (here a fake clock: each event records the device time it was reached)."""
    import torch

    device_clock = iter([0.0, 50.0, 50.0, 60.0, 60.0, 140.0])  # ms: forward 50, send 10, backward 80

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = next(device_clock)

        def elapsed_time(self, other):
            return other.t - self.t

    synced = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))

    class GpuEngine(_Engine):
        device = types.SimpleNamespace(type="cuda")

        def _exec_backward_pass(self, buffer_id):
            pass

        _INSTRUCTION_MAP = {**_Engine._INSTRUCTION_MAP, ds.BackwardPass: _exec_backward_pass}

    eng = GpuEngine()
    timer = StageTimer(eng)
    for cmd in (ds.ForwardPass(buffer_id=0), ds.SendActivation(buffer_id=0), ds.BackwardPass(buffer_id=0)):
        eng.run(cmd)  # the host's own sleeps (20 and 10 ms) are not what is counted
    step = timer.take()
    assert synced == [True]
    assert step.fwd == [0.05] and step.bwd == [0.08] and abs(step.totals["comm"] - 0.01) < 1e-12
    assert timer.take().totals["fwd"] == 0.0  # the next step starts empty
