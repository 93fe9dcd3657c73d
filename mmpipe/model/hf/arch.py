"""Architecture of a Hugging Face model: its transformers config, checked, and turned into the
figures the planner costs (a `ModelSpec`) plus the record the layers are built from (`HFSource`).

Three sources, none of which downloads anything:
- a checkpoint folder written by `save_pretrained` (config.json, safetensors, processor files);
- an inline config (a mapping shaped like config.json: a 7B preset without weights);
- a composition of unimodal checkpoints with a new projector (`model=compose`, LLaVA stage-1
  style): a vision tower + LLM is a `LlavaForConditionalGeneration`, a Whisper encoder + LLM a
  `Qwen2AudioForConditionalGeneration` (Qwen2-Audio's own recipe), and each exports as such.

Every setting that changes numerics stays in the transformers config, because the layers are
that config's own module classes (rope, norms, biases, activations, ties...). What mmpipe cannot
run is refused here, before any process starts, by a one-line ValueError.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from mmpipe.model.hf import qwen3
from mmpipe.model.hf.anyres import ANYRES, anyres_vision, check_anyres, check_processor_settings
from mmpipe.model.hf.anyres import default_processor as default_anyres_processor
from mmpipe.model.hf.configs import ARCHITECTURES, config_from_dict, config_json
from mmpipe.model.hf.media import make_feature_extractor, make_image_processor
from mmpipe.model.hf.skeleton import LLAVA_TOWERS
from mmpipe.model.hf.video import (
    VIDEO_PROCESSORS,
    make_video_processor,
    onevision_video_spec,
    read_video_processor_config,
    video_spec,
)
from mmpipe.model.spec import AudioSpec, HFSource, LLMSpec, ModelSpec, VideoSpec, VisionSpec

LLM_TYPES = ("llama", "mistral", "qwen2")
"""Decoder families a LLaVA (1.5, NeXT, OneVision), Qwen2-Audio or composed model may use."""
VISION_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""Vision towers a LLaVA or composed model may use (a full CLIP/SigLIP model gives its vision part)."""


def supported_models() -> str:
    return (f"{', '.join(ARCHITECTURES.values())}, or model=compose of a CLIP/SigLIP vision model or a "
            f"Whisper encoder with a {'/'.join(LLM_TYPES)} causal LM")


# ----------------------------------------------------------------------------- reading configs


def read_config(folder: str | Path, *, what: str = "model.path") -> PretrainedConfig:
    """A checkpoint folder's transformers config (local files only)."""
    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"{what}={str(folder)!r} does not exist; give a local checkpoint folder written by "
                         f"save_pretrained")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{what}={str(folder)!r} is not a checkpoint folder (no config.json there); "
                         f"give a local folder written by save_pretrained")
    path = folder / "config.json"
    try:  # read here first: transformers says only "not a valid JSON file", with a traceback
        json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{what}={str(folder)!r}: cannot read {path} ({err.strerror or err}); make the folder "
                         f"readable by this user") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        where = f"line {err.lineno} column {err.colno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else err
        raise ValueError(f"{what}={str(folder)!r}: {path} is not valid JSON ({where}); restore the file or "
                         f"re-save the model with save_pretrained") from None
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError) as err:
        raise ValueError(f"{what}={str(folder)!r}: transformers cannot read its config.json ({err}); "
                         f"supported: {supported_models()}") from None


def read_processor_config(folder: str | Path, kind: str) -> dict[str, Any] | None:
    """A folder's image processor (`kind="image_processor"`) or feature extractor config, from
    preprocessor_config.json or the nested entry of processor_config.json (transformers 5)."""
    folder = Path(folder)
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} cannot be read as JSON ({getattr(err, 'strerror', None) or err}); restore "
                             f"it or re-save the processor with save_pretrained") from None
        if name == "processor_config.json":
            data = data.get(kind)
            if not isinstance(data, dict):
                continue
        type_key = "image_processor_type" if kind == "image_processor" else "feature_extractor_type"
        if type_key in data:
            return data
    return None


# ----------------------------------------------------------------------------- checks


QWEN_TEXT_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen2_5_omni_text", "qwen3_vl_text")
"""The M-RoPE decoders of the Qwen-VL and Qwen-Omni classes (each only inside its own class)."""
VISION_KINDS = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "llava_next", "llava_onevision", "qwen3_vl")
"""Supported model types with a vision tower."""
AUDIO_KINDS = ("qwen2_audio", "qwen2_5_omni_thinker")
"""Supported model types with an audio tower."""


