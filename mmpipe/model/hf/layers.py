"""Pipeline layers made of transformers' own modules (LLaVA, Qwen2-VL, Qwen2-Audio, decoders; more in families/).

Each layer holds the transformers modules `skeleton.layer_parts` names and runs them exactly as
the transformers model's forward does, on the carrier (model/carrier.py) instead of keyword
arguments. What differs is only how samples share a tensor:
- LLaVA towers take every image of the micro-batch as one batch [N, P, D] (fixed size);
- Qwen2-VL's tower packs all patches [P, D] and attends per image (its own cu_seqlens path);
- Qwen2-Audio's tower packs the valid positions of all clips [1, A, D] and attends per clip,
  where transformers pads every clip to 30 s and masks: see AudioEmbed for why equal.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from transformers.vision_utils import get_vision_position_ids

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import VARLEN_NAME, Segments, segments
from mmpipe.model.layers import LLMEmbed, PipeLayer, encoder_block_step, llm_segments


class HFLayer(PipeLayer):
    """A pipeline layer holding transformers modules under the attribute names of layer_parts."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        for attr, module in parts.items():
            if isinstance(module, nn.Parameter):  # a bare parameter of the model (LLaVA-NeXT's image_newline)
                self.register_parameter(attr, module)
            else:
                self.add_module(attr, module)
        # parameters transformers itself keeps frozen (Qwen2-Audio's position table)
        self.frozen_params = frozenset(n for n, p in self.named_parameters() if not p.requires_grad)


def empty_like_output(x: torch.Tensor, module: nn.Module, *shape: int) -> torch.Tensor:
    """An empty activation that still carries the module's parameters in its graph, so a stage
    boundary after it gets the gradient DeepSpeed expects (zero, here); and the layer's empty
    input `x` where that requires grad (a tower's states received from the stage before), which
    DeepSpeed sends a gradient back for too."""
    out = x.new_zeros(shape)
    if x.requires_grad:
        out = out + 0 * x.sum()
    params = [p for p in module.parameters() if p.requires_grad]
    return out + 0 * params[0].sum() if params else out


# ----------------------------------------------------------------------------- LLaVA towers


class LlavaVisionEmbed(HFLayer):
    """CLIP/SigLIP patch + class embeddings (+ CLIP's pre-norm): pixels [N, 3, S, S] -> [N, P, D]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        pixels = C.from_wire(slots[C.IMAGE], self.dtype)
        h = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            h = self.pre_layrnorm(h)
        slots[C.IMAGE] = h


class LlavaVisionBlock(HFLayer):
    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if h.shape[0] == 0:
            slots[C.IMAGE] = h
            return
        with segments(Segments(stream=None, causal=False)):  # every image is one row: no mask
            slots[C.IMAGE] = self.block(h, None)


class LlavaVisionProj(HFLayer):
    """vision_feature_select_strategy, then the MLP projector: [N, P, D] -> [N * tokens, D_llm]."""

    def __init__(self, parts: dict[str, nn.Module], *, drop_first: bool):
        super().__init__(parts)
        self.drop_first = drop_first

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if self.drop_first:  # `default`: transformers drops position 0, class token or not
            h = h[:, 1:]
        out = self.projector(h)
        slots[C.IMAGE] = out.reshape(-1, out.shape[-1])


# ----------------------------------------------------------------------------- Qwen2-VL tower


class QwenVisionEmbed(HFLayer):
    """Conv3d patch embedding: processed patches [P, C*T*p*p] -> [P, D]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        slots[C.IMAGE] = self.patch_embed(C.from_wire(slots[C.IMAGE], self.dtype))


def use_varlen_attention(attn: nn.Module) -> None:
    """Route a transformers attention module through mmpipe's attention function, which runs all
    of a micro-batch's segments (images, windows, audio chunks) in one call from the carried
    cu_seqlens (attention.VARLEN_NAME says why the name). The module gets a config of its own, so
    the model's shared config keeps its implementation name."""
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = VARLEN_NAME


