"""Video samples as the planner prices them: a clip's vision work is one attention segment per
temporal patch (LLaVA-OneVision: per frame, each a tower pass) and linear in all its patches, its
LLM tokens count, and the memory its frames' activations take decides its micro-batch: a long
clip gets one of its own rather than running the stage out of memory."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from mmpipe.model.geometry import SampleMeta, VideoMeta, features
from mmpipe.planner.balancer import balance_step
from mmpipe.planner.cost import build_cost_model
from mmpipe.planner.samples import STREAMS, sample_table
from mmpipe.planner.stage_cost import sample_work, stage_costs
from mmpipe.planner.step import evaluate_step

from .helpers import CONF, WORKLOADS, hardware, model

VPOS, VTOK, LLM = STREAMS.index("vpos"), STREAMS.index("vtok"), STREAMS.index("llm")


def test_a_clip_costs_one_attention_segment_per_temporal_patch():
    m = model("qwen2-vl-7b")  # its video processor: 2 frames a second, 128 * 28^2 .. 768 * 28^2 pixels
    clip = features(m, SampleMeta(text_tokens=30, videos=(VideoMeta(frames=20, fps=4.0, height=448, width=448),)))
    assert clip.video_segments == ((5, 1024),)  # 5 s -> 10 frames -> 5 temporal patches of 32 x 32 patches
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
    _assert_alone(sc, table, clip=5)


def _assert_alone(sc, table, *, clip: int) -> None:
    """The step's plan fits with sample `clip` alone in its micro-batch; with the next micro-batch's
    samples added to it, the stage would run out of memory."""
    n = len(table)
    reps = balance_step(sc, table, list(range(n)), dp=1, micro_batches=4)
    assert sorted(i for mb in reps[0] for i in mb) == list(range(n))
    assert evaluate_step(sc, table, reps, packing=True).fits
    j = next(k for k, mb in enumerate(reps[0]) if clip in mb)
    assert reps[0][j] == [clip]
    k = j + 1 if j + 1 < len(reps[0]) else j - 1
    merged = [mb for q, mb in enumerate(reps[0]) if q not in (j, k)]
    merged.insert(min(j, k), [clip, *reps[0][k]])
    assert not evaluate_step(sc, table, [merged], packing=True).fits
    assert np.all(evaluate_step(sc, table, reps, packing=True).peak_bytes >= sc.static)


def test_onevision_prices_every_frame_as_a_tower_pass():
    """LLaVA-OneVision (its preset: 32 frames a clip, each a 384-px tile): a clip is 32 tower passes
    of 729 positions (each pass its own attention segment, priced by its own length squared), and
    32 x 196 pooled tokens + 1 newline in the LLM, whatever the clip's length and size."""
    m = model("llava-onevision-qwen2-7b")
    clips = [VideoMeta(frames=900, fps=30.0, height=720, width=1280), VideoMeta(frames=80, fps=24.0, height=240,
                                                                               width=320)]
    feats = [features(m, SampleMeta(text_tokens=40, videos=(c,))) for c in clips]
    assert [f.video_segments for f in feats] == [((32, 729),)] * 2 and feats[0].video_tokens == (32 * 196 + 1,)
    t = sample_table(feats)
    assert t.tokens[0, VPOS] == 32 * 729 and t.squares[0, VPOS] == 32 * 729 ** 2  # not (32 * 729) ** 2
    assert t.seqs[0, VPOS] == 32 and t.longest[0, VPOS] == 729
    assert t.tokens[0, VTOK] == 6273 and t.tokens[0, LLM] == 6313


