import numpy as np
import pytest

from mmpipe.model.geometry import SampleFeatures
from mmpipe.planner.cost import build_cost_model, validate_trainable
from mmpipe.planner.samples import mb_streams, sample_table
from mmpipe.planner.stage_cost import micro_batch_costs, stage_costs

from .helpers import hardware, model


def _text(n):
    return SampleFeatures(image_positions=(), image_tokens=(), audio_positions=(), audio_tokens=(),
                          text_tokens=n)


def _layer(cost, name):
    return next(l for l in cost.layers if l.name == name)


def test_freeze_aware_backward_factors():
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("vision.proj", "llm"), dp=2)
    # frozen with nothing trainable upstream: no backward, no activations
    assert _layer(c, "vision.block.5").bwd_factor == 0 and _layer(c, "vision.block.5").act_bytes == 0
    assert _layer(c, "vision.proj").bwd_factor == 2 and _layer(c, "llm.block.3").bwd_factor == 2
    c2 = build_cost_model(model=m, hardware=hw, trainable=("vision",), dp=1)
    # frozen LLM that gradients must cross to reach the trainable vision tower: 1x, keeps acts
    assert _layer(c2, "llm.block.3").bwd_factor == 1 and _layer(c2, "llm.block.3").act_bytes > 0
    assert _layer(c2, "vision.block.0").bwd_factor == 2


def test_llm_block_flops_and_activation_rule():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("all",), dp=1)
    blk = _layer(c, "llm.block.0")
    assert blk.lin_flops == pytest.approx(2 * blk.params, rel=1e-3)  # 2 * params per token
    assert blk.attn_flops == 2 * 4096  # causal: 2 s^2 h
    assert _layer(c, "vision.block.0").attn_flops == 4 * 1024  # bidirectional: 4 s^2 h
    assert blk.act_bytes == 34 * 4096 and blk.recompute_bytes == 2 * 4096
    assert _layer(c, "llm.head").act_bytes == 6 * 32064  # 6 bytes per vocabulary entry (llava-hf's 32064)


def test_static_memory_zero1():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=4)
    blk = _layer(c, "llm.block.0")
    vb = _layer(c, "vision.block.0")
    i = c.names.index("llm.block.0")
    j = c.names.index("vision.block.0")
    assert c.static_bytes(i, i + 1) == pytest.approx(blk.params * (4 + 12 / 4))
    assert c.static_bytes(j, j + 1) == pytest.approx(vb.params * 2)


def test_padding_costs_more_than_packing_and_attention_is_per_sample():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    sc = stage_costs(c, [(0, len(c.layers))])
    t = sample_table([_text(100), _text(1900)])
    packed = micro_batch_costs(sc, *mb_streams(t, [[0, 1]], packing=True))
    padded = micro_batch_costs(sc, *mb_streams(t, [[0, 1]], packing=False))
    assert padded.fwd[0, 0] > packed.fwd[0, 0]
    one = micro_batch_costs(sc, *mb_streams(t, [[1]], packing=True))
    assert packed.fwd[0, 0] > one.fwd[0, 0]
    equal = sample_table([_text(500), _text(500)])
    a = micro_batch_costs(sc, *mb_streams(equal, [[0, 1]], packing=True))
    b = micro_batch_costs(sc, *mb_streams(equal, [[0, 1]], packing=False))
    assert a.fwd[0, 0] == pytest.approx(b.fwd[0, 0])


def test_small_micro_batches_are_less_efficient():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    sc = stage_costs(c, [(0, len(c.layers))])
    t = sample_table([_text(64)] * 64)
    one = micro_batch_costs(sc, *mb_streams(t, [[i] for i in range(64)], packing=True))
    big = micro_batch_costs(sc, *mb_streams(t, [list(range(64))], packing=True))
    assert one.fwd.sum() > 1.5 * big.fwd.sum()


