"""Micro-batch tensors: targets, label masking, patches, padding."""

from __future__ import annotations

import numpy as np
import torch

from mmpipe.model import carrier as C
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
    assert grid.tolist() == [[2, 3]]
    rebuilt = patches.reshape(2, 3, 3, 8, 8).permute(0, 3, 1, 4, 2).reshape(16, 24, 3)
    assert torch.equal(rebuilt, torch.from_numpy(img))
