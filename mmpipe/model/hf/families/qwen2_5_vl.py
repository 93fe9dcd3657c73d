"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): its windowed vision tower (also Qwen2.5-Omni's,
the same modules), its figures, its time-aligned video positions and its family declaration.

transformers' `Qwen2_5_VisionTransformerPretrainedModel.forward` reorders all patches of all images
once, before the blocks, so that every attention window's patches are contiguous (`window_index`
over merge units, `get_vision_window_index`); the blocks attend within those windows
(`cu_window_seqlens`) except the `fullatt_block_indexes`, which attend over each image
(`cu_seqlens`, still contiguous per image in window order); the merger's outputs are put back in
image order (`argsort(window_index)`). As pipeline layers:

- `vision.embed` embeds the patches and reorders them into window order;
- every `vision.block.<i>` receives window-ordered states, whichever stage it is on, so a stage
  boundary may fall between any two blocks: the window order, the windows' segments and the
  rotary positions in window order are computed from the carried grids once per micro-batch and
  stage (`layout.per_batch`), with transformers' own functions; the per-image segments of the full
  blocks are the carried layout's image stream (computed once in collate);
- `vision.proj` merges 2x2, projects, and restores image order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.demo_kit import QWEN_SPECIALS, qwen_tokenizer, save
from mmpipe.model.hf.families import qwen2_vl
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.layers import HFLayer, use_varlen_attention
from mmpipe.model.hf.positions import grid_positions
from mmpipe.model.hf.video import make_video_processor
from mmpipe.model.layout import Stream
from mmpipe.model.spec import ModelSpec, VideoSpec, VisionSpec

TOWER = qwen2_vl.TOWER


@dataclass(frozen=True, slots=True)
class Windows:
    """The window attention of one micro-batch's images (what transformers' forward computes
    before its blocks)."""

    index: torch.Tensor
    """[patches / merge^2] long: transformers' window_index (merge units in window order)."""
    reverse: torch.Tensor
    """argsort(index): window order back to image order."""
    positions: torch.Tensor
    """[patches, 2] long: rotary (row, col) positions of the patches, in window order."""
    stream: Stream
    """The windows as attention segments (transformers' cu_window_seqlens)."""


def windows(grid: torch.Tensor, *, merge: int, window: int, patch: int) -> Windows:
    """The window attention of the images of a carried IMAGE_GRID slot, once per micro-batch and
    stage."""
    def make(g: torch.Tensor) -> Windows:
        host = g.cpu()
        index, cu = get_vision_window_index(host, spatial_merge_size=merge, window_size=window, patch_size=patch)
        pos = get_vision_position_ids(host, merge)
        unit = merge * merge
        pos = pos.reshape(-1, unit, 2)[index].reshape(-1, 2)  # the rotary tables follow the patches
        lengths = tuple(int(b - a) for a, b in zip(cu.tolist(), cu.tolist()[1:]))
        dev = g.device
        return Windows(index=index.to(dev), reverse=torch.argsort(index).to(dev), positions=pos.to(dev),
                       stream=Stream(lengths=lengths, cu_seqlens=cu.to(dev)))

    return layout.per_batch(grid, ("qwen25_windows", merge, window, patch), make)


class _Tower(HFLayer):
    """What every layer of the tower knows: its window geometry (from the config)."""

    def __init__(self, parts: dict[str, nn.Module], *, merge: int, window: int, patch: int):
        super().__init__(parts)
        self.merge, self.window, self.patch = merge, window, patch

    def _windows(self, slots: list[torch.Tensor]) -> Windows:
        return windows(slots[C.IMAGE_GRID], merge=self.merge, window=self.window, patch=self.patch)


