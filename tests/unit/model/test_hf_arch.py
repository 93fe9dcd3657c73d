"""Architectures from configs: the 7B presets without weights, the memory estimate, and the
one-line errors for what is not supported."""

from __future__ import annotations

import pytest
import yaml

from mmpipe.model.geometry import SampleMeta, features
from mmpipe.model.group import model_from_group
from mmpipe.model.hf.arch import spec_from_config
from mmpipe.model.hf.build import build_layer
from mmpipe.model.hf.memory import check_memory, estimate_memory, layer_params
from mmpipe.model.hf.settings import spec_from_settings
from mmpipe.model.spec import layer_names
from mmpipe.paths import CONF_DIR

# The Hub configs of the three 7B checkpoints (config.json and preprocessor figures), as the
# presets state them.
LLAVA_15_7B = {
    "model_type": "llava", "image_token_index": 32000, "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu", "pad_token_id": 32001,
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                      "projection_dim": 768, "hidden_act": "quick_gelu"},
    "text_config": {"model_type": "llama", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 0},
}
QWEN2_VL_7B = {
    "model_type": "qwen2_vl", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16, "mlp_ratio": 4,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}},
}
QWEN2_VL_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 1003520,
                      "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
QWEN2_AUDIO_7B = {
    "model_type": "qwen2_audio", "audio_token_index": 151646,
    "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 1280, "encoder_layers": 32,
                     "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128,
                     "max_source_positions": 1500},
    "text_config": {"model_type": "qwen2", "vocab_size": 156032, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                    "max_position_embeddings": 8192},
}
WHISPER_FE = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "chunk_length": 30,
              "sampling_rate": 16000, "hop_length": 160}
QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct's config.json (transformers 4.57 layout, as the Hub has it)
    "model_type": "qwen3_vl", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 4096,
                    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "out_hidden_size": 4096, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
}
QWEN3_VL_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                      "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _preset(name):
    """The preset as `model=NAME` builds it (its own, separately written copy of the Hub config)."""
    return model_from_group(yaml.safe_load((CONF_DIR / f"model/{name}.yaml").read_text())).spec


def _same_figures(ours, preset, fields):
    for f in fields:
        assert getattr(ours, f) == getattr(preset, f), f


