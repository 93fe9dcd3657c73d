"""Chaining the pipeline layers of a Hugging Face model in one process gives the loss and the
gradients of the transformers model itself, on inputs made by the checkpoint's processors."""

from __future__ import annotations

import io
import itertools
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    Gemma3ForConditionalGeneration,
    InternVLForConditionalGeneration,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    Qwen2AudioForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    WhisperFeatureExtractor,
)

from mmpipe.model.geometry import anyres_image, audio_tokens, image_tokens
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers
from mmpipe.model.spec import LORA_TARGETS, LoraSpec

from . import hf_cases as H

LORA = LoraSpec(r=4, alpha=8.0, target_modules=LORA_TARGETS + ("qkv", "attn.proj", "fc1", "fc2", "out_proj",
                                                                "linear_1", "linear_2"),
                parts=("llm", "vision", "audio"))
"""Adapters on every Linear of the towers, the projectors and the decoder that these names reach."""


def _fill_adapters(named: dict[str, torch.nn.Module]) -> None:
    """Every adapter's A and B drawn from its whole-model module name (B non-zero, so that A's
    gradient is not zero by construction), the same on both sides."""
    with torch.no_grad():
        for name, m in named.items():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            for which in ("lora_A", "lora_B"):
                w = getattr(m, which)["default"].weight
                w.copy_(torch.randn(w.shape, generator=gen) * 0.2)


@pytest.fixture(autouse=True, params=[False, True], ids=["full", "lora"])
def lora_mode(request, monkeypatch):
    """Every comparison also with PEFT's LoRA: transformers' model wrapped by get_peft_model, the
    pipeline layers given the same adapters (mmpipe.model.lora), only the adapters training on
    both sides; the loss and every adapter's gradient (through the towers too) must agree."""
    if not request.param:
        return False
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from mmpipe.model.lora import adapt_layers, trains, whole_name

    load, build = H.load_reference, build_layers

    def peft_reference(cls, folder):
        model = get_peft_model(load(cls, folder), LoraConfig(r=LORA.r, lora_alpha=LORA.alpha,
                                                             target_modules=list(LORA.target_modules)))
        _fill_adapters({n.removeprefix("base_model.model."): m for n, m in model.named_modules()
                        if isinstance(m, LoraLayer)})
        return model

    def adapted_layers(spec, *, seed):
        layers = adapt_layers(build(spec, seed=seed), spec, LORA, seed=seed)
        for layer in layers:
            _fill_adapters({name: layer.get_submodule(local)
                            for local, name in getattr(layer, "lora_modules", {}).items()})
            for n, p in layer.named_parameters():
                p.requires_grad_(trains(layer.name, n, full=False, lora=LORA))
        return layers

    def adapter_grad_differences(spec, layers, hf_model):
        """grad_differences over the adapters: ours by whole-model name against PEFT's."""
        theirs = dict(hf_model.named_parameters())
        worst, count, towers = 0.0, 0, 0
        for layer in layers:
            for local, p in layer.named_parameters():
                if ".lora_" not in local:
                    continue
                want = theirs[f"base_model.model.{whole_name(spec, layer.name, local)}"].grad
                if want is None or not want.any():
                    assert p.grad is None or not p.grad.any(), f"{layer.name}.{local} got a gradient it should not"
                    continue
                assert p.grad is not None, f"{layer.name}.{local}: no gradient"
                worst = max(worst, float((p.grad - want).abs().max()) / max(float(want.abs().max()), 1e-4))
                count += 1
                towers += not layer.name.startswith("llm.")
        assert towers, "no tower adapter got a gradient: the comparison covers the decoder alone"
        return worst, count

    monkeypatch.setattr(H, "load_reference", peft_reference)
    monkeypatch.setattr(H, "grad_differences", adapter_grad_differences)
    monkeypatch.setitem(globals(), "build_layers", adapted_layers)
    return True


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
    the same pixel values (the folder's image processor and its video processor)."""
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


def qwen3_vl_samples(spec, rng):
    """Two images of different sizes in one sample, one in another, and a text-only sample; the
    images' grids differ from the 3 x 3 position table and from each other."""
    sizes = [(56, 90), (30, 120), (100, 40)]
    imgs = [H.random_image(rng, h, w) for h, w in sizes]
    n = [image_tokens(spec.vision, h, w) for h, w in sizes]
    assert len(set(n)) == 3

    def img(k):
        return [H.VSTART] + [H.IMAGE] * n[k] + [H.VEND]

    return [H.sample("a", [H.text(rng, 4), img(0), H.text(rng, 3), img(1), H.text(rng, 11)], images=imgs[:2]),
            H.sample("t", [H.text(rng, 5), H.text(rng, 8)]),
            H.sample("b", [H.text(rng, 2), img(2), H.text(rng, 7)], images=imgs[2:])]


def qwen3_vl_reference(folder, samples):
    """transformers' Qwen3-VL on the samples (padded, its own 3-D positions from get_rope_index)."""
    inputs = H.processed_images(folder, [b for s in samples for b in s.images])
    ids = H.padded(samples, "input_ids")
    hf = H.load_reference(Qwen3VLForConditionalGeneration, folder)
    out = hf(input_ids=ids, attention_mask=H.mask(samples), pixel_values=inputs["pixel_values"],
             image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == H.IMAGE).int(),
             labels=H.padded(samples, "labels"))
    return hf, out.loss


