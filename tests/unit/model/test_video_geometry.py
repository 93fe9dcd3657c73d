"""Video geometry (mmpipe.model.geometry) is Qwen2-VL's video processor's: the frames it samples, the
size it resizes them to, its temporal padding and grid, over many clip lengths, rates and sizes
and every frame rule of its config; its pixel values are the documented math; the 3-D positions
of video tokens are transformers' get_rope_index's."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from transformers import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from mmpipe.model.geometry import VideoMeta, video_frame_indices, video_grid, video_tokens
from mmpipe.model.hf.video import video_spec
from mmpipe.model.spec import VisionSpec

from . import hf_cases as H

CONFIGS = {  # name: the video processor's settings (as a folder's video_preprocessor_config.json has them)
    "defaults": {},  # every frame, 128 * 28^2 .. 768 * 28^2 pixels
    "fps": {"do_sample_frames": True, "fps": 2.0, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16},
    "fps-odd": {"do_sample_frames": True, "fps": 0.7, "min_frames": 3, "max_frames": 9, "min_pixels": 28 * 28 * 2,
                "max_pixels": 28 * 28 * 40},
    "count": {"do_sample_frames": True, "num_frames": 7, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 9},
    # 48 of 208 or 392 frames: torch.arange's float32 steps truncate to other indices than float64 ones
    "count-48": {"do_sample_frames": True, "num_frames": 48, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4},
    "capped": {"cap_pixels_per_frame": True, "max_video_tokens": 40, "min_pixels": 28 * 28 * 2,
               "max_pixels": 28 * 28 * 64},
}
CLIPS = [(n, fps) for n in (1, 2, 3, 4, 5, 7, 8, 9, 16, 25, 31, 48, 100, 208, 301, 392, 1800)
         for fps in (1.0, 2.5, 8.0, 23.976, 30.0, 60.0)]
SIZES = [(48, 64), (28, 28), (360, 640), (17, 300), (1080, 1920)]


def _vision(proc) -> VisionSpec:
    video = video_spec(proc, patch=14, merge=2, temporal=2, what="test")
    return VisionSpec(blocks=1, hidden=8, mlp=16, heads=1, patch=14, merge=2, resize="smart", min_pixels=28 * 28 * 4,
                      max_pixels=28 * 28 * 16, temporal_patch=2, proj=(16,), video=video)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sampled_frames_are_the_processors(config):
    proc = Qwen2VLVideoProcessor(**CONFIGS[config])
    v = _vision(proc)
    for frames, fps in CLIPS:
        meta = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)
        try:
            theirs = proc.sample_frames(meta, **{k: getattr(proc, k) for k in ("fps", "num_frames")}).tolist() \
                if proc.do_sample_frames else list(range(frames))
        except (ValueError, ZeroDivisionError):
            theirs = None  # transformers cannot sample this clip
        if theirs is None or not theirs:
            with pytest.raises(ValueError):
                video_frame_indices(v.video, frames, fps)
        else:
            assert list(video_frame_indices(v.video, frames, fps)) == theirs, (config, frames, fps)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grids_and_tokens_are_the_processors(config):
    """The processor run on zero frames of each clip's size: its video_grid_thw and its pixel rows
    are the geometry's grid and encoder positions; tokens = t * h * w / merge^2."""
    proc = Qwen2VLVideoProcessor(**CONFIGS[config])
    v = _vision(proc)
    cases = [(n, fps, h, w) for (n, fps), (h, w) in itertools.product(CLIPS[::7], SIZES)]
    checked = 0
    for n, fps, h, w in cases:
        try:
            indices = video_frame_indices(v.video, n, fps)
        except ValueError:
            continue
        if len(indices) * max(h * w, v.video.min_pixels) > 1_000_000:
            continue  # resizing many large frames is slow and adds nothing
        meta = VideoMeta(frames=n, fps=fps, height=h, width=w)
        frames = np.zeros((len(indices), h, w, 3), np.uint8)
        out = proc(videos=[frames], do_sample_frames=False, cap_pixels_per_frame=bool(proc.cap_pixels_per_frame),
                   return_tensors="pt")
        grid = tuple(out["video_grid_thw"][0].tolist())
        assert video_grid(v, meta) == grid, (config, n, fps, h, w)
        assert out["pixel_values_videos"].shape[0] == math.prod(grid)
        assert video_tokens(v, meta) == math.prod(grid) // 4
        checked += 1
    assert checked >= 10