def _text(config: PretrainedConfig, what: str) -> PretrainedConfig:
    text = config.get_text_config()
    if text.model_type not in (*LLM_TYPES, *QWEN_TEXT_TYPES):
        raise ValueError(f"{what}: language model type {text.model_type!r} is not supported; "
                         f"use one of {', '.join(LLM_TYPES)}")
    return text


def _feature_layer(config: PretrainedConfig, layers: int, what: str) -> int:
    """How many vision blocks LLaVA's `vision_feature_layer` runs (hidden_states[k] is the
    output of block k-1; index 0 is the embedding output)."""
    layer = config.vision_feature_layer
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"{what}.vision_feature_layer={layer!r}: only a single layer index is supported "
                         f"(features of several layers are not); use e.g. -2")
    k = layer % (layers + 1) if -(layers + 1) <= layer <= layers else -1
    if k < 1:
        raise ValueError(f"{what}.vision_feature_layer={layer} selects no vision block of {layers}; "
                         f"use an index in 1..{layers} or -{layers}..-1")
    return k


def check_supported(config: PretrainedConfig, *, what: str = "model") -> str:
    """The model_type of a supported architecture, or a ValueError naming what is not."""
    kind = config.model_type
    if kind not in ARCHITECTURES:
        raise ValueError(f"{what}: model_type {kind!r} is not supported; supported: {supported_models()}")
    _text(config, what)
    if kind in ("qwen2_5_vl", "qwen2_5_omni_thinker"):
        check_qwen25(config, what)
    if kind in LLAVA_TOWERS:
        vtype = config.vision_config.model_type
        if vtype not in VISION_TYPES:
            raise ValueError(f"{what}: LLaVA vision tower {vtype!r} is not supported; use "
                             f"{' or '.join(VISION_TYPES)}")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"{what}.vision_feature_select_strategy="
                             f"{config.vision_feature_select_strategy!r} is unknown; use default or full")
        _feature_layer(config, config.vision_config.num_hidden_layers, what)
    if kind in ANYRES:
        check_anyres(config, cls_token=VISION_TYPES[config.vision_config.model_type] == "clip", what=what)
    if kind == "qwen3_vl":
        qwen3.check(config, what)
    if kind == "qwen2_audio" and config.audio_config.model_type != "qwen2_audio_encoder":
        raise ValueError(f"{what}: audio tower {config.audio_config.model_type!r} is not supported; "
                         f"use qwen2_audio_encoder")
    return kind


# ----------------------------------------------------------------------------- figures


def _llm_spec(text: PretrainedConfig, *, tie: bool, max_seq_len: int | None) -> LLMSpec:
    heads = text.num_attention_heads
    return LLMSpec(blocks=text.num_hidden_layers, hidden=text.hidden_size, mlp=text.intermediate_size,
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   vocab=text.vocab_size, max_seq_len=int(max_seq_len or text.max_position_embeddings),
                   tie_embeddings=tie)


def _fixed_side(ip: Mapping[str, Any], vc: PretrainedConfig, what: str) -> int:
    """The square side a CLIP/SigLIP image processor outputs (its tower has fixed positions)."""
    proc = make_image_processor(ip)
    box = proc.crop_size if getattr(proc, "do_center_crop", False) else proc.size
    h, w = getattr(box, "height", None), getattr(box, "width", None)
    if h is None or h != w:
        raise ValueError(f"{what}: the image processor does not output square images of a fixed side "
                         f"(size={proc.size}, crop_size={getattr(proc, 'crop_size', None)}); the tower has "
                         f"fixed positions")
    if h != vc.image_size:
        raise ValueError(f"{what}: the image processor outputs {h}x{h} images but the vision tower's "
                         f"image_size is {vc.image_size}")
    return int(h)


def _llava_vision(config: PretrainedConfig, ip: Mapping[str, Any] | None, what: str) -> VisionSpec:
    vc, text = config.vision_config, config.get_text_config()
    return VisionSpec(
        blocks=_feature_layer(config, vc.num_hidden_layers, what), hidden=vc.hidden_size, mlp=vc.intermediate_size,
        heads=vc.num_attention_heads, patch=vc.patch_size, resize="fixed", image_size=_fixed_side(ip, vc, what),
        merge=1, cls_token=VISION_TYPES[vc.model_type] == "clip", select=config.vision_feature_select_strategy,
        proj=(text.hidden_size, text.hidden_size), channels=vc.num_channels)


