"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, dense): its figures and its pipeline layers.

The tower is Qwen2-VL's in shape (Conv3d patches, 2-D rotary, attention per image, a 2x2 merger)
with two additions, and the decoder is Qwen3 (q/k norms) with interleaved M-RoPE:

- **Learned positions.** A square table of `num_position_embeddings` entries is resampled to each
  image's patch grid (bilinear, corners aligned) and added after the patch embedding. The taps and
  weights are transformers' own `get_vision_interpolation_indices_and_weights`, made once per
  micro-batch and stage from the carried grids, with the settings the meta model's tower holds.
- **DeepStack.** The outputs of the blocks in `deepstack_visual_indexes`, each through its own
  merger (`deepstack_merger_list`), are added to the LLM hidden states at the image tokens after
  decoder layers 0, 1, ... (`Qwen3VLTextModel._deepstack_process`). The features travel in the
  carrier's DEEPSTACK slot (model/carrier.py), so the planner may cut anywhere, also between the
  decoder layers that add them: the block states ride from their block to `vision.proj`, which
  holds every merger (the final one and the DeepStack ones, all projectors into the LLM width, so
  `train.trainable=[vision.proj, ...]` trains them together), and the merged features ride from
  there to the decoder layer that adds each. A feature that requires grad crosses stages as a
  float and gets its gradient back from the decoder layer that adds it; a frozen one crosses as
  bits. The planner prices those bytes at every cut (planner/cost.py). docs/hf.md says why this
  rather than keeping those decoder layers on the tower's stage.

Video (timestamps as text, `<|video_pad|>`) is not supported yet; the decoder layers' mask of
visual tokens is a tuple of token ids so that video tokens can join it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.hf.build import placeholder_tokens
from mmpipe.model.hf.demo_kit import QWEN_SPECIALS, TEXT_ITEM, qwen_tokenizer, save
from mmpipe.model.hf.families import qwen2_vl
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.layers import HFLayer, HFLLMBlock, QwenVisionBlock
from mmpipe.model.hf.positions import grid_positions
from mmpipe.model.hf.skeleton import skeleton
from mmpipe.model.spec import ModelSpec, VisionSpec

