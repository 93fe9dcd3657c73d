"""LLaVA-NeXT and LLaVA-OneVision: any-resolution tiles through a CLIP / SigLIP tower.

`LlavaNextForConditionalGeneration` and `LlavaOnevisionForConditionalGeneration` cut an image
into the whole image at the tower's side plus a grid of tiles of the `image_grid_pinpoints`
resolution that fits it best; every tile is a full tower pass. The features of the grid are
put back together, cut to the image's aspect (unpadded), for OneVision shrunk when the grid is
larger than `anyres_max_N` tiles' worth, and each row ends with the learned `image_newline`.

In mmpipe the tower layers are LLaVA's own (`vision.embed`, `vision.block.<i>`: every tile of the
micro-batch is one row of a batch, as transformers runs them) and this module adds:
- the spec of such a checkpoint (`anyres_vision`): the tower's figures, the grid and the
  processor checked against the model;
- `vision.proj` (`AnyresVisionProj`): the select strategy and the projector over all tiles, then
  transformers' own `pack_image_features` per image (called on the meta-device model, which it
  touches only through its config), so unpadding, the newline order and OneVision's bilinear
  downsampling are transformers' code, not a copy.

The token counts before decoding are `mmpipe.model.geometry.anyres_image`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.layers import HFLayer
from mmpipe.model.hf.media import make_image_processor
from mmpipe.model.hf.skeleton import skeleton
from mmpipe.model.spec import HFSource, VisionSpec

NEWLINE = "model.image_newline"
"""The learned row separator of the any-resolution classes: a bare parameter of the model, not a
module (skeleton.materialise draws it as transformers does)."""
Pack = Callable[[nn.Module, list[torch.Tensor], torch.Tensor, nn.Parameter, PretrainedConfig], list[torch.Tensor]]
"""(the meta model, each image's tile features, the images' (height, width), image_newline,
config) -> each image's packed features: the class's own `pack_image_features`, as it calls it."""


def _pinpoints(config: PretrainedConfig, side: int, what: str) -> tuple[tuple[int, int], ...]:
    pins = config.image_grid_pinpoints
    if not isinstance(pins, (list, tuple)) or not pins:
        raise ValueError(f"{what}.image_grid_pinpoints={pins!r} must be a non-empty list of [height, width]")
    out = []
    for pin in pins:
        if (not isinstance(pin, (list, tuple)) or len(pin) != 2
                or any(not isinstance(x, int) or x <= 0 or x % side for x in pin)):
            raise ValueError(f"{what}.image_grid_pinpoints holds {pin!r}; each must be [height, width] in multiples "
                             f"of the tower's image_size {side} (the model reshapes whole tiles)")
        out.append((int(pin[0]), int(pin[1])))
    return tuple(out)


def check_anyres(config: PretrainedConfig, *, cls_token: bool, what: str) -> None:
    """What the any-resolution classes' feature packing needs of a config, as one-line errors."""
    vc = config.vision_config
    strategy = config.vision_feature_select_strategy
    if (strategy == "default") != cls_token:
        tower = vc.model_type
        fix = "full" if strategy == "default" else "default"
        raise ValueError(f"{what}.vision_feature_select_strategy={strategy!r} with a {tower} tower leaves "
                         f"{'one feature too few' if strategy == 'default' else 'the class token'} per tile, which "
                         f"{config.model_type}'s feature packing cannot reshape; use {fix}")
    _pinpoints(config, vc.image_size, what)


def anyres_vision(config: PretrainedConfig, ip: Mapping[str, Any], what: str, *, blocks: int, cls_token: bool,
                  side: int, anyres_max: int, single: bool) -> VisionSpec:
    """The figures of an any-resolution tower (its LLaVA tower's, plus the tiles), given the image
    processor's config; `side` is the square the processor outputs (checked against the tower);
    `anyres_max` and `single` are VisionSpec's (OneVision's shrinking and lone-image tiling)."""
    vc, text = config.vision_config, config.get_text_config()
    pins = _pinpoints(config, vc.image_size, what)
    proc = make_image_processor(ip)
    # the side transformers cuts the grid into (its _preprocess): crop_size, else size
    crop, size = getattr(proc, "crop_size", None), proc.size
    cut = crop.height if crop is not None and crop.height else (size.height or size.shortest_edge)
    if cut != side:
        raise ValueError(f"{what}: the image processor cuts tiles of {cut} px but outputs {side} px ones; give it "
                         f"one tile side (crop_size and size)")
    theirs = tuple(tuple(int(x) for x in pin) for pin in (proc.image_grid_pinpoints or ()))
    if theirs != pins:
        raise ValueError(f"{what}: the image processor's image_grid_pinpoints {[list(p) for p in theirs]} differ "
                         f"from the model's {[list(p) for p in pins]}; the two must cut the same grids")
    return VisionSpec(
        blocks=blocks, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_attention_heads,
        patch=vc.patch_size, resize="anyres", image_size=side, merge=1, cls_token=cls_token,
        select=config.vision_feature_select_strategy, proj=(text.hidden_size, text.hidden_size),
        channels=vc.num_channels, grid_pinpoints=pins, anyres_max=anyres_max, anyres_single=single)


