"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP or SigLIP tower run to one
`vision_feature_layer`, an MLP projector, a Llama / Mistral / Qwen2 decoder.

Also the LLaVA tower the any-resolution families (llava_next.py, llava_onevision.py) and
`model=compose` share: its checks, its fixed-side processor, its layer parts and layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model.hf import layers as L
from mmpipe.model.hf.arch import LLM_TYPES, VISION_TYPES
from mmpipe.model.hf.demo_kit import CLIP, llama_tokenizer, llm_config, save
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.media import make_image_processor
from mmpipe.model.hf.skeleton import PROJECTOR
from mmpipe.model.spec import ModelSpec, VisionSpec

TOWER = "model.vision_tower"
"""Where every LLaVA class keeps its CLIP / SigLIP tower."""
IMAGE_PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor")

TEMPLATE = (  # LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT: answer</s>"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ ' ' }}"
    "{% elif m['role'] == 'user' %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{{ ' ' }}"
    "{% else %}ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


# ----------------------------------------------------------------------------- the LLaVA tower


def clip_tower(config: PretrainedConfig) -> bool:
    """Whether the tower is CLIP's (a class token, a pre-norm) rather than SigLIP's."""
    return VISION_TYPES[config.vision_config.model_type] == "clip"


def feature_layer(config: PretrainedConfig, layers: int, what: str) -> int:
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


def check_tower(config: PretrainedConfig, what: str) -> None:
    """What every LLaVA class needs of its tower: CLIP or SigLIP, a known select strategy, one
    feature layer."""
    vtype = config.vision_config.model_type
    if vtype not in VISION_TYPES:
        raise ValueError(f"{what}: LLaVA vision tower {vtype!r} is not supported; use "
                         f"{' or '.join(VISION_TYPES)}")
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(f"{what}.vision_feature_select_strategy="
                         f"{config.vision_feature_select_strategy!r} is unknown; use default or full")
    feature_layer(config, config.vision_config.num_hidden_layers, what)


def fixed_side(ip: Mapping[str, Any], vc: PretrainedConfig, what: str) -> int:
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


def tower_parts(config: PretrainedConfig, kind: str, i: str, *,
                proj_extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """A LLaVA tower layer's modules: the embeddings (+ CLIP's pre-norm), encoder layer i, the
    projector (+ `proj_extra`: the any-resolution classes' image_newline)."""
    embed = (("embeddings", f"{TOWER}.embeddings"),)
    if clip_tower(config):
        embed += (("pre_layrnorm", f"{TOWER}.pre_layrnorm"),)
    proj = (("projector", PROJECTOR),) + proj_extra
    return {"embed": embed, "block": (("block", f"{TOWER}.encoder.layers.{i}"),), "proj": proj}[kind]


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    """`vision.embed` and `vision.block.<i>` of every LLaVA class; LLaVA-1.5's `vision.proj`."""
    kind = name.split(".")[1]
    if kind == "proj":
        return L.LlavaVisionProj(parts, drop_first=spec.vision.select == "default")
    return {"embed": L.LlavaVisionEmbed, "block": L.LlavaVisionBlock}[kind](parts)


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    """CLIP's resize-and-crop or SigLIP's resize to the tower's side (transformers' defaults)."""
    side = config.vision_config.image_size
    if clip_tower(config):
        return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": side},
                "crop_size": {"height": side, "width": side}, "do_center_crop": True}
    return {"image_processor_type": "SiglipImageProcessor", "size": {"height": side, "width": side}}


# ----------------------------------------------------------------------------- LLaVA-1.5


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """Every image resized to the tower's side: one tower pass, one token per kept position."""
    vc, text = config.vision_config, config.get_text_config()
    return VisionSpec(
        blocks=feature_layer(config, vc.num_hidden_layers, what), hidden=vc.hidden_size, mlp=vc.intermediate_size,
        heads=vc.num_attention_heads, patch=vc.patch_size, resize="fixed", image_size=fixed_side(ip, vc, what),
        merge=1, cls_token=clip_tower(config), select=config.vision_feature_select_strategy,
        proj=(text.hidden_size, text.hidden_size), channels=vc.num_channels)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    return tower_parts(config, kind, i)


def write_demo(root: Path, texts: list[str]) -> Path:
    """CLIP (feature layer -2, `default`) + Llama (rope theta 5e5), LLaVA-1.5's template."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(41)
    tok = llama_tokenizer(texts)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP),
                      text_config=llm_config("llama", tok, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                             bos_token_id=tok.bos_token_id),
                      image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    folder = save(LlavaForConditionalGeneration(cfg), tok, TEMPLATE, root / "llava", 41)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="llava", architecture="LlavaForConditionalGeneration", title="LLaVA", text_types=LLM_TYPES,
    towers={"vision": TOWER}, check=check_tower, vision=vision, audio=None, image_processors=IMAGE_PROCESSORS,
    default_image_processor=default_image_processor, default_feature_extractor=None, video_processor=None,
    processor_settings=None, layer_parts=layer_parts, tower_layer=tower_layer, llm_block=None, positions=None,
    audio_in_video=False, outer=None, demo=Demo(name="llava", write=write_demo))