def test_qwen3_vl_layers_equal_transformers(qwen3_vl):
    """DeepStack, learned positions resampled per image, interleaved M-RoPE: three samples (two
    images, text only, one image) packed in one row, and padded."""
    spec = spec_from_folder(qwen3_vl)
    samples = qwen3_vl_samples(spec, np.random.default_rng(1))
    hf, loss = qwen3_vl_reference(qwen3_vl, samples)
    H.compare(spec, build_layers(spec, seed=0), hf, loss, samples)


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


ANYRES = {"llava_next": LlavaNextForConditionalGeneration, "llava_onevision": LlavaOnevisionForConditionalGeneration}


@pytest.mark.parametrize("case", list(ANYRES))
def test_anyres_layers_equal_transformers(case, request):
    """Any-resolution tiles (NeXT: CLIP + Mistral; OneVision: SigLIP + Qwen2): samples of one
    image, of two (OneVision: one tile each, no grid), a text-only one; grids unpadded to the
    image's aspect, OneVision's largest grid shrunk (anyres_max_4); packed into one row and padded."""
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    samples = H.anyres_samples(spec, np.random.default_rng(3))
    v, side = spec.vision, spec.vision.image_size // spec.vision.patch
    images = [(h, w, len(sizes) == 1) for sizes in H.ANYRES_SIZES for h, w in sizes]
    plans = [anyres_image(v, h, w, alone=alone) for h, w, alone in images]
    unshrunk = [anyres_image(replace(v, anyres_max=0), h, w, alone=alone) for h, w, alone in images]
    # the case covers what it claims: grids of several sizes, rows or columns unpadded away, and
    # (OneVision) a shrunk grid and two images without one
    assert len({p.tiles for p in plans}) >= 3
    assert any(p.rows and p.tokens < side * side + p.rows * side * (p.cols * side + 1) for p in unshrunk)
    if case == "llava_onevision":
        assert [p.tiles for p in plans[:2]] == [1, 1]
        assert any(p.tokens < q.tokens for p, q in zip(plans, unshrunk))
    inputs = H.anyres_reference_inputs(folder, samples, nested=case == "llava_onevision")
    hf = H.load_reference(ANYRES[case], folder)
    out = hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
             labels=H.padded(samples, "labels"), **inputs)
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


