"""Pipeline layers of the Qwen2.5-VL vision tower (also Qwen2.5-Omni's, the same modules).

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

from dataclasses import dataclass

import torch
from torch import nn
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf.layers import HFLayer, use_varlen_attention
from mmpipe.model.layout import Stream


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


def vision_layer(kind: str, index: int, parts: dict[str, nn.Module], config) -> nn.Module:
    """The `vision.<kind>[.<index>]` layer of a Qwen2.5-VL / Qwen2.5-Omni tower."""
    vc = config.vision_config
    geometry = dict(merge=vc.spatial_merge_size, window=vc.window_size, patch=vc.patch_size)
    if kind == "block":
        return Qwen25VisionBlock(parts, **geometry, full=index in vc.fullatt_block_indexes)
    return {"embed": Qwen25VisionEmbed, "proj": Qwen25VisionMerger}[kind](parts, **geometry)
