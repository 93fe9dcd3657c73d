"""Chaining the pipeline layers of a Hugging Face model in one process gives the loss and the
gradients of the transformers model itself, on inputs made by the checkpoint's processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (AutoImageProcessor, LlavaForConditionalGeneration, Qwen2AudioForConditionalGeneration,
                          Qwen2VLForConditionalGeneration, WhisperFeatureExtractor)

import hf_cases as H
from mmpipe.model.geometry import audio_tokens, image_tokens
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers
from mmpipe.model.hf.media import preprocess_audio, preprocess_image
from mmpipe.runtime.batch import collate_hf

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # fp32, relative to the largest gradient of each tensor


def _padded(samples, key):
    t = max(len(getattr(s, key)) for s in samples)
    fill = 0 if key == "input_ids" else -100
    return torch.tensor([getattr(s, key) + [fill] * (t - len(getattr(s, key))) for s in samples])


def _mask(samples):
    t = max(len(s.input_ids) for s in samples)
    return torch.tensor([[1] * len(s.input_ids) + [0] * (t - len(s.input_ids)) for s in samples])


def _load(cls, folder):
    """The transformers model, with the parameters its modules declare frozen kept frozen
    (from_pretrained in transformers 5.24 loses `requires_grad_(False)`, e.g. on Whisper's and
    Qwen2-Audio's position table; mmpipe keeps what the module declares)."""
    model = cls.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    with torch.device("meta"):
        fresh = cls(model.config)
    frozen = {n for n, p in fresh.named_parameters() if not p.requires_grad}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    return model


def _compare(spec, layers, hf_model, hf_loss, samples, *, packed):
    hf_loss.backward()
    ours = [H.Sample(s.key, s.input_ids, s.labels, [preprocess_image(spec, b) for b in s.images],
                     [preprocess_audio(spec, w, 16000) for w in s.audio]) for s in samples]
    mb = collate_hf(ours, spec=spec, packed=packed, pad_id=0)
    loss = H.our_loss_and_grads(layers, mb)
    assert loss == pytest.approx(hf_loss.item(), rel=LOSS_RTOL)
    worst, count = H.grad_differences(spec, layers, hf_model)
    assert count > 0
    assert worst < GRAD_RTOL, f"largest relative gradient difference {worst:.2e}"
    print(f"\n{spec.name} packed={packed}: loss {loss:.6f} vs {hf_loss.item():.6f} "
          f"(rel {abs(loss - hf_loss.item()) / abs(hf_loss.item()):.1e}); max rel grad diff {worst:.1e} over {count} tensors")


def _llava_samples(spec, rng):
    n = image_tokens(spec.vision, 1, 1)
    imgs = [H.random_image(rng, 40, 60), H.random_image(rng, 28, 28), H.random_image(rng, 90, 33)]
    return [H.sample("a", [H.text(rng, 3), [H.IMAGE] * n, H.text(rng, 5), [H.IMAGE] * n, H.text(rng, 12)],
                     images=imgs[:2]),
            H.sample("b", [H.text(rng, 4), [H.IMAGE] * n, H.text(rng, 9)], images=imgs[2:])]


@pytest.mark.parametrize("case,packings", [("llava_clip_llama", (True,)), ("llava_siglip_qwen2", (True,)),
                                           ("llava_clip_mistral", (True, False))])
def test_llava_layers_equal_transformers(case, packings, request):
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    samples = _llava_samples(spec, np.random.default_rng(0))
    proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    from PIL import Image
    import io
    pixels = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for s in samples for b in s.images],
                  return_tensors="pt")["pixel_values"]
    layers = build_layers(spec, seed=0)
    for packed in packings:
        hf = _load(LlavaForConditionalGeneration, folder)
        out = hf(input_ids=_padded(samples, "input_ids"), attention_mask=_mask(samples), pixel_values=pixels,
                 labels=_padded(samples, "labels"))
        _compare(spec, layers, hf, out.loss, samples, packed=packed)


def test_qwen2_vl_layers_equal_transformers(qwen2_vl):
    """Two images of different sizes in one sample, and a packed micro-batch of two samples."""
    spec = spec_from_folder(qwen2_vl)
    rng = np.random.default_rng(1)
    sizes = [(56, 90), (30, 120), (70, 70)]
    imgs = [H.random_image(rng, h, w) for h, w in sizes]
    n = [image_tokens(spec.vision, h, w) for h, w in sizes]
    assert len(set(n)) > 1

    def img(k):
        return [H.VSTART] + [H.IMAGE] * n[k] + [H.VEND]

    samples = [H.sample("a", [H.text(rng, 4), img(0), H.text(rng, 3), img(1), H.text(rng, 11)], images=imgs[:2]),
               H.sample("b", [H.text(rng, 2), img(2), H.text(rng, 7)], images=imgs[2:])]
    proc = AutoImageProcessor.from_pretrained(qwen2_vl, local_files_only=True)
    from PIL import Image
    import io
    inputs = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs], return_tensors="pt")
    ids = _padded(samples, "input_ids")
    hf = _load(Qwen2VLForConditionalGeneration, qwen2_vl)
    out = hf(input_ids=ids, attention_mask=_mask(samples), pixel_values=inputs["pixel_values"],
             image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == H.IMAGE).int(),
             labels=_padded(samples, "labels"))
    _compare(spec, build_layers(spec, seed=0), hf, out.loss, samples, packed=True)


def test_qwen2_audio_layers_equal_transformers(qwen2_audio):
    """Two clips of different lengths in one sample (and one past the 4-s cut) in a packed batch."""
    spec = spec_from_folder(qwen2_audio)
    rng = np.random.default_rng(2)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (20_800, 46_410, 70_000)]
    n = [audio_tokens(spec.audio, len(c) / 16000) for c in clips]
    samples = [H.sample("a", [H.text(rng, 3), [H.AUDIO] * n[0], H.text(rng, 4), [H.AUDIO] * n[1], H.text(rng, 10)],
                        audio=clips[:2]),
               H.sample("b", [H.text(rng, 2), [H.AUDIO] * n[2], H.text(rng, 6)], audio=clips[2:])]
    fe = WhisperFeatureExtractor.from_pretrained(qwen2_audio, local_files_only=True)
    feats = fe(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    assert [(((l - 1) // 2 + 1) - 2) // 2 + 1 for l in feats["attention_mask"].sum(-1).tolist()] == n
    hf = _load(Qwen2AudioForConditionalGeneration, qwen2_audio)
    out = hf(input_ids=_padded(samples, "input_ids"), attention_mask=_mask(samples),
             input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"],
             labels=_padded(samples, "labels"))
    _compare(spec, build_layers(spec, seed=0), hf, out.loss, samples, packed=True)
