"""Defaults that fit the machine: the layout and the hardware preset a run gets when the user sets
neither, for a machine without a GPU, with one and with eight (torch's device queries replaced by
a stated machine), and the one-line refusal of a layout the node's GPUs cannot run."""

from __future__ import annotations

import pytest

from mmpipe.cli import load, main
from mmpipe.commands import train_layout
from mmpipe.machine import Machine, preset_for_gpu
from mmpipe.runtime.host import figures_mismatch


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H800", "h100"),
    ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A800 80GB PCIe", "a100"), ("NVIDIA L40S", None), ("Tesla V100-SXM2-32GB", None), (None, None),
])
def test_a_gpu_gets_the_preset_its_name_says(name, preset):
    assert preset_for_gpu(name) == preset


def _on(monkeypatch, machine: Machine) -> None:
    monkeypatch.setattr("mmpipe.machine.detect", lambda: machine)


def test_no_gpu_trains_a_two_stage_pipeline_on_the_cpu_preset(monkeypatch):
    _on(monkeypatch, Machine())
    rc = load([])
    assert (rc.parallel.pp, rc.parallel.dp) == (2, 1)
    assert rc.hardware["name"] == "cpu" and rc.hardware["device"] == "cpu"
    assert rc.machine_notes == ("hardware=auto: no GPU, the cpu preset",
                                "layout: parallel.pp / parallel.dp unset (no GPU): pp=2 x dp=1 on the CPU")


def test_one_gpu_trains_one_stage_on_its_preset(monkeypatch):
    _on(monkeypatch, Machine(gpus=1, gpu_name="NVIDIA H200"))
    rc = load([])
    assert (rc.parallel.pp, rc.parallel.dp) == (1, 1)
    assert rc.hardware["name"] == "h200" and rc.hardware["memory_gb"] == 141
    assert "hardware=auto: NVIDIA H200, the h200 preset" in rc.machine_notes
    # a key set on the command line applies on top of the chosen preset
    assert load(["hardware.memory_gb=40"]).hardware["memory_gb"] == 40
    # the user's own choices win: a preset by name, and a layout given
    assert load(["hardware=a100"]).hardware["name"] == "a100"
    assert load(["parallel.pp=1", "parallel.dp=1"]).machine_notes == ("hardware=auto: NVIDIA H200, the h200 preset",)


def test_eight_gpus_are_split_by_the_planner_before_launch(monkeypatch):
    _on(monkeypatch, Machine(gpus=8, gpu_name="NVIDIA A100-SXM4-80GB"))
    rc = load(["train.global_batch=64"])
    assert (rc.parallel.pp, rc.parallel.dp, rc.parallel.devices) == ("auto", "auto", 8)
    assert rc.hardware["name"] == "a100"
    chosen = train_layout(rc, say=False)
    assert chosen.parallel.pp * chosen.parallel.dp == 8
    # a fixed pp: the planner picks dp over the 8 GPUs
    fixed = train_layout(load(["parallel.pp=2", "train.global_batch=64"]), say=False)
    assert (fixed.parallel.pp, fixed.parallel.dp) == (2, 4)


def test_a_gpu_without_a_preset_is_planned_but_gets_no_efficiency_figures(monkeypatch):
    _on(monkeypatch, Machine(gpus=1, gpu_name="NVIDIA L40S"))
    rc = load([])
    assert rc.hardware["name"] == "a100" and rc.hardware["device"] == "gpu"
    assert "no efficiency or MFU printed" in " ".join(rc.machine_notes)
    assert "no peak rates of this GPU" in figures_mismatch(rc.hardware, "gpu")


def test_efficiency_is_figured_only_against_the_device_the_ranks_train_on():
    assert figures_mismatch({"name": "cpu", "device": "cpu"}, "cpu") is None
    assert figures_mismatch({"name": "h200", "device": "h200"}, "h200") is None
    assert figures_mismatch({"name": "measured-tiny"}, "cpu") is None  # a file that does not say: this machine's
    assert figures_mismatch({"name": "h100", "device": "h100"}, "cpu") == (
        "hardware=h100 describes h100 and the ranks train on cpu; hardware=auto or a measured file of this "
        "machine gives the figures")
    assert figures_mismatch({"name": "h100", "device": "h100"}, "h200") is not None


@pytest.mark.parametrize("args, fix", [
    (["parallel.pp=2"], "use parallel.pp=1 parallel.dp=1"),
    (["parallel.pp=2", "parallel.dp=2"], "use parallel.pp=1 parallel.dp=1"),
])
def test_a_layout_the_gpus_cannot_run_is_one_line_before_launch(monkeypatch, capsys, tmp_path, args, fix):
    _on(monkeypatch, Machine(gpus=1, gpu_name="NVIDIA H200"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args, "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "ranks need" in err and "torch sees 1 here (1 x NVIDIA H200)" in err and fix in err
    assert "launcher.backend=gloo" in err
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("rank*.log"))


class _Driver:
    """The CUDA driver calls detect makes, answering as a node with `count` GPUs would."""

    def __init__(self, count: int, name: bytes = b"NVIDIA H200", init: int = 0):
        self.count, self.name, self.init = count, name, init

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, out):
        out._obj.value = self.count
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDeviceGetName(self, buf, size, device):
        buf.value = self.name
        return 0


def test_the_gpus_are_counted_and_named_by_the_driver_without_importing_torch():
    """The command line decides the defaults before any rank starts; torch's import takes seconds."""
    from mmpipe.machine import _driver_gpus

    assert _driver_gpus(_Driver(8)) == (8, "NVIDIA H200")
    assert _driver_gpus(_Driver(0)) == (0, None)  # CUDA_VISIBLE_DEVICES=""
    assert _driver_gpus(_Driver(2, init=100)) == (0, None)  # CUDA_ERROR_NO_DEVICE
    assert _driver_gpus(None) == (0, None)  # no NVIDIA driver installed
