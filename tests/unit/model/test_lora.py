"""LoRA adapters on the pipeline layers of every supported Hugging Face model are PEFT's: the same
modules get adapters as `get_peft_model` gives on the whole transformers model, and the layers
chained in one process compute PEFT's loss and adapter gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers
from mmpipe.model.hf.memory import adapter_counts
from mmpipe.model.hf.skeleton import unowned_keys
from mmpipe.model.lora import adapt_layers, peft_lora_config
from mmpipe.model.spec import LORA_TARGETS, LoraSpec, layer_names
from mmpipe.runtime.batch import collate_hf

from . import hf_cases as H

TOWER_TARGETS = ("qkv", "attn.proj", "fc1", "fc2", "out_proj", "linear_1", "linear_2")
"""Linear names of the towers and projectors (CLIP, SigLIP, Whisper, the Qwen towers' blocks and mergers)."""


def _adapted(model) -> set[str]:
    """Module names of a PEFT model's LoRA layers, without PEFT's `base_model.model.` prefix."""
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _ours(layers) -> set[str]:
    return {name for layer in layers for name in getattr(layer, "lora_modules", {}).values()}


@pytest.mark.parametrize("case", list(H.CLASSES))
def test_the_adapted_modules_are_peft_s(case, request):
    """Every part adapted: the modules are those PEFT adapts on the whole model for the same list
    of names. parts=[llm]: those of them inside the decoder, and the config mmpipe writes for
    PEFT (explicit module names) adapts exactly those on the whole model."""
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    targets = LORA_TARGETS + TOWER_TARGETS
    every = LoraSpec(r=2, target_modules=targets, parts=("llm", "vision", "audio"))
    ours = _ours(adapt_layers(build_layers(spec, seed=0), spec, every, seed=0))
    theirs = _adapted(get_peft_model(H.load_reference(H.CLASSES[case], folder),
                                     LoraConfig(r=2, target_modules=list(targets))))
    # modules no pipeline layer holds (a CLIP tower's blocks after the feature layer, SigLIP's
    # pooling head: the model's forward never runs them) get none here
    unused = set(unowned_keys(spec))
    assert ours and ours <= theirs and all(f"{n}.weight" in unused for n in theirs - ours), sorted(theirs - ours)[:5]
    towers = [n for n in ours if "language_model" not in n]
    assert towers, f"{case}: no tower module was adapted"

    llm = LoraSpec(r=2)
    ours = _ours(adapt_layers(build_layers(spec, seed=0), spec, llm, seed=0))
    assert ours == {n for n in _adapted(get_peft_model(H.load_reference(H.CLASSES[case], folder),
                                                       LoraConfig(r=2, target_modules=list(LORA_TARGETS))))
                    if n.startswith("model.language_model.")}
    assert _adapted(get_peft_model(H.load_reference(H.CLASSES[case], folder), peft_lora_config(llm, ours))) == ours
    # the memory check counts exactly the adapters the layers hold
    layers = adapt_layers(build_layers(spec, seed=0), spec, every, seed=0)
    counts = adapter_counts(spec, every)
    for layer in layers:
        held = sum(p.numel() for n, p in layer.named_parameters() if ".lora_" in n)
        assert counts.get(layer.name, 0) == held, layer.name
    assert set(counts) <= set(layer_names(spec))


def _text_samples(rng):
    return [H.sample("a", [H.text(rng, 5), H.text(rng, 9)]), H.sample("b", [H.text(rng, 3), H.text(rng, 12)])]


@pytest.mark.parametrize("case", list(H.CLASSES))
def test_lora_layers_compute_peft_s_loss_and_adapter_gradients(case, request):
    """Text samples (the decoder's adapters, every family's decoder): the pipeline layers with
    adapters, in one process, give the loss and the gradient of every lora_A and lora_B that
    PEFT's model gives with the same adapter weights (lora_B made non-zero, so that lora_A's
    gradient is not zero by construction), and no base weight of an adapted layer has one."""
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    lora = LoraSpec(r=4, alpha=8.0)
    layers = adapt_layers(build_layers(spec, seed=0), spec, lora, seed=0)
    peft = get_peft_model(H.load_reference(H.CLASSES[case], folder),
                          LoraConfig(r=4, lora_alpha=8, target_modules=sorted(_ours(layers))))
    theirs = dict(peft.named_parameters())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            for local, name in getattr(layer, "lora_modules", {}).items():
                m = layer.get_submodule(local)
                m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=gen) * 0.1)
                for which in ("lora_A", "lora_B"):
                    theirs[f"base_model.model.{name}.{which}.default.weight"].copy_(
                        getattr(m, which)["default"].weight)
    for layer in layers:
        for n, p in layer.named_parameters():
            p.requires_grad_(".lora_" in n)
    samples = _text_samples(np.random.default_rng(3))
    ids = H.padded(samples, "input_ids")
    kwargs = {"mm_token_type_ids": torch.zeros_like(ids)} if case == "qwen3_vl" else {}
    loss = peft(input_ids=ids, attention_mask=H.mask(samples), labels=H.padded(samples, "labels"), **kwargs).loss
    loss.backward()
    mb = collate_hf(samples, spec=spec, packed=True, pad_id=0)
    ours = H.our_loss_and_grads(layers, mb)
    assert ours == pytest.approx(loss.item(), rel=H.LOSS_RTOL)
    compared = 0
    for layer in layers:
        for local, name in getattr(layer, "lora_modules", {}).items():
            m = layer.get_submodule(local)
            assert m.base_layer.weight.grad is None
            for which in ("lora_A", "lora_B"):
                mine = getattr(m, which)["default"].weight.grad
                want = theirs[f"base_model.model.{name}.{which}.default.weight"].grad
                scale = max(float(want.abs().max()), 1e-6)
                assert float((mine - want).abs().max()) / scale < H.GRAD_RTOL, f"{name}.{which}"
                compared += 1
    assert compared == 2 * len(_ours(layers)) >= 2 * 7 * spec.llm.blocks


@pytest.mark.parametrize("case", ["llava_siglip_qwen2", "qwen2_5_vl", "qwen2_5_omni"])
def test_all_linear_adapts_what_peft_s_all_linear_adapts(case, request):
    """target_modules=[all-linear] over every part: PEFT's `all-linear` on the whole model (every
    Linear but the LM head), but for modules no layer holds; over [llm]: those of the decoder."""
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    theirs = _adapted(get_peft_model(H.load_reference(H.CLASSES[case], folder),
                                     LoraConfig(r=2, target_modules="all-linear")))
    every = LoraSpec(r=2, target_modules=("all-linear",), parts=("llm", "vision", "audio"))
    ours = _ours(adapt_layers(build_layers(spec, seed=0), spec, every, seed=0))
    unused = set(unowned_keys(spec))
    assert ours <= theirs and all(f"{n}.weight" in unused for n in theirs - ours), sorted(theirs - ours)[:5]
    assert any("language_model" not in n for n in ours) and not any(n.endswith("lm_head") for n in ours)
    llm = _ours(adapt_layers(build_layers(spec, seed=0), spec, LoraSpec(r=2, target_modules=("all-linear",)), seed=0))
    assert llm == {n for n in theirs if n.startswith("model.language_model.")}