TOWER = qwen2_vl.TOWER
TEMPLATE = (  # Qwen3-VL's ChatML: no default system message; an image item becomes its three markers
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>" + TEXT_ITEM + "{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------- figures


def check(config: PretrainedConfig, what: str) -> None:
    """A one-line ValueError for what mmpipe cannot run of a Qwen3-VL config."""
    indexes = list(config.vision_config.deepstack_visual_indexes)
    depth, layers = config.vision_config.depth, config.get_text_config().num_hidden_layers
    if indexes != sorted(set(indexes)) or any(not 0 <= i < depth for i in indexes):
        raise ValueError(f"{what}.vision_config.deepstack_visual_indexes={indexes}: mmpipe takes rising block "
                         f"indexes in 0..{depth - 1} (the order transformers adds the features in)")
    if len(indexes) > layers:
        raise ValueError(f"{what}.vision_config.deepstack_visual_indexes={indexes}: {len(indexes)} features for "
                         f"{layers} decoder layers; transformers drops the extra ones, mmpipe refuses them")


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """The figures the planner costs, from the config and its image processor config (no video yet)."""
    vc = config.vision_config
    proc = qwen2_vl.image_processor(config, ip, what)
    merged = vc.hidden_size * vc.spatial_merge_size ** 2
    return VisionSpec(
        blocks=vc.depth, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_heads, patch=vc.patch_size,
        resize="smart", min_pixels=int(proc.size.shortest_edge), max_pixels=int(proc.size.longest_edge),
        merge=vc.spatial_merge_size, temporal_patch=vc.temporal_patch_size, proj=(merged, vc.out_hidden_size),
        channels=vc.in_channels, deepstack=tuple(int(i) for i in vc.deepstack_visual_indexes),
        position_table=int(vc.num_position_embeddings))


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """(attribute, module path) of each module of a tower layer (skeleton.layer_parts)."""
    return {"embed": (("patch_embed", f"{TOWER}.patch_embed"), ("pos_embed", f"{TOWER}.pos_embed")),
            "block": (("block", f"{TOWER}.blocks.{i}"), ("rotary", f"{TOWER}.rotary_pos_emb")),
            "proj": (("merger", f"{TOWER}.merger"), ("deepstack", f"{TOWER}.deepstack_merger_list"))}[kind]


# ----------------------------------------------------------------------------- tower


class Qwen3VisionEmbed(HFLayer):
    """Conv3d patch embedding plus the learned positions resampled to each image's grid:
    processed patches [P, C*T*p*p] -> [P, D]."""

    def __init__(self, parts: dict[str, nn.Module], *, visual: nn.Module):
        super().__init__(parts)
        # how transformers' tower resamples its table (set in its __init__, read off the meta model)
        self.interpolation = dict(num_grid_per_side=int(visual.num_grid_per_side), mode=visual.interpolation_mode,
                                  align_corners=bool(visual.interpolation_align_corners),
                                  spatial_merge_size=int(visual.spatial_merge_size))

    def step(self, slots: list[torch.Tensor]) -> None:
        h = self.patch_embed(C.from_wire(slots[C.IMAGE], self.dtype))
        if h.shape[0]:
            key = ("qwen3_vl_interpolation", *sorted(self.interpolation.items()))
            taps, weights = layout.per_batch(slots[C.IMAGE_GRID], key, self._taps)
            h = h + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(h.dtype)
        slots[C.IMAGE] = h

    def _taps(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return get_vision_interpolation_indices_and_weights(grid, **self.interpolation)


class Qwen3VisionBlock(QwenVisionBlock):
    """A Qwen2-VL-style block (per-image attention, 2-D rotary); a DeepStack block also appends
    its output to the DEEPSTACK slot for its merger in `vision.proj`."""

    def __init__(self, parts: dict[str, nn.Module], *, deepstack: bool):
        super().__init__(parts)
        self.deepstack = deepstack

    def step(self, slots: list[torch.Tensor]) -> None:
        super().step(slots)
        if self.deepstack:  # also for a micro-batch without images: every stage counts on j entries
            h = slots[C.IMAGE]
            before = slots[C.DEEPSTACK]
            states = [C.from_wire(before, h.dtype)] if before.dim() == 3 else []
            slots[C.DEEPSTACK] = torch.cat([*states, h[None]])


class Qwen3VisionMerger(HFLayer):
    """The final merger [P, D] -> [P / 4, D_llm], and each DeepStack merger on its block's
    carried states: [k, P, D] -> [k, P / 4, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        slots[C.IMAGE] = self.merger(h)
        k = len(self.deepstack)
        if not k:
            return
        carried = slots[C.DEEPSTACK]
        if carried.dim() != 3 or carried.shape[0] != k:
            raise ValueError(f"vision.proj holds {k} DeepStack mergers but the carrier brings DeepStack states of "
                             f"shape {tuple(carried.shape)}; the vision blocks of this model must run before it")
        states = C.from_wire(carried, self.dtype)
        slots[C.DEEPSTACK] = torch.stack([merger(states[j]) for j, merger in enumerate(self.deepstack)])


# ----------------------------------------------------------------------------- decoder


class Qwen3LLMBlock(HFLLMBlock):
    """A Qwen3-VL decoder layer (3-D positions, interleaved M-RoPE by its own rotary module).
    Decoder layer j < k then adds the first of the k - j DeepStack features it receives to the
    hidden states at the visual tokens (row-major, the order transformers' mask takes them in)
    and passes the rest on."""

    def __init__(self, parts: dict[str, nn.Module], *, index: int, features: int, visual_tokens: tuple[int, ...]):
        super().__init__(parts, mrope=True)
        self.index, self.features, self.visual_tokens = index, features, visual_tokens

    def step(self, slots: list[torch.Tensor]) -> None:
        super().step(slots)
        left = self.features - self.index
        if left <= 0:
            return
        carried, ids = slots[C.DEEPSTACK], slots[C.INPUT_IDS]
        where = layout.per_batch(ids, ("qwen3_vl_visual", self.visual_tokens), self._visual)
        if carried.dim() != 3 and not where[0].numel():
            return  # no tower ran before this layer (the decoder alone) and there is nothing to add
        if carried.dim() != 3 or carried.shape[0] != left:
            raise ValueError(f"llm.block.{self.index} adds DeepStack feature {self.index} of {self.features}, but the "
                             f"carrier brings DeepStack features of shape {tuple(carried.shape)}, not {left} of them")
        h = slots[C.HIDDEN]
        feats = C.from_wire(carried, h.dtype)
        if where[0].numel() != feats.shape[1]:
            raise ValueError(f"{where[0].numel()} visual tokens for {feats.shape[1]} DeepStack features; the "
                             f"sample's media and its text disagree")
        # (with no visual token, index_put still links the empty feature into the graph: a stage
        # boundary that sent it gets its gradient back; test_hf_layers cuts after every layer)
        h = h.index_put(where, feats[0], accumulate=True)
        slots[C.HIDDEN] = h
        slots[C.DEEPSTACK] = feats[1:] if left > 1 else C.empty(ids)

    def _visual(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Where the visual tokens are (one host sync per micro-batch and stage, not per layer)."""
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for token in self.visual_tokens:
            visual |= ids == token
        return visual.nonzero(as_tuple=True)


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    """The pipeline layer `vision.<kind>[.<i>]` of a Qwen3-VL model."""
    _, kind, *rest = name.split(".")
    if kind == "embed":
        return Qwen3VisionEmbed(parts, visual=skeleton(spec.hf).get_submodule(TOWER))
    if kind == "block":
        return Qwen3VisionBlock(parts, deepstack=int(rest[0]) in spec.vision.deepstack)
    return Qwen3VisionMerger(parts)


def llm_block(spec: ModelSpec, index: int, parts: dict[str, nn.Module]) -> nn.Module:
    """Decoder layer `index`, adding its DeepStack feature when it has one."""
    return Qwen3LLMBlock(parts, index=index, features=len(spec.vision.deepstack),
                         visual_tokens=(placeholder_tokens(spec)[0],))


def write_demo(root: Path, texts: list[str]) -> Path:
    """A 3-block Qwen3-VL tower (16-px patches, 2x2 merge, images of 4 to 16 tokens, a 3 x 3 learned
    position table resampled to every grid, DeepStack features of blocks 0 and 2 added after
    decoder layers 0 and 1) + a 3-layer Qwen3 decoder (q/k norms, head_dim 16, interleaved M-RoPE
    with unequal sections)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(47)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=9,
                           deepstack_visual_indexes=[0, 2]),
        text_config=dict(vocab_size=len(tok) + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 1e4,
                                          "mrope_interleaved": True}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = save(Qwen3VLForConditionalGeneration(cfg), tok, TEMPLATE, root / "qwen3-vl", 47)
    Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32 * 4,
                          max_pixels=32 * 32 * 16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="qwen3_vl", architecture="Qwen3VLForConditionalGeneration", title="Qwen3-VL",
    text_types=("qwen3_vl_text",), towers={"vision": TOWER}, check=check, vision=vision, audio=None,
    image_processors=(qwen2_vl.IMAGE_PROCESSOR,), default_image_processor=qwen2_vl.default_image_processor,
    default_feature_extractor=None, video_processor=None, processor_settings=None, layer_parts=layer_parts,
    tower_layer=tower_layer, llm_block=llm_block, positions=grid_positions, audio_in_video=False, outer=None,
    demo=Demo(name="qwen3-vl", write=write_demo))