def _anyres_vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None,
                   what: str) -> VisionSpec:
    vc = config.vision_config
    spec = anyres_vision(config, ip, what, blocks=_feature_layer(config, vc.num_hidden_layers, what),
                         cls_token=VISION_TYPES[vc.model_type] == "clip", side=_fixed_side(ip, vc, what))
    if config.model_type != "llava_onevision":
        return spec
    proc = make_video_processor(config.model_type, vp or {})  # OneVision's frames: one tile each
    return dataclasses.replace(spec, video=onevision_video_spec(proc, side=spec.image_size, what=what))


def _qwen_processors(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any], what: str,
                     audio_in_video: bool = False) -> tuple[Any, VideoSpec]:
    """A Qwen-VL-family tower's image processor, checked against the tower's patch, merge and
    temporal figures, and its VideoSpec (as the model's processor calls its video processor)."""
    vc = config.vision_config
    proc = make_image_processor(ip)
    for key, ours in (("patch_size", vc.patch_size), ("merge_size", vc.spatial_merge_size),
                      ("temporal_patch_size", vc.temporal_patch_size)):
        if getattr(proc, key) != ours:
            raise ValueError(f"{what}: the image processor has {key}={getattr(proc, key)} but the vision tower {ours}")
    video = video_spec(make_video_processor(config.model_type, vp), patch=vc.patch_size, merge=vc.spatial_merge_size,
                       temporal=vc.temporal_patch_size, what=what, model_type=config.model_type,
                       audio_in_video=audio_in_video)
    return proc, video


def _qwen2_vl_vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any], what: str) -> VisionSpec:
    vc = config.vision_config
    proc, video = _qwen_processors(config, ip, vp, what)
    merged = vc.embed_dim * vc.spatial_merge_size ** 2
    return VisionSpec(
        blocks=vc.depth, hidden=vc.embed_dim, mlp=int(vc.embed_dim * vc.mlp_ratio), heads=vc.num_heads,
        patch=vc.patch_size, resize="smart", min_pixels=int(proc.size.shortest_edge),
        max_pixels=int(proc.size.longest_edge), merge=vc.spatial_merge_size, temporal_patch=vc.temporal_patch_size,
        proj=(merged, vc.hidden_size), channels=vc.in_channels, video=video)


def _feature_extractor(ac: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> Any:
    """The audio tower's feature extractor, checked against the tower: whole mel frames per
    second, and the tower's number of mel bins."""
    fe = make_feature_extractor(fe_config)
    if fe.sampling_rate % fe.hop_length:
        raise ValueError(f"{what}: feature extractor hop_length={fe.hop_length} does not divide "
                         f"sampling_rate={fe.sampling_rate}")
    if fe.feature_size != ac.num_mel_bins:
        raise ValueError(f"{what}: the feature extractor makes {fe.feature_size} mel bins but the audio tower "
                         f"takes num_mel_bins={ac.num_mel_bins}")
    return fe


def _audio(config: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> AudioSpec:
    ac, text = config.audio_config, config.get_text_config()
    fe = _feature_extractor(ac, fe_config, what)
    rate, hop = fe.sampling_rate, fe.hop_length
    if fe.nb_max_frames != 2 * ac.max_source_positions:
        raise ValueError(f"{what}: the feature extractor pads clips to {fe.nb_max_frames} frames but the audio "
                         f"tower takes 2 x max_source_positions = {2 * ac.max_source_positions}")
    if ac.encoder_layerdrop:
        raise ValueError(f"{what}.audio_config.encoder_layerdrop={ac.encoder_layerdrop}: layer drop is not "
                         f"supported (a pipeline stage cannot skip its layer); set it to 0")
    return AudioSpec(blocks=ac.encoder_layers, hidden=ac.d_model, mlp=ac.encoder_ffn_dim,
                     heads=ac.encoder_attention_heads, mel_bins=ac.num_mel_bins, sample_rate=rate,
                     frames_per_s=rate // hop, conv_stride=2, pool=2, pool_ceil=False,
                     max_seconds=fe.n_samples / rate, proj=(text.hidden_size,))


# ----------------------------------------------------------------------------- Qwen2.5-VL and Qwen2.5-Omni


def unwrap_omni(config: PretrainedConfig) -> PretrainedConfig:
    """A full Qwen2.5-Omni config (model_type qwen2_5_omni: thinker, talker, token2wav) as the
    thinker's, which is what mmpipe trains; any other config unchanged."""
    return config.thinker_config if config.model_type == "qwen2_5_omni" else config


def check_qwen25(config: PretrainedConfig, what: str) -> None:
    """What the Qwen2.5-VL / Qwen2.5-Omni towers need that mmpipe checks before launch."""
    vc = config.vision_config
    if vc.window_size // vc.spatial_merge_size // vc.patch_size < 1:
        raise ValueError(f"{what}.vision_config.window_size={vc.window_size} is smaller than one merged token "
                         f"(spatial_merge_size x patch_size = {vc.spatial_merge_size * vc.patch_size} pixels)")
    if config.model_type == "qwen2_5_omni_thinker":
        ac = config.audio_config
        if not 0 < ac.n_window <= ac.max_source_positions:
            raise ValueError(f"{what}.audio_config.n_window={ac.n_window} must be in 1..max_source_positions="
                             f"{ac.max_source_positions} (each chunk's positions index the sinusoidal table)")


def _qwen25_vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any], what: str,
                   audio_in_video: bool) -> VisionSpec:
    """Qwen2.5-VL's tower (also Qwen2.5-Omni's): RMSNorm + SwiGLU blocks, windowed attention in all
    blocks but `fullatt_block_indexes`, out_hidden_size into the LLM; videos as the model's
    processor calls its video processor (model/hf/video.py)."""
    vc = config.vision_config
    proc, video = _qwen_processors(config, ip, vp, what, audio_in_video)
    merged = vc.hidden_size * vc.spatial_merge_size ** 2
    return VisionSpec(
        blocks=vc.depth, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_heads, patch=vc.patch_size,
        resize="smart", min_pixels=int(proc.size.shortest_edge), max_pixels=int(proc.size.longest_edge),
        merge=vc.spatial_merge_size, temporal_patch=vc.temporal_patch_size, proj=(merged, vc.out_hidden_size),
        channels=vc.in_channels, window=int(vc.window_size), mlp_gated=True,
        full_blocks=tuple(int(b) for b in vc.fullatt_block_indexes), video=video)


