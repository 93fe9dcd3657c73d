"""Initial weights from local Hugging Face checkpoint folders (nothing is downloaded).

`pretrained.vision=DIR` (a SigLIP vision model), `pretrained.audio=DIR` (a Whisper model or
its encoder) and `pretrained.llm=DIR` (a Llama-architecture causal LM) load with
transformers' own `from_pretrained(..., local_files_only=True)`; each pipeline layer then
copies the weights of the part it is. The checkpoint's architecture must match the model
config (the error says which setting to change). Projectors are not part of these
checkpoints and keep their initialisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mmpipe.model.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Pretrained:
    """Local checkpoint folders, per component (None: random initialisation)."""

    vision: str | None = None
    """A SiglipVisionModel folder (config.json + weights)."""
    audio: str | None = None
    """A WhisperModel / WhisperForConditionalGeneration folder; its encoder is used."""
    llm: str | None = None
    """A LlamaForCausalLM-compatible folder."""

    def __post_init__(self) -> None:
        for comp in ("vision", "audio", "llm"):
            path = getattr(self, comp)
            if path is not None and not (Path(path) / "config.json").is_file():
                raise ValueError(f"pretrained.{comp}={path!r} is not a checkpoint folder (no config.json there); "
                                 f"give a local folder written by save_pretrained, or null")

    def any(self) -> bool:
        return any((self.vision, self.audio, self.llm))


@functools.lru_cache(maxsize=3)
def _load(component: str, path: str) -> nn.Module:
    """The checkpoint's module for a component, loaded once per process."""
    if component == "vision":
        from transformers import SiglipVisionModel

        model = SiglipVisionModel.from_pretrained(path, local_files_only=True)
        return getattr(model, "vision_model", model)
    if component == "audio":
        from transformers import WhisperModel

        return WhisperModel.from_pretrained(path, local_files_only=True).encoder
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def _check(setting: str, ours: int, theirs: int, path: str, key: str) -> None:
    if ours != theirs:
        raise ValueError(f"{setting}={ours} but the checkpoint in {path} has {key}={theirs}; "
                         f"set {setting}={theirs} (or use a model preset that matches it)")


def check_matches(spec: ModelSpec, pre: Pretrained) -> None:
    """The checkpoints' architectures equal the configured one (before any process starts)."""
    from transformers import AutoConfig

    if pre.vision and spec.vision is not None:
        c = AutoConfig.from_pretrained(pre.vision, local_files_only=True)
        c = getattr(c, "vision_config", c)
        for ours, key, setting in ((spec.vision.hidden, "hidden_size", "model.vision.hidden"),
                                   (spec.vision.mlp, "intermediate_size", "model.vision.mlp"),
                                   (spec.vision.heads, "num_attention_heads", "model.vision.heads"),
                                   (spec.vision.patch, "patch_size", "model.vision.patch")):
            _check(setting, ours, getattr(c, key), pre.vision, key)
        if c.num_hidden_layers < spec.vision.blocks:
            _check("model.vision.blocks", spec.vision.blocks, c.num_hidden_layers, pre.vision, "num_hidden_layers")
    if pre.audio and spec.audio is not None:
        c = AutoConfig.from_pretrained(pre.audio, local_files_only=True)
        for ours, key, setting in ((spec.audio.hidden, "d_model", "model.audio.hidden"),
                                   (spec.audio.mlp, "encoder_ffn_dim", "model.audio.mlp"),
                                   (spec.audio.heads, "encoder_attention_heads", "model.audio.heads"),
                                   (spec.audio.mel_bins, "num_mel_bins", "model.audio.mel_bins"),
                                   (spec.audio.blocks, "encoder_layers", "model.audio.blocks")):
            _check(setting, ours, getattr(c, key), pre.audio, key)
    if pre.llm:
        c = AutoConfig.from_pretrained(pre.llm, local_files_only=True)
        for ours, key, setting in ((spec.llm.hidden, "hidden_size", "model.llm.hidden"),
                                   (spec.llm.mlp, "intermediate_size", "model.llm.mlp"),
                                   (spec.llm.heads, "num_attention_heads", "model.llm.heads"),
                                   (spec.llm.kv_heads, "num_key_value_heads", "model.llm.kv_heads"),
                                   (spec.llm.vocab, "vocab_size", "model.llm.vocab"),
                                   (spec.llm.blocks, "num_hidden_layers", "model.llm.blocks")):
            _check(setting, ours, getattr(c, key), pre.llm, key)


def _copy_embedding(dst: nn.Embedding, src: torch.Tensor) -> nn.Embedding:
    """A learned position table of another size: take the checkpoint's table as it is for
    images (positions are interpolated per image), its first rows for audio."""
    return nn.Embedding.from_pretrained(src.detach().clone(), freeze=False).to(dst.weight.dtype)


@torch.no_grad()
def load_into(layer: nn.Module, name: str, pre: Pretrained) -> None:
    """Copy the checkpoint weights of pipeline layer `name` into `layer`, if one is given."""
    comp, kind, *rest = name.split(".")
    path = getattr(pre, comp, None)
    if not path:
        return
    hf = _load(comp, path)
    if comp == "vision":
        if kind == "embed":
            layer.embed.patch_embedding.load_state_dict(hf.embeddings.patch_embedding.state_dict())
            layer.embed.position_embedding = _copy_embedding(layer.embed.position_embedding,
                                                             hf.embeddings.position_embedding.weight)
        elif kind == "block":
            layer.block.load_state_dict(hf.encoder.layers[int(rest[0])].state_dict())
        elif kind == "proj":
            layer.norm.load_state_dict(hf.post_layernorm.state_dict())
    elif comp == "audio":
        if kind == "embed":
            layer.conv1.load_state_dict(hf.conv1.state_dict())
            layer.conv2.load_state_dict(hf.conv2.state_dict())
            n = layer.positions.weight.shape[0]
            table = hf.embed_positions.weight
            if table.shape[0] < n:
                raise ValueError(f"pretrained.audio={path!r} has {table.shape[0]} positions but model.audio.max_seconds "
                                 f"needs {n}; lower model.audio.max_seconds")
            layer.positions.weight.copy_(table[:n])
        elif kind == "block":
            layer.block.load_state_dict(hf.layers[int(rest[0])].state_dict())
        elif kind == "proj":
            layer.norm.load_state_dict(hf.layer_norm.state_dict())
    elif comp == "llm":
        base = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.model
        if kind == "embed":
            layer.embed.load_state_dict(base.embed_tokens.state_dict())
        elif kind == "block":
            layer.block.load_state_dict(base.layers[int(rest[0])].state_dict())
        elif kind == "norm":
            layer.norm.load_state_dict(base.norm.state_dict())
        elif kind == "head":
            layer.head.load_state_dict(hf.lm_head.state_dict())