class Qwen25VisionEmbed(_Tower):
    """Conv3d patch embedding, then the window reorder: pixels [P, C*T*p*p] -> states [P, D] in
    window order."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = self.patch_embed(C.from_wire(slots[C.IMAGE], self.dtype))
        if h.shape[0]:
            unit = self.merge * self.merge
            h = h.reshape(-1, unit, h.shape[-1])[self._windows(slots).index].reshape(-1, h.shape[-1])
        slots[C.IMAGE] = h


class Qwen25VisionBlock(_Tower):
    """One block (RMSNorm, attention with 2-D rotary positions, SwiGLU) over all patches in window
    order: within each window, or over each image (`full`, transformers' fullatt_block_indexes)."""

    def __init__(self, parts: dict[str, nn.Module], *, merge: int, window: int, patch: int, full: bool):
        super().__init__(parts, merge=merge, window=window, patch=patch)
        self.full = full
        use_varlen_attention(self.block.attn)

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if h.shape[0] == 0:
            slots[C.IMAGE] = h
            return
        win = self._windows(slots)
        stream = layout.read(slots[C.LAYOUT]).image if self.full else win.stream
        if stream.total != h.shape[0]:
            what = "images" if self.full else "windows"
            raise ValueError(f"vision block got {h.shape[0]} patches but the micro-batch's {what} hold "
                             f"{stream.total}; collate it with mmpipe.runtime.batch.collate_hf")
        with segments(Segments(stream=stream, causal=False)):
            slots[C.IMAGE] = self.block(h, cu_seqlens=stream.cu_seqlens, max_seqlen=stream.max_len,
                                        position_embeddings=self.rotary(h, win.positions))


class Qwen25VisionMerger(_Tower):
    """RMSNorm, 2x2 merge and MLP, then image order again: [P, D] -> [P / 4, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        out = self.merger(C.from_wire(slots[C.IMAGE], self.dtype))
        if out.shape[0]:
            out = out[self._windows(slots).reverse]
        slots[C.IMAGE] = out


def vision_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    """The `vision.<kind>[.<index>]` layer of a Qwen2.5-VL / Qwen2.5-Omni tower."""
    _, kind, *rest = name.split(".")
    vc = hf_config(spec.hf).vision_config
    geometry = dict(merge=vc.spatial_merge_size, window=vc.window_size, patch=vc.patch_size)
    if kind == "block":
        return Qwen25VisionBlock(parts, **geometry, full=int(rest[0]) in vc.fullatt_block_indexes)
    return {"embed": Qwen25VisionEmbed, "proj": Qwen25VisionMerger}[kind](parts, **geometry)


# ----------------------------------------------------------------------------- figures


def check_windows(config: PretrainedConfig, what: str) -> None:
    """A window must hold at least one merged token (Qwen2.5-VL's and Qwen2.5-Omni's tower)."""
    vc = config.vision_config
    if vc.window_size // vc.spatial_merge_size // vc.patch_size < 1:
        raise ValueError(f"{what}.vision_config.window_size={vc.window_size} is smaller than one merged token "
                         f"(spatial_merge_size x patch_size = {vc.spatial_merge_size * vc.patch_size} pixels)")


def windowed_vision(config: PretrainedConfig, proc: Any, video: VideoSpec) -> VisionSpec:
    """Qwen2.5-VL's tower (also Qwen2.5-Omni's): RMSNorm + SwiGLU blocks, windowed attention in all
    blocks but `fullatt_block_indexes`, out_hidden_size into the LLM; `proc` its checked image
    processor, `video` its videos as the model's processor calls its video processor (video.py)."""
    vc = config.vision_config
    merged = vc.hidden_size * vc.spatial_merge_size ** 2
    return VisionSpec(
        blocks=vc.depth, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_heads, patch=vc.patch_size,
        resize="smart", min_pixels=int(proc.size.shortest_edge), max_pixels=int(proc.size.longest_edge),
        merge=vc.spatial_merge_size, temporal_patch=vc.temporal_patch_size, proj=(merged, vc.out_hidden_size),
        channels=vc.in_channels, window=int(vc.window_size), mlp_gated=True,
        full_blocks=tuple(int(b) for b in vc.fullatt_block_indexes), video=video)


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    proc = qwen2_vl.image_processor(config, ip, what)
    frames = qwen2_vl.video(config, make_video_processor(qwen2_vl.VIDEO_PROCESSOR, vp), what,
                            audio_in_video=audio_in_video)
    return windowed_vision(config, proc, frames)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    return qwen2_vl.tower_parts(kind, i)


def positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[Any], videos: Sequence[Any]) -> np.ndarray:
    """Qwen2-VL's rule, a video's temporal index scaled by its time_interval = tokens_per_second x
    second_per_grid_ts (float32, as torch computes it)."""
    tps = np.float32(hf_config(spec.hf).vision_config.tokens_per_second)
    steps = [float(tps * np.float32(v.second_per_grid)) for v in videos]
    return grid_positions(spec, input_ids, images, videos, video_steps=steps)


# ----------------------------------------------------------------------------- demo checkpoint


DEMO_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
"""A 3-block Qwen2.5-VL tower: windows of 4 x 4 patches (56 px), so the shipped images (16 to 140 px a
side, resized to 56 to 168) span up to nine; block 1 attends over each whole image, blocks 0 and 2 per
window (also the demo Qwen2.5-Omni's)."""


def demo_text(tok, **extra) -> dict[str, Any]:
    """The demo's 2-layer M-RoPE decoder config (also the demo Qwen2.5-Omni's)."""
    return dict(vocab_size=len(tok) + 3, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048,
                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}, **extra)


def demo_image_processor():
    """Images of 4 to 36 tokens (also the demo Qwen2.5-Omni's)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 36)


def write_demo(root: Path, texts: list[str]) -> Path:
    """The Qwen2.5-VL tower above + its M-RoPE decoder (tokens_per_second 4: the shipped clips' frame
    pairs, every frame taken, are 2 to 4 temporal positions apart), ChatML with Qwen2-VL's image and
    video markers; the processor (image and video processors, tokenizer, template) saved by
    Qwen2_5_VLProcessor. Video frames of 4 to 16 tokens."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(47)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2_5_VLConfig(vision_config=DEMO_VISION, text_config=demo_text(tok),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = save(Qwen2_5_VLForConditionalGeneration(cfg), tok, qwen2_vl.TEMPLATE, root / "qwen2.5-vl", 47)
    Qwen2_5_VLProcessor(image_processor=demo_image_processor(), tokenizer=tok, chat_template=qwen2_vl.TEMPLATE,
                        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
                        ).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="qwen2_5_vl", architecture="Qwen2_5_VLForConditionalGeneration", title="Qwen2.5-VL",
    text_types=("qwen2_5_vl_text",), towers={"vision": TOWER}, check=check_windows, vision=vision, audio=None,
    image_processors=(qwen2_vl.IMAGE_PROCESSOR,), default_image_processor=qwen2_vl.default_image_processor,
    default_feature_extractor=None, video_processor=qwen2_vl.VIDEO_PROCESSOR, processor_settings=None,
    layer_parts=layer_parts, tower_layer=vision_layer, llm_block=None, positions=positions, audio_in_video=False,
    outer=None, demo=Demo(name="qwen2.5-vl", write=write_demo))
