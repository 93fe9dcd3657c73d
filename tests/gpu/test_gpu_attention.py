"""Attention kernels on CUDA: flash-attn varlen (where it imports), FlexAttention with a document
mask (compiled) and SDPA per segment agree with the dense eager reference in output and
gradients, in fp32 and bf16, on causal, bidirectional and sliding-window segments with GQA;
the tiny model gives one loss and one gradient under each; and a forward syncs the host as
often with three times the blocks. `benchmarks/bench_attention.py` (run by
scripts/gpu_check.sh --full) prints the kernels' times against the planner's sum-of-squares cost."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from mmpipe.model import kernels, layout
from mmpipe.model.attention import Segments, segment_attention, segments
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.runtime.batch import collate

pytestmark = pytest.mark.gpu

LENGTHS = (300, 1, 1024, 77, 2000, 129, 8)  # one position, lengths off the 128-tile grid, longer than WINDOW
WINDOW = 256
HEADS, KV_HEADS, DIM = 16, 4, 64


def _kernels(dtype: torch.dtype) -> list[str]:
    return (["flash"] if kernels.flash_importable() and dtype != torch.float32 else []) + ["flex", "sdpa"]


def _attend(kernel, q, k, v, grad_out, stream, *, causal, window):
    for x in (q, k, v):
        x.grad = None
    with kernels.using(kernel), segments(Segments(stream=stream, causal=causal)):
        out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=DIM ** -0.5, sliding_window=window)
    out.backward(grad_out.to(out.dtype))
    return out.float(), [x.grad.float() for x in (q, k, v)]


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    return ((a - b).abs().max() / max(b.abs().max().item(), floor)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, WINDOW)],
                         ids=["causal", "bidirectional", "window"])
def test_cuda_kernels_agree_with_the_dense_reference(dtype, causal, window):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENGTHS)
    master = [torch.randn(1, h, t, DIM, device="cuda", generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad_out = torch.randn(1, t, HEADS, DIM, device="cuda", generator=g)
    stream = layout.read(layout.encode(LENGTHS, [], []).cuda()).llm
    ref_in = [x.clone().requires_grad_() for x in master]  # fp32 dense block-diagonal reference
    ref, ref_grads = _attend("eager", *ref_in, grad_out, stream, causal=causal, window=window)
    out_tol, grad_tol = (5e-3, 5e-3) if dtype == torch.float32 else (2e-2, 5e-2)
    for kernel in _kernels(dtype):
        inputs = [x.to(dtype).requires_grad_() for x in master]
        out, grads = _attend(kernel, *inputs, grad_out, stream, causal=causal, window=window)
        errs = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads)]
        print(f"\n{kernel} {dtype} causal={causal} window={window}: max error / max value: out {errs[0]:.1e}, "
              f"dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}")
        assert errs[0] < out_tol and max(errs[1:]) < grad_tol, (kernel, errs)


def _image_blocks(n: int) -> torch.Tensor:
    """Gemma 3's image blocks over the LENGTHS row: 300-position blocks (longer than WINDOW, across 128-tile
    edges) filling a segment, at a segment's start, inside one and at its end; -1 elsewhere."""
    out = torch.full((n,), -1, dtype=torch.long, device="cuda")
    for k, a in enumerate((0, 301, 1000, 1500, 3402 - 300)):
        out[a:a + 300] = k
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
def test_image_blocks_agree_with_the_dense_reference_on_cuda(dtype, window):
    """Segments.blocks (Gemma 3's bidirectional images): compiled FlexAttention (create_block_mask over the
    blocks' mask function) and SDPA per segment (an explicit mask) against the eager dense reference; flash
    is refused under the blocks and `auto` runs FlexAttention."""
    g = torch.Generator(device="cuda").manual_seed(1)
    t = sum(LENGTHS)
    master = [torch.randn(1, h, t, DIM, device="cuda", generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad_out = torch.randn(1, t, HEADS, DIM, device="cuda", generator=g)
    stream = layout.read(layout.encode(LENGTHS, [], []).cuda()).llm
    blocks = _image_blocks(t)

    def attend(kernel, q, k, v):
        for x in (q, k, v):
            x.grad = None
        with kernels.using(kernel), segments(Segments(stream=stream, causal=True, blocks=blocks)):
            out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=DIM ** -0.5, sliding_window=window)
        out.backward(grad_out.to(out.dtype))
        return out.float(), [x.grad.float() for x in (q, k, v)]

    ref, ref_grads = attend("eager", *[x.clone().requires_grad_() for x in master])
    out_tol, grad_tol = (5e-3, 5e-3) if dtype == torch.float32 else (2e-2, 5e-2)
    for kernel in ("flex", "sdpa"):
        out, grads = attend(kernel, *[x.to(dtype).requires_grad_() for x in master])
        errs = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads)]
        print(f"\nblocks {kernel} {dtype} window={window}: out {errs[0]:.1e}, grads {max(errs[1:]):.1e}")
        assert errs[0] < out_tol and max(errs[1:]) < grad_tol, (kernel, errs)
    q = master[0].to(torch.bfloat16)
    assert kernels.resolve("auto", q, dropout=0.0, blocks=True) == "flex"
    with pytest.raises(ValueError, match="train.attention=flash cannot attend bidirectionally"):
        kernels.resolve("flash", q, dropout=0.0, blocks=True)