def test_an_odd_frame_count_is_padded_to_whole_temporal_patches():
    proc = Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)  # every frame
    v = _vision(proc)
    for n in (1, 3, 5, 9):
        assert video_grid(v, VideoMeta(frames=n, fps=8.0, height=56, width=56)) == ((n + 1) // 2, 4, 4)


UNRESIZED = {  # model: clips (frames, height, width) that its processor call does not resize
    "qwen2_vl": ((3, 56, 84), (4, 28, 56)),
    "qwen2_5_vl": ((3, 56, 84), (4, 28, 56)),
    "qwen2_5_omni": ((3, 308, 336),),  # the Omni processor's forced minimum is 128 x 28^2 pixels
}


@pytest.mark.parametrize("kind", sorted(UNRESIZED))
def test_unresized_frames_become_the_documented_pixel_values(kind):
    """Frames whose size smart_resize keeps (sides multiples of 28, area in bounds) reach the model
    as the processor's documented math gives them, computed here without the processor: x / 255,
    then (x - CLIP mean) / CLIP std per channel, an odd count padded with the last frame, and
    patches ordered (temporal patch, row block, col block, row in block, col in block), each
    flattened as (channel, frame in patch, patch row, patch col)."""
    from mmpipe.model.hf.arch import spec_from_config

    vp = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}
    if kind == "qwen2_vl":
        spec = spec_from_config(H.qwen2_vl_config(), name="qwen2-vl-video",
                                video_processor={"video_processor_type": "Qwen2VLVideoProcessor", **vp})
    else:
        spec = _qwen25_spec(kind, vp)
    from mmpipe.model.hf.video import preprocess_video

    rng = np.random.default_rng(3)
    mean = np.array([0.48145466, 0.4578275, 0.40821073])
    std = np.array([0.26862954, 0.26130258, 0.27577711])
    for n, h, w in UNRESIZED[kind]:
        frames = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
        meta = VideoMeta(frames=n, fps=4.0, height=h, width=w)
        ours = preprocess_video(spec, frames, meta, tuple(range(n)))
        x = (frames / 255.0 - mean) / std  # [n, h, w, C]
        if n % 2:
            x = np.concatenate([x, x[-1:]])
        t, gh, gw = len(x) // 2, h // 14, w // 14
        x = x.reshape(t, 2, gh // 2, 2, 14, gw // 2, 2, 14, 3)  # (t, T, hb, hm, p, wb, wm, p, C)
        want = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(t * gh * gw, 3 * 2 * 14 * 14)
        assert ours.grid == (t, gh, gw)
        np.testing.assert_allclose(ours.pixels, want, rtol=0, atol=2e-6)


def test_video_positions_are_get_rope_index(qwen2_vl):
    """Text, images and videos in any order: M-RoPE positions as transformers' get_rope_index gives
    them (a video's temporal index runs over its temporal patches)."""
    from mmpipe.model.hf.arch import spec_from_folder
    from mmpipe.model.hf.positions import mrope_positions
    from mmpipe.model.hf.skeleton import skeleton

    spec = spec_from_folder(qwen2_vl)
    model = skeleton(spec.hf).model
    video = H.VIDEO
    rng = np.random.default_rng(4)
    image_grids, video_grids = [(1, 4, 6), (1, 2, 2)], [(3, 4, 4), (1, 2, 6), (5, 2, 2)]
    for order in (["v"], ["i", "v"], ["v", "i", "v"], ["v", "v", "i", "i"]):
        ids = H.text(rng, 3)
        imgs, vids = iter(image_grids), iter(video_grids)
        used = {"i": [], "v": []}
        for k in order:
            g = next(imgs if k == "i" else vids)
            used[k].append(g)
            token = H.IMAGE if k == "i" else video
            ids += [H.VSTART] + [token] * (math.prod(g) // 4) + [H.VEND] + H.text(rng, int(rng.integers(1, 4)))
        ours = mrope_positions(ids, used["i"], image_token=H.IMAGE, merge=2, video_token=video,
                               video_grids=used["v"])
        x = torch.tensor([ids])
        types = (x == H.IMAGE).int() + 2 * (x == video).int()
        theirs, _ = model.get_rope_index(x, mm_token_type_ids=types,
                                         image_grid_thw=torch.tensor(used["i"]) if used["i"] else None,
                                         video_grid_thw=torch.tensor(used["v"]))
        assert np.array_equal(ours, theirs[:, 0].numpy()), order
        flat = mrope_positions(ids, used["i"], image_token=H.IMAGE, merge=2)  # videos as text: 1-D
        assert not np.array_equal(flat, theirs[:, 0].numpy())


# ----------------------------------------------------------------------------- LLaVA-OneVision

ONEVISION_CONFIGS = {  # LlavaOnevisionVideoProcessor settings (28-px tiles)
    "defaults": {},  # every frame (do_sample_frames=false, transformers' default for this class)
    "fps": {"do_sample_frames": True, "fps": 1.0},
    "fps-odd": {"do_sample_frames": True, "fps": 0.7},
    "count": {"do_sample_frames": True, "num_frames": 8},
    "count-32": {"do_sample_frames": True, "num_frames": 32},
}


def _onevision(tower: str, config: dict):
    """A tiny OneVision spec (SigLIP `full`, or CLIP `default` with its class token) and its model."""
    from transformers import CLIPVisionConfig, LlavaOnevisionConfig, SiglipVisionConfig

    from mmpipe.model.hf.arch import spec_from_config

    v = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
             patch_size=7)
    vc = CLIPVisionConfig(**v) if tower == "clip" else SiglipVisionConfig(**v, vision_use_head=False)
    cfg = LlavaOnevisionConfig(vision_config=vc, text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=16,
                                                                  intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1),
                               image_token_id=60, video_token_id=61, vision_feature_layer=-1,
                               vision_feature_select_strategy="default" if tower == "clip" else "full",
                               image_grid_pinpoints=H.ONEVISION_PINPOINTS, vision_aspect_ratio="anyres_max_4")
    side = {"height": 28, "width": 28}
    image = {"image_processor_type": "LlavaOnevisionImageProcessor", "size": side,
             "image_grid_pinpoints": H.ONEVISION_PINPOINTS}
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": side, **config}
    return spec_from_config(cfg, name=f"onevision-{tower}", image_processor=image, video_processor=video), cfg


