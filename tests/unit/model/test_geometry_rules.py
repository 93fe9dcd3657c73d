"""The token geometry the planner costs equals the rules transformers applies."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from mmpipe.model.geometry import (
    audio_frames,
    audio_positions,
    audio_tokens,
    image_positions,
    image_tokens,
    smart_resize,
)
from mmpipe.model.spec import AudioSpec, VisionSpec

SIZES = [(1, 1), (5, 300), (13, 13), (27, 29), (224, 224), (333, 500), (1080, 1920), (4000, 30), (2, 399)]


@pytest.mark.parametrize("h,w", SIZES)
def test_smart_resize_is_transformers_rule(h, w):
    for lo, hi in ((56 * 56, 28 * 28 * 1280), (4 * 28 * 28, 16384), (100, 10**8)):
        assert smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi) == hf_smart_resize(h, w, 28, lo, hi)


def test_extreme_aspect_is_refused_like_transformers():
    with pytest.raises(ValueError, match="aspect ratio over 200"):
        smart_resize(1, 201, factor=28, min_pixels=56 * 56, max_pixels=10**6)
    with pytest.raises(ValueError):
        hf_smart_resize(1, 201, 28, 56 * 56, 10**6)


def test_llava_feature_select_counts():
    clip = dict(blocks=1, hidden=8, mlp=8, heads=1, patch=14, image_size=336, proj=(8,))
    assert image_positions(VisionSpec(**clip, cls_token=True, select="default"), 10, 10) == 577
    assert image_tokens(VisionSpec(**clip, cls_token=True, select="default"), 10, 10) == 576
    assert image_tokens(VisionSpec(**clip, cls_token=True, select="full"), 10, 10) == 577
    # SigLIP has no class token: `default` still drops position 0, as transformers does
    assert image_tokens(VisionSpec(**clip, select="default"), 10, 10) == 575


def test_audio_counts_are_qwen2_audio_lengths():
    a = AudioSpec(blocks=1, hidden=8, mlp=8, heads=1, mel_bins=128, sample_rate=16000, frames_per_s=100,
                  conv_stride=2, pool=2, pool_ceil=False, max_seconds=30.0, proj=(8,))
    for samples in (1, 159, 160, 161, 1600, 16000 * 7 + 5, 479_999, 480_000, 700_000):
        seconds = samples / 16000
        frames = min(3000, -(-samples // 160))  # Whisper's feature extractor: a frame per started hop
        assert audio_frames(a, seconds) == frames
        conv, pooled = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(frames))
        assert audio_positions(a, seconds) == int(conv)
        assert audio_tokens(a, seconds) == int(pooled)
