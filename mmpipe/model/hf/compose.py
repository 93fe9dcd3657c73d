"""`model=compose`: unimodal checkpoints joined by a new projector, LLaVA stage-1 style.

A composition is one of the architectures transformers already has, so it trains, loads and
exports as that class:
- a CLIP/SigLIP vision model (or the vision half of a CLIP/SigLIP model) + a causal LM is a
  `LlavaForConditionalGeneration` (MLP projector, `vision_feature_layer`, select strategy);
- a Whisper encoder + a causal LM is a `Qwen2AudioForConditionalGeneration`: Whisper's encoder
  weights are exactly Qwen2-Audio's audio tower (Qwen2-Audio was initialised from Whisper),
  which adds average pooling by 2 before the tower's final norm; the projector is one linear.
Both encoders at once has no transformers class, so it is refused (a documented limitation).
The weights come from each folder through that folder's own class and transformers' key
mapping; the projector is random, or loaded from a folder holding one (e.g. a LLaVA checkpoint
or an earlier export).
"""

from __future__ import annotations

from typing import Any

from transformers import LlavaConfig, PretrainedConfig, Qwen2AudioConfig, Qwen2AudioEncoderConfig

from mmpipe.model.hf.arch import LLM_TYPES, VISION_TYPES, read_config, read_processor_config, spec_from_config
from mmpipe.model.spec import ModelSpec


def _llm_config(folder: str) -> PretrainedConfig:
    config = read_config(folder, what="model.llm.path")
    if config.model_type not in LLM_TYPES or not any(a.endswith("ForCausalLM") for a in config.architectures or []):
        raise ValueError(f"model.llm.path={folder!r} is a {config.model_type} "
                         f"{'/'.join(config.architectures or ['model'])}; use a {'/'.join(LLM_TYPES)} *ForCausalLM")
    return config


def _vision_config(folder: str) -> PretrainedConfig:
    config = read_config(folder, what="model.vision.path")
    if config.model_type in ("clip", "siglip"):  # a full CLIP / SigLIP model: its vision half
        config = config.vision_config
    if config.model_type not in VISION_TYPES:
        raise ValueError(f"model.vision.path={folder!r} is a {config.model_type} model; use a CLIP or "
                         f"SigLIP (vision) model")
    return config


def _audio_config(folder: str) -> Qwen2AudioEncoderConfig:
    w = read_config(folder, what="model.audio.path")
    if w.model_type != "whisper":
        raise ValueError(f"model.audio.path={folder!r} is a {w.model_type} model; use a Whisper model")
    return Qwen2AudioEncoderConfig(
        num_mel_bins=w.num_mel_bins, encoder_layers=w.encoder_layers, encoder_attention_heads=w.encoder_attention_heads,
        encoder_ffn_dim=w.encoder_ffn_dim, d_model=w.d_model, dropout=w.dropout, attention_dropout=w.attention_dropout,
        activation_function=w.activation_function, activation_dropout=w.activation_dropout,
        scale_embedding=w.scale_embedding, initializer_range=w.init_std, max_source_positions=w.max_source_positions,
        encoder_layerdrop=0.0)


PLACEHOLDERS = {"image_token_id": ("image_token", "<image>"), "audio_token_id": ("audio_token", "<audio>")}
"""Where an unset placeholder id is looked up in the LLM's tokenizer: its named token, else this text."""


def _tokenizer_token(llm: str, key: str) -> int | None:
    """The id of the LLM tokenizer's placeholder token (`image_token` / `audio_token`, else
    `<image>` / `<audio>`) when it is one token of its own; None when the tokenizer has none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(llm, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    named, text = PLACEHOLDERS[key]
    for candidate in (getattr(tok, named, None), text):
        if candidate and candidate in tok.get_vocab() and tok(candidate, add_special_tokens=False)["input_ids"] == [
                tok.convert_tokens_to_ids(candidate)]:
            return int(tok.convert_tokens_to_ids(candidate))
    return None


def _token(value: Any, key: str, llm: str, vocab: int) -> int:
    if value is None:
        value = _tokenizer_token(llm, key)
        if value is None:
            raise ValueError(f"model.{key} is not set and the tokenizer in model.llm.path={llm!r} has no "
                             f"{PLACEHOLDERS[key][1]} token; add the placeholder token to the LLM (tokenizer."
                             f"add_special_tokens, model.resize_token_embeddings, save_pretrained) or set model.{key}")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise ValueError(f"model.{key}={value!r} must be a token id of the LLM's vocabulary "
                         f"(0..{vocab - 1}); add the placeholder token to the LLM first (resize_token_embeddings "
                         f"and save_pretrained)")
    return value


def spec_from_compose(*, name: str, llm: str, vision: str | None = None, audio: str | None = None,
                      projector: str | None = None, vision_feature_layer: int = -2,
                      vision_feature_select_strategy: str = "default", projector_hidden_act: str = "gelu",
                      image_token_id: int | None = None, audio_token_id: int | None = None,
                      max_seq_len: int | None = None) -> ModelSpec:
    """The spec of a composition (see the module docstring); the settings of the `model=compose`
    group (conf/model/compose.yaml). An unset image / audio token id is the LLM tokenizer's
    `<image>` / `<audio>` token (or its `image_token` / `audio_token`)."""
    if (vision is None) == (audio is None):
        raise ValueError("model=compose needs exactly one encoder, model.vision.path or model.audio.path (no "
                         "transformers class holds both; compose one at a time)")
    text = _llm_config(llm)
    weights: tuple[tuple[str, str], ...]
    if vision is not None:
        config = LlavaConfig(vision_config=_vision_config(vision).to_dict(), text_config=text.to_dict(),
                             vision_feature_layer=vision_feature_layer,
                             vision_feature_select_strategy=vision_feature_select_strategy,
                             projector_hidden_act=projector_hidden_act, multimodal_projector_bias=True,
                             image_token_id=_token(image_token_id, "image_token_id", str(llm), text.vocab_size))
        weights = (("vision", str(vision)), ("llm", str(llm)))
        processors = {"image_processor": read_processor_config(vision, "image_processor")}
    else:
        config = Qwen2AudioConfig(audio_config=_audio_config(audio).to_dict(), text_config=text.to_dict(),
                                  audio_token_id=_token(audio_token_id, "audio_token_id", str(llm), text.vocab_size))
        weights = (("audio", str(audio)), ("llm", str(llm)))
        processors = {"feature_extractor": read_processor_config(audio, "feature_extractor")}
    if projector is not None:
        weights += (("projector", str(projector)),)
    return spec_from_config(config, name=name, weights=weights, max_seq_len=max_seq_len,
                            what="model", **processors)