@pytest.mark.parametrize("case", ["internvl", "internvl_qwen3"])
def test_internvl_layers_equal_transformers(case, request):
    """InternVL's dynamic tiles: samples of two images of different grids, of one large image, of
    none and of three (a lone tile among them); every image's tiles and thumbnail one tower pass
    each, pixel-shuffled; packed into one row and padded. InternVL 3 (Qwen2) and 3.5 (Qwen3, tied)."""
    from mmpipe.model.geometry import image_tiles

    internvl = request.getfixturevalue(case)
    spec = spec_from_folder(internvl)
    samples = H.internvl_samples(spec, np.random.default_rng(6))
    tiles = [image_tiles(spec.vision, h, w) for sizes in H.INTERNVL_SIZES for h, w in sizes]
    assert 1 in tiles and len(set(tiles)) >= 4, tiles  # a lone tile and grids of several sizes
    inputs = H.internvl_pixels(internvl, samples)
    assert list(inputs["num_patches"]) == tiles  # the processor's tiles are the geometry's
    hf = H.load_reference(InternVLForConditionalGeneration, internvl)
    out = hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
             labels=H.padded(samples, "labels"), pixel_values=inputs["pixel_values"])
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


def test_gemma3_layers_equal_transformers(gemma3):
    """Gemma 3: samples of two images, of one, of none and of three; every image one 16-token block,
    bidirectional inside (token_type_ids as Gemma3Processor makes them: the image tokens), longer than the
    sliding window, which the samples are longer than too; sliding and full layers with their own rope
    bases; packed into one row and padded."""
    spec = spec_from_folder(gemma3)
    samples = H.gemma3_samples(spec, np.random.default_rng(7))
    assert spec.vision.pooled and spec.vision.merge == 2 and spec.vision.image_markers == 4
    assert min(len(s.input_ids) for s in samples) > H.GEMMA3_WINDOW
    images = [b for s in samples for b in s.images]
    inputs = H.processed_images(gemma3, images)
    assert inputs["pixel_values"].shape[-2:] == (56, 56)
    ids = H.padded(samples, "input_ids")
    hf = H.load_reference(Gemma3ForConditionalGeneration, gemma3)
    out = hf(input_ids=ids, attention_mask=H.mask(samples), labels=H.padded(samples, "labels"),
             token_type_ids=(ids == H.IMAGE).long(), pixel_values=inputs["pixel_values"])
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


@pytest.mark.parametrize("lora_mode", [False], indirect=True, ids=["full"])
@pytest.mark.parametrize("case", list(ANYRES))
def test_a_micro_batch_without_images_accumulates_transformers_gradients(case, request, lora_mode):
    """A step of two micro-batches, one without any image (as a pipeline step or a replica may
    have): the micro-batch without images gives the projector and image_newline zero gradients
    (not none: every replica's ZeRO-1 buckets then hold them) and the tower nothing but zeros; the
    gradients summed over both micro-batches are transformers' on all the samples at once."""
    from mmpipe.model.hf.media import preprocess_images
    from mmpipe.model.layers import run_layers, token_loss
    from mmpipe.runtime.batch import collate_hf

    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    samples = H.anyres_samples(spec, np.random.default_rng(5))
    hf = H.load_reference(ANYRES[case], folder)
    out = hf(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
             labels=H.padded(samples, "labels"),
             **H.anyres_reference_inputs(folder, samples, nested=case == "llava_onevision"))
    out.loss.backward()
    layers = build_layers(spec, seed=0)
    ours = [H.Sample(s.key, s.input_ids, s.labels, preprocess_images(spec, s.images)) for s in samples]
    text_only = [s for s in ours if not s.images]
    with_images = [s for s in ours if s.images]
    assert text_only and with_images
    mbs = [collate_hf(part, spec=spec, packed=True, pad_id=0) for part in (text_only, with_images)]
    scale = torch.tensor([1.0 / sum(mb.label_tokens for mb in mbs)])
    for k, mb in enumerate(mbs):
        token_loss(run_layers(layers, mb.carrier), (mb.targets, scale)).backward()
        if k == 0:
            for layer in layers:
                if not layer.name.startswith("vision."):
                    continue
                for name, p in layer.named_parameters():
                    assert p.grad is None or not p.grad.any(), f"{layer.name}.{name}"
                    if layer.name == "vision.proj":
                        assert p.grad is not None, f"{layer.name}.{name} got no gradient"
    worst, count = H.grad_differences(spec, layers, hf)
    assert count > 50 and worst < H.GRAD_RTOL, worst


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


