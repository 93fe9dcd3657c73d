"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): LLaVA-NeXT's tiles (llava_next.py)
plus `anyres_max_N` shrinking, one untiled tile per image of a sample with several, and videos
(every frame one tile, pooled 2x2, one newline per video)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model.hf.anyres import check_processor_settings, default_processor
from mmpipe.model.hf.arch import LLM_TYPES
from mmpipe.model.hf.demo_kit import CLIP, llm_config, qwen_tokenizer, save
from mmpipe.model.hf.families import llava, llava_next
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.video import make_video_processor
from mmpipe.model.spec import ModelSpec, VideoSpec, VisionSpec

PROCESSOR = "LlavaOnevisionImageProcessor"
VIDEO_PROCESSOR = "transformers.models.llava_onevision.video_processing_llava_onevision.LlavaOnevisionVideoProcessor"
TEMPLATE = (  # LLaVA-OneVision's ChatML (no default system message), a message's images, then videos first
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] if c['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'video' %}<video>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PINPOINTS = [[28 * i, 28 * j] for i in range(1, 4) for j in range(1, 4)]
"""The demo's grids, to 3x3 tiles of 28 px; with anyres_max_4 the unpadded features of a grid
larger than 4.84 tiles' worth are shrunk (the shipped images, 16 to 200 px, get all cases)."""


def anyres_max(config: PretrainedConfig, what: str) -> int:
    """`vision_aspect_ratio` ("anyres_max_9") as transformers reads it."""
    text = str(config.vision_aspect_ratio)
    try:
        n = int(text.strip("anyres_max_"))  # noqa: B005 - transformers' own parse (pack_image_features)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{what}.vision_aspect_ratio={text!r} is not anyres_max_N; LlavaOnevisionForConditional"
                         f"Generation reads only that form (e.g. anyres_max_9)")
    return n


def video_spec(proc: Any, *, side: int, what: str) -> VideoSpec:
    """The VideoSpec of LLaVA-OneVision's video processor (LlavaOnevisionVideoProcessor) for a
    tower of `side`-px tiles: every frame resized to the tile (checked: the tower has fixed
    positions), frames picked by transformers' default sampler, one tower pass per frame, then
    the model's 2x2 apply_pooling and one image_newline per video (get_video_features)."""
    if not proc.do_resize:
        raise ValueError(f"{what}: the video processor has do_resize=false; LLaVA-OneVision's tower takes "
                         f"{side}x{side} frames only (set do_resize=true)")
    box = proc.crop_size if proc.do_center_crop else proc.size
    h, w = getattr(box, "height", None), getattr(box, "width", None)
    if (h, w) != (side, side):
        raise ValueError(f"{what}: the video processor outputs frames of size={dict(box.items()) if box else box} but "
                         f"the vision tower takes {side}x{side}; set the video processor's size to "
                         f"{{height: {side}, width: {side}}}")
    fps, count = proc.fps, proc.num_frames
    if proc.do_sample_frames and fps is not None and count is not None:
        raise ValueError(f"{what}: the video processor sets both fps={fps} and num_frames={count}, which "
                         f"transformers refuses as mutually exclusive; keep one")
    # do_sample_frames without fps or num_frames: transformers' sampler takes every frame
    sample = "count" if proc.do_sample_frames and count is not None else "fps" if proc.do_sample_frames else "all"
    return VideoSpec(sample=sample, fps=float(fps) if fps else 2.0, frames=int(count or 0), temporal_patch=1,
                     indices="uniform", pool=2, newline=True)


def check(config: PretrainedConfig, what: str) -> None:
    llava_next.check_tiles(config, what)
    anyres_max(config, what)


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """NeXT's tiles with anyres_max shrinking and lone-image tiling; its frames one tile each."""
    spec = llava_next.tiled_vision(config, ip, what, anyres_max=anyres_max(config, what), single=True)
    proc = make_video_processor(VIDEO_PROCESSOR, vp or {})
    return dataclasses.replace(spec, video=video_spec(proc, side=spec.image_size, what=what))


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    return default_processor(config, "clip" if llava.clip_tower(config) else "siglip", PROCESSOR)


def processor_settings(settings: Mapping[str, Any], config: PretrainedConfig, what: str) -> None:
    """LlavaOnevisionProcessor counts placeholders from num_image_tokens and vision_aspect_ratio."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    check_processor_settings(settings, {
        "vision_feature_select_strategy": config.vision_feature_select_strategy, "num_image_tokens": side * side,
        "vision_aspect_ratio": config.vision_aspect_ratio}, what)


def pack(model: nn.Module, features: list[torch.Tensor], sizes: torch.Tensor, newline: nn.Parameter,
         config: PretrainedConfig) -> list[torch.Tensor]:
    """LlavaOnevisionModel.pack_image_features as its get_image_features calls it."""
    packed, _ = model.pack_image_features(features, sizes, image_newline=newline,
                                          vision_aspect_ratio=config.vision_aspect_ratio)
    return packed


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    return llava_next.tiled_layer(spec, name, parts, pack)


def write_demo(root: Path, texts: list[str]) -> Path:
    """SigLIP (28-px tiles of 7-px patches, last layer, `full`) + Qwen2, grids to 3x3 tiles,
    anyres_max_4, OneVision's ChatML; the processor (LlavaOnevisionProcessor) saved whole."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        SiglipVisionConfig,
    )

    torch.manual_seed(48)
    tok = qwen_tokenizer(texts, extra=("<image>", "<video>"),
                         named={"image_token": "<image>", "video_token": "<video>"})
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**CLIP, vision_use_head=False),
        text_config=llm_config("qwen2", tok, hidden_size=48, intermediate_size=96),
        image_token_id=tok.convert_tokens_to_ids("<image>"), video_token_id=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_4")
    folder = save(LlavaOnevisionForConditionalGeneration(cfg), tok, TEMPLATE, root / "llava-onevision", 48)
    side = {"height": 28, "width": 28}
    LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=side, image_grid_pinpoints=PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size=side), tokenizer=tok, num_image_tokens=16,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_4",
        chat_template=TEMPLATE).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="llava_onevision", architecture="LlavaOnevisionForConditionalGeneration", title="LLaVA-OneVision",
    text_types=LLM_TYPES, towers={"vision": llava.TOWER}, check=check, vision=vision, audio=None,
    image_processors=(PROCESSOR,), default_image_processor=default_image_processor, default_feature_extractor=None,
    video_processor=VIDEO_PROCESSOR, processor_settings=processor_settings, layer_parts=llava_next.layer_parts,
    tower_layer=tower_layer, llm_block=None, positions=None, audio_in_video=False, outer=None,
    demo=Demo(name="llava-onevision", write=write_demo))
