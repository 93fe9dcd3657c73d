"""A micro-batch padded up to its ladder rung (plan.ladder) trains exactly as the unpadded one:
the padding is a segment of its own without labels, so the loss, its per-token mean and every
gradient stay those of the samples (mmpipe's own model, and Qwen2-VL with its M-RoPE positions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.geometry import image_tokens
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers as build_hf_layers
from mmpipe.model.hf.media import preprocess_images
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.runtime.batch import collate, collate_hf

from . import hf_cases as H
from .test_model import AUD, IMG, VID, FakeSample, tiny


def _loss_and_grads(layers, mb) -> tuple[float, list[torch.Tensor]]:
    """The loss as training computes it (mean over the micro-batch's label tokens) and every
    parameter's gradient."""
    for layer in layers:
        layer.zero_grad()
    loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
    loss.backward()
    return loss.item(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                         for layer in layers for p in layer.parameters()]


def _same_training(layers, plain, padded) -> None:
    loss, grads = _loss_and_grads(layers, plain)
    loss_p, grads_p = _loss_and_grads(layers, padded)
    assert loss_p == pytest.approx(loss, rel=1e-6)
    assert padded.label_tokens == plain.label_tokens  # the per-token mean's denominator
    for a, b in zip(grads, grads_p):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_padded_tiny_micro_batch_has_the_loss_and_gradients_of_the_unpadded_one():
    spec = tiny()
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD, video_token=VID)
    rng = np.random.default_rng(2)
    samples = [FakeSample("a", spec, rng, images=[(30, 30)], text=5),
               FakeSample("b", spec, rng, clips=[1.7], text=40, videos=[(8, 4.0, 48, 48)]),
               FakeSample("c", spec, rng, images=[(100, 20)], clips=[0.4], text=9)]
    n = sum(len(s.input_ids) for s in samples)

    def mb(pad_to):
        return collate(samples, patch=spec.vision.patch, packed=True, pad_id=0,
                       temporal_patch=spec.vision.video.temporal_patch, pad_to=pad_to)

    plain, padded = mb(None), mb(384)
    assert n < 384 and padded.targets.shape == (1, 384) and padded.carrier[C.INPUT_IDS].shape == (1, 384)
    assert (padded.tokens, padded.pad_tokens) == (n, 384 - n)
    assert list(layout.read(padded.carrier[C.LAYOUT]).llm.lengths) == [len(s.input_ids) for s in samples] + [384 - n]
    assert padded.carrier[C.POSITION_IDS][0, n:].tolist() == list(range(384 - n))
    _same_training(layers, plain, padded)


def test_a_padded_qwen2_vl_micro_batch_has_the_loss_and_gradients_of_the_unpadded_one(qwen2_vl):
    """M-RoPE: the padding's 3-D positions restart at 0 like a sample's; the samples' own
    positions (which jump over their images) are untouched."""
    spec = spec_from_folder(qwen2_vl)
    rng = np.random.default_rng(1)
    sizes = [(56, 90), (70, 70)]
    imgs = [H.random_image(rng, h, w) for h, w in sizes]
    n_img = [image_tokens(spec.vision, h, w) for h, w in sizes]

    def img(k):
        return [H.VSTART] + [H.IMAGE] * n_img[k] + [H.VEND]

    raw = [H.sample("a", [H.text(rng, 4), img(0), H.text(rng, 9)], images=imgs[:1]),
           H.sample("b", [H.text(rng, 3), img(1), H.text(rng, 6)], images=imgs[1:])]
    samples = [H.Sample(s.key, s.input_ids, s.labels, preprocess_images(spec, s.images)) for s in raw]
    n = sum(len(s.input_ids) for s in samples)
    plain = collate_hf(samples, spec=spec, packed=True, pad_id=0)
    padded = collate_hf(samples, spec=spec, packed=True, pad_id=0, pad_to=256)
    pos, pos_p = plain.carrier[C.POSITION_IDS], padded.carrier[C.POSITION_IDS]
    assert pos_p.shape == (3, 1, 256) and torch.equal(pos_p[:, :, :n], pos)
    assert pos_p[:, 0, n:].tolist() == [list(range(256 - n))] * 3
    _same_training(build_hf_layers(spec, seed=0), plain, padded)
