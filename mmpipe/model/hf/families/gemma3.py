"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower over one fixed-size image (896 px, 14-px
patches: 64 x 64 positions, no class token), its final layer norm, Gemma 3's projector (an average pool
to `mm_tokens_per_image` tokens, a Gemma RMSNorm, one matrix), and the Gemma 3 text decoder.

The decoder is transformers' own Gemma3DecoderLayer, run as Gemma3TextModel runs it: its layer type
(`config.layer_types`: sliding or full attention) picks the rotary table (the local base for sliding
layers, the global one, possibly scaled, for full layers) and the mask. Inside an image the attention
is bidirectional: every run of consecutive image tokens is one block (transformers'
`get_block_sequence_ids_for_mask` of the processor's token_type_ids, which mark exactly the image
tokens); a full layer attends causally or inside the query's block, a sliding layer the same but never
to a key `sliding_window` or more positions back. mmpipe finds the blocks from the carried token ids
(the image token) once per micro-batch and stage and hands them to its packed attention
(attention.Segments.blocks); text-only rows are plain causal, as transformers' are.

Text: Gemma3Processor puts "\\n\\n<start_of_image>" + image_seq_length image tokens + "<end_of_image>\\n\\n"
in place of each <start_of_image> the chat template writes; the planner counts the four text tokens
around the image's 256 (VisionSpec.image_markers). Pan-and-scan crops (do_pan_and_scan, off in
Gemma3Processor's defaults) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf import layers as L
from mmpipe.model.hf.anyres import check_processor_settings
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.families.llava import fixed_side
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.skeleton import PROJECTOR
from mmpipe.model.spec import ModelSpec, VisionSpec

