"""The transformers model on the meta device, and which of its modules each pipeline layer is.

The whole model is built on the meta device (no memory, well under a second for a 7B); it is
the one source of module structure, parameter names and ties. A pipeline layer is a few of its
modules (`layer_parts`): a rank copies only those off the meta device and initialises them the
way transformers initialises missing weights in `from_pretrained` (`to_empty`, then the
owning model's `_init_weights`, which also fills non-persistent buffers such as rotary
frequencies), so no rank ever holds the rest of the model.
"""

from __future__ import annotations

import copy
import functools

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from mmpipe.model.attention import NAME as SEGMENT_ATTENTION
from mmpipe.model.hf import qwen3
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.spec import HFSource, ModelSpec, layer_names

LM = "model.language_model"
"""Where every supported architecture keeps its decoder (transformers 5 module layout)."""
TOWERS = {"llava": "model.vision_tower", "qwen2_vl": "model.visual", "qwen2_audio": "model.audio_tower",
          "llava_next": "model.vision_tower",
          "llava_onevision": "model.vision_tower",
          "qwen3_vl": "model.visual",
          "qwen2_5_vl": "model.visual", "qwen2_5_omni_thinker": "model.visual"}
"""Each model type's (vision, else audio) tower; Qwen2.5-Omni's audio tower is OMNI_AUDIO."""
OMNI_AUDIO = "model.audio_tower"
PROJECTOR = "model.multi_modal_projector"
LLAVA_TOWERS = ("llava", "llava_next", "llava_onevision")
"""Architectures whose tower is LLaVA's CLIP / SigLIP (the last two tile any-resolution images)."""
NEWLINE = "model.image_newline"
"""LLaVA-NeXT / OneVision's learned row separator: a bare parameter of the model, not a module."""


@functools.lru_cache(maxsize=8)
def skeleton(src: HFSource) -> PreTrainedModel:
    """The model of `src.architecture` on the meta device, its attention routed to mmpipe's
    per-sample attention (model/attention.py). Shared per process; never materialised."""
    config = copy.deepcopy(hf_config(src))
    config._attn_implementation = SEGMENT_ATTENTION  # set recursively on the sub-configs
    cls = getattr(transformers, src.architecture)
    with torch.device("meta"):
        return cls(config)


def model_type(src: HFSource) -> str:
    return hf_config(src).model_type


def ties_embeddings(src: HFSource) -> bool:
    """Whether transformers ties the LM head to the input embedding for this config."""
    model = skeleton(src)
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _clip_tower(src: HFSource) -> bool:
    return model_type(src) in LLAVA_TOWERS and hf_config(src).vision_config.model_type == "clip_vision_model"


def layer_parts(spec: ModelSpec, name: str) -> tuple[tuple[str, str], ...]:
    """(attribute in the pipeline layer, module path in the transformers model) of each module
    a pipeline layer holds (a path may also name a bare parameter, LLaVA-NeXT's image_newline).
    Modules without parameters (rotary tables, pooling) may appear in several layers; every
    parameter belongs to exactly one layer (tied ones aside)."""
    src = _src(spec)
    if name not in layer_names(spec):
        raise ValueError(f"layer {name} does not exist in model {spec.name}")
    comp, kind, *rest = name.split(".")
    i = rest[0] if rest else ""
    kind_of = model_type(src)
    if comp == "llm":
        return {"embed": (("embed", f"{LM}.embed_tokens"),),
                "block": (("block", f"{LM}.layers.{i}"), ("rotary", f"{LM}.rotary_emb")),
                "norm": (("norm", f"{LM}.norm"),),
                "head": (("head", "lm_head"),)}[kind]
    if kind_of in ("qwen2_5_vl", "qwen2_5_omni_thinker"):
        return _qwen25_parts(comp, kind, i)
    tower = TOWERS[kind_of]
    if kind_of in LLAVA_TOWERS:
        embed = (("embeddings", f"{tower}.embeddings"),)
        if _clip_tower(src):
            embed += (("pre_layrnorm", f"{tower}.pre_layrnorm"),)
        proj = (("projector", PROJECTOR),) + ((("image_newline", NEWLINE),) if kind_of != "llava" else ())
        return {"embed": embed, "block": (("block", f"{tower}.encoder.layers.{i}"),), "proj": proj}[kind]
    if kind_of == "qwen3_vl":
        return qwen3.layer_parts(tower, kind, i)
    if kind_of == "qwen2_vl":
        return {"embed": (("patch_embed", f"{tower}.patch_embed"),),
                "block": (("block", f"{tower}.blocks.{i}"), ("rotary", f"{tower}.rotary_pos_emb")),
                "proj": (("merger", f"{tower}.merger"),)}[kind]
    return {"embed": (("conv1", f"{tower}.conv1"), ("conv2", f"{tower}.conv2"),
                      ("embed_positions", f"{tower}.embed_positions")),
            "block": (("block", f"{tower}.layers.{i}"),),
            "proj": (("avg_pooler", f"{tower}.avg_pooler"), ("layer_norm", f"{tower}.layer_norm"),
                     ("projector", PROJECTOR))}[kind]


