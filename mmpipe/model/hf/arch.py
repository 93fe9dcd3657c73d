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
run is refused here, before any process starts, by a one-line ValueError. What differs between
classes (their checks, towers, processors and figures) is their family's (`Family`, families/);
this module is what they share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from mmpipe.model.hf.configs import config_from_dict, config_json
from mmpipe.model.hf.family import REGISTRY, Family, families
from mmpipe.model.hf.media import make_feature_extractor
from mmpipe.model.hf.outer import unwrap
from mmpipe.model.hf.video import read_video_processor_config
from mmpipe.model.spec import HFSource, LLMSpec, ModelSpec

LLM_TYPES = ("llama", "mistral", "qwen2")
"""Decoders a LLaVA (1.5, NeXT, OneVision), Qwen2-Audio or composed model may use."""
VISION_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""Vision towers a LLaVA or composed model may use (a full CLIP/SigLIP model gives its vision part)."""


def supported_models() -> str:
    """Every registered family's class, and the compositions (what errors list)."""
    return (f"{', '.join(f.architecture for f in families())}, or model=compose of a CLIP/SigLIP vision model or "
            f"a Whisper encoder with a {'/'.join(LLM_TYPES)} causal LM")


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


def check_supported(config: PretrainedConfig, *, what: str = "model") -> Family:
    """The family of a supported architecture, its config checked, or a ValueError naming what is not."""
    family = REGISTRY.get(config.model_type)
    if family is None:
        raise ValueError(f"{what}: model_type {config.model_type!r} is not supported; supported: {supported_models()}")
    text = config.get_text_config()
    if text.model_type not in family.text_types:
        raise ValueError(f"{what}: language model type {text.model_type!r} is not supported; "
                         f"use one of {', '.join(family.text_types)}")
    if family.check is not None:
        family.check(config, what)
    return family


# ----------------------------------------------------------------------------- figures


def _llm_spec(text: PretrainedConfig, *, tie: bool, max_seq_len: int | None) -> LLMSpec:
    heads = text.num_attention_heads
    return LLMSpec(blocks=text.num_hidden_layers, hidden=text.hidden_size, mlp=text.intermediate_size,
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   vocab=text.vocab_size, max_seq_len=int(max_seq_len or text.max_position_embeddings),
                   tie_embeddings=tie)


def audio_feature_extractor(ac: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> Any:
    """An audio tower's (Whisper) feature extractor, checked against the tower `ac`: whole mel
    frames per second, and the tower's number of mel bins."""
    fe = make_feature_extractor(fe_config)
    if fe.sampling_rate % fe.hop_length:
        raise ValueError(f"{what}: feature extractor hop_length={fe.hop_length} does not divide "
                         f"sampling_rate={fe.sampling_rate}")
    if fe.feature_size != ac.num_mel_bins:
        raise ValueError(f"{what}: the feature extractor makes {fe.feature_size} mel bins but the audio tower "
                         f"takes num_mel_bins={ac.num_mel_bins}")
    return fe


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
    config = unwrap(config)
    family = check_supported(config, what=what)
    if use_audio_in_video and not family.audio_in_video:
        readers = " / ".join(f.title for f in families() if f.audio_in_video)
        raise ValueError(f"model.use_audio_in_video=true: only {readers} reads a video's audio track, this model "
                         f"is {family.model_type}; set model.use_audio_in_video=false")
    vision, audio, video = family.vision is not None, family.audio is not None, family.video_processor is not None
    if vision:
        image_processor = dict(image_processor or family.default_image_processor(config))
    if audio:
        feature_extractor = dict(feature_extractor or family.default_feature_extractor(config))
    if video:
        video_processor = dict(video_processor or image_processor)
    config.architectures = [family.architecture]
    src = HFSource(architecture=family.architecture, config=config_json(config), weights=tuple(weights),
                   image_processor=json.dumps(image_processor, sort_keys=True) if vision else "",
                   feature_extractor=json.dumps(feature_extractor, sort_keys=True) if audio else "",
                   video_processor=json.dumps(video_processor, sort_keys=True) if video else "")
    from mmpipe.model.hf.skeleton import ties_embeddings  # builds the model on the meta device

    llm = _llm_spec(config.get_text_config(), tie=ties_embeddings(src), max_seq_len=max_seq_len)
    return ModelSpec(name=name, llm=llm, hf=src,
                     vision=family.vision(config, image_processor, video_processor, what, use_audio_in_video)
                     if vision else None,
                     audio=family.audio(config, feature_extractor, what) if audio else None)


def spec_from_folder(folder: str | Path, *, name: str | None = None, max_seq_len: int | None = None,
                     what: str = "model.path", use_audio_in_video: bool = False) -> ModelSpec:
    """The spec of a checkpoint folder (its config.json, preprocessor files and weights)."""
    config = unwrap(read_config(folder, what=what))
    family = check_supported(config, what=f"{what}={str(folder)!r}")
    settings = Path(folder) / "processor_config.json"
    if family.processor_settings is not None and settings.is_file():
        family.processor_settings(json.loads(settings.read_text()), config, f"{what}={str(folder)!r}")
    video = (read_video_processor_config(folder, family.video_processor)
             if family.video_processor is not None else None)
    return spec_from_config(config, name=name or Path(folder).name, weights=(("model", str(folder)),),
                            image_processor=read_processor_config(folder, "image_processor"),
                            feature_extractor=read_processor_config(folder, "feature_extractor"),
                            max_seq_len=max_seq_len, what=f"{what}={str(folder)!r}", video_processor=video,
                            use_audio_in_video=use_audio_in_video)
