import pytest

from mmpipe.model.spec import layer_names
from mmpipe.planner.hardware import hardware_from_dict, hardware_to_dict

from .helpers import hardware, model


@pytest.mark.parametrize("name,layers,first_llm", [
    ("llava-1.5-7b", 24 + 2 + 32 + 3, "llm.embed"),
    ("qwen2-vl-7b", 32 + 2 + 28 + 3, "llm.embed"),
    ("qwen2-audio-7b", 32 + 2 + 32 + 3, "llm.embed"),
    ("omni-7b", 34 + 34 + 28 + 3, "llm.embed"),
    ("tiny", 4 + 4 + 4 + 3, "llm.embed"),
])
def test_model_presets_load_and_list_layers_without_weights(name, layers, first_llm):
    spec = model(name)
    names = layer_names(spec)
    assert len(names) == layers
    assert names[-1] == "llm.head" and first_llm in names


def test_preset_figures_match_the_spec_table():
    q = model("qwen2-vl-7b")
    assert (q.vision.blocks, q.vision.hidden, q.vision.merge, q.vision.proj) == (32, 1280, 2, (5120, 3584))
    assert (q.llm.hidden, q.llm.mlp, q.llm.kv_heads, q.llm.vocab) == (3584, 18944, 4, 152064)
    a = model("qwen2-audio-7b")
    assert (a.audio.blocks, a.audio.heads, a.audio.proj, a.llm.vocab) == (32, 20, (4096,), 151936)
    o = model("omni-7b")
    assert o.audio.proj == (3584,) and o.vision.proj == (5120, 3584)


@pytest.mark.parametrize("name,peak,link", [("h100", 989e12, 25.0), ("a100", 312e12, 12.5), ("cpu", 5e10, 2.0)])
def test_hardware_presets(name, peak, link):
    hw = hardware(name)
    assert hw.name == name and hw.peak_flops == pytest.approx(peak) and hw.link_gbps == link
    assert hardware_from_dict(hardware_to_dict(hw)) == hw


def test_hardware_unknown_key_names_it():
    with pytest.raises(ValueError, match=r"hardware\.peak_flop is not a hardware setting"):
        hardware_from_dict({"name": "x", "peak_flop": 1, "memory_gb": 1, "link_gbps": 1})


def test_hardware_bad_value_names_key():
    with pytest.raises(ValueError, match=r"hardware\.memory_gb='lots' is not a number"):
        hardware_from_dict({"name": "x", "peak_flops": 1, "memory_gb": "lots", "link_gbps": 1})
    with pytest.raises(ValueError, match=r"hardware\.max_efficiency=1.5"):
        hardware_from_dict({"name": "x", "peak_flops": 1, "memory_gb": 1, "link_gbps": 1,
                            "max_efficiency": 1.5})


def test_measured_machine_overrides_per_kind():
    hw = hardware_from_dict({"name": "box", "peak_flops": 1e12, "memory_gb": 8, "link_gbps": 1,
                             "kind_efficiency": {"llm.block": 0.8}, "kind_overhead_s": {"llm.head": 1e-3}})
    assert hw.efficiency_max("llm.block") == 0.8 and hw.efficiency_max("vision.block") == hw.max_efficiency
    assert hw.overhead("llm.head") == 1e-3
