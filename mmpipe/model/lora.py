"""LoRA adapters on pipeline layers, with the `peft` library's own layers.

A pipeline layer holds a few modules of the transformers model (model/hf/skeleton.py:
`layer_parts`); `add_adapters` gives the Linear modules that `LoraSpec` selects PEFT's
`LoraLayer` (peft's `inject_adapter_in_model`, adapter `default`), so the forward, dropout and
scaling are PEFT's. What mmpipe adds:
- which modules: PEFT's own matching rule (`check_target_module_exists`) applied to each
  module's name in the whole transformers model, restricted to `LoraSpec.parts`, so that the
  same modules are adapted as `get_peft_model` adapts on the whole model for the config that
  `peft_config` writes;
- the initial adapters depend on (run seed, module name) only, as a layer's weights do, so a
  module starts the same on whichever stage builds it (PEFT draws them from the global RNG as
  it walks the whole model: an order no pipeline stage sees);
- the names: PEFT's saved adapter names (`base_model.model.<module>.lora_A.weight`) from the
  layer's local state-dict names, for export (model/hf/export.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mmpipe.model.spec import LoraSpec, ModelSpec

ADAPTER = "default"
"""PEFT's adapter name in the layers (not part of the saved names)."""
ALL_LINEAR = "all-linear"
"""PEFT's shorthand target: every Linear module but the output layer (here: of the adapted parts)."""
OUTPUT_LAYERS = ("lm_head", "llm.head.head")
"""The output layer all-linear leaves out (the transformers name, mmpipe's own model's)."""
BASE = ".base_layer"
"""What PEFT inserts into a wrapped module's own parameter names (`q_proj.base_layer.weight`)."""


def peft_lora_config(lora: LoraSpec, targets: Iterable[str]):
    """PEFT's LoraConfig adapting exactly `targets` (whole-model module names), with the run's
    rank, alpha and dropout."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      target_modules=sorted(targets))


def whole_name(spec: ModelSpec, layer: str, local: str) -> str:
    """The whole-model name of a module named `local` inside pipeline layer `layer`: its
    transformers path (skeleton.layer_parts maps the layer's attributes) for a Hugging Face model,
    `<layer name>.<local>` for mmpipe's own."""
    from mmpipe.model.hf.skeleton import layer_parts

    paths = dict(layer_parts(spec, layer)) if spec.hf is not None else {}
    attr, _, rest = local.partition(".")
    if attr in paths:
        return paths[attr] + ("." + rest if rest else "")
    return f"{layer}.{local}"


def matched_modules(module: nn.Module, spec: ModelSpec, layer: str, lora: LoraSpec) -> dict[str, str]:
    """local module name -> whole-model name of every module of `module` (pipeline layer `layer`)
    that LoRA adapts, by PEFT's matching rule for a list of target names.

    Raises:
        ValueError: one line, for a matched module that is not an nn.Linear.
    """
    if not lora.adapts(layer):
        return {}
    from peft.tuners.tuners_utils import check_target_module_exists

    every = ALL_LINEAR in lora.target_modules
    probe = peft_lora_config(lora, [t for t in lora.target_modules if t != ALL_LINEAR] or ["-"])
    out: dict[str, str] = {}
    for local, m in module.named_modules():
        if not local:
            continue
        name = whole_name(spec, layer, local)
        if every and type(m) is nn.Linear and not name.endswith(OUTPUT_LAYERS):
            out[local] = name
            continue
        if not check_target_module_exists(probe, name):
            continue
        if type(m) is not nn.Linear:
            raise ValueError(f"train.lora.target_modules={list(lora.target_modules)} matches {name}, a "
                             f"{type(m).__name__}; mmpipe adapts nn.Linear modules only: name Linear layers")
        out[local] = name
    return out


def add_adapters(module: nn.Module, spec: ModelSpec, layer: str, lora: LoraSpec, *, seed: int) -> dict[str, str]:
    """Wrap the matched Linear modules of pipeline layer `layer` in PEFT's LoRA layers, in place.

    lora_A starts as PEFT draws it (kaiming-uniform) from a generator seeded by (seed, module
    name); lora_B starts at zero, so the layer computes what it did before. Returns the
    adapted modules (local name -> whole-model name).
    """
    from peft import inject_adapter_in_model

    from mmpipe.model.layers import layer_seed

    matched = matched_modules(module, spec, layer, lora)
    if not matched:
        return matched
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(peft_lora_config(lora, matched), module, adapter_name=ADAPTER)
        for local, name in sorted(matched.items()):
            torch.manual_seed(layer_seed(seed, name + ".lora"))
            wrapped = module.get_submodule(local)
            wrapped.reset_lora_parameters(ADAPTER, True)
            dtype = wrapped.base_layer.weight.dtype
            wrapped.lora_A[ADAPTER].to(dtype)
            wrapped.lora_B[ADAPTER].to(dtype)
    module.lora_modules = dict(matched)
    return matched


def is_adapter(param_name: str) -> bool:
    """Whether a parameter (or state-dict key) of a layer is an adapter's."""
    return ".lora_A." in param_name or ".lora_B." in param_name


def base_key(key: str) -> str:
    """A wrapped module's base weight under its unwrapped name (`q_proj.base_layer.weight` ->
    `q_proj.weight`); other keys unchanged."""
    return key.replace(BASE + ".", ".")


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer state dict as (base tensors under their unwrapped names, adapter tensors)."""
    base = {base_key(k): v for k, v in state.items() if not is_adapter(k)}
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    return base, adapters


def saved_adapter_names(spec: ModelSpec, layer: str, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors of a layer under PEFT's saved names (`adapter_model.safetensors`):
    `base_model.model.<whole-model module>.lora_A.weight`, the adapter name dropped."""
    out = {}
    for key, t in adapters.items():
        local, which, rest = key.partition(".lora_A." if ".lora_A." in key else ".lora_B.")
        out[f"base_model.model.{whole_name(spec, layer, local)}{which}{rest.split('.', 1)[1]}"] = t
    return out


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: LoraSpec) -> torch.Tensor:
    """A base weight with its adapter merged in, by PEFT's own LoRA Linear (`merge`), so the
    merged export is what PEFT's merge_and_unload gives."""
    from peft.tuners.lora import Linear

    out_f, in_f = weight.shape
    base = nn.Linear(in_f, out_f, bias=False, device="meta")
    base.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layer = Linear(base, ADAPTER, config=peft_lora_config(lora, ["x"]), r=lora.r, lora_alpha=lora.alpha,
                   lora_dropout=0.0)
    layer.lora_A[ADAPTER].weight.copy_(a)
    layer.lora_B[ADAPTER].weight.copy_(b)
    layer.to(weight.dtype)
    layer.merge(adapter_names=[ADAPTER])
    return layer.base_layer.weight.detach()


