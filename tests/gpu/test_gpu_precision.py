"""bf16 / fp16 with ZeRO-1 on CUDA under NCCL, and measured against predicted stage memory.

pp=2 when the machine has two GPUs (one stage per GPU), else one stage on one GPU. The model is
the tiny one widened to ~0.1 B parameters so that weights, gradients and optimizer state, not
fixed buffers, dominate the memory figures. Each test prints its figures (the script
scripts/gpu_check.sh --full shows them)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

WIDE = ["model.llm.hidden=1024", "model.llm.mlp=2816", "model.llm.heads=16", "model.llm.kv_heads=8",
        "model.llm.blocks=8", "model.vision.proj=[1024,1024]", "model.audio.proj=[1024]"]


def _pp() -> list[str]:
    pp = 2 if torch.cuda.device_count() >= 2 else 1
    return [f"parallel.pp={pp}", "parallel.dp=1", "hardware=h100"]


def _report(name: str, rows: list[dict]) -> None:
    head = sum(r["loss"] for r in rows[:3]) / 3
    tail = sum(r["loss"] for r in rows[-3:]) / 3
    sps = sum(r["samples_per_s"] for r in rows[2:]) / max(1, len(rows) - 2)
    print(f"\n{name}: loss {head:.3f} -> {tail:.3f} (mean of first/last 3), {sps:.1f} samples/s after step 2")
    last = rows[-1]
    for s, (measured, predicted) in enumerate(zip(last["stage_peak_mem_gb"], last["predicted_peak_mem_gb"])):
        print(f"  stage {s}: measured peak {measured:.3f} GB ({last['peak_mem_measure']}), "
              f"predicted {predicted:.3f} GB, ratio {measured / predicted:.2f}")


def test_bf16_zero1_falls_like_fp32_under_nccl_and_memory_is_near_the_prediction(train):
    code32, out32, fp32 = train("train.steps=12", *_pp(), *WIDE, name="fp32")
    code16, out16, bf16 = train("train.precision=bf16", "train.steps=12", *_pp(), *WIDE, name="bf16")
    assert code32 == 0, out32[-4000:]
    assert code16 == 0, out16[-4000:]
    assert "BF16_Optimizer" in out16 and "clipping: global norm 1 (DeepSpeed)" in out16
    _report("fp32 ZeRO-0", fp32)
    _report("bf16 ZeRO-1", bf16)
    # The first steps agree within bf16 error (CPU, same model: 0.1% on the loss, 1.2% on the
    # pre-clip norm of step 1). Later the run is chaotic at lr 3e-3 (the loss jumps up at step 3
    # in fp32 too): the H200 run ended at 3.784 (fp32) against 4.594 (bf16), the same CPU runs at
    # 3.772 against 4.581 (means of the last 3), and fp32 from bf16-rounded initial weights alone
    # moves 0.18, bf16 with fp32 masters without DeepSpeed ends at 4.335 (benchmarks/
    # bench_bf16_drift.py; docs/runtime.md "precision"): rounding, not a defect. So the end is held
    # loosely: both fall, and bf16 within 30% of fp32 (dropped fp32 masters stall far above).
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=5e-3)
    assert bf16[1]["loss"] == pytest.approx(fp32[1]["loss"], rel=1e-2)
    assert bf16[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=3e-2)
    tail16, tail32 = (sum(r["loss"] for r in rows[-3:]) / 3 for rows in (bf16, fp32))
    assert bf16[-1]["loss"] < bf16[0]["loss"] and tail16 == pytest.approx(tail32, rel=0.3)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in bf16)
    last = bf16[-1]
    assert last["peak_mem_measure"] == "cuda_max_allocated"
    for measured, predicted in zip(last["stage_peak_mem_gb"], last["predicted_peak_mem_gb"]):
        # The planner prices 16 bytes per trainable parameter (bf16 weight and gradient, fp32
        # master and Adam moments); DeepSpeed's bf16 optimizer also keeps fp32 gradients (+4)
        # and reduce buffers. A wide band: this is the first comparison on real hardware.
        assert 0.5 < measured / predicted < 3.0, (measured, predicted)


def test_fp16_zero1_trains_under_nccl_with_a_live_loss_scale(train):
    code, out, rows = train("train.precision=fp16", "train.steps=12", *_pp(), *WIDE)
    assert code == 0, out[-4000:]
    assert "DeepSpeedZeroOptimizer" in out
    _report("fp16 ZeRO-1", rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["loss_scale"] >= 1 for r in rows)
    assert sum(r["grad_norm"] is None for r in rows) <= 3  # a few overflow-skipped steps at most
