"""Chaining the pipeline layers of a Hugging Face model in one process gives the loss and the
gradients of the transformers model itself, on inputs made by the checkpoint's processors."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import (
    LlavaForConditionalGeneration,
    Qwen2AudioForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    WhisperFeatureExtractor,
)

from mmpipe.model.geometry import audio_tokens, image_tokens
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers

from . import hf_cases as H


@pytest.mark.parametrize("case", ["llava_clip_llama", "llava_siglip_qwen2", "llava_clip_mistral"])
def test_llava_layers_equal_transformers(case, request):
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    samples = H.llava_samples(spec, np.random.default_rng(0))
    pixels = H.processed_images(folder, [b for s in samples for b in s.images])["pixel_values"]
    hf = H.load_reference(LlavaForConditionalGeneration, folder)
    out = hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples), pixel_values=pixels,
             labels=H.padded(samples, "labels"))
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


def test_qwen2_vl_layers_equal_transformers(qwen2_vl):
    """Two images of different sizes in one sample; two samples packed in one row, and padded."""
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
    inputs = H.processed_images(qwen2_vl, imgs)
    ids = H.padded(samples, "input_ids")
    hf = H.load_reference(Qwen2VLForConditionalGeneration, qwen2_vl)
    out = hf(input_ids=ids, attention_mask=H.mask(samples), pixel_values=inputs["pixel_values"],
             image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == H.IMAGE).int(),
             labels=H.padded(samples, "labels"))
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


def test_qwen2_audio_layers_equal_transformers(qwen2_audio):
    """Two clips of different lengths in one sample, one past the 4-s cut in another; packed and padded."""
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
    hf = H.load_reference(Qwen2AudioForConditionalGeneration, qwen2_audio)
    out = hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
             input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"],
             labels=H.padded(samples, "labels"))
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


def _qwen_image(n):
    return [H.VSTART] + [H.IMAGE] * n + [H.VEND]


def test_qwen2_5_vl_layers_equal_transformers(qwen2_5_vl):
    """Images spanning several 4x4-patch windows (and one inside a single window) in windowed and
    full-attention blocks; two images in one sample; packed and padded."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    spec = spec_from_folder(qwen2_5_vl)
    rng = np.random.default_rng(3)
    sizes = [(84, 112), (40, 40), (100, 60), (70, 130)]
    imgs = [H.random_image(rng, h, w) for h, w in sizes]
    n = [image_tokens(spec.vision, h, w) for h, w in sizes]
    samples = [H.sample("a", [H.text(rng, 4), _qwen_image(n[0]), H.text(rng, 3), _qwen_image(n[1]), H.text(rng, 11)],
                        images=imgs[:2]),
               H.sample("b", [H.text(rng, 2), _qwen_image(n[2]), H.text(rng, 7)], images=imgs[2:3]),
               H.sample("c", [H.text(rng, 5), H.text(rng, 6)]),
               H.sample("d", [H.text(rng, 1), _qwen_image(n[3]), H.text(rng, 9)], images=imgs[3:])]
    inputs = H.processed_images(qwen2_5_vl, imgs)
    ids = H.padded(samples, "input_ids")
    hf = H.load_reference(Qwen2_5_VLForConditionalGeneration, qwen2_5_vl)
    out = hf(input_ids=ids, attention_mask=H.mask(samples), pixel_values=inputs["pixel_values"],
             image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == H.IMAGE).int(),
             labels=H.padded(samples, "labels"))
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


def omni_samples(spec, rng):
    """Two clips and an image in one sample, a clip alone, text only, an image alone."""
    sizes = [(84, 112), (100, 60)]
    imgs = [H.random_image(rng, h, w) for h, w in sizes]
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (20_800, 46_410, 70_000)]
    ni = [image_tokens(spec.vision, h, w) for h, w in sizes]
    na = [audio_tokens(spec.audio, len(c) / 16000) for c in clips]

    def clip(k):
        return [H.ASTART] + [H.AUDIO] * na[k] + [H.AEND]

    samples = [H.sample("a", [H.text(rng, 3), _qwen_image(ni[0]), H.text(rng, 2), clip(0), clip(1), H.text(rng, 10)],
                        images=imgs[:1], audio=clips[:2]),
               H.sample("b", [H.text(rng, 2), clip(2), H.text(rng, 6)], audio=clips[2:]),
               H.sample("c", [H.text(rng, 4), H.text(rng, 8)]),
               H.sample("d", [H.text(rng, 3), _qwen_image(ni[1]), H.text(rng, 7)], images=imgs[1:])]
    return samples, imgs, clips


def omni_reference_loss(folder, hf, samples, imgs, clips):
    """transformers' thinker on the samples: its own image processor and feature extractor (the
    folder's), its own M-RoPE positions (get_rope_index, from the attention mask)."""
    fe = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
    feats = fe(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    inputs = H.processed_images(folder, imgs)
    return hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
              pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
              input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"],
              labels=H.padded(samples, "labels")).loss


def test_qwen2_5_omni_thinker_layers_equal_transformers(qwen2_5_omni):
    """Images and clips (clips of 2 to 25 chunks of the audio tower's n_window), both in one sample,
    text only; packed and padded."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    spec = spec_from_folder(qwen2_5_omni)
    samples, imgs, clips = omni_samples(spec, np.random.default_rng(4))
    hf = H.load_reference(Qwen2_5OmniThinkerForConditionalGeneration, qwen2_5_omni)
    loss = omni_reference_loss(qwen2_5_omni, hf, samples, imgs, clips)
    H.compare(spec, build_layers(spec, seed=0), hf, loss, samples)