def test_recompute_trades_memory_for_time():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    t = sample_table([_text(2000)])
    T, S2 = mb_streams(t, [[0]], packing=True)
    off = micro_batch_costs(stage_costs(c, [(30, 50)], [False]), T, S2)
    on = micro_batch_costs(stage_costs(c, [(30, 50)], [True]), T, S2)
    assert on.act[0, 0] < off.act[0, 0] / 5
    assert on.bwd[0, 0] == pytest.approx(off.bwd[0, 0] + off.fwd[0, 0], rel=1e-6)
    assert on.transient[0, 0] > 0 and off.transient[0, 0] == 0


def test_boundary_bytes_are_the_hidden_state():
    m, hw = model("llava-1.5-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("llm",), dp=1)
    i = c.names.index("llm.block.10")
    assert c.cut_fwd_bytes[i, 4] == 2 * 4096 and c.cut_bwd_bytes[i, 4] == 2 * 4096
    j = c.names.index("vision.block.10")
    assert c.cut_fwd_bytes[j, 0] == 2 * 1024 and c.cut_bwd_bytes[j, 0] == 0  # frozen tower


def test_validate_trainable_error_text():
    m = model("qwen2-vl-7b")
    with pytest.raises(ValueError) as err:
        validate_trainable(["visoin"], m)
    msg = str(err.value)
    assert "train.trainable=[visoin]" in msg and "qwen2-vl-7b" in msg
    assert "use all, vision, vision.proj or llm" in msg
    assert validate_trainable(["vision.proj", "llm"], m) == ("vision.proj", "llm")
    with pytest.raises(ValueError, match="audio"):
        validate_trainable(["audio"], m)


def test_windowed_vision_blocks_price_attention_per_window():
    """Qwen2.5-VL: a windowed block's attention is priced over its 8 x 8-patch windows, a full
    block's (fullatt_block_indexes) over the whole image. On a big image the windowed block costs
    less; on an image inside one window the two cost the same."""
    from mmpipe.model.geometry import SampleMeta, features

    m, hw = model("qwen2.5-vl-7b"), hardware("h100")
    c = build_cost_model(model=m, hardware=hw, trainable=("all",), dp=1)
    assert _layer(c, "vision.block.6").kind == "vision.window" and _layer(c, "vision.block.7").kind == "vision.block"
    assert _layer(c, "vision.block.6").params == _layer(c, "vision.block.7").params  # the same module
    names = c.names
    w, f = names.index("vision.block.6"), names.index("vision.block.7")
    sc = stage_costs(c, [(0, w), (w, f), (f, f + 1), (f + 1, len(names))])

    def block_times(h, w_):
        t = sample_table([features(m, SampleMeta(text_tokens=10, images=((h, w_),)))])
        cost = micro_batch_costs(sc, *mb_streams(t, [[0]], packing=True))
        return float(cost.fwd[2, 0]), float(cost.fwd[1, 0])  # the full block, the windowed one

    full, windowed = block_times(1008, 1008)  # 72 x 72 patches: 81 windows
    assert windowed < 0.8 * full
    full, windowed = block_times(100, 100)  # 8 x 8 patches: one window
    assert windowed == pytest.approx(full, rel=1e-12)


def test_chunked_audio_blocks_price_attention_per_chunk():
    """Qwen2.5-Omni's audio blocks attend within 2-s chunks: a 30-s clip's attention is priced
    over 15 chunks of 100 positions, not one sequence of 1500."""
    from mmpipe.model.geometry import SampleMeta, features

    omni, whisper = model("qwen2.5-omni-7b"), model("omni-7b")
    feats = [features(m, SampleMeta(text_tokens=10, audio_seconds=(30.0,))) for m in (omni, whisper)]
    assert feats[0].audio_positions == feats[1].audio_positions == (1500,)
    tables = [sample_table([f]) for f in feats]
    assert tables[0].squares[0, 2] == 15 * 100 ** 2 and tables[1].squares[0, 2] == 1500 ** 2


def test_lora_layers_train_only_their_adapters():
    """Qwen2-VL-7B with adapters (r=16) on the decoder's seven projections, the merger in full: a
    decoder block's base weights hold no gradient or optimizer state, its adapters r x (in + out)
    each; its backward is one input gradient plus twice the adapters' share; gradients still
    cross every decoder cut (the adapters below need them)."""
    from mmpipe.model.spec import LoraSpec
    from mmpipe.planner.precision import TrainingPrecision

    m = model("qwen2-vl-7b")
    lora = LoraSpec(r=16)
    full = build_cost_model(model=m, hardware=hardware("h100"), trainable=("vision.proj", "llm"))
    cost = build_cost_model(model=m, hardware=hardware("h100"), trainable=("vision.proj",), lora=lora)
    h, kv, f = m.llm.hidden, m.llm.hidden // m.llm.heads * m.llm.kv_heads, m.llm.mlp
    block, before = _layer(cost, "llm.block.3"), _layer(full, "llm.block.3")
    assert block.adapter_params == 16 * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + f))
    assert not block.trainable and block.learns and block.params == before.params
    assert 1.0 < block.bwd_factor < 1.01 and before.bwd_factor == 2.0
    assert block.lin_flops == pytest.approx(before.lin_flops + 2 * block.adapter_params)
    assert _layer(cost, "vision.proj").trainable and _layer(cost, "vision.block.0").adapter_params == 0
    assert _layer(cost, "llm.embed").adapter_params == 0 and not _layer(cost, "llm.embed").trainable
    pr = TrainingPrecision()
    blocks = [i for i, l in enumerate(cost.layers) if l.kind == "llm.block"]
    a, b = blocks[0], blocks[-1] + 1
    want = sum(l.params * pr.param_bytes(trainable=False, dp=1)
               + l.adapter_params * pr.param_bytes(trainable=True, dp=1)
               for l in cost.layers[a:b]) * (1 + cost.hardware.memory_slack)
    assert cost.static_bytes(a, b) == pytest.approx(want)
    assert cost.static_bytes(a, b) < 0.2 * full.static_bytes(a, b)
    assert (cost.cut_bwd_bytes[blocks[5]] == full.cut_bwd_bytes[blocks[5]]).all()
    assert cost.cut_bwd_bytes[blocks[5]].sum() > 0