class QwenVisionBlock(HFLayer):
    """One ViT block over all patches, attending per image (cu_seqlens), 2-D rotary positions.

    The block's attention calls mmpipe's attention function once for all images, with the
    micro-batch's carried image cu_seqlens (attention.VARLEN_NAME says why the name), and the
    rotary positions are computed once per micro-batch and stage, not in every block."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__(parts)
        use_varlen_attention(self.block.attn)

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if h.shape[0] == 0:
            slots[C.IMAGE] = h
            return
        images = layout.read(slots[C.LAYOUT]).image
        merge = self.block.attn.config.spatial_merge_size
        positions = layout.per_batch(slots[C.IMAGE_GRID], ("qwen2_vl_positions", merge),
                                     lambda g: get_vision_position_ids(g.cpu(), merge).to(g.device))
        with segments(Segments(stream=images, causal=False)):
            slots[C.IMAGE] = self.block(h, cu_seqlens=images.cu_seqlens, max_seqlen=images.max_len,
                                        position_embeddings=self.rotary(h, positions))


class QwenVisionMerger(HFLayer):
    """Norm, 2x2 merge and MLP: [P, D] -> [P / 4, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        slots[C.IMAGE] = self.merger(C.from_wire(slots[C.IMAGE], self.dtype))


# ----------------------------------------------------------------------------- Qwen2-Audio tower


class AudioEmbed(HFLayer):
    """Whisper conv front and positions, per clip, over its valid positions only.

    transformers pads every clip to max_source_positions * 2 frames (30 s) and masks attention
    to the valid positions P = (L - 1) // 2 + 1 of its L valid frames. Output position j of the
    two k=3 convs (the second of stride 2, both padded by 1) reads frames 2j - 2 .. 2j + 2 and
    nothing else, so positions 0..P-1 need frames 0..2P only: the carrier brings those
    min(2P + 1, all) frames (the feature extractor's values, padding frames included) and the
    convs run on them alone. Attention over valid positions equals the masked attention (masked
    keys weigh exactly 0), and pooling pairs stay inside the valid positions (AudioProj).
    """

    def __init__(self, parts: dict[str, nn.Module], *, dropout: float):
        super().__init__(parts)
        self.dropout = dropout

    def step(self, slots: list[torch.Tensor]) -> None:
        feats = C.from_wire(slots[C.AUDIO], self.dtype)
        limit = self.embed_positions.weight.shape[0] * 2
        out = []
        for i, p in enumerate(layout.read(slots[C.LAYOUT]).audio.lengths):
            need = min(2 * p + 1, limit)
            if feats.shape[2] < need:
                raise ValueError(f"audio clip {i} carries {feats.shape[2]} mel frames but its {p} positions read "
                                 f"{need}; make its features with mmpipe.model.hf.media.preprocess_audio")
            x = feats[i:i + 1, :, :need]
            x = F.gelu(self.conv1(x))
            x = F.gelu(self.conv2(x))[0, :, :p].transpose(0, 1)
            out.append(x + self.embed_positions.weight[:p])
        if not out:
            slots[C.AUDIO] = empty_like_output(feats, self, 1, 0, self.conv2.out_channels)
            return
        slots[C.AUDIO] = F.dropout(torch.cat(out)[None], p=self.dropout, training=self.training)


class AudioBlock(HFLayer):
    def step(self, slots: list[torch.Tensor]) -> None:
        encoder_block_step(self.block, slots, C.AUDIO, "audio", self.dtype)


class AudioProj(HFLayer):
    """Average pooling by 2 per clip (floor), the tower's final norm, the linear projector."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.AUDIO], self.dtype)[0]
        lengths = list(layout.read(slots[C.LAYOUT]).audio.lengths)
        pooled = [self.avg_pooler(x.T[None])[0].T for x in torch.split(h, lengths)] if lengths else []
        x = torch.cat(pooled) if pooled else h[:0]
        slots[C.AUDIO] = self.projector(self.layer_norm(x))


# ----------------------------------------------------------------------------- decoder


class HFLLMEmbed(LLMEmbed):
    """The decoder's token embedding; image, video and audio embeddings replace their
    placeholders in order (transformers' masked_scatter of each)."""

    def __init__(self, parts: dict[str, nn.Module], *, image_token: int, audio_token: int, video_token: int = -1):
        PipeLayer.__init__(self)
        self.embed = parts["embed"]
        self.image_token = image_token
        self.audio_token = audio_token
        self.video_token = video_token
        self.frozen_params = frozenset()


class HFLLMBlock(HFLayer):
    """One decoder layer with its rotary table: 1-D positions [B, T] or M-RoPE [3, B, T]."""

    def __init__(self, parts: dict[str, nn.Module], *, mrope: bool):
        super().__init__(parts)
        self.mrope = mrope

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.HIDDEN], self.dtype)
        pos = slots[C.POSITION_IDS]
        with segments(llm_segments(slots, h.dtype)):
            slots[C.HIDDEN] = self.block(h, attention_mask=None, position_ids=None if self.mrope else pos,
                                         position_embeddings=self.rotary(h, pos))


class HFLLMNorm(HFLayer):
    def step(self, slots: list[torch.Tensor]) -> None:
        slots[C.HIDDEN] = self.norm(C.from_wire(slots[C.HIDDEN], self.dtype))


class HFLLMHead(HFLayer):
    """The LM head: returns logits [B, T, V] (the loss is token_loss)."""

    def forward(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.head(C.from_wire(carrier[C.HIDDEN], self.head.weight.dtype))


def tied_head_forward(embed: nn.Module, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`llm.head` of a tied model, given the `llm.embed` layer that owns the one weight
    (DeepSpeed's TiedLayerSpec calls it as forward_fn with that module)."""
    w = embed.embed.weight
    return F.linear(C.from_wire(carrier[C.HIDDEN], w.dtype), w)


class TiedHead(nn.Module):
    """`llm.head` of a tied model in one process: logits through the embedding layer's weight."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed_layer = embed
        self.frozen_params = frozenset()

    def forward(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return tied_head_forward(self.embed_layer, carrier)
