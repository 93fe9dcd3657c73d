"""Per-layer loading from safetensors (both key layouts, sharded or not) and export back to a
folder transformers loads with the original class."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    LlavaForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
)

from mmpipe.model.hf import weights as W
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layer, build_layers
from mmpipe.model.hf.compose import spec_from_compose
from mmpipe.model.hf.export import export, save_layer_states
from mmpipe.model.hf.skeleton import layer_parts, owned_keys
from mmpipe.model.spec import layer_names

from . import hf_cases as H


def _differences(spec, layers, hf_model) -> list[str]:
    """Keys whose tensor (or buffer) in a pipeline layer differs from the transformers model's."""
    theirs = hf_model.state_dict()
    buffers = dict(hf_model.named_buffers())
    bad = []
    for layer in layers:
        mine, keys = layer.state_dict(), owned_keys(spec, layer.name)
        if not keys:
            continue  # a tied LM head holds the embedding layer's weight
        for local, key in keys.items():
            if not torch.equal(mine[local], theirs[key]):
                bad.append(key)
        for attr, path in layer_parts(spec, layer.name):  # non-persistent buffers: rotary tables, position ids
            if isinstance(getattr(layer, attr), torch.nn.Parameter):  # a bare parameter (image_newline)
                continue
            for name, buf in getattr(layer, attr).named_buffers():
                if not torch.equal(buf, buffers[f"{path}.{name}"]):
                    bad.append(f"{path}.{name}")
    return bad


@pytest.mark.parametrize("case", list(H.CLASSES))
def test_a_built_layer_holds_the_checkpoints_tensors(case, request):
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    hf = H.CLASSES[case].from_pretrained(folder, local_files_only=True)
    assert _differences(spec, build_layers(spec, seed=0), hf) == []
    # the same check fails when nothing is loaded: the perturbed norms and biases differ
    unloaded = _differences(spec, build_layers(spec, seed=0, load=False), hf)
    assert any("norm" in k for k in unloaded) and any(k.endswith("bias") for k in unloaded)
    if "image_newline" in json.dumps(list(hf.state_dict())):  # LLaVA-NeXT / OneVision's bare parameter
        assert "model.image_newline" in unloaded


def test_a_layer_reads_only_its_own_tensors(llava_clip_llama, monkeypatch):
    spec = spec_from_folder(llava_clip_llama)
    W.checkpoint_index(spec.hf)  # headers only
    read = []
    real = W.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(W, "safe_open", Recording)
    build_layer(spec, "llm.block.1", seed=0)
    assert read and all(k.startswith("language_model.model.layers.1.") for k in read)
    assert len(read) == len(owned_keys(spec, "llm.block.1"))
    report = W.LOAD_LOG[-1]
    assert report.layer == "llm.block.1" and report.tensors == len(read) and report.peak_rss_mb > 0