@pytest.mark.parametrize("config", sorted(ONEVISION_CONFIGS))
def test_onevision_sampled_frames_are_the_processors(config):
    """transformers' default sampler (LlavaOnevisionVideoProcessor.sample_frames) over many clips:
    the same frames, or an error where transformers refuses the clip."""
    from transformers import LlavaOnevisionVideoProcessor

    proc = LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}, **ONEVISION_CONFIGS[config])
    spec, _ = _onevision("siglip", ONEVISION_CONFIGS[config])
    vs = spec.vision.video
    assert (vs.temporal_patch, vs.pool, vs.newline, vs.indices) == (1, 2, True, "uniform")
    for frames, fps in CLIPS:
        meta = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)
        try:
            theirs = proc.sample_frames(meta).tolist() if proc.do_sample_frames else list(range(frames))
        except ValueError:
            with pytest.raises(ValueError):
                video_frame_indices(vs, frames, fps)
            continue
        assert list(video_frame_indices(vs, frames, fps)) == theirs, (config, frames, fps)


@pytest.mark.parametrize("tower", ["siglip", "clip"])
def test_onevision_passes_and_tokens_are_the_processors_and_models(tower):
    """From the header alone, over many clips and every frame rule: the frames the processor makes
    (each one tower pass of 28 x 28 px: 16 positions, 17 with CLIP's class token), and the LLM
    tokens that both LlavaOnevisionProcessor counts and the model's get_video_features makes
    (each frame 2 x 2 pooled to 4, one newline per video)."""
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor

    from mmpipe.model.geometry import video_segments
    from mmpipe.model.hf.video import preprocess_video

    model = None
    checked = modelled = 0
    for config in sorted(ONEVISION_CONFIGS):
        spec, cfg = _onevision(tower, ONEVISION_CONFIGS[config])
        if model is None:
            torch.manual_seed(0)
            model = LlavaOnevisionForConditionalGeneration(cfg).eval()
        from mmpipe.model.hf.video import video_processor

        proc = video_processor(spec.hf)
        counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)  # its token count needs no tokenizer
        counter.num_image_tokens = 16
        for (n, fps), (h, w) in itertools.product(CLIPS[::5], SIZES):
            meta = VideoMeta(frames=n, fps=fps, height=h, width=w)
            try:
                indices = video_frame_indices(spec.vision.video, n, fps)
            except ValueError:
                continue
            assert video_grid(spec.vision, meta) == (len(indices), 4, 4)
            assert video_segments(spec.vision, meta) == (len(indices), 16 + (tower == "clip"))
            tokens = video_tokens(spec.vision, meta)
            assert counter._get_num_multimodal_tokens(video_sizes=[(len(indices), h, w)])["num_video_tokens"] == [
                tokens]
            checked += 1
            if checked % 6 or len(indices) * h * w > 400_000:
                continue  # resizing many large frames is slow and adds nothing: the processor and model on some
            frames = np.zeros((len(indices), h, w, 3), np.uint8)
            out = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")["pixel_values_videos"]
            assert tuple(out.shape) == (1, len(indices), 3, 28, 28)
            assert preprocess_video(spec, frames, meta, indices).pixels.shape == tuple(out.shape[1:])
            with torch.no_grad():
                feats = model.model.get_video_features(out).pooler_output
            assert tuple(feats.shape[:2]) == (1, tokens), (config, n, fps)
            modelled += 1
    assert checked >= 150 and modelled >= 10, (checked, modelled)