def _omni_audio(config: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> AudioSpec:
    """Qwen2.5-Omni's audio tower: Whisper-style blocks attending within chunks of n_window
    positions (2 * n_window mel frames), pooled by 2 per clip, ln_post, linear into the LLM.
    The feature extractor's length (its chunk_length) cuts clips; the chunks need no 30-s cap."""
    ac = config.audio_config
    fe = _feature_extractor(ac, fe_config, what)
    rate, hop = fe.sampling_rate, fe.hop_length
    return AudioSpec(blocks=ac.encoder_layers, hidden=ac.d_model, mlp=ac.encoder_ffn_dim,
                     heads=ac.encoder_attention_heads, mel_bins=ac.num_mel_bins, sample_rate=rate,
                     frames_per_s=rate // hop, conv_stride=2, pool=2, pool_ceil=False,
                     max_seconds=fe.n_samples / rate, proj=(ac.output_dim,), window=int(ac.n_window))


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    """The processor config transformers' own defaults give a tower (for an inline config)."""
    if config.model_type in ("qwen2_vl", "qwen3_vl", "qwen2_5_vl", "qwen2_5_omni_thinker"):
        vc = config.vision_config
        return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": vc.patch_size,
                "merge_size": vc.spatial_merge_size, "temporal_patch_size": vc.temporal_patch_size}
    if config.model_type in ANYRES:
        return default_anyres_processor(config, VISION_TYPES[config.vision_config.model_type])
    side = config.vision_config.image_size
    if VISION_TYPES[config.vision_config.model_type] == "clip":
        return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": side},
                "crop_size": {"height": side, "width": side}, "do_center_crop": True}
    return {"image_processor_type": "SiglipImageProcessor", "size": {"height": side, "width": side}}


def default_feature_extractor(config: PretrainedConfig) -> dict[str, Any]:
    ac = config.audio_config
    # Qwen2.5-Omni's chunked tower takes clips of any length; its Hub preprocessor pads to 300 s
    seconds = 300 if config.model_type == "qwen2_5_omni_thinker" else 2 * ac.max_source_positions * 160 // 16000
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": ac.num_mel_bins,
            "chunk_length": seconds, "sampling_rate": 16000, "hop_length": 160}