def _tiny_micro_batch(spec):
    from tests.unit.model.test_model import FakeSample

    rng = np.random.default_rng(5)
    samples = [FakeSample("a", spec, rng, images=[(48, 32), (16, 40)], clips=[0.6], text=200),
               FakeSample("b", spec, rng, clips=[0.9, 0.3], text=500),
               FakeSample("c", spec, rng, images=[(24, 80)], text=70)]
    return collate(samples, patch=spec.vision.patch, packed=True, pad_id=0)


def _tiny(dtype):
    from tests.unit.model.test_model import AUD, IMG, tiny

    spec = tiny()
    layers = [layer.to("cuda", dtype) for layer in build_layers(spec, seed=0, image_token=IMG, audio_token=AUD)]
    return spec, layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_tiny_model_gives_one_loss_and_gradient_under_every_cuda_kernel(dtype):
    spec, layers = _tiny(dtype)
    mb = _tiny_micro_batch(spec)
    results = {}
    for kernel in ["eager", *_kernels(dtype)]:
        for layer in layers:
            layer.zero_grad()
        carrier = tuple(t.cuda() for t in mb.carrier)
        with kernels.using(kernel):
            loss = token_loss(run_layers(layers, carrier),
                              (mb.targets.cuda(), torch.tensor([1.0 / mb.label_tokens], device="cuda")))
        loss.backward()
        results[kernel] = (loss.item(), [p.grad.float().clone() for layer in layers for p in layer.parameters()])
    ref_loss, ref_grads = results.pop("eager")
    for kernel, (loss, grads) in results.items():
        # relative to each tensor's largest gradient, floored at 1e-3 of the model's largest: a
        # key bias's gradient is 0 in exact arithmetic, and its rounding noise has no scale
        floor = 1e-3 * max(g.abs().max().item() for g in ref_grads)
        worst = max(_rel(a, b, floor) for a, b in zip(grads, ref_grads))
        cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads]).double(),
                                                    torch.cat([g.flatten() for g in ref_grads]).double(), dim=0).item()
        print(f"\ntiny {dtype} {kernel}: loss {loss:.6f} vs eager {ref_loss:.6f}; max rel grad diff {worst:.1e}, "
              f"gradient cosine {cos:.6f}")
        if dtype == torch.float32:
            assert loss == pytest.approx(ref_loss, rel=1e-4) and worst < 1e-3
        else:  # bf16 rounding differs per kernel through 15 layers: the loss, and the gradient's direction
            assert loss == pytest.approx(ref_loss, rel=2e-2) and cos > 0.99


def test_host_syncs_do_not_grow_with_the_blocks_on_cuda():
    """CUDA's own sync debug mode counts what makes the host wait; tripling every encoder and
    decoder block adds none (the layout is read once per micro-batch and stage)."""
    spec, layers = _tiny(torch.bfloat16)
    mb = _tiny_micro_batch(spec)
    deeper = [layer for layer in layers
              for _ in range(3 if any(layer.name.startswith(k) for k in ("vision.block", "audio.block", "llm.block"))
                             else 1)]

    def syncs(stack) -> int:
        carrier = tuple(t.cuda() for t in mb.carrier)  # a micro-batch no layer has seen
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run_layers(stack, carrier)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    syncs(deeper)  # warm-up: FlexAttention compiles here
    base, deep = syncs(layers), syncs(deeper)
    print(f"\nhost syncs per micro-batch forward: {base} with {len(layers)} layers, {deep} with {len(deeper)} "
          f"(kernel {kernels.describe('auto', cuda=True, precision='bf16')})")
    assert deep == base