def test_a_long_onevision_clip_gets_a_micro_batch_of_its_own():
    """OneVision taking every frame (a folder whose video processor samples none, transformers'
    default): a 2-s clip of 48 frames is 48 passes of the 26-block tower, about 36 GB of
    activations where everything trains (26 blocks x 34 bytes x width 1152 x 48 x 729 positions),
    among 15 samples of a 300-px image (two tiles, 1.5 GB each): it trains in a micro-batch of its
    own, and would not fit beside the next micro-batch's samples."""
    import yaml

    from mmpipe.model.group import model_from_group
    from mmpipe.model.spec import layer_names


    group = yaml.safe_load((CONF / "model" / "llava-onevision-qwen2-7b.yaml").read_text())
    group["video_processor"] = {**group["video_processor"], "do_sample_frames": False}
    m = model_from_group(group).spec
    clip = SampleMeta(text_tokens=100, videos=(VideoMeta(frames=48, fps=24.0, height=360, width=640),))
    metas = [SampleMeta(text_tokens=150 + 20 * i, images=((300, 300),)) for i in range(15)]
    metas.insert(5, clip)
    feats = [features(m, x) for x in metas]
    assert feats[5].video_segments == ((48, 729),) and feats[0].image_positions == (729, 729)
    cost = build_cost_model(model=m, hardware=hardware("h100"), trainable=("all",), dp=1, memory_headroom=0.08)
    tower = layer_names(m).index("vision.proj") + 1  # stage 0: the vision tower and its projector
    sc = stage_costs(cost, [(0, tower), (tower, tower + 10), (tower + 10, tower + 20), (tower + 20, len(cost.layers))])
    table = sample_table(feats)
    _, act, _ = sample_work(sc, table)
    blocks = 26 * 34 * 1152 * 48 * 729
    assert blocks < act[5, 0] < 1.02 * blocks
    _assert_alone(sc, table, clip=5)


def _video_presets() -> list[str]:
    """The Hub-checkpoint presets (an inline `config`) whose vision encoder takes video."""
    out = []
    for path in sorted((CONF / "model").glob("*.yaml")):
        if "config" in yaml.safe_load(path.read_text()):
            v = model(path.stem).vision
            if v is not None and v.video is not None:
                out.append(path.stem)
    return out


VIDEO_PRESETS = _video_presets()


@pytest.mark.parametrize("name", VIDEO_PRESETS)
def test_plan_on_the_video_trace_beats_every_tuned_baseline(name):
    """`mmpipe plan` on the public video trace (video-mix: clips of 2 s to 3 min beside images and
    text), every preset that takes video, pp=4 x dp=2, two 64-sample steps: the data-aware plan
    fits and its mean step time beats each baseline tuned as docs/spec.md section 7 says, the best of
    them by 20%."""
    from mmpipe.planner.api import DEFAULT_HEADROOM, PlanProblem
    from mmpipe.planner.command import PlanInput, PlanOutput, run_plan
    from mmpipe.planner.trace import read_trace

    assert {"qwen2-vl-7b", "llava-onevision-qwen2-7b"} <= set(VIDEO_PRESETS)
    trace = WORKLOADS / "video-mix.jsonl"
    m = model(name)
    head = [features(m, meta) for meta, _ in zip(read_trace(trace), range(128))]
    assert sum(len(f.video_segments) for f in head) >= 50  # the steps are planned with their clips
    problem = PlanProblem(model=m, hardware=hardware("h100"), pp=4, dp=2, global_batch=64, micro_batches=4,
                          trainable=("vision.proj", "llm"), policy="data-aware", memory_headroom=DEFAULT_HEADROOM)
    plan = run_plan(problem, PlanInput(trace_path=str(trace), steps=2), output=PlanOutput(quiet=True))
    p = plan["predicted"]
    ours = np.mean(p["step_time_s"])
    assert p["fits"] and len(p["step_time_s"]) == 2
    assert set(p["baselines"]) == {"ds-default", "llava-grouped", "packed-ffd"}
    for base, b in p["baselines"].items():
        assert ours < np.mean(b["step_time_s"]), base
    # and by a margin (0.71 and 0.68 of the best baseline today): replicas dealt as stream-order
    # slices instead of by work reach 0.83 with qwen2-vl-7b
    best = min(np.mean(b["step_time_s"]) for b in p["baselines"].values())
    assert ours <= 0.8 * best, (ours, best)
