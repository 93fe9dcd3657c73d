"""`mmpipe profile` writes a machine description the planner accepts, for its model only."""

from __future__ import annotations

import re
import shlex

import yaml

from mmpipe.cli import CONF_DIR, load, main
from mmpipe.planner.cost import KINDS
from mmpipe.planner.hardware import KIND_FALLBACK, hardware_from_dict


def test_profile_writes_a_description_of_this_machine(tmp_path, capsys):
    shipped = (CONF_DIR / "hardware" / "measured-tiny.yaml").read_bytes()
    assert main(["profile", "profile.repeats=1", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    out = tmp_path / "run" / "conf" / "hardware" / "measured-tiny.yaml"  # in the run dir, as a config folder
    doc = yaml.safe_load(out.read_text())
    assert doc.pop("measured_for") == "tiny"
    hw = hardware_from_dict(doc)
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
    printed = capsys.readouterr().out
    said = re.search(r"link (\d+)us \+ ([\d.]+) GB/s", printed)
    assert said and int(said.group(1)) == round(hw.link_latency_s * 1e6), (said, hw.link_latency_s)  # as printed
    assert float(said.group(2)) == round(hw.link_gbps, 2)
    use = printed.split("use: ")[1].splitlines()[0]
    assert use == f"mmpipe train --config-dir={tmp_path / 'run' / 'conf'} hardware=measured-tiny"
    assert main(["train", *shlex.split(use)[2:], "--cfg", "job", "--package", "hardware"]) == 0  # it works as said
    assert yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1]) == yaml.safe_load(out.read_text())


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
