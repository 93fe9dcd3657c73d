"""`mmpipe profile` writes a machine description the planner accepts, for its model only: the
layers' costs, the engine's fixed costs and a rank's memory, measured, not copied."""

from __future__ import annotations

import json
import re
import shlex

import yaml

from mmpipe.cli import load, main
from mmpipe.config import hardware_spec
from mmpipe.paths import CONF_DIR
from mmpipe.planner.cost import KINDS
from mmpipe.planner.hardware import KIND_FALLBACK, hardware_from_dict

QUICK = ["profile.repeats=1", "profile.engine_steps=1"]


def _written(path):
    doc = yaml.safe_load(path.read_text())
    assert doc.pop("device") == "cpu"  # measured here: efficiency and MFU are figured with it on this machine only
    return doc.pop("measured_for"), hardware_from_dict(doc)


def test_profile_writes_a_description_of_this_machine(tmp_path, capsys):
    shipped = (CONF_DIR / "hardware" / "measured-tiny.yaml").read_bytes()
    assert main(["profile", *QUICK, f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    out = tmp_path / "run" / "conf" / "hardware" / "measured-tiny.yaml"  # in the run dir, as a config folder
    model, hw = _written(out)
    assert model == "tiny"
    # every layer kind of the tiny model measured (it has no windowed vision block: that kind takes
    # a vision block's figures)
    assert set(hw.kind_efficiency) == set(KINDS) - set(KIND_FALLBACK)
    assert all(0 < e <= 1 for e in hw.kind_efficiency.values())
    # in seconds, as the planner prices it: a gloo message between two local processes takes
    # tens of microseconds (80 us on the idle 2-core development VM, 2 ms with four test suites
    # sharing its cores); written in milliseconds it would be 0.08 or more, off this range
    assert 2e-6 < hw.link_latency_s < 2e-2, hw.link_latency_s
    assert hw.link_gbps > 0
    assert (CONF_DIR / "hardware" / "measured-tiny.yaml").read_bytes() == shipped  # the shipped file untouched

    # The engine's costs and a rank's memory come from a real pipeline, not from the base preset.
    record = json.loads((tmp_path / "run" / "profile.json").read_text())
    probe = record["probe"]
    assert sorted({st["micro_batches"] for st in probe["steps"]}) == [1, 2, 4, 8, 16]
    cpu = hardware_spec(load([], job="test"))
    assert (hw.micro_batch_overhead_s, hw.step_overhead_s) != (cpu.micro_batch_overhead_s, cpu.step_overhead_s)
    assert hw.micro_batch_overhead_s > 0  # each micro-batch costs the engine something on any machine
    assert hw.reserved_gb * 1e9 == max(probe["before_model"]) > 1e8  # interpreter + torch + DeepSpeed: > 0.1 GB
    text = out.read_text()
    assert "# Engine (a real pipeline, 5 steps of 1 to 16 micro-batches): step = a * compute" in text
    assert "# Memory (peak_rss): resident" in text

    printed = capsys.readouterr().out
    said = re.search(r"link (\d+)us \+ ([\d.]+) GB/s", printed)
    assert said and int(said.group(1)) == round(hw.link_latency_s * 1e6), (said, hw.link_latency_s)  # as printed
    assert float(said.group(2)) == round(hw.link_gbps, 2)
    use = printed.split("use: ")[1].splitlines()[0]
    assert use == f"mmpipe train --config-dir={tmp_path / 'run' / 'conf'} hardware=measured-tiny"
    assert main(["train", *shlex.split(use)[2:], "--cfg", "job", "--package", "hardware"]) == 0  # it works as said
    assert yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1]) == yaml.safe_load(out.read_text())


def test_profile_measures_a_transformers_checkpoint(hf_checkpoints, tmp_path, capsys):
    """model=hf: the checkpoint's own layers on its processors' inputs; the file names the
    checkpoint, plans with it, and is refused for another model."""
    folder = hf_checkpoints["qwen2-vl"]
    run = tmp_path / "run"
    assert main(["profile", "model=hf", f"model.path={folder}", *QUICK, f"hydra.run.dir={run}"]) == 0
    out = run / "conf" / "hardware" / "measured-qwen2-vl.yaml"
    model, hw = _written(out)
    assert model == "qwen2-vl"
    assert set(hw.kind_efficiency) == {"vision.embed", "vision.block", "vision.proj", "llm.embed", "llm.block",
                                       "llm.norm", "llm.head"}
    layers = json.loads((run / "profile.json").read_text())["layers"]
    tokens = sorted({m["tokens"] for m in layers if m["layer"] == "vision.block.0"})
    assert len(tokens) >= 5 and tokens[-1] > 8 * tokens[0]  # micro-batches of growing size
    assert hw.reserved_gb > 0.1 and hw.micro_batch_overhead_s > 0
    capsys.readouterr()
    conf = f"--config-dir={run / 'conf'}"
    assert main(["plan", conf, "hardware=measured-qwen2-vl", "model=hf", f"model.path={folder}", "data=shards",
                 "plan.steps=1", f"hydra.run.dir={tmp_path / 'plan'}"]) == 0
    assert "mmpipe plan: model qwen2-vl on measured-qwen2-vl" in capsys.readouterr().out
    assert main(["plan", conf, "hardware=measured-qwen2-vl", "data=shards", "plan.steps=1"]) == 2
    assert "hardware=measured-qwen2-vl was measured for model qwen2-vl, not model tiny" in capsys.readouterr().err


def test_a_profile_of_another_model_is_refused(tmp_path, capsys):
    assert (CONF_DIR / "hardware" / "measured-tiny.yaml").is_file()
    load(["hardware=measured-tiny"], job="test")  # its own model: fine
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"text_tokens": 10}\n')
    assert main(["plan", "model=llava-1.5-7b", "hardware=measured-tiny", "data=trace", f"data.path={trace}"]) == 2
    assert ("hardware=measured-tiny was measured for model tiny, not model llava-1.5-7b; "
            "run `mmpipe profile model=llava-1.5-7b`") in capsys.readouterr().err


def test_a_bad_hardware_value_names_the_key(capsys):
    assert main(["train", "hardware.peak_flops=fast"]) == 2
    assert "hardware.peak_flops='fast' must be a number" in capsys.readouterr().err
