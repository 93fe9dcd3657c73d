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
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.family import family_of
from mmpipe.model.spec import HFSource, ModelSpec, layer_names

LM = "model.language_model"
"""Where every supported architecture keeps its decoder (transformers 5 module layout)."""
PROJECTOR = "model.multi_modal_projector"
"""The LLaVA classes' and Qwen2-Audio's projector into the LLM (also what a composition trains)."""


@functools.lru_cache(maxsize=8)
def skeleton(src: HFSource) -> PreTrainedModel:
    """The model of `src.architecture` on the meta device, its attention routed to mmpipe's
    per-sample attention (model/attention.py). Shared per process; never materialised."""
    config = copy.deepcopy(hf_config(src))
    config._attn_implementation = SEGMENT_ATTENTION  # set recursively on the sub-configs
    cls = getattr(transformers, src.architecture)
    with torch.device("meta"):
        return cls(config)


def ties_embeddings(src: HFSource) -> bool:
    """Whether transformers ties the LM head to the input embedding for this config."""
    model = skeleton(src)
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def layer_parts(spec: ModelSpec, name: str) -> tuple[tuple[str, str], ...]:
    """(attribute in the pipeline layer, module path in the transformers model) of each module
    a pipeline layer holds (a path may also name a bare parameter, LLaVA-NeXT's image_newline):
    the decoder's here, the towers' by their family (`Family.layer_parts`). Modules without
    parameters (rotary tables, pooling) may appear in several layers; every parameter belongs to
    exactly one layer (tied ones aside)."""
    src = _src(spec)
    if name not in layer_names(spec):
        raise ValueError(f"layer {name} does not exist in model {spec.name}")
    comp, kind, *rest = name.split(".")
    i = rest[0] if rest else ""
    if comp == "llm":
        return {"embed": (("embed", f"{LM}.embed_tokens"),),
                "block": (("block", f"{LM}.layers.{i}"), ("rotary", f"{LM}.rotary_emb")),
                "norm": (("norm", f"{LM}.norm"),),
                "head": (("head", "lm_head"),)}[kind]
    return family_of(src).layer_parts(hf_config(src), comp, kind, i)


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
