import pytest

from mmpipe.model.spec import layer_names
from mmpipe.planner.hardware import hardware_from_dict, hardware_to_dict

from .helpers import hardware, model


@pytest.mark.parametrize("name,layers,first_llm", [
    ("llava-1.5-7b", 23 + 2 + 32 + 3, "llm.embed"),  # vision_feature_layer -2: the 24th CLIP block never runs
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
    """docs/spec.md section 5, as the Hub configs give it (the differences are stated there)."""
    q = model("qwen2-vl-7b")
    assert (q.vision.blocks, q.vision.hidden, q.vision.merge, q.vision.proj) == (32, 1280, 2, (5120, 3584))
    assert (q.vision.min_pixels, q.vision.max_pixels) == (4 * 28 * 28, 1280 * 28 * 28)
    assert (q.llm.blocks, q.llm.hidden, q.llm.mlp, q.llm.heads, q.llm.kv_heads, q.llm.vocab) == (
        28, 3584, 18944, 28, 4, 152064)
    l = model("llava-1.5-7b")
    assert (l.vision.blocks, l.vision.hidden, l.vision.mlp, l.vision.heads, l.vision.image_size) == (
        23, 1024, 4096, 16, 336)
    assert (l.llm.blocks, l.llm.hidden, l.llm.mlp, l.llm.heads, l.llm.kv_heads, l.llm.vocab) == (
        32, 4096, 11008, 32, 32, 32064)
    a = model("qwen2-audio-7b")
    assert (a.audio.blocks, a.audio.hidden, a.audio.mlp, a.audio.heads, a.audio.proj) == (32, 1280, 5120, 20, (4096,))
    assert (a.llm.blocks, a.llm.hidden, a.llm.mlp, a.llm.heads, a.llm.kv_heads, a.llm.vocab) == (
        32, 4096, 11008, 32, 32, 156032)
    o = model("omni-7b")
    assert o.audio.proj == (3584,) and o.vision.proj == (5120, 3584)


@pytest.mark.parametrize("name,peak,link", [("h100", 989e12, 25.0), ("h200", 989e12, 25.0), ("a100", 312e12, 12.5),
                                            ("cpu", 5e10, 2.0)])
def test_hardware_presets(name, peak, link):
    """Each shipped file loads as written, with the keys that say where its figures come from."""
    hw = hardware(name)
    assert hw.name == name and hw.peak_flops == pytest.approx(peak) and hw.link_gbps == link
    assert hardware_from_dict(hardware_to_dict(hw)) == hw


def test_the_planner_passes_over_exactly_the_keys_the_run_config_reads_as_origin():
    from dataclasses import fields

    from mmpipe.config import HardwareOrigin
    from mmpipe.planner.hardware import ORIGIN_KEYS

    assert set(ORIGIN_KEYS) == {f.name for f in fields(HardwareOrigin)}


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