def adapt_layers(layers: list[nn.Module], spec: ModelSpec, lora: LoraSpec, *, seed: int) -> list[nn.Module]:
    """`add_adapters` on every layer of a one-process model (build_layers' list), in place."""
    seen: set[int] = set()
    for layer in layers:
        if id(layer) not in seen and hasattr(layer, "name"):
            add_adapters(layer, spec, layer.name, lora, seed=seed)
        seen.add(id(layer))
    return layers


class Parts(nn.Module):
    """A layer's modules under their layer attributes, for matching names (nothing is copied)."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        for attr, module in parts.items():
            self.add_module(attr, module)


def layer_modules(spec: ModelSpec, name: str) -> nn.Module:
    """The modules of pipeline layer `name`, weightless where possible: the meta-device
    transformers modules under the layer's attributes, or mmpipe's own (small) layer built."""
    if spec.hf is None:
        from mmpipe.model.layers import build_layer

        return build_layer(spec, name, seed=0, image_token=-1, audio_token=-1)
    from mmpipe.model.hf.skeleton import layer_parts, skeleton

    model = skeleton(spec.hf)
    return Parts({attr: model.get_submodule(path) for attr, path in layer_parts(spec, name)
                  if not path.endswith("image_newline")})


def tied_head(spec: ModelSpec) -> bool:
    """Whether `llm.head` is the input embedding's weight (no module of its own to adapt)."""
    if spec.hf is None:
        return spec.llm.tie_embeddings
    from mmpipe.model.hf.skeleton import ties_embeddings

    return ties_embeddings(spec.hf)


def check_adapters(spec: ModelSpec, lora: LoraSpec) -> None:
    """Before launch: every part in train.lora.parts gets at least one adapter, and no target is
    a tied LM head. Raises ValueError (one line) naming the part and the Linear modules it has."""
    if not lora.active:
        return
    from mmpipe.model.spec import layer_names

    tied = tied_head(spec)
    for part in lora.parts:
        matched: set[str] = set()
        names: set[str] = set()
        for layer in layer_names(spec):
            if not layer.startswith(part + ".") or (tied and layer == "llm.head"):
                continue
            holder = layer_modules(spec, layer)
            matched |= set(matched_modules(holder, spec, layer, lora).values())
            names |= {".".join(n.split(".")[-2:]) for n, m in holder.named_modules() if type(m) is nn.Linear}
        if not matched:
            raise ValueError(f"train.lora.target_modules={list(lora.target_modules)} matches no module of the "
                             f"{part} part of model {spec.name}, whose Linear modules are named "
                             f"{', '.join(sorted(names)[:12]) or 'nothing'}: name some of them (or [all-linear]), "
                             f"or drop {part} from train.lora.parts")
    if tied and "llm" in lora.parts and ALL_LINEAR not in lora.target_modules:
        from peft.tuners.tuners_utils import check_target_module_exists

        if check_target_module_exists(peft_lora_config(lora, lora.target_modules), "lm_head"):
            raise ValueError(f"train.lora.target_modules={list(lora.target_modules)} names lm_head, which model "
                             f"{spec.name} ties to its input embedding (no module of its own): drop lm_head")


def trains(layer: str, param: str, *, full: bool, lora: LoraSpec) -> bool:
    """Whether parameter `param` of pipeline layer `layer` trains: an adapter always; a base
    weight when the layer trains in full and LoRA does not adapt it."""
    if is_adapter(param):
        return True
    return full and not lora.adapts(layer)
