"""Micro-batch tensors: targets, label masking, patches, padding, the carried segment layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.runtime.batch import collate, shifted_targets


class S:
    def __init__(self, key, ids, labels, images=(), audio=()):
        self.key, self.input_ids, self.labels = key, ids, labels
        self.images, self.audio = list(images), list(audio)


def test_targets_predict_the_next_answer_token_only():
    s = S("a", [1, 3, 50, 51, 4, 60, 61, 2], [-100] * 5 + [60, 61, 2])
    assert shifted_targets(s.labels) == [-100] * 4 + [60, 61, 2, -100]
    mb = collate([s, s], patch=8, packed=True, pad_id=0)
    assert mb.label_tokens == 6
    assert mb.targets.shape == (1, 16)
    # No position predicts across the boundary between two packed samples.
    assert mb.targets[0, 7].item() == -100 and mb.targets[0, 15].item() == -100
    assert mb.carrier[C.POSITION_IDS][0].tolist() == list(range(8)) * 2
    assert mb.carrier[C.SEGMENT_IDS][0].tolist() == [1] * 8 + [2] * 8


def test_padded_rows_carry_no_labels_on_padding():
    a = S("a", [1, 2, 3], [-100, 2, 3])
    b = S("b", [1, 2, 3, 4, 5], [-100, -100, -100, 4, 5])
    mb = collate([a, b], patch=8, packed=False, pad_id=0)
    assert mb.carrier[C.INPUT_IDS].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert mb.carrier[C.SEGMENT_IDS].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert mb.targets.tolist() == [[2, 3, -100, -100, -100], [-100, -100, 4, 5, -100]]
    assert mb.tokens == 8 and mb.label_tokens == 4


def test_patches_rebuild_the_image():
    img = np.arange(16 * 24 * 3, dtype=np.uint8).reshape(16, 24, 3)
    mb = collate([S("i", [5] * 6, [-100] * 6, images=[img])], patch=8, packed=True, pad_id=0)
    patches, grid = mb.carrier[C.IMAGE], mb.carrier[C.IMAGE_GRID]
    assert grid.tolist() == [[1, 2, 3]]  # (temporal patches, rows, cols): an image is one temporal patch
    rebuilt = patches.reshape(2, 3, 3, 8, 8).permute(0, 3, 1, 4, 2).reshape(16, 24, 3)
    assert torch.equal(rebuilt, torch.from_numpy(img))


def test_video_patches_are_frame_pairs_in_order_after_the_images():
    """A video of 4 frames (2 temporal patches) after an image: the image's patches, then per
    temporal patch and patch position its 2 frames' patches, in frame order (model/carrier.py)."""
    from types import SimpleNamespace

    img = np.arange(8 * 16 * 3, dtype=np.uint8).reshape(8, 16, 3)
    clip = np.random.default_rng(0).integers(0, 256, (4, 16, 8, 3), dtype=np.uint8)
    s = S("v", [5] * 6, [-100] * 6, images=[img])
    s.videos = [SimpleNamespace(frames=clip)]
    mb = collate([s], patch=8, packed=True, pad_id=0, temporal_patch=2)
    patches, grid = mb.carrier[C.IMAGE], mb.carrier[C.IMAGE_GRID]
    assert grid.tolist() == [[1, 1, 2], [2, 2, 1]] and mb.carrier[C.VIDEOS].tolist() == [1]
    assert list(layout.read(mb.carrier[C.LAYOUT]).image.lengths) == [2, 2, 2]  # one segment per temporal patch
    video = patches[2:]  # rows: (temporal patch, row, col, frame), each [C, p, p]
    for t in range(2):
        for r in range(2):
            for f in range(2):
                want = torch.from_numpy(clip[2 * t + f, 8 * r:8 * r + 8, :, :]).permute(2, 0, 1)
                assert torch.equal(video[(t * 2 + r) * 2 + f], want), (t, r, f)


def _run_lengths(ids: torch.Tensor) -> list[int]:
    """What every LLM block used to compute from the segment ids: [1, 1, 2, 3, 3] -> [2, 1, 2]."""
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()


def _media_samples():
    rng = np.random.default_rng(0)
    img = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((16, 24), (40, 8), (8, 8))]
    mel = [rng.standard_normal((4, f)).astype(np.float32) for f in (9, 30, 1)]
    return [S("a", [1] * 7, [-100] * 7, images=img[:2], audio=mel[:1]),
            S("b", [2] * 3, [-100] * 3, audio=mel[1:]),
            S("c", [3] * 12, [-100] * 12, images=img[2:])]


def test_the_carried_layout_is_what_the_layers_used_to_compute_per_layer():
    """Sample lengths (the segment ids' runs; each padded row's valid length), patches per image
    (grid rows * cols), positions per clip (ceil(frames / conv stride)), as int32 cu_seqlens."""
    for packed in (True, False):
        mb = collate(_media_samples(), patch=8, packed=packed, pad_id=0, audio_stride=3)
        lay = layout.read(mb.carrier[C.LAYOUT])
        seg, grid, frames = mb.carrier[C.SEGMENT_IDS], mb.carrier[C.IMAGE_GRID], mb.carrier[C.AUDIO_FRAMES]
        rows = _run_lengths(seg[0]) if packed else (seg > 0).sum(1).tolist()
        assert list(lay.llm.lengths) == rows == [7, 3, 12]
        assert list(lay.image.lengths) == (grid[:, 1] * grid[:, 2]).tolist() == [6, 5, 1]
        assert list(lay.audio.lengths) == (-(-frames // 3)).tolist() == [3, 10, 1]
        for stream, lengths in ((lay.llm, rows), (lay.image, [6, 5, 1]), (lay.audio, [3, 10, 1])):
            assert stream.cu_seqlens.dtype == torch.int32
            assert stream.cu_seqlens.tolist() == [0, *np.cumsum(lengths).tolist()]
            assert stream.max_len == max(lengths)
    empty = layout.read(collate([S("t", [1] * 4, [-100] * 4)], patch=8, packed=True, pad_id=0).carrier[C.LAYOUT])
    assert empty.image.lengths == () and empty.audio.lengths == () and empty.image.cu_seqlens.tolist() == [0]


def test_a_layout_slot_that_is_not_collate_s_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"LAYOUT slot is \(4,\) torch.int64"):
        layout.read(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"holds 7 values but its header \[1, 1, 1\] needs 9"):
        layout.read(torch.tensor([1, 1, 1, 0, 5, 0, 0], dtype=torch.int32))