def check_processor_settings(settings: Mapping[str, Any], want: Mapping[str, Any], what: str) -> None:
    """The placeholder settings of the folder's processor (processor_config.json's top level) must
    be `want`, what the model's config makes them (each class names its own), or the folder's own
    processor and its model disagree (transformers fails at the forward) while mmpipe, which counts
    the model's features, would train on."""
    for key, value in want.items():
        if key in settings and settings[key] != value:
            raise ValueError(f"{what}: processor_config.json has {key}={settings[key]!r} but the model's config "
                             f"makes it {value!r}; the folder's processor would count other placeholders than "
                             f"the model's features: set {key} to {value!r}")


def default_processor(config: PretrainedConfig, tower: str, processor: str) -> dict[str, Any]:
    """The image processor (class `processor`) transformers' defaults give the config of a `tower`
    (clip or siglip) tower (for an inline config)."""
    side = config.vision_config.image_size
    out: dict[str, Any] = {"image_processor_type": processor,
                           "image_grid_pinpoints": [list(p) for p in config.image_grid_pinpoints]}
    if tower == "clip":  # CLIP's resize-and-crop
        return {**out, "size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side},
                "do_center_crop": True}
    return {**out, "size": {"height": side, "width": side}, "do_center_crop": False}


# ----------------------------------------------------------------------------- the layer


class AnyresVisionProj(HFLayer):
    """`vision.proj`: tile states [tiles, positions, Dv] -> the LLM tokens of every image [N_tok, D].

    The IMAGE_GRID slot holds, per image, (tiles, rows, cols, height, width): how many of the
    micro-batch's tiles are its own (the whole image first, then the grid row by row) and the
    size transformers unpads to (`image_sizes`). The features of each image go through the
    transformers model's own `pack_image_features`. OneVision's videos follow the images (the
    carrier's VIDEOS slot counts them), a row (frames, 0, 0, S, S) each, every frame a tile: their
    features go through the model's own `apply_pooling` (2x2 bilinear, per frame) and each video
    ends with one image_newline, as `get_video_features` makes them.
    """

    def __init__(self, parts: dict[str, nn.Module], *, src: HFSource, drop_first: bool, pack: Pack):
        super().__init__(parts)
        self.src = src
        self.drop_first = drop_first
        self.pack = pack

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if self.drop_first:  # `default`: transformers drops position 0 (the class token)
            h = h[:, 1:]
        feats = self.projector(h)
        grid = layout.host_list(slots[C.IMAGE_GRID])
        if not grid:  # no image: an empty output still carrying the newline, for a zero gradient
            slots[C.IMAGE] = feats.reshape(0, feats.shape[-1]) + 0 * self.image_newline.sum()
            return
        tiles = [g[0] for g in grid]
        if sum(tiles) != feats.shape[0]:
            raise ValueError(f"the micro-batch carries {feats.shape[0]} tiles but its images hold {sum(tiles)}; "
                             f"make its pixels with mmpipe.model.hf.media.preprocess_images")
        images = len(grid) - C.videos_in(slots)  # images first, then OneVision's videos (a frame per tile)
        model = skeleton(self.src).model  # pack_image_features / apply_pooling read only the model's config
        config = hf_config(self.src)
        parts = list(torch.split(feats, tiles))
        out: list[torch.Tensor] = []
        if images:
            sizes = torch.tensor([[g[3], g[4]] for g in grid[:images]], dtype=torch.long)
            out += self.pack(model, parts[:images], sizes, self.image_newline, config)
        if images < len(grid):  # get_video_features: each frame pooled, the video's frames, one newline
            pooled = model.apply_pooling(torch.cat(parts[images:]))
            for frames in torch.split(pooled, tiles[images:]):
                out += [frames.reshape(-1, frames.shape[-1]), self.image_newline[None].to(frames.dtype)]
        slots[C.IMAGE] = torch.cat(out)
