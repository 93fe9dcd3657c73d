"""LLaVA-NeXT / 1.6 (`LlavaNextForConditionalGeneration`): LLaVA's tower on any-resolution tiles
(anyres.py), features unpadded to the image's aspect with a learned newline after every row."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model.hf.anyres import (
    NEWLINE,
    AnyresVisionProj,
    Pack,
    anyres_vision,
    check_anyres,
    check_processor_settings,
    default_processor,
)
from mmpipe.model.hf.arch import LLM_TYPES
from mmpipe.model.hf.demo_kit import CLIP, llama_tokenizer, llm_config, save
from mmpipe.model.hf.families import llava
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.spec import ModelSpec, VisionSpec

PROCESSOR = "LlavaNextImageProcessor"
TEMPLATE = (  # LLaVA-NeXT on Mistral: "[INST] <image>\n... [/INST] answer</s>", a message's images first
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ '\n\n' }}"
    "{% elif m['role'] == 'user' %}[INST] {% for c in m['content'] if c['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %} [/INST]"
    "{% else %} {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}")
PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""The demo's five grids (1x2, 2x1, 2x2, 1x3, 3x1 tiles), at a 28-px tile."""


def check_tiles(config: PretrainedConfig, what: str) -> None:
    """LLaVA's tower checks, then what the tiles' feature packing needs."""
    llava.check_tower(config, what)
    check_anyres(config, cls_token=llava.clip_tower(config), what=what)


def tiled_vision(config: PretrainedConfig, ip: Mapping[str, Any], what: str, *, anyres_max: int,
                 single: bool) -> VisionSpec:
    """The any-resolution figures of a LLaVA tower (shared with LLaVA-OneVision)."""
    vc = config.vision_config
    return anyres_vision(config, ip, what, blocks=llava.feature_layer(config, vc.num_hidden_layers, what),
                         cls_token=llava.clip_tower(config), side=llava.fixed_side(ip, vc, what),
                         anyres_max=anyres_max, single=single)


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """Every image is the whole image plus the best grid of tiles; no shrinking (anyres_max 0)."""
    return tiled_vision(config, ip, what, anyres_max=0, single=False)


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    return default_processor(config, "clip" if llava.clip_tower(config) else "siglip", PROCESSOR)


def processor_settings(settings: Mapping[str, Any], config: PretrainedConfig, what: str) -> None:
    """LlavaNextProcessor counts placeholders from the patch size and the class token it is told."""
    vc = config.vision_config
    check_processor_settings(settings, {
        "vision_feature_select_strategy": config.vision_feature_select_strategy, "patch_size": vc.patch_size,
        "num_additional_image_tokens": int(config.vision_feature_select_strategy == "default")}, what)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """LLaVA's tower layers; `vision.proj` also holds the newline."""
    return llava.tower_parts(config, kind, i, proj_extra=(("image_newline", NEWLINE),))


def pack(model: nn.Module, features: list[torch.Tensor], sizes: torch.Tensor, newline: nn.Parameter,
         config: PretrainedConfig) -> list[torch.Tensor]:
    """LlavaNextModel.pack_image_features as its get_image_features calls it."""
    packed, _ = model.pack_image_features(features, sizes, config.vision_feature_select_strategy,
                                          image_newline=newline)
    return packed


def tiled_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module], pack_features: Pack) -> nn.Module:
    """LLaVA's tower layers; `vision.proj` packs the tiles with the class's `pack_features`."""
    if name == "vision.proj":
        return AnyresVisionProj(parts, src=spec.hf, drop_first=spec.vision.select == "default", pack=pack_features)
    return llava.tower_layer(spec, name, parts)


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    return tiled_layer(spec, name, parts, pack)


def write_demo(root: Path, texts: list[str]) -> Path:
    """CLIP (28-px tiles of 7-px patches, feature layer -2, `default`) + Mistral, the five NeXT grids,
    Mistral's [INST] template; the processor (LlavaNextProcessor) saved whole."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    torch.manual_seed(47)
    tok = llama_tokenizer(texts + ["[INST] [/INST]"])
    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**CLIP),
                          text_config=llm_config("mistral", tok, bos_token_id=tok.bos_token_id, sliding_window=None),
                          image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                          vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS)
    folder = save(LlavaNextForConditionalGeneration(cfg), tok, TEMPLATE, root / "llava-next", 47)
    image = LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=PINPOINTS)
    LlavaNextProcessor(image_processor=image, tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=TEMPLATE).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="llava_next", architecture="LlavaNextForConditionalGeneration", title="LLaVA-NeXT",
    text_types=LLM_TYPES, towers={"vision": llava.TOWER}, check=check_tiles, vision=vision, audio=None,
    image_processors=(PROCESSOR,), default_image_processor=default_image_processor, default_feature_extractor=None,
    video_processor=None, processor_settings=processor_settings, layer_parts=layer_parts, tower_layer=tower_layer,
    llm_block=None, positions=None, audio_in_video=False, outer=None, demo=Demo(name="llava-next", write=write_demo))
