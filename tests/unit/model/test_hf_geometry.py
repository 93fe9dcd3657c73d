"""The geometry the planner costs (mmpipe.model.geometry) equals what the checkpoints' own
processors and models produce: patch grids, image tokens, valid audio frames, pooled tokens."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlavaProcessor, PreTrainedTokenizerFast, WhisperFeatureExtractor
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmpipe.model.geometry import (
    SampleMeta,
    anyres_image,
    audio_frames,
    audio_positions,
    audio_tokens,
    chunk_positions,
    features,
    image_grid,
    image_positions,
    image_tokens,
    image_windows,
)
from mmpipe.model.hf.arch import spec_from_config, spec_from_folder
from mmpipe.model.hf.media import (
    feature_extractor,
    image_processor,
    preprocess_audio,
    preprocess_image,
    preprocess_images,
)

from . import hf_cases as H
from .test_hf_arch import QWEN2_AUDIO_7B, QWEN2_VL_7B, QWEN2_VL_PROCESSOR, QWEN3_VL_8B, QWEN3_VL_PROCESSOR, WHISPER_FE

SIZES = [(20, 20), (56, 90), (30, 120), (333, 500), (1000, 37), (3, 280), (1080, 1920)]


def _image(h, w):
    return Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("h,w", SIZES)
def test_qwen2_vl_grid_and_tokens_are_the_processors(h, w):
    spec = spec_from_config(QWEN2_VL_7B, name="qwen2-vl-7b", image_processor=QWEN2_VL_PROCESSOR)
    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=1003520)
    out = proc(images=[_image(h, w)], return_tensors="np")
    t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
    assert (t, (gh, gw)) == (1, image_grid(spec.vision, h, w))
    assert out["pixel_values"].shape[0] == image_positions(spec.vision, h, w)  # the tower's sequence
    assert image_tokens(spec.vision, h, w) == t * gh * gw // 4  # what the merger emits, what the processor expands


@pytest.mark.parametrize("h,w", SIZES)
def test_qwen3_vl_grid_and_tokens_are_the_processors(h, w):
    """Qwen3-VL-8B's Hub processor (16-px patches, factor 32, 64 to 16384 tokens) through transformers'
    own image processor: the tower's sequence and the LLM tokens the planner counts, before decoding."""
    from transformers import Qwen2VLImageProcessor

    spec = spec_from_config(QWEN3_VL_8B, name="qwen3-vl-8b", image_processor=QWEN3_VL_PROCESSOR)
    proc = Qwen2VLImageProcessor(**{k: v for k, v in QWEN3_VL_PROCESSOR.items() if k != "image_processor_type"})
    out = proc(images=[_image(h, w)], return_tensors="np")
    t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
    assert (t, (gh, gw)) == (1, image_grid(spec.vision, h, w))
    assert out["pixel_values"].shape == (image_positions(spec.vision, h, w), 3 * 2 * 16 * 16)
    assert image_tokens(spec.vision, h, w) == t * gh * gw // 4 >= 64


def _llava_processor(folder):
    vocab = {f"w{i}": i for i in range(280)} | {"<image>": H.IMAGE, "<pad>": 0}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                  extra_special_tokens={"image_token": "<image>"})
    spec = spec_from_folder(folder)
    return spec, LlavaProcessor(image_processor=image_processor(spec.hf), tokenizer=tok, patch_size=spec.vision.patch,
                                vision_feature_select_strategy=spec.vision.select,
                                num_additional_image_tokens=int(spec.vision.cls_token))


@pytest.mark.parametrize("case", ["llava_clip_llama", "llava_siglip_qwen2"])
def test_llava_image_tokens_are_the_processors(case, request):
    """CLIP with `default` (the class token dropped) and SigLIP with `full`."""
    spec, proc = _llava_processor(request.getfixturevalue(case))
    for h, w in SIZES[:4]:
        out = proc(images=[_image(h, w)], text=["w2 <image> w3"], return_tensors="pt")
        assert int((out["input_ids"] == H.IMAGE).sum()) == image_tokens(spec.vision, h, w)
        assert tuple(out["pixel_values"].shape[-2:]) == (spec.vision.image_size,) * 2


