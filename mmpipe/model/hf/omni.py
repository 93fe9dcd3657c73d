"""Qwen2.5-Omni's thinker: the audio tower's pipeline layers, and what a full Qwen2.5-Omni folder
(thinker, talker, token2wav) means to mmpipe.

The audio tower (`Qwen2_5OmniAudioEncoder`) takes the valid mel frames of all clips, cuts each clip
into chunks of 2 * n_window frames (the last one shorter), runs the conv front on each chunk alone
(zeros past its end), adds sinusoidal positions restarting at every chunk, attends within each
chunk in every block, then averages pairs of positions per clip, normalises (`ln_post`) and
projects into the LLM. The layers run transformers' own chunking and index helpers on the carried
frames; the chunks' attention segments come with the micro-batch's layout (collate computes them,
`model/geometry.py: chunk_positions`). The vision tower is Qwen2.5-VL's (`qwen25.py`); the decoder
is the M-RoPE decoder of `layers.HFLLMBlock`, its positions computed in collate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    chunk_and_pad_features,
    get_pool_indices,
    get_valid_indices,
)

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf.layers import HFLayer, empty_like_output, use_varlen_attention
from mmpipe.model.spec import ModelSpec

FULL_OMNI = "qwen2_5_omni"
"""model_type of a full Qwen2.5-Omni folder (`thinker.*`, `talker.*`, `token2wav.*` tensors)."""
SPEAKER_FILES = ("spk_dict.pt",)
"""Files of a full Qwen2.5-Omni folder that only its talker reads; export copies them along."""


class OmniAudioEmbed(HFLayer):
    """Conv front per chunk and sinusoidal positions per chunk: features [clips, mel, F] (each
    clip's valid frames, zero-filled past them) -> states [A, D] over every chunk's positions."""

    def __init__(self, parts: dict[str, nn.Module], *, window: int):
        super().__init__(parts)
        self.window = window

    def step(self, slots: list[torch.Tensor]) -> None:
        feats = C.from_wire(slots[C.AUDIO], self.dtype)
        frames = slots[C.AUDIO_FRAMES]
        lengths = layout.host_list(frames)
        if not lengths:
            slots[C.AUDIO] = empty_like_output(feats, self, 0, self.conv2.out_channels)
            return
        x = torch.cat([feats[i, :, :n] for i, n in enumerate(lengths)], dim=1)  # [mel, all valid frames]
        padded, chunk_lengths = chunk_and_pad_features(x, frames, self.window)
        mask = (torch.arange(padded.shape[2], device=padded.device) < chunk_lengths[:, None])[:, None]
        h = F.gelu(self.conv1(padded)) * mask.to(padded.dtype)
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        h = h + self.positions.positional_embedding[:h.shape[1]].to(h.dtype)
        h = h.reshape(-1, h.shape[-1]).index_select(0, get_valid_indices(chunk_lengths))
        carried = layout.read(slots[C.LAYOUT]).audio
        if carried.total != h.shape[0]:
            raise ValueError(f"the audio tower made {h.shape[0]} positions of clips of {lengths} mel frames but the "
                             f"micro-batch's layout has {carried.total}; collate it with "
                             f"mmpipe.runtime.batch.collate_hf")
        slots[C.AUDIO] = h


class OmniAudioBlock(HFLayer):
    """One encoder block over all chunks' positions [A, D], attending within each chunk."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__(parts)
        use_varlen_attention(self.block.self_attn)

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.AUDIO], self.dtype)
        if h.shape[0] == 0:
            slots[C.AUDIO] = h
            return
        chunks = layout.read(slots[C.LAYOUT]).audio
        with segments(Segments(stream=chunks, causal=False)):
            slots[C.AUDIO] = self.block(h, cu_seqlens=chunks.cu_seqlens, max_seqlen=chunks.max_len)[0]


class OmniAudioProj(HFLayer):
    """Average of position pairs per clip (the last odd one dropped), ln_post, linear into the LLM:
    [A, D] -> [tokens, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.AUDIO], self.dtype)
        frames = slots[C.AUDIO_FRAMES]
        if frames.numel():
            pairs = get_pool_indices(frames)
            h = (h[pairs] + h[pairs + 1]) / 2
        else:
            h = h[:0]
        slots[C.AUDIO] = self.proj(self.ln_post(h))


def audio_layer(kind: str, parts: dict[str, nn.Module], config) -> nn.Module:
    """The `audio.<kind>[.<index>]` layer of a Qwen2.5-Omni thinker."""
    if kind == "embed":
        return OmniAudioEmbed(parts, window=config.audio_config.n_window)
    return {"block": OmniAudioBlock, "proj": OmniAudioProj}[kind](parts)


# ----------------------------------------------------------------------------- full Qwen2.5-Omni folders


def full_omni_folder(spec: ModelSpec) -> Path | None:
    """The checkpoint folder when the spec's thinker comes from a full Qwen2.5-Omni folder (its
    config.json has model_type qwen2_5_omni), else None."""
    if spec.hf is None:
        return None
    folder = dict(spec.hf.weights).get("model")
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    return Path(folder) if config.get("model_type") == FULL_OMNI else None


def source_note(spec: ModelSpec) -> str | None:
    """One line for the start of a run from a full Qwen2.5-Omni folder, else None."""
    folder = full_omni_folder(spec)
    if folder is None:
        return None
    return (f"model.path={str(folder)!r} is a full Qwen2.5-Omni folder: mmpipe trains its thinker (audio and "
            f"vision towers, LLM); the talker and token2wav are not loaded, and `mmpipe export` copies them "
            f"unchanged into the full folder it writes")