def _qwen25_parts(comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """Qwen2.5-VL's (and Qwen2.5-Omni's) vision tower; Qwen2.5-Omni's audio tower. Omni's
    `audio_bos_eos_token` is in no layer: the thinker's forward never reads it (export carries it)."""
    if comp == "vision":
        tower = "model.visual"
        return {"embed": (("patch_embed", f"{tower}.patch_embed"),),
                "block": (("block", f"{tower}.blocks.{i}"), ("rotary", f"{tower}.rotary_pos_emb")),
                "proj": (("merger", f"{tower}.merger"),)}[kind]
    return {"embed": (("conv1", f"{OMNI_AUDIO}.conv1"), ("conv2", f"{OMNI_AUDIO}.conv2"),
                      ("positions", f"{OMNI_AUDIO}.positional_embedding")),
            "block": (("block", f"{OMNI_AUDIO}.layers.{i}"),),
            "proj": (("ln_post", f"{OMNI_AUDIO}.ln_post"), ("proj", f"{OMNI_AUDIO}.proj"))}[kind]


def _src(spec: ModelSpec) -> HFSource:
    if spec.hf is None:
        raise ValueError(f"model {spec.name} is mmpipe's own assembly, not a Hugging Face model")
    return spec.hf


def owned_keys(spec: ModelSpec, name: str) -> dict[str, str]:
    """A layer's state-dict keys -> the transformers model's own keys (its state_dict names).
    Empty for `llm.head` when it is the tied input embedding."""
    src = _src(spec)
    if name == "llm.head" and ties_embeddings(src):
        return {}
    model = skeleton(src)
    out: dict[str, str] = {}
    for attr, path in layer_parts(spec, name):
        if _is_parameter(model, path):
            out[attr] = path
            continue
        for key in model.get_submodule(path).state_dict():
            out[f"{attr}.{key}"] = f"{path}.{key}"
    return out


def _newline(config: PretrainedConfig) -> nn.Parameter:
    """A fresh `image_newline`, drawn as LlavaNextPreTrainedModel._init_weights draws it (normal,
    std 1/sqrt(text hidden size)): that method reaches the bare parameter only through the whole
    model, which no rank builds."""
    hidden = config.get_text_config().hidden_size
    return nn.Parameter(torch.randn(hidden) * hidden ** -0.5)


def _is_parameter(model: nn.Module, path: str) -> bool:
    module, _, leaf = path.rpartition(".")
    return leaf in dict(model.get_submodule(module).named_parameters(recurse=False))


def unowned_keys(spec: ModelSpec) -> list[str]:
    """The model's keys no pipeline layer holds: a CLIP tower's post_layernorm and the blocks
    after `vision_feature_layer`, SigLIP's pooling head, a tied LM head. Export carries them
    over from the source checkpoint (or from a fresh initialisation) so the folder is whole."""
    src = _src(spec)
    owned = {k for n in layer_names(spec) for k in owned_keys(spec, n).values()}
    model = skeleton(src)
    tied = set(_tied_targets(model))
    return [k for k in model.state_dict() if k not in owned and k not in tied]


def _tied_targets(model: PreTrainedModel) -> dict[str, str]:
    """Tied key -> the key it is tied to, where the two really are one tensor (what
    save_pretrained leaves out)."""
    out = {}
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            if model.get_parameter(target) is model.get_parameter(source):
                out[target] = source
        except AttributeError:
            continue
    return out


def tied_targets(spec: ModelSpec) -> dict[str, str]:
    return _tied_targets(skeleton(_src(spec)))


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    seen: dict[int, PretrainedConfig] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if isinstance(c, PretrainedConfig) and id(c) not in seen:
            seen[id(c)] = c
            todo.extend(getattr(c, k, None) for k in getattr(c, "sub_configs", {}))
    return list(seen.values())


def _owner(model: PreTrainedModel, path: str) -> PreTrainedModel:
    """The innermost transformers model on `path`; its `_init_weights` knows the part's modules."""
    owner, node = model, model
    for piece in path.split("."):
        node = getattr(node, piece) if not piece.isdigit() else node[int(piece)]
        if isinstance(node, PreTrainedModel):
            owner = node
    return owner


def materialise(src: HFSource, path: str, *, init_weights: bool = True) -> nn.Module:
    """A real copy of one module of the meta model, initialised by transformers' own init
    (random weights drawn from the current torch RNG; buffers computed from the config).

    With `init_weights=False` (every weight is about to be loaded) only modules holding
    non-persistent buffers (rotary tables, position ids) are initialised; other weights are
    left as allocated, which saves drawing billions of random numbers per 7B stage.
    """
    model = skeleton(src)
    if _is_parameter(model, path):  # only LLaVA-NeXT / OneVision's image_newline
        return _newline(hf_config(src))
    meta = model.get_submodule(path)
    memo = {id(c): c for c in _configs(model)}  # parts share the one config, as in the model
    part = copy.deepcopy(meta, memo)
    part.to_empty(device="cpu")
    owner = _owner(model, path)
    with torch.no_grad():
        for module in part.modules():
            if init_weights or module._non_persistent_buffers_set:
                owner._init_weights(module)
    return part
