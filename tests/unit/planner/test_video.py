"""Video samples as the planner prices them: a clip's vision work is one attention segment per
temporal patch and linear in all its patches, its LLM tokens count, and the memory its frames'
activations take decides its micro-batch: a long clip gets one of its own rather than running
the stage out of memory."""

from __future__ import annotations

import numpy as np

from mmpipe.model.geometry import SampleMeta, VideoMeta, features
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.samples import STREAMS, sample_table
from mmpipe.planner.stage_cost import sample_work, stage_costs
from mmpipe.planner.step import evaluate_step

from .helpers import hardware, model

VPOS, VTOK, LLM = STREAMS.index("vpos"), STREAMS.index("vtok"), STREAMS.index("llm")


def test_a_clip_costs_one_attention_segment_per_temporal_patch():
    m = model("qwen2-vl-7b")  # its video processor: every frame, 4 * 28^2 .. 1280 * 28^2 pixels
    clip = features(m, SampleMeta(text_tokens=30, videos=(VideoMeta(frames=9, fps=3.0, height=448, width=448),)))
    assert clip.video_segments == ((5, 1024),)  # 9 frames -> 5 temporal patches (the last frame repeated)
    assert clip.video_tokens == (5 * 1024 // 4,) and clip.llm_len == 30 + 1280 and clip.modality == "video"
    image = features(m, SampleMeta(text_tokens=30, images=((448, 448),)))
    t = sample_table([clip, image])
    assert t.tokens[0, VPOS] == 5 * 1024 and t.squares[0, VPOS] == 5 * 1024 ** 2  # not (5 * 1024) ** 2
    assert t.seqs[0, VPOS] == 5 and t.longest[0, VPOS] == 1024
    assert t.tokens[0, VTOK] == 1280 and t.tokens[0, LLM] == 1310
    assert t.tokens[1, VPOS] == 1024 and t.squares[1, VPOS] == 1024 ** 2


def test_a_long_clip_gets_a_micro_batch_of_its_own():
    """Everything trains; stage 0 is the vision tower. A 32-s clip at 2 fps (32 temporal patches of
    32 x 32 patches) keeps about 46 GB of activations there: 32 blocks x 34 bytes x width 1280 x
    32768 positions (docs/spec.md section 6), beside 10.8 GB of weights and optimizer states on an
    80-GB device, with 15 samples of a 448-px image (1.4 GB each there) around it. The plan fits with
    the clip alone in its micro-batch; with the next micro-batch's samples added to it, the stage
    would run out of memory."""
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    clip = SampleMeta(text_tokens=100, videos=(VideoMeta(frames=64, fps=2.0, height=448, width=448),))
    metas = [SampleMeta(text_tokens=150 + 20 * i, images=((448, 448),)) for i in range(15)]
    metas.insert(5, clip)
    feats = [features(m, x) for x in metas]
    cost = build_cost_model(model=m, hardware=hw, trainable=("all",), dp=1, memory_headroom=0.08)
    sc = stage_costs(cost, [(0, 34), (34, 46), (46, 56), (56, 65)])  # vision.embed .. vision.proj first
    table = sample_table(feats)
    _, act, _ = sample_work(sc, table)
    blocks = 32 * 34 * 1280 * 32 * 1024
    assert blocks < act[5, 0] < 1.02 * blocks  # the blocks, plus the merger's input
    reps = balance_step(sc, table, list(range(16)), dp=1, micro_batches=4)
    assert sorted(i for mb in reps[0] for i in mb) == list(range(16))
    assert evaluate_step(sc, table, reps, packing=True).fits
    j = next(k for k, mb in enumerate(reps[0]) if 5 in mb)
    assert reps[0][j] == [5]
    k = j + 1 if j + 1 < len(reps[0]) else j - 1
    merged = [mb for q, mb in enumerate(reps[0]) if q not in (j, k)]
    merged.insert(min(j, k), [5, *reps[0][k]])
    assert not evaluate_step(sc, table, [merged], packing=True).fits
    assert np.all(evaluate_step(sc, table, reps, packing=True).peak_bytes >= sc.static)
