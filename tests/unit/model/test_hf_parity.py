"""Chaining the pipeline layers of a Hugging Face model in one process gives the loss and the
gradients of the transformers model itself, on inputs made by the checkpoint's processors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
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


def test_qwen2_vl_video_layers_equal_transformers(qwen2_vl):
    """Videos and images in one sample, in both orders, a clip of an odd frame count: the pipeline
    layers (one tower pass over images and videos, video embeddings on the video tokens, M-RoPE
    over video tokens) give transformers' loss and gradients, packed and padded. Both sides get
    the same pixel values (the folder's image processor, PIL backend, and its video processor)."""
    from mmpipe.model.geometry import VideoMeta, video_tokens
    from mmpipe.model.hf.media import image_processor
    from mmpipe.model.hf.video import video_processor

    spec = spec_from_folder(qwen2_vl)
    rng = np.random.default_rng(6)
    clips = [(rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8), VideoMeta(frames=n, fps=4.0, height=h, width=w))
             for n, h, w in ((5, 56, 56), (4, 28, 84))]
    imgs = [H.random_image(rng, h, w) for h, w in ((56, 90), (70, 70))]
    ni = [image_tokens(spec.vision, h, w) for h, w in ((56, 90), (70, 70))]
    nv = [video_tokens(spec.vision, m) for _, m in clips]
    assert nv == [12, 6]

    def item(token, n):
        return [H.VSTART] + [token] * n + [H.VEND]

    samples = [H.sample("a", [H.text(rng, 4), item(H.VIDEO, nv[0]), H.text(rng, 3), item(H.IMAGE, ni[0]),
                              H.text(rng, 9)], images=imgs[:1], videos=clips[:1]),
               H.sample("b", [H.text(rng, 2), item(H.IMAGE, ni[1]), H.text(rng, 5), item(H.VIDEO, nv[1]),
                              H.text(rng, 6)], images=imgs[1:], videos=clips[1:])]
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in imgs]
    images = image_processor(spec.hf)(images=pil, return_tensors="pt")
    videos = video_processor(spec.hf)(videos=[f for f, _ in clips], return_tensors="pt")
    assert videos["video_grid_thw"].tolist() == [[3, 4, 4], [2, 2, 6]]  # 5 frames: the last repeated
    ids = H.padded(samples, "input_ids")
    hf = H.load_reference(Qwen2VLForConditionalGeneration, qwen2_vl)
    out = hf(input_ids=ids, attention_mask=H.mask(samples), pixel_values=torch.as_tensor(images["pixel_values"]),
             image_grid_thw=torch.as_tensor(images["image_grid_thw"]),
             pixel_values_videos=videos["pixel_values_videos"], video_grid_thw=videos["video_grid_thw"],
             mm_token_type_ids=(ids == H.IMAGE).int() + 2 * (ids == H.VIDEO).int(), labels=H.padded(samples, "labels"))
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