def spec_from_config(config: PretrainedConfig | Mapping[str, Any], *, name: str,
                     weights: tuple[tuple[str, str], ...] = (),
                     image_processor: Mapping[str, Any] | None = None,
                     feature_extractor: Mapping[str, Any] | None = None,
                     max_seq_len: int | None = None, what: str = "model.config",
                     video_processor: Mapping[str, Any] | None = None,
                     use_audio_in_video: bool = False) -> ModelSpec:
    """The spec of a supported architecture given its transformers config.

    Args:
        config: a transformers config, or a mapping shaped like config.json.
        name: the preset name.
        weights: (part, folder) pairs the weights load from (empty: random initialisation).
        image_processor, feature_extractor: processor configs (transformers' defaults if None).
        max_seq_len: longest sample; the config's max_position_embeddings if None.
        video_processor: the video processor's config of an architecture that takes video
            (Qwen2-VL, LLaVA-OneVision); None: the image processor's, the fallback transformers takes for a
            folder without a video processor file.
        use_audio_in_video: Qwen2.5-Omni's use_audio_in_video: a clip's audio track is encoded
            and interleaved with its frames (model.use_audio_in_video; an error for other models).
    """
    if not isinstance(config, PretrainedConfig):
        config = config_from_dict(config, what=what)
    config = unwrap_omni(config)
    kind = check_supported(config, what=what)
    if use_audio_in_video and kind != "qwen2_5_omni_thinker":
        raise ValueError(f"model.use_audio_in_video=true: only Qwen2.5-Omni reads a video's audio track, this model "
                         f"is {kind}; set model.use_audio_in_video=false")
    if kind in VISION_KINDS:
        image_processor = dict(image_processor or default_image_processor(config))
    if kind in AUDIO_KINDS:
        feature_extractor = dict(feature_extractor or default_feature_extractor(config))
    if kind in VIDEO_PROCESSORS:
        video_processor = dict(video_processor or image_processor)
    arch = ARCHITECTURES[kind]
    config.architectures = [arch]
    src = HFSource(architecture=arch, config=config_json(config), weights=tuple(weights),
                   image_processor=json.dumps(image_processor, sort_keys=True) if kind in VISION_KINDS else "",
                   feature_extractor=json.dumps(feature_extractor, sort_keys=True) if kind in AUDIO_KINDS else "",
                   video_processor=json.dumps(video_processor, sort_keys=True) if kind in VIDEO_PROCESSORS else "")
    from mmpipe.model.hf.skeleton import ties_embeddings  # builds the model on the meta device

    llm = _llm_spec(config.get_text_config(), tie=ties_embeddings(src), max_seq_len=max_seq_len)
    vision = audio = None
    if kind == "llava":
        vision = _llava_vision(config, image_processor, what)
    elif kind == "qwen2_vl":
        vision = _qwen2_vl_vision(config, image_processor, video_processor, what)
    elif kind in ANYRES:
        vision = _anyres_vision(config, image_processor, video_processor, what)
    elif kind == "qwen3_vl":
        vision = qwen3.vision_spec(config, image_processor, what)
    elif kind in ("qwen2_5_vl", "qwen2_5_omni_thinker"):
        vision = _qwen25_vision(config, image_processor, video_processor, what, use_audio_in_video)
    if kind == "qwen2_audio":
        audio = _audio(config, feature_extractor, what)
    elif kind == "qwen2_5_omni_thinker":
        audio = _omni_audio(config, feature_extractor, what)
    return ModelSpec(name=name, llm=llm, vision=vision, audio=audio, hf=src)


def spec_from_folder(folder: str | Path, *, name: str | None = None, max_seq_len: int | None = None,
                     what: str = "model.path", use_audio_in_video: bool = False) -> ModelSpec:
    """The spec of a checkpoint folder (its config.json, preprocessor files and weights)."""
    config = unwrap_omni(read_config(folder, what=what))
    check_supported(config, what=f"{what}={str(folder)!r}")
    if config.model_type in ANYRES and (Path(folder) / "processor_config.json").is_file():
        settings = json.loads((Path(folder) / "processor_config.json").read_text())
        check_processor_settings(settings, config, f"{what}={str(folder)!r}")
    video = read_video_processor_config(folder, config.model_type) if config.model_type in VIDEO_PROCESSORS else None
    return spec_from_config(config, name=name or Path(folder).name, weights=(("model", str(folder)),),
                            image_processor=read_processor_config(folder, "image_processor"),
                            feature_extractor=read_processor_config(folder, "feature_extractor"),
                            max_seq_len=max_seq_len, what=f"{what}={str(folder)!r}", video_processor=video,
                            use_audio_in_video=use_audio_in_video)