def test_onevision_video_layers_equal_transformers(llava_onevision):
    """LLaVA-OneVision videos: every frame a tower pass, each frame's features pooled 2x2 by the
    model's own apply_pooling, one newline per video; clips of 3 to 7 frames beside a tiled image,
    two one-tile images, two clips in one sample and a text-only sample: transformers' loss and
    gradients, packed and padded."""
    from mmpipe.model.geometry import video_segments

    spec = spec_from_folder(llava_onevision)
    samples = H.onevision_video_samples(spec, np.random.default_rng(7))
    side = spec.vision.image_size // spec.vision.patch
    assert [video_segments(spec.vision, m) for _, m in samples[0].videos] == [(5, side * side)]
    hf = H.load_reference(LlavaOnevisionForConditionalGeneration, llava_onevision)
    loss = H.onevision_reference_loss(llava_onevision, hf, samples)
    H.compare(spec, build_layers(spec, seed=0), hf, loss, samples)


# ----------------------------------------------------------------------------- Qwen2.5 video


def _clip(rng, n, h, w, fps, track=0.0):
    """Random frames of a clip, its header figures, and (track seconds > 0) a 16-kHz audio track."""
    from mmpipe.model.geometry import VideoMeta

    frames = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    meta = VideoMeta(frames=n, fps=fps, height=h, width=w, audio_seconds=track, audio_rate=16000 if track else 0)
    wave = (rng.standard_normal(round(track * 16000)) * 0.1).astype(np.float32)
    return (frames, meta, wave) if track else (frames, meta)


def _processed(proc, kind, key, prompt, answer, *, images=(), audio=(), videos=(), tracks=(), **call):
    """One sample through the class's own processor: its ids (placeholders expanded by transformers),
    labels on the answer, its media inputs; `tracks`: the audio slot of each clip (Omni's
    use_audio_in_video: audio_from_video_indices), in token order."""
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    media = dict(images=pil or None, audio=list(audio) or None,
                 videos=[v[0] for v in videos] or None,
                 video_metadata=[{"total_num_frames": v[1].frames, "fps": v[1].fps} for v in videos] or None)
    if tracks:
        media.update(audio_from_video_indices=list(tracks), load_audio_from_video=True)
    out = proc(text=H.words(prompt + answer, kind), return_tensors="pt", **media, **call)
    ids = out["input_ids"][0].tolist()
    own = [a for a, slot in zip(audio, tracks or [None] * len(audio)) if slot is None]
    sample = H.Sample(key, ids, [-100] * (len(ids) - len(answer)) + answer, list(images), own, list(videos))
    return sample, out


def _reference_batch(samples, outs, kind):
    batch = {"input_ids": H.padded(samples, "input_ids"), "attention_mask": H.mask(samples),
             "labels": H.padded(samples, "labels")}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                "video_second_per_grid", "input_features", "feature_attention_mask"):
        parts = [o[key] for o in outs if key in o]
        if parts:
            batch[key] = torch.cat(parts)
    if kind == "qwen2_5_vl":
        ids = batch["input_ids"]
        batch["mm_token_type_ids"] = (ids == H.IMAGE).int() + 2 * (ids == H.VIDEO).int()
    return batch


