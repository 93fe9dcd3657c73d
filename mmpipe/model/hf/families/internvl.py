"""InternVL 3 / 3.5 (`InternVLForConditionalGeneration`): an InternViT tower (class token, learned
positions of one tile, layer-scaled blocks) over InternVL's dynamic tiles, a 2x2 pixel shuffle, an
MLP projector with a pre-norm, and a Qwen2 (InternVL 3) or Qwen3 (InternVL 3.5) decoder (1-D RoPE).

An image is cut by transformers' GotOcr2ImageProcessor as InternVLProcessor calls it
(crop_to_patches=True): the grid of min_patches..max_patches tiles whose aspect is closest to the
image's, plus a thumbnail when the grid has more than one tile (`geometry.image_tiles`). Every tile
is one tower pass of a fixed size; its patches (the class token dropped) are pixel-shuffled by
`downsample_ratio` into (side / patch / 2)^2 LLM tokens, and an image's tokens are its tiles' in
order. The chat template writes one `<IMG_CONTEXT>` per image (as the Hub's does) and the processor
puts the image's tokens between `<img>` and `</img>`: mmpipe's templater does the same
(VisionSpec.image_markers; the tokenizer's start_image_token / end_image_token), and the planner
counts the two markers as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmpipe.model import carrier as C
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf.anyres import check_processor_settings
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.demo_kit import llm_config, qwen_tokenizer, save
from mmpipe.model.hf.family import Demo, Family
from mmpipe.model.hf.layers import HFLayer
from mmpipe.model.hf.media import make_image_processor
from mmpipe.model.hf.skeleton import PROJECTOR, skeleton
from mmpipe.model.spec import HFSource, ModelSpec, VisionSpec

TOWER = "model.vision_tower"
PROCESSOR = "GotOcr2ImageProcessor"
PROCESSOR_SEQ_LENGTH = 256  # InternVLProcessor's image_seq_length default
TEMPLATE = (  # InternVL's ChatML (no default system message); an image is <IMG_CONTEXT> and a newline
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<IMG_CONTEXT>\n{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _square(value: Any, name: str, what: str) -> int:
    pair = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(pair) != 2 or pair[0] != pair[1]:
        raise ValueError(f"{what}.vision_config.{name}={value!r}: only square "
                         f"{ {'image_size': 'tiles', 'patch_size': 'patches'}[name]} are supported")
    return int(pair[0])


def merge(config: PretrainedConfig, what: str) -> int:
    """Patches a side that the pixel shuffle folds into one LLM token (1 / downsample_ratio)."""
    ratio = config.downsample_ratio
    k = round(1 / ratio) if ratio and ratio > 0 else 0
    if k < 1 or abs(k * ratio - 1) > 1e-9:
        raise ValueError(f"{what}.downsample_ratio={ratio!r}: only 1 / an integer is supported (InternVL's 0.5)")
    return k


def check(config: PretrainedConfig, what: str) -> None:
    """What the tower layers run: the last layer's features (InternVL 3 / 3.5), the class token dropped,
    square tiles of whole merge units."""
    vc = config.vision_config
    if config.vision_feature_layer != -1:
        raise ValueError(f"{what}.vision_feature_layer={config.vision_feature_layer!r}: only -1 (the last layer, "
                         f"InternVL's) is supported")
    if config.vision_feature_select_strategy != "default":
        raise ValueError(f"{what}.vision_feature_select_strategy={config.vision_feature_select_strategy!r}: only "
                         f"default (the class token dropped) is supported; InternVL's pixel shuffle reshapes "
                         f"the patches alone")
    side, patch = _square(vc.image_size, "image_size", what), _square(vc.patch_size, "patch_size", what)
    k = merge(config, what)
    if side % patch or (side // patch) % k:
        raise ValueError(f"{what}: image_size {side} is not whole {patch}-px patches in whole {k}x{k} merge units")
    n, ratio, width = side // patch, config.downsample_ratio, vc.hidden_size
    if n % ratio or int(n * ratio) * k != n or int(width / ratio ** 2) != width * k * k:
        raise ValueError(f"{what}.downsample_ratio={ratio!r}: transformers' pixel_shuffle cannot fold a tile of "
                         f"{n}x{n} patches by it in floating point ({n} % {ratio!r} != 0); use a ratio of 1 / a "
                         f"power of two, e.g. 0.5 (InternVL's)")


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """The tiles' figures: the processor's tile side (the tower's image_size) and tile bounds."""
    vc, text = config.vision_config, config.get_text_config()
    side = _square(vc.image_size, "image_size", what)
    proc = make_image_processor(ip)
    size = (proc.size.height, proc.size.width)
    if size != (side, side):
        raise ValueError(f"{what}: the image processor cuts {size[0]}x{size[1]} tiles but the vision tower's "
                         f"image_size is {side}; the tower has the positions of one {side}-px tile: set the image "
                         f"processor's size to {{height: {side}, width: {side}}}")
    lo, hi = proc.min_patches, proc.max_patches
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{what}: the image processor's min_patches={lo!r} / max_patches={hi!r}: mmpipe takes "
                         f"integers with 1 <= min_patches <= max_patches (InternVL's 1 and 12)")
    return VisionSpec(
        blocks=vc.num_hidden_layers, hidden=vc.hidden_size, mlp=vc.intermediate_size, heads=vc.num_attention_heads,
        patch=_square(vc.patch_size, "patch_size", what), resize="tiles", image_size=side, merge=merge(config, what),
        cls_token=True, select="patches", proj=(text.hidden_size, text.hidden_size), channels=vc.num_channels,
        min_tiles=int(proc.min_patches), max_tiles=int(proc.max_patches), image_markers=2)