def test_transformers_4_hub_layout_sharded_loads_the_same(llava_clip_llama, tmp_path):
    """llava-hf checkpoints keep `vision_tower.vision_model.*`; split in two shards with an index."""
    old = tmp_path / "old-layout"
    old.mkdir()
    tensors = load_file(str(llava_clip_llama / "model.safetensors"))
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: renamed[k] for k in part}, str(old / name), metadata={"format": "pt"})
    (old / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}))
    for f in ("config.json", "preprocessor_config.json"):
        (old / f).write_text((llava_clip_llama / f).read_text())
    hf, info = LlavaForConditionalGeneration.from_pretrained(old, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # a layout transformers itself loads
    spec = spec_from_folder(old)
    assert _differences(spec, build_layers(spec, seed=0), hf) == []


def _export_round_trip(spec, source_model, tmp_path, cls):
    layers = build_layers(spec, seed=0)
    ckpt = tmp_path / "checkpoints" / "step0"
    save_layer_states(layers, spec, ckpt)
    report = export(spec, ckpt, tmp_path / "export", shard_bytes=40_000)
    assert report.shards > 1
    back, info = cls.from_pretrained(tmp_path / "export", local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs = source_model.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    return report, layers


@pytest.mark.parametrize("case", list(H.CLASSES))
def test_export_right_after_loading_is_bit_identical(case, request, tmp_path):
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    source = H.CLASSES[case].from_pretrained(folder, local_files_only=True)
    report, _ = _export_round_trip(spec, source, tmp_path, H.CLASSES[case])
    with open(folder / "config.json") as a, open(tmp_path / "export" / "config.json") as b:
        assert json.load(a) == json.load(b)
    assert (tmp_path / "export" / "preprocessor_config.json").is_file()
    # the same layout save_pretrained writes
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = set(json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"])
        assert written == set(f.keys())
    if case == "llava_clip_llama":  # post_layernorm and the block after feature layer -2 come from the source
        assert any("post_layernorm" in k for k in report.copied) and any("layers.2." in k for k in report.copied)


def test_export_carries_trained_weights(llava_siglip_qwen2, tmp_path):
    """A changed tensor (here the tied embedding, which is also the LM head) reaches the export."""
    spec = spec_from_folder(llava_siglip_qwen2)
    layers = build_layers(spec, seed=0)
    embed = layers[layer_names(spec).index("llm.embed")]
    with torch.no_grad():
        embed.embed.weight.add_(1.0)
    save_layer_states(layers, spec, tmp_path / "ckpt")
    export(spec, tmp_path / "ckpt", tmp_path / "out")
    back = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", local_files_only=True)
    assert torch.equal(back.model.language_model.embed_tokens.weight, embed.embed.weight)
    assert back.lm_head.weight is back.model.language_model.embed_tokens.weight


def test_a_composed_model_exports_as_llava(unimodal, tmp_path):
    vision, llm = unimodal("clip-vision"), unimodal("llama")
    spec = spec_from_compose(name="c", vision=str(vision), llm=str(llm), image_token_id=H.IMAGE)
    layers = build_layers(spec, seed=7)
    save_layer_states(layers, spec, tmp_path / "ckpt")
    export(spec, tmp_path / "ckpt", tmp_path / "out")
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", local_files_only=True,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    proj = layers[layer_names(spec).index("vision.proj")].projector
    assert torch.equal(back.model.multi_modal_projector.linear_1.weight, proj.linear_1.weight)
    assert (tmp_path / "out" / "tokenizer_config.json").exists() is (llm / "tokenizer_config.json").exists()
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()


def test_export_refuses_a_checkpoint_of_another_model(llava_clip_llama, qwen2_vl, tmp_path):
    spec, other = spec_from_folder(llava_clip_llama), spec_from_folder(qwen2_vl)
    save_layer_states(build_layers(other, seed=0, load=False), other, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"layer_00-model_states\.pt does not hold layer vision\.embed of "
                                         r"LlavaForConditionalGeneration"):
        export(spec, tmp_path / "ckpt", tmp_path / "out")


def test_a_full_omni_folder_trains_its_thinker_and_exports_whole(hf_root, tmp_path):
    """A full Qwen2.5-Omni folder (thinker, talker, token2wav): the layers hold the thinker's
    tensors as transformers' thinker class loads them from that folder; the export is the full
    folder again (talker, token2wav and speaker file copied), bit-identical after loading."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from mmpipe.model.hf.omni import source_note

    folder = H.write_qwen2_5_omni(hf_root, seed=18, full=True)
    torch.save({"Chelsie": {"bos_token": 3}}, folder / "spk_dict.pt")  # read by the full class's from_pretrained
    spec = spec_from_folder(folder)
    assert spec.hf.architecture == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert "talker and token2wav are not loaded" in source_note(spec)
    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder, local_files_only=True)
    assert _differences(spec, build_layers(spec, seed=0), thinker) == []
    save_layer_states(build_layers(spec, seed=0), spec, tmp_path / "ckpt")
    report = export(spec, tmp_path / "ckpt", tmp_path / "export", shard_bytes=40_000)
    # (this class's from_pretrained cannot return loading info: it loads its speakers into the tuple)
    back = Qwen2_5OmniForConditionalGeneration.from_pretrained(tmp_path / "export", local_files_only=True)
    theirs = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, local_files_only=True).state_dict()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = set(json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"])
        assert written == set(f.keys())  # every tensor of the source, under its own name
    for key, value in back.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    assert any(k.startswith("talker.") for k in report.copied)
    assert any(k.startswith("token2wav.") for k in report.copied)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "qwen2_5_omni"
    assert (tmp_path / "export" / "spk_dict.pt").read_bytes() == (folder / "spk_dict.pt").read_bytes()