def test_7b_presets_build_from_their_configs_alone():
    llava = spec_from_config(LLAVA_15_7B, name="llava-1.5-7b")
    preset = _preset("llava-1.5-7b")
    _same_figures(llava.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "image_size", "cls_token",
                                                "select", "proj"))
    _same_figures(llava.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len"))
    assert llava.vision.blocks == 23  # feature layer -2: the last CLIP block never runs
    assert features(llava, SampleMeta(text_tokens=10, images=((480, 640),))).image_tokens == (576,)

    qwen = spec_from_config(QWEN2_VL_7B, name="qwen2-vl-7b", image_processor=QWEN2_VL_PROCESSOR)
    preset = _preset("qwen2-vl-7b")
    _same_figures(qwen.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "merge", "min_pixels",
                                               "max_pixels", "proj"))
    _same_figures(qwen.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len"))

    audio = spec_from_config(QWEN2_AUDIO_7B, name="qwen2-audio-7b", feature_extractor=WHISPER_FE)
    preset = _preset("qwen2-audio-7b")
    _same_figures(audio.audio, preset.audio, ("blocks", "hidden", "mlp", "heads", "mel_bins", "sample_rate",
                                              "frames_per_s", "conv_stride", "pool", "pool_ceil", "max_seconds",
                                              "proj"))
    _same_figures(audio.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len"))
    assert features(audio, SampleMeta(text_tokens=3, audio_seconds=(10.0,))).audio_tokens == (250,)
    # a layer of a 7B model is built alone, without weights
    block = build_layer(qwen, "vision.block.31", seed=0)
    assert sum(p.numel() for p in block.parameters()) == layer_params(qwen)["vision.block.31"]


def test_qwen3_vl_8b_preset_is_its_hub_config_and_the_planner_prices_its_layers():
    """The preset states the Hub config (max_pixels bounded, as its header says); the planner's
    parameter counts of the tower, the projector with its DeepStack mergers, and the decoder are
    the transformers model's own, and every cut carries the DeepStack features still alive there."""
    from mmpipe.planner.cost import build_cost_model
    from mmpipe.planner.hardware import hardware_from_dict

    ours = spec_from_config(QWEN3_VL_8B, name="qwen3-vl-8b", image_processor=QWEN3_VL_PROCESSOR)
    preset = _preset("qwen3-vl-8b")
    _same_figures(ours.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "merge", "min_pixels",
                                               "proj", "deepstack", "position_table", "temporal_patch"))
    _same_figures(ours.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len"))
    assert ours.vision.max_pixels == 16384 * 32 * 32 and preset.vision.max_pixels == 1280 * 32 * 32
    assert preset.vision.deepstack == (8, 16, 24) and preset.vision.proj == (4608, 4096)
    counts = layer_params(preset)
    assert 8.7e9 < sum(counts.values()) < 8.8e9  # Qwen3-VL-8B: 8.77 B parameters
    hw = hardware_from_dict(yaml.safe_load((CONF_DIR / "hardware/h100.yaml").read_text()))
    cost = build_cost_model(model=preset, hardware=hw, trainable=("vision.proj", "llm"))
    priced = {l.name: l.params for l in cost.layers}
    for name in ("vision.block.0", "vision.proj", "llm.embed", "llm.head"):
        assert priced[name] == pytest.approx(counts[name], rel=2e-5), name
    assert priced["llm.block.0"] == pytest.approx(counts["llm.block.0"], rel=1e-4)
    names = cost.names
    b, d = 2, 4096  # bf16 bytes of one image token's feature
    for layer, alive in (("llm.embed", 3), ("llm.block.0", 3), ("llm.block.1", 2), ("llm.block.2", 1),
                         ("llm.block.3", 0)):
        image_slot = 1 if layer == "llm.embed" else 0  # the merged image embeddings reach llm.embed too
        assert cost.cut_fwd_bytes[names.index(layer), 1] == b * d * (alive + image_slot), layer
        assert cost.cut_bwd_bytes[names.index(layer), 1] == b * d * (alive + image_slot), layer  # the mergers train
    # block 8's state rides to vision.proj as patches (the frozen tower sends no gradient back)
    assert cost.cut_fwd_bytes[names.index("vision.block.9"), 0] == 2 * b * 1152
    assert cost.cut_bwd_bytes[names.index("vision.block.9"), 0] == 0


INTERNVL3_8B = {  # OpenGVLab/InternVL3-8B-hf's config.json figures
    "model_type": "internvl", "image_token_id": 151667, "image_seq_length": 256, "downsample_ratio": 0.5,
    "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen2", "vocab_size": 151674, "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6},
    "vision_config": {"model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": [448, 448],
                      "patch_size": [14, 14], "attention_bias": True, "norm_type": "layer_norm"},
}
INTERNVL_PROCESSOR = {"image_processor_type": "GotOcr2ImageProcessorFast", "size": {"height": 448, "width": 448},
                      "crop_to_patches": False, "min_patches": 1, "max_patches": 12}


def test_internvl3_8b_preset_is_its_hub_config_and_the_planner_prices_its_layers():
    """The preset states the Hub config; the model has InternVL3-8B's 7.9 B parameters and the
    planner prices the tower, the projector and the decoder at the transformers model's own counts
    (the tower's class token, layer scales and the projector's norm aside: under 0.1 %)."""
    from mmpipe.planner.cost import build_cost_model
    from mmpipe.planner.hardware import hardware_from_dict

    ours = spec_from_config(INTERNVL3_8B, name="internvl3-8b", image_processor=INTERNVL_PROCESSOR)
    preset = _preset("internvl3-8b")
    _same_figures(ours.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "merge", "image_size",
                                               "resize", "cls_token", "min_tiles", "max_tiles", "proj"))
    _same_figures(ours.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len",
                                         "tie_embeddings"))
    assert preset.vision.proj_in == 4096 and preset.vision.max_tiles == 12
    meta = SampleMeta(text_tokens=10, images=((448, 448), (1080, 1920)))
    assert features(preset, meta).image_tokens == (256, 9 * 256)  # one tile; a 4x2 grid and the thumbnail
    counts = layer_params(preset)
    assert 7.9e9 < sum(counts.values()) < 8.0e9
    hw = hardware_from_dict(yaml.safe_load((CONF_DIR / "hardware/h100.yaml").read_text()))
    cost = build_cost_model(model=preset, hardware=hw, trainable=("vision.proj", "llm"))
    priced = {l.name: l.params for l in cost.layers}
    for name in ("vision.embed", "vision.block.0", "vision.proj", "llm.embed", "llm.block.0", "llm.head"):
        assert priced[name] == pytest.approx(counts[name], rel=1e-3), name
    with pytest.raises(ValueError, match=r"cuts 224x224 tiles but the vision tower's image_size is 448; .*: set "
                                         r"the image processor's size to \{height: 448, width: 448\}$"):
        spec_from_config(INTERNVL3_8B, name="x", image_processor={**INTERNVL_PROCESSOR,
                                                                  "size": {"height": 224, "width": 224}})
    with pytest.raises(ValueError, match=r"the image processor's min_patches=4 / max_patches=2: mmpipe takes integers "
                                         r"with 1 <= min_patches <= max_patches"):
        spec_from_config(INTERNVL3_8B, name="x", image_processor={**INTERNVL_PROCESSOR, "min_patches": 4,
                                                                  "max_patches": 2})


