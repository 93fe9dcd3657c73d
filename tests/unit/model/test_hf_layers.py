"""Carrier rules for Hugging Face layers: a stage boundary may fall between any two layers
(every float that crosses gets a gradient back; the rest travel as integers; every slot is
contiguous, as a send needs), and a micro-batch without images or clips runs no encoder work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.model import carrier as C
from mmpipe.model.geometry import audio_tokens, image_tokens
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers
from mmpipe.model.hf.media import preprocess_audio, preprocess_image
from mmpipe.model.layers import run_layers, token_loss
from mmpipe.runtime.batch import collate_hf

from . import hf_cases as H

CASES = ["llava_clip_llama", "llava_siglip_qwen2", "qwen2_vl", "qwen2_audio", "llava_next", "llava_onevision",
         "qwen3_vl", "qwen2_5_vl", "qwen2_5_omni", "gemma3", "internvl"]


def media_sample(spec, rng):
    """A sample with a clip (audio towers) and an image (vision towers): both for Qwen2.5-Omni."""
    pieces, images, clips = [H.text(rng, 3)], [], []
    if spec.audio is not None:
        clip = rng.standard_normal(12_345).astype(np.float32)
        pieces += [[H.AUDIO] * audio_tokens(spec.audio, len(clip) / 16000), H.text(rng, 2)]
        clips.append(preprocess_audio(spec, clip, 16000))
    if spec.vision is not None:
        img = H.random_image(rng, 45, 70)
        pieces += [[H.VSTART] + [H.IMAGE] * image_tokens(spec.vision, 45, 70) + [H.VEND]]
        images.append(preprocess_image(spec, img))
    return H.Sample("m", *_ids(pieces + [H.text(rng, 6)]), images, clips)


def _ids(pieces):
    s = H.sample("x", pieces)
    return s.input_ids, s.labels


def text_sample(rng):
    return H.Sample("t", *_ids([H.text(rng, 4), H.text(rng, 9)]), [], [])


@pytest.mark.parametrize("frozen_towers", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_a_stage_boundary_may_fall_after_any_layer(case, frozen_towers, request):
    spec = spec_from_folder(request.getfixturevalue(case))
    layers = build_layers(spec, seed=0)
    if frozen_towers:  # train.trainable=[llm]: tower outputs carry no gradient
        for layer in layers:
            if not layer.name.startswith("llm."):
                layer.requires_grad_(False)
    rng = np.random.default_rng(0)
    for samples in ([media_sample(spec, rng), text_sample(rng)], [text_sample(rng)]):
        mb = collate_hf(samples, spec=spec, packed=True, pad_id=0)
        for cut in range(1, len(layers) - 1):
            x = mb.carrier
            for layer in layers[:cut]:
                x = layer(x)
            for t in x:  # what DeepSpeed sends: floats that need a gradient back, integers otherwise
                assert not t.is_floating_point() or t.requires_grad, f"{case}: a float without grad after cut {cut}"
                assert t.is_contiguous(), f"{case}: torch.distributed cannot send a non-contiguous slot (cut {cut})"
            received = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in x)
            floats = [t for t in received if t.is_floating_point()]
            loss = token_loss(run_layers(layers[cut:], received), (mb.targets, torch.tensor([1.0])))
            loss.backward()
            for t in floats:
                assert t.grad is not None, f"{case}: no gradient came back across cut {cut} ({layers[cut].name})"


@pytest.mark.parametrize("case", CASES)
def test_text_only_micro_batch_runs_no_encoder_work(case, request):
    spec = spec_from_folder(request.getfixturevalue(case))
    layers = build_layers(spec, seed=0)
    mb = collate_hf([text_sample(np.random.default_rng(1))], spec=spec, packed=True, pad_id=0)
    first_llm = next(i for i, l in enumerate(layers) if l.name == "llm.embed")
    x = mb.carrier
    for layer in layers[:first_llm]:
        x = layer(x)
        assert x[C.IMAGE].numel() == 0 and x[C.AUDIO].numel() == 0
    full = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0])))
    llm_only = token_loss(run_layers(layers[first_llm:], mb.carrier), (mb.targets, torch.tensor([1.0])))
    assert full.item() == pytest.approx(llm_only.item(), rel=1e-6)


def test_a_new_layer_is_the_same_whoever_builds_it(unimodal):
    """A composition's new projector (random) depends on (seed, layer name) only, so every
    stage that builds it builds the same weights."""
    from mmpipe.model.hf.build import build_layer
    from mmpipe.model.hf.compose import spec_from_compose

    spec = spec_from_compose(name="c", vision=str(unimodal("clip-vision")), llm=str(unimodal("llama")),
                             image_token_id=H.IMAGE)
    a, b = build_layer(spec, "vision.proj", seed=3), build_layer(spec, "vision.proj", seed=3)
    other = build_layer(spec, "vision.proj", seed=4)
    for (k, v), w, u in zip(a.state_dict().items(), b.state_dict().values(), other.state_dict().values()):
        assert torch.equal(v, w), k
    assert not torch.equal(a.projector.linear_1.weight, other.projector.linear_1.weight)
    assert float(a.projector.linear_1.weight.detach().std()) == pytest.approx(0.02, rel=0.2)  # transformers' init range
