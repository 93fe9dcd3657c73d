"""Building the pipeline layers of a Hugging Face model, one at a time, by name.

`build_layer(spec, "llm.block.3", seed=...)` materialises only that layer's transformers
modules (skeleton.py), initialises them from (seed, layer name) like mmpipe's own layers, then
copies its tensors from the checkpoint when the spec has weights (weights.py). A rank that
builds its stage's layers therefore holds and reads only those.

Tied embeddings: `tied_embedding(spec)` says how the runtime shares the one weight of
`llm.embed` and `llm.head` (DeepSpeed's TiedLayerSpec across stages, one module in one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mmpipe.model.hf import layers as L
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.family import family_of
from mmpipe.model.hf.skeleton import layer_parts, materialise, owned_keys, ties_embeddings
from mmpipe.model.hf.weights import checkpoint_index, load_layer
from mmpipe.model.layers import layer_seed
from mmpipe.model.spec import ModelSpec, layer_names


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedEmbedding:
    """How `llm.embed` and `llm.head` share one weight (transformers' tie_word_embeddings)."""

    key: str
    """DeepSpeed TiedLayerSpec key (a module name: no dots)."""
    layers: tuple[str, str]
    """The tied pipeline layers: the owner (built) and the one that reuses it."""
    weight_attr: str
    """The tied weight inside the owner layer (TiedLayerSpec's tied_weight_attr)."""
    head_forward: Callable
    """forward_fn of the head occurrence: (owner layer, carrier) -> logits."""


def tied_embedding(spec: ModelSpec) -> TiedEmbedding | None:
    """The tie of a spec's LM head to its input embedding, or None when they are separate.

    The runtime builds both layers with `TiedLayerSpec(key, <builder of the owner layer>,
    forward_fn=None for llm.embed / head_forward for llm.head, tied_weight_attr=weight_attr)`:
    DeepSpeed builds the owner once per stage that needs it, broadcasts its weight from the
    first such stage and all-reduces its gradient between them.
    """
    if spec.hf is None or not ties_embeddings(spec.hf):
        return None
    return TiedEmbedding(key="llm_tied_embedding", layers=("llm.embed", "llm.head"), weight_attr="embed.weight",
                         head_forward=L.tied_head_forward)


def placeholder_tokens(spec: ModelSpec) -> tuple[int, int]:
    """(image, audio) placeholder token ids of the transformers config (-1 where none)."""
    config = hf_config(spec.hf)
    image = getattr(config, "image_token_id", None) if spec.vision is not None else None
    audio = getattr(config, "audio_token_id", None) if spec.audio is not None else None
    return (-1 if image is None else int(image)), (-1 if audio is None else int(audio))


def video_token(spec: ModelSpec) -> int:
    """The video placeholder token id of the transformers config (-1 for a model without video)."""
    if spec.vision is None or spec.vision.video is None:
        return -1
    tid = getattr(hf_config(spec.hf), "video_token_id", None)
    return -1 if tid is None else int(tid)


def _make(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    """The pipeline layer `name` from its parts: the decoder's here, the towers' (and a decoder block
    of a family's own) by the spec's family."""
    family = family_of(spec.hf)
    comp, kind, *rest = name.split(".")
    if comp != "llm":
        return family.tower_layer(spec, name, parts)
    if kind == "embed":
        image, audio = placeholder_tokens(spec)
        return L.HFLLMEmbed(parts, image_token=image, audio_token=audio, video_token=video_token(spec))
    if kind == "block" and family.llm_block is not None:
        return family.llm_block(spec, int(rest[0]), parts)
    if kind == "block":
        return L.HFLLMBlock(parts, mrope=family.positions is not None)
    return {"norm": L.HFLLMNorm, "head": L.HFLLMHead}[kind](parts)


def build_layer(spec: ModelSpec, name: str, *, seed: int, load: bool = True) -> nn.Module:
    """One named pipeline layer of a Hugging Face spec.

    Args:
        spec: a spec made by `mmpipe.model.hf` (spec.hf set).
        name: a layer of layer_names(spec), e.g. `vision.block.0` or `llm.head`.
        seed: run seed; initial weights depend on (seed, name) only.
        load: copy the checkpoint's tensors when the spec names weights.
    """
    if name == "llm.head" and tied_embedding(spec) is not None:
        head = L.TiedHead(build_layer(spec, "llm.embed", seed=seed, load=load))
        head.name = name
        return head
    load = load and bool(spec.hf.weights)
    # weights no source holds (a composition's new projector) keep transformers' random init
    fresh = not load or any(k not in checkpoint_index(spec.hf) for k in owned_keys(spec, name).values())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, name))
        parts = {attr: materialise(spec.hf, path, init_weights=fresh) for attr, path in layer_parts(spec, name)}
    layer = _make(spec, name, parts)
    if load:
        load_layer(layer, spec, name)
    layer.name = name
    return layer


def build_layers(spec: ModelSpec, *, seed: int, load: bool = True) -> list[nn.Module]:
    """All layers in order, for single-process reference runs; a tied head shares the
    embedding layer's module, as one pipeline stage holding both does."""
    out: list[nn.Module] = []
    by_name: dict[str, nn.Module] = {}
    tie = tied_embedding(spec)
    for name in layer_names(spec):
        if tie is not None and name == "llm.head":
            layer = L.TiedHead(by_name["llm.embed"])
            layer.name = name
        else:
            layer = build_layer(spec, name, seed=seed, load=load)
        by_name[name] = layer
        out.append(layer)
    return out