GEMMA3_12B = {  # google/gemma-3-12b-it's config.json figures
    "model_type": "gemma3", "image_token_index": 262144, "boi_token_index": 255999, "eoi_token_index": 256000,
    "mm_tokens_per_image": 256,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                      "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                      "vision_use_head": False},
}
GEMMA3_PROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": None}


def test_gemma3_12b_preset_is_its_hub_config_and_the_planner_prices_its_layers():
    """The preset states the Hub config (its layer types and rope bases are transformers' defaults of it);
    the model has Gemma 3 12B's 12.2 B parameters (the tied head once) and the planner prices the tower, the
    projector and the embedding at the transformers model's counts, a decoder block within 2 % (the planner's
    attention is hidden / heads = 240 wide, Gemma's heads 256)."""
    from mmpipe.model.hf.configs import hf_config
    from mmpipe.planner.cost import build_cost_model
    from mmpipe.planner.hardware import hardware_from_dict

    ours = spec_from_config(GEMMA3_12B, name="gemma3-12b", image_processor=GEMMA3_PROCESSOR)
    preset = _preset("gemma3-12b")
    _same_figures(ours.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "merge", "image_size",
                                               "resize", "pooled", "image_markers", "proj"))
    _same_figures(ours.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len",
                                         "tie_embeddings"))
    for spec in (ours, preset):
        text = hf_config(spec.hf).text_config
        assert text.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
        assert text.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert text.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert preset.vision.proj_in == 1152 and preset.vision.merge == 4
    meta = SampleMeta(text_tokens=10, images=((448, 448), (1080, 1920)))
    assert features(preset, meta).image_tokens == (256, 256)
    counts = layer_params(preset)
    assert 12.1e9 < sum(counts.values()) - counts["llm.head"] < 12.3e9
    hw = hardware_from_dict(yaml.safe_load((CONF_DIR / "hardware/h100.yaml").read_text()))
    cost = build_cost_model(model=preset, hardware=hw, trainable=("vision.proj", "llm"))
    priced = {l.name: l.params for l in cost.layers}
    for name in ("vision.embed", "vision.block.0", "vision.proj", "llm.embed", "llm.head"):
        assert priced[name] == pytest.approx(counts[name], rel=1e-3), name
    assert priced["llm.block.0"] == pytest.approx(counts["llm.block.0"], rel=2e-2)


