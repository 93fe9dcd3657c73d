"""Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): a Whisper-style encoder over 30-s clips,
average pooling by 2, a final norm and a linear projector; a Qwen2 (or Llama, Mistral) decoder.
`model=compose` of a Whisper encoder and a causal LM is this class too (compose.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model.hf import layers as L
from mmpipe.model.hf.arch import LLM_TYPES, audio_feature_extractor
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.demo_kit import TEXT_ITEM, chatml, qwen_tokenizer, save
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.skeleton import PROJECTOR
from mmpipe.model.spec import AudioSpec, ModelSpec

TOWER = "model.audio_tower"
TEMPLATE = chatml("{% if content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
                  "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" + TEXT_ITEM)


def check(config: PretrainedConfig, what: str) -> None:
    if config.audio_config.model_type != "qwen2_audio_encoder":
        raise ValueError(f"{what}: audio tower {config.audio_config.model_type!r} is not supported; "
                         f"use qwen2_audio_encoder")


def audio(config: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> AudioSpec:
    """Clips cut at the tower's 30 s (2 x max_source_positions mel frames), strided conv, pooled by 2."""
    ac, text = config.audio_config, config.get_text_config()
    fe = audio_feature_extractor(ac, fe_config, what)
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


def default_feature_extractor(config: PretrainedConfig) -> dict[str, Any]:
    """Whisper's at 16 kHz, clips padded to the tower's whole window."""
    ac = config.audio_config
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": ac.num_mel_bins,
            "chunk_length": 2 * ac.max_source_positions * 160 // 16000, "sampling_rate": 16000, "hop_length": 160}


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    return {"embed": (("conv1", f"{TOWER}.conv1"), ("conv2", f"{TOWER}.conv2"),
                      ("embed_positions", f"{TOWER}.embed_positions")),
            "block": (("block", f"{TOWER}.layers.{i}"),),
            "proj": (("avg_pooler", f"{TOWER}.avg_pooler"), ("layer_norm", f"{TOWER}.layer_norm"),
                     ("projector", PROJECTOR))}[kind]


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    kind = name.split(".")[1]
    if kind == "embed":
        return L.AudioEmbed(parts, dropout=float(hf_config(spec.hf).audio_config.dropout))
    return {"block": L.AudioBlock, "proj": L.AudioProj}[kind](parts)


def write_demo(root: Path, texts: list[str]) -> Path:
    """A 2-block Qwen2-Audio tower over 16 mel bins, clips cut at 4 s, + a Qwen2 decoder."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    torch.manual_seed(43)
    tok = qwen_tokenizer(texts)
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=200),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048),
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"))
    folder = save(Qwen2AudioForConditionalGeneration(cfg), tok, TEMPLATE, root / "qwen2-audio", 43)
    WhisperFeatureExtractor(feature_size=16, chunk_length=4).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="qwen2_audio", architecture="Qwen2AudioForConditionalGeneration", title="Qwen2-Audio",
    text_types=LLM_TYPES, towers={"audio": TOWER}, check=check, vision=None, audio=audio, image_processors=(),
    default_image_processor=None, default_feature_extractor=default_feature_extractor, video_processor=None,
    processor_settings=None, layer_parts=layer_parts, tower_layer=tower_layer, llm_block=None, positions=None,
    audio_in_video=False, outer=None, demo=Demo(name="qwen2-audio", write=write_demo))