def test_onevision_unresized_frames_become_the_documented_pixel_values():
    """28 x 28 frames (the tile: no resize) reach the model as the processor's documented math gives
    them: x / 255, then (x - mean) / std per channel with its configured mean and std, frames in
    order, channels first."""
    from mmpipe.model.hf.video import preprocess_video

    spec, _ = _onevision("siglip", {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]})
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (6, 28, 28, 3), dtype=np.uint8)
    meta = VideoMeta(frames=6, fps=3.0, height=28, width=28)
    ours = preprocess_video(spec, frames, meta, tuple(range(6)))
    want = ((frames / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.25, 0.3])).transpose(0, 3, 1, 2)
    assert ours.grid == (6, 4, 4)
    np.testing.assert_allclose(ours.pixels, want, rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- Qwen2.5-VL and Qwen2.5-Omni


QWEN25_CONFIGS = {name: CONFIGS[name] for name in ("defaults", "fps-odd", "count")}
QWEN25_CLIPS = [(n, fps) for n in (1, 2, 3, 5, 8, 9, 16, 25, 31, 48) for fps in (1.0, 2.5, 8.0, 23.976, 30.0)]
QWEN25_SIZES = [(28, 28), (48, 64), (17, 300), (360, 640)]


def _qwen25_spec(kind: str, vp: dict, **extra):
    from mmpipe.model.hf.arch import spec_from_config

    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        config = Qwen2_5_VLConfig(vision_config=H.QWEN25_VISION, text_config=H.QWEN25_TEXT, image_token_id=H.IMAGE,
                                  video_token_id=H.VIDEO, vision_start_token_id=H.VSTART, vision_end_token_id=H.VEND)
    else:
        config = H.omni_thinker_config()
    ip = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 12}
    fe = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 16, "chunk_length": 30}
    return spec_from_config(config, name=kind, image_processor=ip,
                            video_processor={"video_processor_type": "Qwen2VLVideoProcessor", **vp},
                            feature_extractor=fe if kind == "qwen2_5_omni" else None, **extra)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_5_omni"])