TOWER = "model.vision_tower"
PROCESSOR = "Gemma3ImageProcessor"
TEMPLATE = (  # Gemma 3's turns (<start_of_turn>user ... <end_of_turn>), an image item as <start_of_image>
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def pool(config: PretrainedConfig, what: str) -> int:
    """Patches a side that the projector's average pool folds into one token."""
    vc = config.vision_config
    side, per = vc.image_size // vc.patch_size, round(config.mm_tokens_per_image ** 0.5)
    if vc.image_size % vc.patch_size or per * per != config.mm_tokens_per_image or side % per:
        raise ValueError(f"{what}.mm_tokens_per_image={config.mm_tokens_per_image}: the projector pools a "
                         f"{side}x{side} patch grid to a square grid of whole pools (Gemma 3's 64 -> 16)")
    return side // per


def check(config: PretrainedConfig, what: str) -> None:
    """A SigLIP tower of whole pools; a causal decoder whose attention mmpipe runs as transformers does."""
    vc, text = config.vision_config, config.get_text_config()
    if vc.model_type != "siglip_vision_model":
        raise ValueError(f"{what}: Gemma 3's vision tower {vc.model_type!r} is not supported; use siglip_vision_model")
    pool(config, what)
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"{what}.text_config.use_bidirectional_attention=true: only the causal decoder (Gemma 3's) "
                         f"is supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, key, None) is not None:
            raise ValueError(f"{what}.text_config.{key}={getattr(text, key)!r}: Gemma3ForConditionalGeneration does "
                             f"not apply it; set it to null")
    if config.image_token_id >= text.vocab_size:
        raise ValueError(f"{what}.image_token_id={config.image_token_id} is outside the vocabulary "
                         f"({text.vocab_size}); mmpipe embeds the image token's row before the image replaces it")


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """One tower pass of the fixed-size image; its 64 x 64 patches pooled 4 x 4 into 256 tokens."""
    if ip.get("do_pan_and_scan"):
        raise ValueError(f"{what}: image_processor.do_pan_and_scan=true: pan-and-scan crops are not supported; "
                         f"set do_pan_and_scan to false (Gemma3Processor's default)")
    vc, text = config.vision_config, config.get_text_config()
    return VisionSpec(
        blocks=vc.num_hidden_layers, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_attention_heads,
        patch=vc.patch_size, resize="fixed", image_size=fixed_side(ip, vc, what), merge=pool(config, what),
        pooled=True, select="patches", proj=(text.hidden_size,), channels=vc.num_channels, image_markers=4,
        image_blocks=True)


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    """Gemma3ImageProcessor at the tower's side (SigLIP's resize, mean and std 0.5), no pan-and-scan."""
    side = config.vision_config.image_size
    return {"image_processor_type": PROCESSOR, "size": {"height": side, "width": side}, "do_pan_and_scan": False,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2}


def processor_settings(settings: Mapping[str, Any], config: PretrainedConfig, what: str) -> None:
    """Gemma3Processor puts image_seq_length image tokens per image."""
    check_processor_settings(settings, {"image_seq_length": config.mm_tokens_per_image}, what)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """SigLIP's embeddings; encoder layer i; the tower's final norm with the projector."""
    return {"embed": (("embeddings", f"{TOWER}.embeddings"),),
            "block": (("block", f"{TOWER}.encoder.layers.{i}"),),
            "proj": (("post_layernorm", f"{TOWER}.post_layernorm"), ("projector", PROJECTOR))}[kind]


# ----------------------------------------------------------------------------- layers


class Gemma3VisionProj(L.HFLayer):
    """The tower's final norm, then Gemma3MultiModalProjector (pool, norm, matrix): [N, P, D] -> [N * tokens, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        width = self.projector.mm_input_projection_weight.shape[1]
        if h.shape[0] == 0:
            slots[C.IMAGE] = L.empty_like_output(h, self, 0, width)
            return
        out = self.projector(self.post_layernorm(h))
        slots[C.IMAGE] = out.reshape(-1, out.shape[-1])


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    kind = name.split(".")[1]
    return {"embed": L.LlavaVisionEmbed, "block": L.LlavaVisionBlock, "proj": Gemma3VisionProj}[kind](parts)


def image_blocks(ids: torch.Tensor, image_token: int) -> torch.Tensor:
    """[B, T] long: the block of every position, each run of consecutive image tokens of a row one
    block (numbered from 0 along the row), -1 elsewhere (transformers' get_block_sequence_ids_for_mask)."""
    image = ids == image_token
    before = torch.nn.functional.pad(image, (1, 0), value=False)[:, :-1]
    starts = (image & ~before).long().cumsum(dim=1) - 1
    return torch.where(image, starts, torch.full_like(starts, -1))


def block_segment_mask(segment_ids: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The padded rows' mask (carrier.causal_segment_mask) with each image block bidirectional."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
    inside = same & (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    mask = C.causal_segment_mask(segment_ids, dtype)
    return mask.masked_fill(inside[:, None], 0.0)


class Gemma3Block(L.HFLayer):
    """One Gemma 3 decoder layer: the rotary table of its layer type, causal attention with every image
    block bidirectional (and the window of a sliding layer)."""

    def __init__(self, parts: dict[str, nn.Module], *, image_token: int):
        super().__init__(parts)
        self.image_token = image_token
        self.layer_type = self.block.self_attn.layer_type

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.HIDDEN], self.dtype)
        pos = slots[C.POSITION_IDS]
        blocks = layout.per_batch(slots[C.INPUT_IDS], ("gemma3_blocks", self.image_token),
                                  lambda ids: image_blocks(ids, self.image_token))
        seg_ids = slots[C.SEGMENT_IDS]
        if seg_ids.shape[0] == 1:
            seg = Segments(stream=layout.read(slots[C.LAYOUT]).llm, causal=True, blocks=blocks[0])
        else:
            seg = Segments(stream=None, causal=True, mask=layout.per_batch(
                seg_ids, ("gemma3_mask", h.dtype), lambda s: block_segment_mask(s, blocks, h.dtype)))
        with segments(seg):
            slots[C.HIDDEN] = self.block(h, attention_mask=None, position_ids=pos,
                                         position_embeddings=self.rotary(h, pos, self.layer_type))


def llm_block(spec: ModelSpec, index: int, parts: dict[str, nn.Module]) -> nn.Module:
    return Gemma3Block(parts, image_token=int(hf_config(spec.hf).image_token_id))


# ----------------------------------------------------------------------------- demo


def perturb_projector(model: nn.Module, seed: int) -> None:
    """The projector's matrix is drawn as zeros (transformers' _init_weights): draw it, so that the image
    features, and with them the tower's gradients, are not zero."""
    w = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)


def write_demo(root: Path, texts: list[str]) -> Path:
    """A 2-layer SigLIP (28-px images of 7-px patches pooled 2x2: 4 tokens an image) + a 4-layer Gemma 3
    decoder (sliding and full layers, an 8-token window); the processor (Gemma3Processor) saved whole."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from mmpipe.model.hf.demo_kit import gemma_tokenizer, save

    torch.manual_seed(53)
    tok = gemma_tokenizer(texts)
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in (("image", tok.image_token), ("boi", tok.boi_token),
                                                         ("eoi", tok.eoi_token))}
    text = Gemma3TextConfig(vocab_size=len(tok) + 5, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                            query_pre_attn_scalar=8, max_position_embeddings=2048,
                            layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vc = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=28, patch_size=7, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vc, mm_tokens_per_image=4, image_token_id=ids["image"],
                       boi_token_id=ids["boi"], eoi_token_id=ids["eoi"])
    model = Gemma3ForConditionalGeneration(cfg)
    perturb_projector(model, 53)
    folder = save(model, tok, TEMPLATE, root / "gemma3", 53)
    image = Gemma3ImageProcessor(size={"height": 28, "width": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Gemma3Processor(image_processor=image, tokenizer=tok, image_seq_length=4,
                    chat_template=TEMPLATE).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="gemma3", architecture="Gemma3ForConditionalGeneration", title="Gemma 3",
    text_types=("gemma3_text",), towers={"vision": TOWER}, check=check, vision=vision, audio=None,
    image_processors=(PROCESSOR,), default_image_processor=default_image_processor, default_feature_extractor=None,
    video_processor=None, processor_settings=processor_settings, layer_parts=layer_parts, tower_layer=tower_layer,
    llm_block=llm_block, positions=None, audio_in_video=False, outer=None, demo=Demo(name="gemma3", write=write_demo))