def test_lora_moves_the_stage_cut_of_a_7b_plan():
    """Frozen decoder weights free memory and halve the decoder's backward: on the same samples
    the data-aware cut of Qwen2-VL-7B (pp=4 x dp=2, H100) moves, and the LoRA plan's stages hold
    far less static memory."""
    from mmpipe.model.spec import LoraSpec
    from mmpipe.planner.api import PlanProblem, plan_stages

    rng = np.random.default_rng(0)
    sizes = rng.integers(64, 1600, 64)
    sample = [SampleFeatures(image_positions=(int(s) * 4,), image_tokens=(int(s),), audio_positions=(),
                             audio_tokens=(), text_tokens=int(t)) for s, t in zip(sizes, rng.integers(40, 900, 64))]
    m, hw = model("qwen2-vl-7b"), hardware("h100")
    args = dict(model=m, hardware=hw, pp=4, dp=2, micro_batches=8, policy="data-aware")
    full = plan_stages(PlanProblem(trainable=("vision.proj", "llm"), **args), sample)
    lora = plan_stages(PlanProblem(trainable=("vision.proj",), lora=LoraSpec(r=16), **args), sample)
    assert full.stages != lora.stages
    with pytest.raises(ValueError, match="train.trainable=\\[\\] trains nothing"):
        build_cost_model(model=m, hardware=hw, trainable=())
    assert build_cost_model(model=m, hardware=hw, trainable=(), lora=LoraSpec(r=8)).layers