def test_qwen2_audio_frames_positions_tokens_are_the_models():
    """Clips up to and past the 30-s cut, through the real Whisper feature extractor and
    Qwen2-Audio's own length rule."""
    spec = spec_from_config(QWEN2_AUDIO_7B, name="qwen2-audio-7b", feature_extractor=WHISPER_FE)
    fe = WhisperFeatureExtractor(feature_size=128)
    lengths = [1, 159, 161, 1600, 19_745, 16000 * 30 - 1, 16000 * 30, 16000 * 31]
    clips = [np.zeros(n, dtype=np.float32) for n in lengths]
    mask = fe(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True,
              return_tensors="pt")["attention_mask"]
    frames = mask.sum(-1)
    conv, pooled = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, frames)
    for n, f, c, p in zip(lengths, frames.tolist(), conv.tolist(), pooled.tolist()):
        seconds = n / 16000
        assert (audio_frames(spec.audio, seconds), audio_positions(spec.audio, seconds),
                audio_tokens(spec.audio, seconds)) == (f, c, p), n
    assert features(spec, SampleMeta(text_tokens=0, audio_seconds=(45.0,))).audio_positions == (1500,)


def test_audio_features_equal_the_processors_30_s_features(qwen2_audio):
    """preprocess_audio pads a clip only to just past the frames its positions read; those
    frames are the numbers the processor's 30-s padding gives (here 4-s chunks)."""
    spec = spec_from_folder(qwen2_audio)
    fe = WhisperFeatureExtractor.from_pretrained(qwen2_audio, local_files_only=True)
    rng = np.random.default_rng(3)
    for n in (800, 16_001, 33_333, 63_999, 64_000, 90_000):
        clip = rng.standard_normal(n).astype(np.float32)
        ours = preprocess_audio(spec, clip, 16000)
        full = fe(clip, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="np")
        assert ours.frames == int(full["attention_mask"].sum())
        want = full["input_features"][0][:, :ours.features.shape[1]]
        np.testing.assert_allclose(ours.features, want, rtol=0, atol=1e-6)
        assert ours.features.shape[1] == min(2 * ((ours.frames - 1) // 2 + 1) + 1, 400)


def test_preprocessed_images_are_the_processors_arrays(qwen2_vl, llava_clip_llama):
    rng = np.random.default_rng(5)
    for folder in (qwen2_vl, llava_clip_llama):
        spec = spec_from_folder(folder)
        img = H.random_image(rng, 61, 97)
        ours = preprocess_image(spec, img)
        theirs = H.processed_images(folder, [img])
        pixels = theirs["pixel_values"].numpy()
        np.testing.assert_array_equal(ours.pixels, pixels if "image_grid_thw" in theirs else pixels[0])
        if "image_grid_thw" in theirs:
            assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())


def test_mrope_positions_are_get_rope_index(qwen2_vl):
    """Qwen2-VL's 3-D positions of a sample equal transformers' own get_rope_index."""
    from mmpipe.model.hf.positions import mrope_positions
    from mmpipe.model.hf.skeleton import skeleton

    spec = spec_from_folder(qwen2_vl)
    model = skeleton(spec.hf).model  # get_rope_index needs no weights
    rng = np.random.default_rng(9)
    grids = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]
    for images in ([], [0], [1, 2], [2, 0, 1]):
        ids = H.text(rng, 3)
        for k in images:
            t, h, w = grids[k]
            ids += [H.VSTART] + [H.IMAGE] * (t * h * w // 4) + [H.VEND] + H.text(rng, int(rng.integers(1, 5)))
        ours = mrope_positions(ids, [grids[k] for k in images], image_token=H.IMAGE, merge=2)
        x = torch.tensor([ids])
        theirs, _ = model.get_rope_index(x, mm_token_type_ids=(x == H.IMAGE).int(),
                                         image_grid_thw=torch.tensor([grids[k] for k in images]) if images else None)
        assert np.array_equal(ours, theirs[:, 0].numpy()), images


# ----------------------------------------------------------------------------- any-resolution tiles


ANYRES_PRESETS = ("llava-next-mistral-7b", "llava-onevision-qwen2-7b")


def _anyres_sizes(v, n: int = 400) -> list[tuple[int, int]]:
    """Image sizes: log-uniform sides from 1 to 5000 px (aspect ratios to 1:5000), the pinpoints
    and one pixel either side of them, and sizes where the unpadded height or width is x.5 before
    rounding (where a floor, a ceil or a missing round(..., 7) would differ)."""
    rng = np.random.default_rng(7)
    sizes = {tuple(int(x) for x in np.exp(rng.uniform(0, np.log(5000), 2))) for _ in range(n)}
    for h, w in v.grid_pinpoints:
        sizes |= {(h + dh, w + dw) for dh in (-1, 0, 1) for dw in (-1, 0, 1)}
    halves = [(h, w) for h in range(3, 400, 7) for w in range(3, 400, 11)
              if any(abs((h * f / w) % 1 - 0.5) < 1e-9 or abs((w * f / h) % 1 - 0.5) < 1e-9
                     for f in range(v.image_size // v.patch, 7 * v.image_size // v.patch))]
    return sorted(sizes | set(halves[:60]))


def _anyres_processor(spec, images=None):
    """transformers' own processor object of the model (LlavaNextProcessor / LlavaOnevisionProcessor)
    around `images` (an image processor; default: the spec's), with the settings the model's
    processor_config.json holds."""
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor

    vocab = {f"w{i}": i for i in range(280)} | {"<image>": H.IMAGE, "<video>": 294, "<pad>": 0}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                  extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})
    v = spec.vision
    if v.anyres_single:
        from transformers import LlavaOnevisionVideoProcessor

        return LlavaOnevisionProcessor(image_processor=images or image_processor(spec.hf), tokenizer=tok,
                                       video_processor=LlavaOnevisionVideoProcessor(),
                                       num_image_tokens=(v.image_size // v.patch) ** 2,
                                       vision_feature_select_strategy=v.select,
                                       vision_aspect_ratio=f"anyres_max_{v.anyres_max}")
    return LlavaNextProcessor(image_processor=images or image_processor(spec.hf), tokenizer=tok, patch_size=v.patch,
                              vision_feature_select_strategy=v.select, num_additional_image_tokens=int(v.cls_token))


def _model_features(spec, sizes) -> tuple[list[int], list[int]]:
    """Tiles (transformers' image_size_to_num_patches) and LLM tokens (the length of its model's own
    pack_image_features output, on features of width 1) of lone images of each size."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    from mmpipe.model.hf.skeleton import skeleton

    v = spec.vision
    config = json.loads(spec.hf.config)
    pins = [list(p) for p in config["image_grid_pinpoints"]]
    tiles = [image_size_to_num_patches(list(hw), pins, config["vision_config"]["image_size"]) for hw in sizes]
    model = skeleton(spec.hf).model
    feats = [torch.zeros(t, (v.image_size // v.patch) ** 2, 1) for t in tiles]
    newline = torch.zeros(1)
    kwargs = {"vision_aspect_ratio": config["vision_aspect_ratio"]} if v.anyres_single else \
        {"vision_feature_select_strategy": v.select}
    _, lengths = model.pack_image_features(feats, torch.tensor(sizes), image_newline=newline, **kwargs)
    return tiles, lengths.tolist()


@pytest.mark.parametrize("name", ANYRES_PRESETS)
def test_anyres_tiles_and_tokens_are_transformers(name):
    """For 500-odd sizes of a lone image, the geometry's tower passes equal the model's tile count,
    its LLM tokens the processor's placeholder count and the length of the features the model
    packs (unpadding, newline rows, OneVision's anyres_max_9 shrink)."""
    from .test_hf_arch import _preset

    spec = _preset(name)
    v = spec.vision
    proc = _anyres_processor(spec)
    sizes = _anyres_sizes(v)
    expected = proc._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [anyres_image(v, h, w).tokens for h, w in sizes] == expected
    tiles, lengths = _model_features(spec, sizes)
    assert [anyres_image(v, h, w).tiles for h, w in sizes] == tiles
    assert [anyres_image(v, h, w).tokens for h, w in sizes] == lengths
    # the sweep covers what it claims: many grids, grids unpadded down to one row or none, and
    # (OneVision) many shrunk by anyres_max_9
    side = v.image_size // v.patch
    assert len(sizes) > 450 and len(set(tiles)) >= (5 if v.anyres_max else 3)
    plans = [anyres_image(v, h, w) for h, w in sizes]
    assert any(p.tokens <= side * side + p.cols * side + 1 for p in plans)
    if v.anyres_max:
        unshrunk = replace(v, anyres_max=0)
        assert sum(anyres_image(v, h, w).tokens < anyres_image(unshrunk, h, w).tokens for h, w in sizes) > 100
    # the planner prices each tile as a tower pass of its own
    f = features(spec, SampleMeta(text_tokens=5, images=((1080, 1920), (300, 400))))
    assert f.image_tokens == tuple(anyres_image(v, h, w, alone=False).tokens for h, w in ((1080, 1920), (300, 400)))
    passes = [anyres_image(v, h, w, alone=False).tiles for h, w in ((1080, 1920), (300, 400))]
    assert f.image_positions == (image_positions(v, 1, 1),) * sum(passes)
    assert image_positions(v, 1, 1) == (v.image_size // v.patch) ** 2 + int(v.cls_token)


@pytest.mark.parametrize("case", ["llava_next", "llava_onevision"])
def test_anyres_pixels_and_placeholders_are_the_processors(case, request):
    """transformers' processor object around the folder's image processor as AutoImageProcessor
    loads it, called as apply_chat_template calls it (one conversation's images, nested for
    OneVision): its placeholder count per image is the geometry's, and
    preprocess_images gives its pixel values, tile for tile, for lone images and for a sample of
    three (OneVision: one padded tile each)."""
    from transformers import AutoImageProcessor

    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    v = spec.vision
    images = AutoImageProcessor.from_pretrained(folder, local_files_only=True)  # as a user loads it
    assert type(images).__name__ == ("LlavaOnevisionImageProcessor" if v.anyres_single else "LlavaNextImageProcessor")
    proc = _anyres_processor(spec, images)
    rng = np.random.default_rng(11)
    samples = [[(40, 60)], [(200, 31)], [(16, 18)], [(130, 197)], [(40, 60), (90, 33), (120, 200)]]
    for sizes in samples:
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        out = proc(text=[" w5 ".join(["<image>"] * len(imgs))], images=[imgs] if v.anyres_single else imgs,
                   return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        runs = [len(list(g)) for k, g in itertools.groupby(ids) if k == H.IMAGE]
        assert runs == [anyres_image(v, h, w, alone=len(sizes) == 1).tokens for h, w in sizes], sizes
        ours = preprocess_images(spec, imgs)
        for i, img in enumerate(ours):
            np.testing.assert_array_equal(img.pixels, out["pixel_values"][i][:img.grid[0]].numpy())
            assert img.grid[3:] == tuple(out["image_sizes"][i].tolist())
            assert not out["pixel_values"][i][img.grid[0]:].any()  # past its own tiles, only the batch's padding


# ----------------------------------------------------------------------------- InternVL


def _internvl_processor(spec, images=None):
    """transformers' own InternVLProcessor around `images` (an image processor; default: the spec's),
    with a word-level tokenizer whose <img>, </img> and <IMG_CONTEXT> are VSTART, VEND and IMAGE."""
    from transformers import InternVLProcessor, InternVLVideoProcessor

    names = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    vocab = {f"w{i}": i for i in range(280)} | {"<img>": H.VSTART, "</img>": H.VEND, "<IMG_CONTEXT>": H.IMAGE,
                                                "<video>": H.VIDEO, "<pad>": 0}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", extra_special_tokens=names)
    side = spec.vision.image_size // spec.vision.patch // spec.vision.merge
    return InternVLProcessor(image_processor=images or image_processor(spec.hf), tokenizer=tok,
                             video_processor=InternVLVideoProcessor(), image_seq_length=side * side)


def test_internvl_tiles_and_tokens_are_the_processors(internvl):
    """For 500-odd sizes, under the 8B preset (448-px tiles, 1..12) and the tiny folder (28-px tiles,
    1..6): the geometry's tower passes are the image processor's tiles and its LLM tokens, with the
    <img> and </img> around them, InternVLProcessor's placeholder count; the planner prices each tile
    as a tower pass of the class token and its patches."""
    from mmpipe.model.geometry import image_tiles

    from .test_hf_arch import _preset

    rng = np.random.default_rng(8)
    for spec in (_preset("internvl3-8b"), spec_from_folder(internvl)):
        v = spec.vision
        sizes = sorted({tuple(int(x) for x in np.exp(rng.uniform(0, np.log(5000), 2))) for _ in range(500)}
                       | {(v.image_size * r, v.image_size * c) for r in range(1, 5) for c in range(1, 5)})
        counts = _internvl_processor(spec)._get_num_multimodal_tokens(image_sizes=sizes)
        assert [image_tiles(v, h, w) for h, w in sizes] == counts["num_image_patches"]
        assert [image_tokens(v, h, w) + 2 for h, w in sizes] == counts["num_image_tokens"]
        assert len(set(counts["num_image_patches"])) >= 6  # many grids, the lone tile among them
        f = features(spec, SampleMeta(text_tokens=5, images=((1080, 1920), (300, 400))))
        side = v.image_size // v.patch
        assert f.image_positions == (side * side + 1,) * sum(image_tiles(v, h, w) for h, w in ((1080, 1920),
                                                                                               (300, 400)))
        assert f.image_tokens == tuple(image_tiles(v, h, w) * side * side // 4 for h, w in ((1080, 1920),
                                                                                           (300, 400)))


def test_internvl_pixels_and_placeholders_are_the_processors(internvl):
    """InternVLProcessor around the folder's image processor as AutoImageProcessor loads it: each
    image's run of <IMG_CONTEXT> tokens is the geometry's count between <img> and </img>, and
    preprocess_images gives its pixel values, tile for tile."""
    from transformers import AutoImageProcessor

    spec = spec_from_folder(internvl)
    v = spec.vision
    images = AutoImageProcessor.from_pretrained(internvl, local_files_only=True)  # as a user loads it
    proc = _internvl_processor(spec, images)
    rng = np.random.default_rng(12)
    for sizes in ([(40, 60)], [(200, 31)], [(16, 18)], [(130, 197)], [(40, 60), (90, 33), (120, 200)]):
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        out = proc(text=[" w5 ".join(["<IMG_CONTEXT>"] * len(imgs))], images=imgs, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        runs = [len(list(g)) for k, g in itertools.groupby(ids) if k == H.IMAGE]
        assert runs == [image_tokens(v, h, w) for h, w in sizes], sizes
        assert ids.count(H.VSTART) == ids.count(H.VEND) == len(sizes)
        ours = np.concatenate([img.pixels for img in preprocess_images(spec, imgs)])
        np.testing.assert_array_equal(ours, out["pixel_values"].numpy())


# ----------------------------------------------------------------------------- Gemma 3


def _gemma3_processor(folder):
    """transformers' own Gemma3Processor around the folder's image processor (as AutoImageProcessor loads
    it) and the demo's Gemma tokenizer ("\\n\\n" one token, as Gemma's), its image tokens the folder's."""
    from transformers import AutoImageProcessor, Gemma3Processor

    from mmpipe.model.hf.demo_kit import gemma_tokenizer

    tok = gemma_tokenizer(["hello world, what is it", "\n\n"])
    config = json.loads((folder / "config.json").read_text())  # the processor's ids are the tokenizer's
    return Gemma3Processor(image_processor=AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                           tokenizer=tok, image_seq_length=config["mm_tokens_per_image"]), tok


def test_gemma3_tokens_pixels_and_blocks_are_the_processors(gemma3):
    """Gemma3Processor (pan-and-scan off, its default): every image, whatever its size, is one tower pass of
    the fixed side and image_seq_length image tokens, the geometry's count (the 12B preset's 256 too), with
    the four text tokens "\\n\\n" <start_of_image> ... <end_of_image> "\\n\\n" around them
    (VisionSpec.image_markers); its token_type_ids are the image tokens, the blocks mmpipe finds; and
    preprocess_images gives its pixel values."""
    from mmpipe.model.hf.families.gemma3 import image_blocks
    from mmpipe.model.hf.media import preprocess_images

    from .test_hf_arch import _preset

    preset = _preset("gemma3-12b").vision
    assert {image_tokens(preset, h, w) for h, w in ((16, 18), (896, 896), (1080, 1920), (4000, 300))} == {256}
    spec = spec_from_folder(gemma3)
    v = spec.vision
    proc, tok = _gemma3_processor(gemma3)
    sizes = [(40, 60), (200, 31), (16, 18), (130, 197)]
    counts = proc._get_num_multimodal_tokens(image_sizes=sizes)
    assert counts["num_image_tokens"] == [image_tokens(v, h, w) for h, w in sizes] == [16] * 4
    assert counts["num_image_patches"] == [1] * 4
    rng = np.random.default_rng(13)
    for group in ([(40, 60)], [(200, 31), (16, 18), (130, 197)]):
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in group]
        text = "hello" + "world".join([tok.boi_token] * len(imgs)) + "what is it"
        out = proc(text=[text], images=imgs, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        runs = [len(list(g)) for k, g in itertools.groupby(ids) if k == tok.image_token_id]
        assert runs == [image_tokens(v, h, w) for h, w in group]
        plain = tok(text.replace(tok.boi_token, ""))["input_ids"]
        assert len(ids) == len(plain) + sum(image_tokens(v, h, w) + v.image_markers for h, w in group)
        types = out["token_type_ids"][0]
        assert torch.equal(types.bool(), out["input_ids"][0] == tok.image_token_id)
        blocks = image_blocks(out["input_ids"], tok.image_token_id)[0]
        assert sorted(set(blocks.tolist()) - {-1}) == list(range(len(group)))
        ours = np.stack([img.pixels for img in preprocess_images(spec, imgs)])
        np.testing.assert_array_equal(ours, out["pixel_values"].numpy())


# ----------------------------------------------------------------------------- Qwen2.5-VL and Qwen2.5-Omni


def _omni_7b():
    from .test_hf_arch import OMNI_FE, QWEN25_OMNI_7B, QWEN25_PROCESSOR

    return spec_from_config(QWEN25_OMNI_7B, name="omni", image_processor=QWEN25_PROCESSOR, feature_extractor=OMNI_FE)


def test_qwen25_windows_are_transformers_window_index():
    """The windows the planner prices for a windowed block are the segments transformers' own
    get_vision_window_index cuts an image into (112-px windows: 8 x 8 patches)."""
    from transformers.vision_utils import get_vision_window_index

    v = _omni_7b().vision
    for h, w in SIZES:
        t, gh, gw = 1, *image_grid(v, h, w)
        _, cu = get_vision_window_index(torch.tensor([[t, gh, gw]]), spatial_merge_size=2, window_size=112,
                                        patch_size=14)
        assert list(np.diff(cu.numpy())) == list(image_windows(v, h, w)), (h, w)
    assert len(image_windows(v, 1080, 1920)) > 1 and image_windows(v, 100, 100) == (image_positions(v, 100, 100),)


def test_omni_audio_chunks_are_transformers_chunks():
    """Chunk positions of clips (model/geometry.py: chunk_positions) are the attention segments
    transformers' Qwen2.5-Omni audio tower makes of their valid frames."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import chunk_and_pad_features, get_audio_cu_seqlens

    frames = [1, 2, 199, 200, 201, 999, 30000]
    _, chunk_lengths = chunk_and_pad_features(torch.zeros(128, sum(frames)), torch.tensor(frames), 100)
    ours = [n for f in frames for n in chunk_positions(f, window=100, conv_stride=2)]
    assert list(np.diff(get_audio_cu_seqlens(chunk_lengths).numpy())) == ours


def _omni_processor(spec):
    """transformers' own Qwen2.5-Omni processor around the 7B preset's image processor and feature
    extractor (and a word-level tokenizer holding its placeholder tokens)."""
    from transformers import Qwen2_5OmniProcessor, Qwen2VLVideoProcessor

    named = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
             "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
             "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    vocab = {f"w{i}": i for i in range(20)} | {t: 20 + i for i, t in enumerate(named.values())} | {"<pad>": 40}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", extra_special_tokens=named)
    return Qwen2_5OmniProcessor(image_processor=image_processor(spec.hf), video_processor=Qwen2VLVideoProcessor(),
                                feature_extractor=feature_extractor(spec.hf), tokenizer=tok), tok


def test_omni_tokens_are_its_processors():
    """Qwen2_5OmniProcessor itself (not only its parts): image tokens and grids of images above and
    below 128 * 28^2 pixels (the minimum it forces on video frames is not applied to images: images
    follow the image processor's own min_pixels), audio tokens and valid frames of clips up to and
    past its 300-s cut."""
    spec = _omni_7b()
    proc, tok = _omni_processor(spec)
    for h, w in SIZES:
        out = proc(text=["w2 <|IMAGE|> w3"], images=[_image(h, w)], return_tensors="np")
        assert int((out["input_ids"] == tok.image_token_id).sum()) == image_tokens(spec.vision, h, w), (h, w)
        assert tuple(out["image_grid_thw"][0][1:]) == image_grid(spec.vision, h, w)
    assert image_grid(spec.vision, 20, 20) == (4, 4)  # 56 x 56 = 4 * 28^2 pixels, not 128 * 28^2
    lengths = [1, 161, 19_745, 16000 * 301]
    out = proc(text=["w2 <|AUDIO|> w3 <|AUDIO|> w4 <|AUDIO|> <|AUDIO|>"],
               audio=[np.zeros(n, np.float32) for n in lengths], return_tensors="np")
    assert int((out["input_ids"] == tok.audio_token_id).sum()) == sum(audio_tokens(spec.audio, n / 16000)
                                                                     for n in lengths)
    assert out["feature_attention_mask"].sum(-1).tolist() == [audio_frames(spec.audio, n / 16000) for n in lengths]


def test_omni_audio_features_are_the_processors(qwen2_5_omni):
    """The Omni tower reads every valid frame: preprocess_audio keeps them all, the same numbers
    as the feature extractor's padding to its full length gives."""
    spec = spec_from_folder(qwen2_5_omni)
    fe = WhisperFeatureExtractor.from_pretrained(qwen2_5_omni, local_files_only=True)
    rng = np.random.default_rng(4)
    for n in (800, 33_333, 63_999, 90_000):
        clip = rng.standard_normal(n).astype(np.float32)
        ours = preprocess_audio(spec, clip, 16000)
        full = fe(clip, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="np")
        assert ours.features.shape[1] == ours.frames == int(full["attention_mask"].sum())
        np.testing.assert_allclose(ours.features, full["input_features"][0][:, :ours.frames], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen2_5_omni"])
def test_mrope_positions_are_the_classes_get_rope_index(case, request):
    """Qwen2.5-VL's and Qwen2.5-Omni's 3-D positions of samples with images (and Omni's clips
    framed by <|audio_bos|>/<|audio_eos|>, which advance one position per token) equal each class's
    own get_rope_index."""
    from mmpipe.model.hf.positions import mrope_positions
    from mmpipe.model.hf.skeleton import skeleton

    spec = spec_from_folder(request.getfixturevalue(case))
    model = skeleton(spec.hf).model
    rng = np.random.default_rng(9)
    grids = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]
    clips = [50, 333]  # mel frames
    for images, audio in (([], [0]), ([0], []), ([1, 2], [1, 0]), ([2, 0, 1], [1])):
        ids, order = H.text(rng, 3), []
        for k in images:
            t, h, w = grids[k]
            ids += [H.VSTART] + [H.IMAGE] * (t * h * w // 4) + [H.VEND] + H.text(rng, int(rng.integers(1, 5)))
        if spec.audio is not None:
            for k in audio:
                p = (clips[k] - 1) // 2 + 1
                ids += [H.ASTART] + [H.AUDIO] * ((p - 2) // 2 + 1) + [H.AEND] + H.text(rng, 2)
                order.append(clips[k])
        ours = mrope_positions(ids, [grids[k] for k in images], image_token=H.IMAGE, merge=2)
        x = torch.tensor([ids])
        grid = torch.tensor([grids[k] for k in images]) if images else None
        if case == "qwen2_5_vl":
            theirs, _ = model.get_rope_index(x, mm_token_type_ids=(x == H.IMAGE).int(), image_grid_thw=grid)
        else:
            theirs, _ = model.get_rope_index(x, image_grid_thw=grid, attention_mask=torch.ones_like(x),
                                             audio_seqlens=torch.tensor(order) if order else None)
        assert np.array_equal(ours, theirs[:, 0].numpy()), (images, audio)