@pytest.mark.parametrize("change,message", [
    ({"vision_config": {**GEMMA3_12B["vision_config"], "model_type": "clip_vision_model"}},
     r"Gemma 3's vision tower 'clip_vision_model' is not supported"),
    ({"mm_tokens_per_image": 200}, r"model\.config\.mm_tokens_per_image=200: the projector pools"),
    ({"text_config": {**GEMMA3_12B["text_config"], "final_logit_softcapping": 30.0}},
     r"model\.config\.text_config\.final_logit_softcapping=30\.0: .* set it to null"),
])
def test_gemma3_configs_mmpipe_cannot_run_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message):
        spec_from_config({**GEMMA3_12B, **change}, name="g", image_processor=GEMMA3_PROCESSOR)


def test_gemma3_pan_and_scan_is_refused_by_name():
    with pytest.raises(ValueError, match=r"image_processor\.do_pan_and_scan=true: pan-and-scan crops are not "
                                         r"supported"):
        spec_from_config(GEMMA3_12B, name="g", image_processor={**GEMMA3_PROCESSOR, "do_pan_and_scan": True})


def test_memory_estimate_refuses_a_7b_stage_that_does_not_fit():
    spec = spec_from_config(LLAVA_15_7B, name="llava-1.5-7b")
    counts = layer_params(spec)
    assert 7.0e9 < sum(counts.values()) < 7.1e9  # llava-1.5-7b has 7.06 B parameters (23 of 24 CLIP blocks)
    n = len(layer_names(spec))
    one = estimate_memory(spec, stages=[(0, n)])
    assert one[0].bytes == one[0].params * 16  # fp32 weights, grads, two AdamW moments
    with pytest.raises(ValueError, match=r"stage 0 \(vision\.embed\.\.llm\.head\) needs 10[0-9]\.\d GiB .* but "
                                         r"64\.0 GiB is available per process; use more pipeline stages"):
        check_memory(one, budget_bytes=64 * 2**30)
    frozen_llm = estimate_memory(spec, stages=[(0, n // 2), (n // 2, n)], trainable=("vision.proj",))
    assert sum(s.trainable for s in frozen_llm) == counts["vision.proj"]
    check_memory(frozen_llm, budget_bytes=64 * 2**30)


@pytest.mark.parametrize("config,message", [
    ({"model_type": "gpt2"}, r"model\.config: model_type 'gpt2' is not supported; supported: "
                             r"LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration, "
                             r"Qwen2AudioForConditionalGeneration, .*or model=compose"),
    ({"model_type": "idefics3"}, r"model_type 'idefics3' is not supported"),
    ({"model_type": "nonsense"}, r"model\.config\.model_type='nonsense' is not a transformers model type"),
    ({**LLAVA_15_7B, "vision_feature_layer": [-2, -5]},
     r"model\.config\.vision_feature_layer=\[-2, -5\]: only a single layer index is supported"),
    ({**LLAVA_15_7B, "vision_feature_layer": 0}, r"vision_feature_layer=0 selects no vision block of 24"),
    ({**LLAVA_15_7B, "vision_config": {"model_type": "pixtral"}},
     r"LLaVA vision tower 'pixtral' is not supported; use clip_vision_model or siglip_vision_model"),
    ({**LLAVA_15_7B, "text_config": {"model_type": "gemma"}},
     r"language model type 'gemma' is not supported; use one of llama, mistral, qwen2"),
    ({**QWEN2_AUDIO_7B, "audio_config": {**QWEN2_AUDIO_7B["audio_config"], "encoder_layerdrop": 0.1}},
     r"encoder_layerdrop=0\.1: layer drop is not supported"),
    ({**QWEN3_VL_8B, "vision_config": {**QWEN3_VL_8B["vision_config"], "deepstack_visual_indexes": [16, 8]}},
     r"model\.config\.vision_config\.deepstack_visual_indexes=\[16, 8\]: mmpipe takes rising block indexes in "
     r"0\.\.26"),
    ({**QWEN3_VL_8B, "model_type": "qwen3_vl_moe"}, r"model_type 'qwen3_vl_moe' is not supported"),
    ({**INTERNVL3_8B, "vision_feature_layer": -2}, r"model\.config\.vision_feature_layer=-2: only -1"),
    ({**INTERNVL3_8B, "vision_feature_select_strategy": "full"},
     r"vision_feature_select_strategy='full': only default \(the class token dropped\)"),
    ({**INTERNVL3_8B, "downsample_ratio": 0.3}, r"downsample_ratio=0\.3: only 1 / an integer"),
    ({**INTERNVL3_8B, "downsample_ratio": 1 / 3,  # 24 patches a tile: whole 3x3 units, but 24 % (1/3) != 0
      "vision_config": {**INTERNVL3_8B["vision_config"], "image_size": [336, 336]}},
     r"downsample_ratio=0\.333\d*: transformers' pixel_shuffle cannot fold a tile of 24x24 patches"),
    ({**INTERNVL3_8B, "vision_config": {**INTERNVL3_8B["vision_config"], "patch_size": [14, 16]}},
     r"model\.config\.vision_config\.patch_size=\[14, 16\]: only square patches are supported"),
    ({**INTERNVL3_8B, "text_config": {"model_type": "gemma"}},
     r"language model type 'gemma' is not supported; use one of qwen2, qwen3"),
])
def test_unsupported_architectures_are_one_line_errors(config, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_config(config, name="x")
    assert "\n" not in str(err.value)


def test_settings_errors_name_the_key(tmp_path):
    """The model groups as typed (conf/model/hf.yaml, compose.yaml, a preset): errors name `model.<key>`."""
    with pytest.raises(ValueError, match=r"model\.pth is not a setting of model=hf; known: name, path, max_seq_len"):
        spec_from_settings({"name": None, "path": "/x", "pth": "/x"})
    with pytest.raises(ValueError, match=r"model\.path is not set; give model\.path=DIR"):
        spec_from_settings({"name": None, "path": "???"})
    with pytest.raises(ValueError, match=r"model\.path='.*' is not a checkpoint folder \(no config\.json"):
        spec_from_settings({"name": None, "path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"model\.vison is not a setting of model=compose"):
        spec_from_settings({"vison": {"path": "/x"}, "llm": {"path": "/y"}})
    with pytest.raises(ValueError, match=r"model\.llm\.path is not set; give model\.llm\.path=DIR"):
        spec_from_settings({"vision": {"path": "/x"}, "llm": {"path": "???"}})
    with pytest.raises(ValueError, match=r"model\.vision\.blocks is not a setting of model=compose; give "
                                         r"model\.vision\.path=DIR"):
        spec_from_settings({"vision": {"path": "/x", "blocks": 2}, "llm": {"path": "/y"}})
    spec = spec_from_settings({"name": "q", "config": QWEN2_VL_7B, "image_processor": QWEN2_VL_PROCESSOR,
                               "max_seq_len": 8192})
    assert spec.llm.max_seq_len == 8192 and spec.hf.architecture == "Qwen2VLForConditionalGeneration"


def _preset_config(name) -> dict:
    return yaml.safe_load((CONF_DIR / f"model/{name}.yaml").read_text())


def test_anyres_presets_build_from_their_configs_alone():
    """The LLaVA-NeXT and OneVision presets: the Hub checkpoints' parameter counts (NeXT's 24th
    CLIP block never runs), tiles and tokens of a 1080p image, and a 7B projector with its
    image_newline built alone, without weights."""
    onevision, nxt = _preset("llava-onevision-qwen2-7b"), _preset("llava-next-mistral-7b")
    assert 8.02e9 < sum(layer_params(onevision).values()) < 8.04e9  # llava-onevision-qwen2-7b-ov-hf: 8.03 B
    assert 7.54e9 < sum(layer_params(nxt).values()) < 7.56e9  # llava-v1.6-mistral-7b-hf: 7.57 B with that block
    assert onevision.vision.blocks == 26 and nxt.vision.blocks == 23
    hd = SampleMeta(text_tokens=10, images=((1080, 1920),))
    assert features(onevision, hd).image_positions == (729,) * 16  # the whole image + a 3 x 5 grid of 384-px tiles
    assert features(onevision, hd).image_tokens == (7269,)  # 729 + 90 x 72 shrunk to anyres_max_9, + 72 newlines
    assert features(nxt, hd).image_positions == (577,) * 5 and features(nxt, hd).image_tokens == (1948,)
    proj = build_layer(onevision, "vision.proj", seed=0)
    assert proj.image_newline.shape == (3584,)
    assert sum(p.numel() for p in proj.parameters()) == layer_params(onevision)["vision.proj"]


@pytest.mark.parametrize("name,change,message", [
    ("llava-next-mistral-7b", {"image_grid_pinpoints": [[336, 672], [336, 600]]},
     r"model\.config\.image_grid_pinpoints holds \[336, 600\]; each must be \[height, width\] in multiples of "
     r"the tower's image_size 336"),
    ("llava-next-mistral-7b", {"vision_feature_select_strategy": "full"},
     r"vision_feature_select_strategy='full' with a clip_vision_model tower leaves the class token per tile"),
    ("llava-onevision-qwen2-7b", {"vision_feature_select_strategy": "default"},
     r"vision_feature_select_strategy='default' with a siglip_vision_model tower leaves one feature too few"),
    ("llava-onevision-qwen2-7b", {"vision_aspect_ratio": "pad"},
     r"model\.config\.vision_aspect_ratio='pad' is not anyres_max_N"),
])
def test_anyres_configs_the_packing_cannot_run_are_one_line_errors(name, change, message):
    group = _preset_config(name)
    with pytest.raises(ValueError, match=message) as err:
        spec_from_config({**group["config"], **change}, name="x", image_processor=group["image_processor"])
    assert "\n" not in str(err.value)


def test_an_anyres_processor_that_cuts_other_grids_is_refused():
    group = _preset_config("llava-next-mistral-7b")
    other = {**group["image_processor"], "image_grid_pinpoints": [[336, 672], [672, 336]]}
    with pytest.raises(ValueError, match=r"the image processor's image_grid_pinpoints \[\[336, 672\], \[672, 336\]\] "
                                         r"differ from the model's"):
        spec_from_config(group["config"], name="x", image_processor=other)


@pytest.mark.parametrize("name,key,want", [("llava-onevision", "num_image_tokens", 16),
                                           ("internvl", "image_seq_length", 4)])
def test_a_folder_whose_processor_counts_other_placeholders_is_refused(name, key, want, hf_checkpoints, tmp_path):
    """processor_config.json's num_image_tokens (OneVision) / image_seq_length (InternVL) must be what
    the model makes (16 per tile / 4 per tile of the demo checkpoints); the folder as written loads.
    InternVL's key left out is InternVLProcessor's default, 256 placeholders a tile: refused too."""
    import json
    import shutil

    from mmpipe.model.hf.arch import spec_from_folder

    folder = tmp_path / name
    shutil.copytree(hf_checkpoints[name], folder)
    assert spec_from_folder(folder).vision is not None
    settings = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**settings, key: 25}))
    with pytest.raises(ValueError, match=rf"processor_config\.json has {key}=25 but the model's config makes "
                                         rf"it {want}; .* set {key} to {want}"):
        spec_from_folder(folder)
    if name == "internvl":
        (folder / "processor_config.json").write_text(json.dumps({k: v for k, v in settings.items() if k != key}))
        with pytest.raises(ValueError, match=r"processor_config\.json leaves image_seq_length out, so "
                                             r"InternVLProcessor puts its default 256 placeholders per tile, but the "
                                             r"model's config makes 4: set image_seq_length to 4"):
            spec_from_folder(folder)


# Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor figures; Qwen/Qwen2.5-Omni-7B's
# thinker_config and preprocessor figures (written again here, apart from the presets).
QWEN25_VL_7B = {
    "model_type": "qwen2_5_vl", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2},
}
QWEN25_PROCESSOR = {**QWEN2_VL_PROCESSOR, "max_pixels": 1003520}
QWEN25_OMNI_7B = {
    "model_type": "qwen2_5_omni_thinker", "audio_token_index": 151646, "image_token_index": 151655,
    "video_token_index": 151656, "vision_start_token_id": 151652, "audio_start_token_id": 151647,
    "audio_end_token_id": 151648,
    "audio_config": {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                     "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100, "output_dim": 3584},
    "vision_config": {**QWEN25_VL_7B["vision_config"], "tokens_per_second": 25},
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
                    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default"}, "rope_theta": 1e6},
}
OMNI_FE = {**WHISPER_FE, "chunk_length": 300}


def test_qwen25_presets_build_from_their_configs_alone():
    vl = spec_from_config(QWEN25_VL_7B, name="qwen2.5-vl-7b", image_processor=QWEN25_PROCESSOR)
    omni = spec_from_config(QWEN25_OMNI_7B, name="qwen2.5-omni-7b", image_processor=QWEN25_PROCESSOR,
                            feature_extractor=OMNI_FE)
    for ours, name in ((vl, "qwen2.5-vl-7b"), (omni, "qwen2.5-omni-7b")):
        preset = _preset(name)
        _same_figures(ours.vision, preset.vision, ("blocks", "hidden", "mlp", "heads", "patch", "merge", "min_pixels",
                                                   "max_pixels", "proj", "window", "full_blocks", "mlp_gated"))
        _same_figures(ours.llm, preset.llm, ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len"))
    _same_figures(omni.audio, _preset("qwen2.5-omni-7b").audio, ("blocks", "hidden", "mlp", "heads", "mel_bins",
                                                                "frames_per_s", "pool_ceil", "max_seconds", "proj",
                                                                "window"))
    assert 8.2e9 < sum(layer_params(vl).values()) < 8.4e9  # Qwen2.5-VL-7B: 8.29 B parameters
    assert omni.audio.max_seconds == 300 and omni.audio.window == 100
    # a 10-s clip: 1000 frames in 5 chunks of 100 positions, 250 LLM tokens
    f = features(omni, SampleMeta(text_tokens=3, audio_seconds=(10.0,), images=((448, 448),)))
    assert f.audio_tokens == (250,) and f.audio_chunks == (100,) * 5
    assert f.image_positions == (1024,) and f.image_windows == (64,) * 16  # 32 x 32 patches, windows of 8 x 8


def test_a_full_omni_config_plans_its_thinker():
    full = {"model_type": "qwen2_5_omni", "thinker_config": QWEN25_OMNI_7B}
    spec = spec_from_config(full, name="omni", image_processor=QWEN25_PROCESSOR, feature_extractor=OMNI_FE)
    assert spec.hf.architecture == "Qwen2_5OmniThinkerForConditionalGeneration" and spec.audio.window == 100


@pytest.mark.parametrize("config,message", [
    ({**QWEN25_VL_7B, "vision_config": {**QWEN25_VL_7B["vision_config"], "window_size": 20}},
     r"model\.config\.vision_config\.window_size=20 is smaller than one merged token \(spatial_merge_size x "
     r"patch_size = 28 pixels\)"),
    ({**QWEN25_OMNI_7B, "audio_config": {**QWEN25_OMNI_7B["audio_config"], "n_window": 2000}},
     r"model\.config\.audio_config\.n_window=2000 must be in 1\.\.max_source_positions=1500"),
])
def test_qwen25_configs_mmpipe_cannot_run_are_one_line_errors(config, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_config(config, name="x")
    assert "\n" not in str(err.value)
