"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): a ViT of Conv3d patches (temporal patch 2), 2-D
rotary, per-image attention and a 2x2 merger, for images and videos alike; an M-RoPE decoder.

Also what the later Qwen-VL classes (qwen3_vl.py, qwen2_5_vl.py, qwen2_5_omni.py) share: the
image processor check, the video figures, the default processor and the tower's module names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model.hf import layers as L
from mmpipe.model.hf.demo_kit import QWEN_SPECIALS, TEXT_ITEM, chatml, qwen_tokenizer, save
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.media import make_image_processor
from mmpipe.model.hf.positions import grid_positions
from mmpipe.model.hf.video import make_video_processor, video_spec
from mmpipe.model.spec import ModelSpec, VideoSpec, VisionSpec

TOWER = "model.visual"
"""Where every Qwen-VL class keeps its vision tower."""
IMAGE_PROCESSOR = "Qwen2VLImageProcessor"
VIDEO_PROCESSOR = "transformers.models.qwen2_vl.video_processing_qwen2_vl.Qwen2VLVideoProcessor"
TEMPLATE = chatml("{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                  "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>" + TEXT_ITEM)


# ----------------------------------------------------------------------------- what the Qwen-VL classes share


def image_processor(config: PretrainedConfig, ip: Mapping[str, Any], what: str) -> Any:
    """A Qwen-VL tower's image processor, checked against the tower's patch, merge and temporal
    figures."""
    vc = config.vision_config
    proc = make_image_processor(ip)
    for key, ours in (("patch_size", vc.patch_size), ("merge_size", vc.spatial_merge_size),
                      ("temporal_patch_size", vc.temporal_patch_size)):
        if getattr(proc, key) != ours:
            raise ValueError(f"{what}: the image processor has {key}={getattr(proc, key)} but the vision tower {ours}")
    return proc


def video(config: PretrainedConfig, proc: Any, what: str, *, call: Mapping[str, Any] | None = None,
          audio_in_video: bool = False, timing: Mapping[str, float] | None = None) -> VideoSpec:
    """The VideoSpec of a Qwen-VL tower's video processor `proc`, as the model's processor calls it
    (video.video_spec's `call` and `timing`)."""
    vc = config.vision_config
    return video_spec(proc, patch=vc.patch_size, merge=vc.spatial_merge_size, temporal=vc.temporal_patch_size,
                      what=what, call=call, audio_in_video=audio_in_video, timing=timing)


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    """Qwen2VLImageProcessor at the tower's patch, merge and temporal patch (transformers' defaults
    otherwise)."""
    vc = config.vision_config
    return {"image_processor_type": IMAGE_PROCESSOR, "patch_size": vc.patch_size,
            "merge_size": vc.spatial_merge_size, "temporal_patch_size": vc.temporal_patch_size}


def tower_parts(kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """The patch embedding, block i with the rotary table, the merger (Qwen2-VL's and Qwen2.5-VL's)."""
    return {"embed": (("patch_embed", f"{TOWER}.patch_embed"),),
            "block": (("block", f"{TOWER}.blocks.{i}"), ("rotary", f"{TOWER}.rotary_pos_emb")),
            "proj": (("merger", f"{TOWER}.merger"),)}[kind]


# ----------------------------------------------------------------------------- Qwen2-VL


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """smart_resize'd images and frames, 2x2 merged into LLM tokens."""
    vc = config.vision_config
    proc = image_processor(config, ip, what)
    frames = video(config, make_video_processor(VIDEO_PROCESSOR, vp), what, audio_in_video=audio_in_video)
    merged = vc.embed_dim * vc.spatial_merge_size ** 2
    return VisionSpec(
        blocks=vc.depth, hidden=vc.embed_dim, mlp=int(vc.embed_dim * vc.mlp_ratio), heads=vc.num_heads,
        patch=vc.patch_size, resize="smart", min_pixels=int(proc.size.shortest_edge),
        max_pixels=int(proc.size.longest_edge), merge=vc.spatial_merge_size, temporal_patch=vc.temporal_patch_size,
        proj=(merged, vc.hidden_size), channels=vc.in_channels, video=frames)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    return tower_parts(kind, i)


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    kind = name.split(".")[1]
    return {"embed": L.QwenVisionEmbed, "block": L.QwenVisionBlock, "proj": L.QwenVisionMerger}[kind](parts)


def write_demo(root: Path, texts: list[str]) -> Path:
    """A 2-block Qwen2-VL tower (14-px patches, 2x2 merge, images and video frames of 4 to 16 tokens)
    + its M-RoPE decoder. Its video processor keeps transformers' default frame rule (every frame,
    do_sample_frames=false), so clips of an odd frame count are padded by the processor."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(42)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=len(tok) + 3, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = save(Qwen2VLForConditionalGeneration(cfg), tok, TEMPLATE, root / "qwen2-vl", 42)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
    Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="qwen2_vl", architecture="Qwen2VLForConditionalGeneration", title="Qwen2-VL",
    text_types=("qwen2_vl_text",), towers={"vision": TOWER}, check=None, vision=vision, audio=None,
    image_processors=(IMAGE_PROCESSOR,), default_image_processor=default_image_processor,
    default_feature_extractor=None, video_processor=VIDEO_PROCESSOR, processor_settings=None,
    layer_parts=layer_parts, tower_layer=tower_layer, llm_block=None, positions=grid_positions,
    audio_in_video=False, outer=None, demo=Demo(name="qwen2-vl", write=write_demo))