@pytest.mark.parametrize("config", sorted(QWEN25_CONFIGS))
def test_qwen25_video_geometry_is_the_processors(kind, config):
    """Qwen2_5_VLProcessor and Qwen2_5OmniProcessor themselves, given a clip's decoded frames and its
    metadata, sample, resize and expand as the geometry plans: video_grid_thw, the video tokens in
    input_ids, and the seconds per temporal patch of the positions (Qwen2.5-VL's second_per_grid_ts
    from the sampled frame rate; Omni's video_second_per_grid, 2 / the call's fps: 2.0 by default,
    the video processor's own fps when it samples by fps, which is passed to the call). Omni resizes
    frames within its own 128 to 768 x 28^2 pixels, not the video processor's."""
    from mmpipe.model.hf.video import second_per_grid

    vp = QWEN25_CONFIGS[config]
    spec = _qwen25_spec(kind, vp)
    proc = H.qwen25_processor(None, kind, Qwen2VLVideoProcessor(**vp))
    v = spec.vision
    if kind == "qwen2_5_omni":
        assert (v.video.min_pixels, v.video.max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    call = {"fps": vp["fps"]} if kind == "qwen2_5_omni" and "fps" in vp else {}
    words = H.QWEN25_WORDS[kind]
    video_word = next(k for k, i in words.items() if i == H.VIDEO)
    checked = 0
    for (n, fps), (h, w) in itertools.product(QWEN25_CLIPS[::3], QWEN25_SIZES):
        meta = VideoMeta(frames=n, fps=fps, height=h, width=w)
        try:
            indices = video_frame_indices(v.video, n, fps)
        except ValueError:
            continue
        if len(indices) * max(h * w, v.video.min_pixels) > 900_000:
            continue  # resizing many large frames is slow and adds nothing
        out = proc(text=f"w3 {video_word} w4", videos=[np.zeros((n, h, w, 3), np.uint8)],
                   video_metadata=[{"total_num_frames": n, "fps": fps, "duration": n / fps}], return_tensors="pt",
                   **call)
        grid = tuple(out["video_grid_thw"][0].tolist())
        assert video_grid(v, meta) == grid, (kind, config, n, fps, h, w)
        assert int((out["input_ids"] == H.VIDEO).sum()) == video_tokens(v, meta)
        ours = second_per_grid(v.video, len(indices) / n * fps)
        theirs = out["second_per_grid_ts" if kind == "qwen2_5_vl" else "video_second_per_grid"]
        assert theirs.dtype == torch.float32 and float(theirs[0]) == float(np.float32(ours)), (n, fps, ours)
        checked += 1
    assert checked >= 6


OMNI_TRACK_CASES = [  # video processor config, clips (frames, fps, audio seconds)
    ({}, [(6, 4.0, 1.5), (16, 8.0, 0.4), (9, 2.5, 4.5)]),  # every frame; 1 s per temporal patch (the default)
    ({"do_sample_frames": True, "fps": 0.7}, [(48, 8.0, 6.0), (31, 23.976, 1.3)]),  # 2.86 s: chunks skipped
    ({"do_sample_frames": True, "fps": 4.0}, [(40, 8.0, 4.2), (13, 6.0, 2.0)]),  # 0.5 s: 12.5 positions
]


@pytest.mark.parametrize("case", range(len(OMNI_TRACK_CASES)))
def test_interleaved_tokens_are_the_omni_processors(case):
    """With use_audio_in_video, Qwen2_5OmniProcessor (given each clip's audio track, one per slot)
    replaces a clip's <|VIDEO|> by <|audio_bos|>, then chunk by chunk (2 s: 50 temporal positions)
    the chunk's video tokens and its audio tokens, then <|audio_eos|>: the ids mmpipe's templater
    makes from geometry.interleaved_runs, the planner's LLM length, and the track's valid mel
    frames (an audio tower clip the planner counts); videos outlasting their track and tracks
    outlasting their video."""
    from mmpipe.model.geometry import SampleMeta, audio_frames, features, interleaved_runs

    vp, clips = OMNI_TRACK_CASES[case]
    spec = _qwen25_spec("qwen2_5_omni", vp, use_audio_in_video=True)
    proc = H.qwen25_processor(None, "qwen2_5_omni", Qwen2VLVideoProcessor(**vp))
    call = {"fps": vp["fps"]} if "fps" in vp else {}
    shapes = set()
    for n, fps, seconds in clips:
        meta = VideoMeta(frames=n, fps=fps, height=28, width=28, audio_seconds=seconds, audio_rate=44100)
        out = proc(text="w3 <|vision_bos|><|VIDEO|><|vision_eos|> w4", videos=[np.zeros((n, 28, 28, 3), np.uint8)],
                   video_metadata=[{"total_num_frames": n, "fps": fps, "duration": n / fps}],
                   audio=[np.zeros(round(seconds * 16000), np.float32)], audio_from_video_indices=[0],
                   load_audio_from_video=True, return_tensors="np", **call)
        runs = interleaved_runs(spec, meta)
        token = {"video": H.VIDEO, "audio": H.AUDIO}
        ours = [3, H.VSTART, H.ASTART, *(token[k] for k, m in runs for _ in range(m)), H.AEND, H.VEND, 4]
        assert out["input_ids"][0].tolist() == ours, (case, n, fps, seconds, runs)
        f = features(spec, SampleMeta(text_tokens=4, videos=(meta,)))
        assert f.llm_len == len(ours) and f.audio_tokens == (sum(m for k, m in runs if k == "audio"),)
        assert int(out["feature_attention_mask"].sum()) == audio_frames(spec.audio, seconds)
        shapes.add(tuple(k for k, _ in runs))
    assert any(s.count("video") > 1 and s.count("audio") > 1 for s in shapes)  # really interleaved


def _fake_video(grid, seconds, track_frames=0):
    from mmpipe.model.hf.media import AudioInput
    from mmpipe.model.hf.video import VideoInput

    audio = AudioInput(features=np.zeros((16, track_frames), np.float32), frames=track_frames) if track_frames else None
    return VideoInput(pixels=np.zeros((0, 1)), grid=tuple(grid), sampled_fps=0.0, second_per_grid=seconds, audio=audio)


def _omni_tokens(p: int) -> int:
    """Audio LLM tokens of a clip of `p` valid mel frames (transformers' formula)."""
    return (((p - 1) // 2 + 1) - 2) // 2 + 1


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen2_5_omni"])
def test_video_positions_are_the_classes_get_rope_index(case, request):
    """Text, images, videos (and Omni's clips) in many orders: sample_positions, what collate gives
    every sample, equals each class's own get_rope_index: Qwen2.5-VL's temporal index
    trunc(k x tokens_per_second x second_per_grid_ts), Omni's trunc(k x video_second_per_grid x 25)
    with every segment starting one past the last one's largest position, and with use_audio_in_video
    the interleaved clips (ids from Qwen2_5OmniProcessor's own replacement text): both openers on one
    position, video and audio positions from the same start, chunk by chunk, both closers on one."""
    from mmpipe.model.hf.arch import spec_from_folder
    from mmpipe.model.hf.media import ImageInput
    from mmpipe.model.hf.positions import sample_positions
    from mmpipe.model.hf.skeleton import skeleton

    spec = spec_from_folder(request.getfixturevalue(case))
    model = skeleton(spec.hf).model
    rng = np.random.default_rng(5)
    image_grids = [(1, 4, 6), (1, 2, 2)]
    video_grids = [(3, 4, 4), (1, 2, 6), (5, 4, 8), (7, 2, 2)]
    seconds = [0.5, 2 / 6, 2 / 23.976, 2 / 0.7]  # every frame at 4, 6, 23.976 fps; 0.7-fps sampling
    track_frames = [120, 400, 33, 1000]  # mel frames of each video's audio track (Omni's use_audio_in_video)
    clip_frames = [50, 333]
    layouts = [["v0"], ["i0", "v1"], ["v2", "i1", "v3"], ["v3", "v0", "i0", "i1"], ["a0", "v2", "a1"]]
    if case == "qwen2_5_omni":
        layouts += [["V0"], ["i0", "V2", "a1"], ["a0", "V3", "V1", "i1"], ["V1", "V0"]]  # V: its track interleaved
    proc = H.qwen25_processor(None, "qwen2_5_omni") if case == "qwen2_5_omni" else None
    checked = 0
    for layout in layouts:
        if case == "qwen2_5_vl" and any(x.startswith("a") for x in layout):
            continue
        ids, images, videos, grids_i, grids_v, secs, seqlens = H.text(rng, 3), [], [], [], [], [], []
        for item in layout:
            k = int(item[1])
            if item[0] == "i":
                ids += [H.VSTART] + [H.IMAGE] * (np.prod(image_grids[k]) // 4) + [H.VEND]
                images.append(ImageInput(pixels=np.zeros((0, 1)), grid=image_grids[k]))
                grids_i.append(image_grids[k])
            elif item[0] == "a":
                ids += [H.ASTART] + [H.AUDIO] * _omni_tokens(clip_frames[k]) + [H.AEND]
                seqlens.append(clip_frames[k])
            else:
                g, s = video_grids[k], seconds[k]
                if item[0] == "V":  # transformers' own replacement text for the clip and its track
                    text = proc.replace_video_with_audio_token(
                        {"video_grid_thw": torch.tensor([g]), "video_second_per_grid": [s]}, 0,
                        {"num_audio_tokens": [_omni_tokens(track_frames[k])]}, 0, position_id_per_seconds=25,
                        seconds_per_chunk=2.0)
                    ids += [H.VSTART] + proc.tokenizer(text, add_special_tokens=False)["input_ids"] + [H.VEND]
                    seqlens.append(track_frames[k])
                else:
                    ids += [H.VSTART] + [H.VIDEO] * (np.prod(g) // 4) + [H.VEND]
                videos.append(_fake_video(g, s, track_frames[k] if item[0] == "V" else 0))
                grids_v.append(g)
                secs.append(s)
            ids += H.text(rng, int(rng.integers(1, 4)))
        ids = [int(x) for x in ids]
        ours = sample_positions(spec, ids, images, videos)
        x = torch.tensor([ids])
        gi = torch.tensor(grids_i) if grids_i else None
        if case == "qwen2_5_vl":
            types = (x == H.IMAGE).int() + 2 * (x == H.VIDEO).int()
            theirs, _ = model.get_rope_index(x, mm_token_type_ids=types, image_grid_thw=gi,
                                             video_grid_thw=torch.tensor(grids_v),
                                             second_per_grid_ts=torch.tensor(secs))
        else:
            theirs, _ = model.get_rope_index(x, image_grid_thw=gi, video_grid_thw=torch.tensor(grids_v),
                                             attention_mask=torch.ones_like(x), second_per_grids=torch.tensor(secs),
                                             use_audio_in_video=any(v[0] == "V" for v in layout),
                                             audio_seqlens=torch.tensor(seqlens) if seqlens else None)
        assert np.array_equal(ours, theirs[:, 0].numpy()), layout
        checked += 1
    assert checked >= 4


def test_video_windows_are_transformers_window_index():
    """The windows the planner prices for a clip's windowed blocks (every temporal patch cut on its
    own) are the segments transformers' get_vision_window_index cuts the clip's video_grid_thw
    into, and a sample's features list them after its images'."""
    from transformers.vision_utils import get_vision_window_index

    from mmpipe.model.geometry import SampleMeta, features, image_windows, video_windows

    spec = _qwen25_spec("qwen2_5_vl", {})
    v = spec.vision
    checked = 0
    for (n, fps), (h, w) in itertools.product([(1, 2.0), (5, 4.0), (8, 23.976)], [(56, 56), (84, 200), (300, 17)]):
        meta = VideoMeta(frames=n, fps=fps, height=h, width=w)
        grid = video_grid(v, meta)
        _, cu = get_vision_window_index(torch.tensor([grid]), spatial_merge_size=v.merge, window_size=v.window,
                                        patch_size=v.patch)
        assert list(np.diff(cu.numpy())) == list(video_windows(v, meta)), (n, h, w, grid)
        checked += grid[0] > 1 and len(video_windows(v, meta)) > grid[0]  # several frames, several windows each
    assert checked
    meta = VideoMeta(frames=5, fps=4.0, height=84, width=200)
    f = features(spec, SampleMeta(text_tokens=3, images=((56, 90),), videos=(meta,)))
    assert f.image_windows == image_windows(v, 56, 90) + video_windows(v, meta)
