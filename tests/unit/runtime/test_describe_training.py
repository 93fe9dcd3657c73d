"""The start-up line states the precision DeepSpeed really trains with, read from the engine:
DeepSpeed picks its optimizer wrapper, master copy and gradient-accumulation dtype from the
config, and a line written from mmpipe's own settings would say "fp32 gradient accumulation"
whatever DeepSpeed did."""

from __future__ import annotations

from mmpipe.cli import load
from mmpipe.runtime.dsconfig import deepspeed_config
from mmpipe.runtime.pipeline import describe_precision, describe_training


def test_the_precision_line_is_what_the_engine_does(make_engine):
    rc = load(["train.precision=bf16"], job="test")
    config = deepspeed_config(rc)  # what a bf16 rank hands to deepspeed.initialize
    engine, basic = make_engine(config)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    line = describe_training(rc.train, 1, engine, basic, mmpipe_clips=False)
    assert line.startswith("precision: bf16 (fp32 master weights, fp32 gradient accumulation) | ZeRO-1 (one "
                           "replica: nothing to shard) | optimizer: torch AdamW (fused) in DeepSpeed BF16_Optimizer "
                           "| clipping: global norm 1 (DeepSpeed) | "), line
    # the same settings, where DeepSpeed accumulates in bf16 (its ZeRO optimizer instead): the
    # line follows the engine, not train.precision
    engine, basic = make_engine({**config, "data_types": {"grad_accum_dtype": "bf16"}})
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    line = describe_training(rc.train, 1, engine, basic, mmpipe_clips=False)
    assert line.startswith("precision: bf16 (fp32 master weights, bf16 gradient accumulation) | ZeRO-1 (one "
                           "replica: nothing to shard) | optimizer: torch AdamW (fused) in DeepSpeed "
                           "DeepSpeedZeroOptimizer | "), line
    fp32 = load([], job="test")
    engine, basic = make_engine(deepspeed_config(fp32))
    assert describe_precision(engine) == "fp32"
    assert describe_training(fp32.train, 1, engine, basic, mmpipe_clips=True).startswith(
        "precision: fp32 | ZeRO-0 | optimizer: torch AdamW (fused) | clipping: global norm 1 (mmpipe) | ")


def test_fp16_says_its_loss_scale(make_engine, monkeypatch):
    """Built only (this CPU may have no fp16 kernels, so DeepSpeed's accelerator is told it has):
    the line reads the fp16 engine's master copy, accumulation dtype and dynamic loss scale."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    engine, _ = make_engine(deepspeed_config(load(["train.precision=fp16"], job="test")))
    assert describe_precision(engine) == ("fp16 (fp32 master weights, fp16 gradient accumulation, dynamic loss "
                                          "scale)")


def test_adamw_is_torch_fused_on_cuda_even_where_deepspeed_fusedadam_cannot_build(make_engine, monkeypatch):
    """On a CUDA machine whose arch list DeepSpeed's JIT build cannot parse (Hopper's "9.0a"),
    adamw is torch's fused AdamW, never DeepSpeed's FusedAdam, and the start-up text says so and why."""
    import sys
    import types

    import torch

    from mmpipe.runtime.pipeline import make_optimizer

    rc = load(["train.precision=bf16"], job="test")
    engine, basic = make_engine(deepspeed_config(rc))
    line = describe_training(rc.train, 1, engine, basic, mmpipe_clips=False)
    broken = types.ModuleType("deepspeed.ops.adam")

    def fail(*_, **__):
        raise ValueError("invalid literal for int() with base 10: '0a'")

    broken.FusedAdam = fail
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    opt = make_optimizer([torch.nn.Parameter(torch.ones(3))], lr=1e-3, weight_decay=0.0, cuda=True)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert "optimizer: torch AdamW (fused) in DeepSpeed BF16_Optimizer" in line
    assert ("AdamW: torch's fused kernel (shipped with torch, no JIT build; not DeepSpeed's FusedAdam, which is "
            "compiled at start-up and fails on CUDA arch lists such as '9.0a' (Hopper))") in line, line