def default_image_processor(config: PretrainedConfig) -> dict[str, Any]:
    """GotOcr2ImageProcessor at the tower's tile side, InternVL's 1..12 tiles."""
    side = _square(config.vision_config.image_size, "image_size", "model.config")
    return {"image_processor_type": PROCESSOR, "size": {"height": side, "width": side}, "crop_to_patches": True,
            "min_patches": 1, "max_patches": 12}


def processor_settings(settings: Mapping[str, Any], config: PretrainedConfig, what: str) -> None:
    """InternVLProcessor puts image_seq_length placeholders per tile (its default, 256, where the file
    leaves the key out)."""
    vc = config.vision_config
    side = _square(vc.image_size, "image_size", what) // _square(vc.patch_size, "patch_size", what)
    want = (side // merge(config, what)) ** 2
    if "image_seq_length" not in settings and want != PROCESSOR_SEQ_LENGTH:
        raise ValueError(f"{what}: processor_config.json leaves image_seq_length out, so InternVLProcessor puts its "
                         f"default {PROCESSOR_SEQ_LENGTH} placeholders per tile, but the model's config makes "
                         f"{want}: set image_seq_length to {want}")
    check_processor_settings(settings, {"image_seq_length": want}, what)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """The embeddings; block i; the tower's final norm (an Identity unless use_mean_pooling is off)
    with the projector."""
    return {"embed": (("embeddings", f"{TOWER}.embeddings"),),
            "block": (("block", f"{TOWER}.encoder.layer.{i}"),),
            "proj": (("layernorm", f"{TOWER}.layernorm"), ("projector", PROJECTOR))}[kind]


# ----------------------------------------------------------------------------- layers


class InternVisionEmbed(HFLayer):
    """Patch, class and position embeddings of every tile: pixels [T, C, S, S] -> [T, P + 1, D]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        slots[C.IMAGE] = self.embeddings(C.from_wire(slots[C.IMAGE], self.dtype))


class InternVisionBlock(HFLayer):
    """One InternViT layer; every tile is one row of the batch, attending over itself."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.IMAGE], self.dtype)
        if h.shape[0] == 0:
            slots[C.IMAGE] = h
            return
        with segments(Segments(stream=None, causal=False)):
            slots[C.IMAGE] = self.block(h)


class InternVisionProj(HFLayer):
    """The tower's final norm, the class token dropped, the model's own pixel_shuffle (called on the
    meta-device model: it is tensor operations only), the projector: [T, P + 1, D] -> [T * tokens, D_llm]."""

    def __init__(self, parts: dict[str, nn.Module], *, src: HFSource):
        super().__init__(parts)
        self.src = src

    def step(self, slots: list[torch.Tensor]) -> None:
        h = self.layernorm(C.from_wire(slots[C.IMAGE], self.dtype))[:, 1:]
        n, positions, width = h.shape
        side = int(round(positions ** 0.5))
        shuffled = skeleton(self.src).model.pixel_shuffle(h.reshape(n, side, side, width),
                                                          scale_factor=hf_config(self.src).downsample_ratio)
        out = self.projector(shuffled.flatten(1, 2))
        slots[C.IMAGE] = out.reshape(-1, out.shape[-1])


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    kind = name.split(".")[1]
    if kind == "proj":
        return InternVisionProj(parts, src=spec.hf)
    return {"embed": InternVisionEmbed, "block": InternVisionBlock}[kind](parts)


# ----------------------------------------------------------------------------- demo


def perturb_tower(model: nn.Module, seed: int) -> None:
    """perturb() moves 1-D tensors; InternViT's class token and position table ([1, n, D], drawn as
    zeros) are moved too, so that a table not loaded shows."""
    g = torch.Generator().manual_seed(seed + 1)
    emb = model.model.vision_tower.embeddings
    with torch.no_grad():
        for p in (emb.cls_token, emb.position_embeddings):
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def write_demo(root: Path, texts: list[str]) -> Path:
    """A 2-layer InternViT (28-px tiles of 7-px patches, 2x2 pixel shuffle: 4 tokens a tile, up to 6
    tiles and the thumbnail) + Qwen2; the processor (InternVLProcessor, which needs a video processor:
    InternVL's, saved but not read by mmpipe) saved whole."""
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        InternVLVisionConfig,
    )

    torch.manual_seed(49)
    names = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    tok = qwen_tokenizer(texts, extra=tuple(names.values()), named=names)
    cfg = InternVLConfig(
        vision_config=InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=7),
        text_config=llm_config("qwen2", tok, hidden_size=48, intermediate_size=96),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=False)
    model = InternVLForConditionalGeneration(cfg)
    perturb_tower(model, 49)
    folder = save(model, tok, TEMPLATE, root / "internvl", 49)
    image = GotOcr2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True, min_patches=1,
                                  max_patches=6)
    InternVLProcessor(image_processor=image, video_processor=InternVLVideoProcessor(size={"height": 28, "width": 28}),
                      tokenizer=tok, image_seq_length=4,
                      chat_template=TEMPLATE).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="internvl", architecture="InternVLForConditionalGeneration", title="InternVL",
    text_types=("qwen2", "qwen3"), towers={"vision": TOWER}, check=check, vision=vision, audio=None,
    image_processors=(PROCESSOR,), default_image_processor=default_image_processor, default_feature_extractor=None,
    video_processor=None, processor_settings=processor_settings, layer_parts=layer_parts, tower_layer=tower_layer,
    llm_block=None, positions=None, audio_in_video=False, outer=None, demo=Demo(name="internvl", write=write_demo))