def test_qwen2_5_vl_video_layers_equal_transformers(qwen2_5_vl):
    """Videos and images in one sample (both orders), two videos in one, a text-only sample: clips of
    4, 6 and 23.976 fps (temporal positions 2, 1.33 and 0.33 apart: tokens_per_second 4 x
    second_per_grid_ts), an odd frame count, frames spanning several 4 x 4-patch windows per temporal
    patch; transformers' Qwen2_5_VLProcessor makes the ids, pixels and second_per_grid_ts; packed
    and padded."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    spec = spec_from_folder(qwen2_5_vl)
    proc = H.qwen25_processor(qwen2_5_vl, "qwen2_5_vl")
    rng = np.random.default_rng(7)
    clips = [_clip(rng, 5, 84, 112, 4.0), _clip(rng, 4, 56, 56, 6.0), _clip(rng, 6, 28, 140, 23.976)]
    imgs = [H.random_image(rng, h, w) for h, w in ((56, 90), (70, 70))]
    v, i = [H.VSTART, H.VIDEO, H.VEND], [H.VSTART, H.IMAGE, H.VEND]
    made = [_processed(proc, "qwen2_5_vl", "a", H.text(rng, 3) + v + H.text(rng, 2) + i, H.text(rng, 6),
                       images=imgs[:1], videos=clips[:1]),
            _processed(proc, "qwen2_5_vl", "t", H.text(rng, 5), H.text(rng, 4)),
            _processed(proc, "qwen2_5_vl", "b", H.text(rng, 2) + i + v + H.text(rng, 1) + v, H.text(rng, 5),
                       images=imgs[1:], videos=clips[1:])]
    samples, outs = [s for s, _ in made], [o for _, o in made]
    assert [float(x) for o in outs if "second_per_grid_ts" in o for x in o["second_per_grid_ts"]] == pytest.approx(
        [0.5, 1 / 3, 2 / 23.976])
    assert any(int(o["video_grid_thw"][0][1]) > 4 for o in outs if "video_grid_thw" in o)  # several windows
    hf = H.load_reference(Qwen2_5_VLForConditionalGeneration, qwen2_5_vl)
    out = hf(**_reference_batch(samples, outs, "qwen2_5_vl"))
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)


@pytest.mark.parametrize("audio_in_video", [False, True])
def test_qwen2_5_omni_video_layers_equal_transformers(qwen2_5_omni, audio_in_video):
    """The Omni thinker with videos beside images, clips and text (its processor forces frames up to
    128 x 28^2 pixels; temporal positions 25 per second of video_second_per_grid). With
    use_audio_in_video each clip's audio track goes through the audio tower and its tokens are
    interleaved with the frames' in 2-s chunks (video, audio, video, audio), a video with its track
    before a standalone clip (the tower takes the track first, in token order): transformers'
    processor makes the ids and features (the tracks given one per slot), its forward the
    positions; packed and padded."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    spec = spec_from_folder(qwen2_5_omni, use_audio_in_video=audio_in_video)
    proc = H.qwen25_processor(qwen2_5_omni, "qwen2_5_omni")
    rng = np.random.default_rng(8)
    track = (lambda s: s) if audio_in_video else (lambda s: 0.0)
    clips = [_clip(rng, 6, 56, 56, 4.0, track(1.5)), _clip(rng, 8, 28, 56, 4.0, track(2.3))]
    imgs = [H.random_image(rng, 70, 70)]
    own = [(rng.standard_normal(20_800) * 0.1).astype(np.float32)]
    v, i, a = [H.VSTART, H.VIDEO, H.VEND], [H.VSTART, H.IMAGE, H.VEND], [H.ASTART, H.AUDIO, H.AEND]
    audio_b = [clips[1][2], own[0]] if audio_in_video else own  # the slots in token order: the track first
    made = [_processed(proc, "qwen2_5_omni", "a", H.text(rng, 3) + v + H.text(rng, 2) + i, H.text(rng, 6),
                       images=imgs, videos=clips[:1], audio=[clips[0][2]] if audio_in_video else (),
                       tracks=[0] if audio_in_video else ()),
            _processed(proc, "qwen2_5_omni", "t", H.text(rng, 5), H.text(rng, 4)),
            _processed(proc, "qwen2_5_omni", "b", H.text(rng, 2) + v + a, H.text(rng, 5), videos=clips[1:],
                       audio=audio_b, tracks=[0, None] if audio_in_video else ())]
    samples, outs = [s for s, _ in made], [o for _, o in made]
    if audio_in_video:  # the layout interleaves (video, audio, video, audio), then the standalone clip
        runs = [k for k, _ in itertools.groupby(samples[2].input_ids) if k in (H.VIDEO, H.AUDIO)]
        assert runs == [H.VIDEO, H.AUDIO, H.VIDEO, H.AUDIO, H.AUDIO], runs
    hf = H.load_reference(Qwen2_5OmniThinkerForConditionalGeneration, qwen2_5_omni)
    out = hf(**_reference_batch(samples, outs, "qwen2_5_omni"), use_audio_in_video=audio_in_video)
    H.compare(spec, build_layers(spec, seed=0), hf, out.loss, samples)
