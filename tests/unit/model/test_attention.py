"""Attention kernels for packed segments: every kernel that runs on CPU agrees with a dense
block-diagonal reference (and so with the others), grouped-query attention keeps its few K/V
heads, and the segment layout is read to the host once per micro-batch, not in every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.model import carrier as C
from mmpipe.model import kernels, layout
from mmpipe.model.attention import Segments, segment_attention, segments
from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.build import build_layers as build_hf_layers
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.runtime.batch import collate, collate_hf

from .host_reads import HostReads
from .test_hf_layers import media_sample, text_sample
from .test_model import AUD, IMG, FakeSample, tiny

LENGTHS = (5, 1, 17, 9, 30, 2)  # a one-position segment, and segments shorter and longer than WINDOW
WINDOW = 7
CPU_KERNELS = ("sdpa", "eager")  # train on CPU; flex runs forward only on CPU (no backward in torch)
UNFUSED_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _stream(lengths) -> layout.Stream:
    return layout.read(layout.encode(lengths, [], [])).llm


def _qkv(heads: int, kv_heads: int, seed: int = 0, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return [torch.randn(1, h, t, d, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


def _reference(q, k, v, *, causal: bool, window: int | None) -> torch.Tensor:
    """Dense block-diagonal attention in float64, built from LENGTHS alone: [1, T, H, d]."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    i = torch.arange(doc.shape[0])
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _attend(kernel: str, q, k, v, *, causal: bool, window: int | None) -> torch.Tensor:
    with kernels.using(kernel), segments(Segments(stream=_stream(LENGTHS), causal=causal)):
        out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5,
                                   sliding_window=window)
    return out


CASES = [pytest.param(causal, window, heads, id=f"{'causal' if causal else 'bidir'}-w{window}-h{heads[0]}kv{heads[1]}")
         for causal, window in ((True, None), (False, None), (True, WINDOW))
         for heads in ((4, 4), (8, 2))]


@pytest.mark.parametrize("causal, window, heads", CASES)
def test_cpu_kernels_agree_with_the_dense_reference_in_output_and_gradients(causal, window, heads):
    ref_in = _qkv(*heads)
    ref = _reference(*ref_in, causal=causal, window=window)
    ref.backward(torch.ones_like(ref))
    ref_grads = [x.grad.double() for x in ref_in]
    report = []
    for kernel in CPU_KERNELS:
        q, k, v = _qkv(*heads)
        out = _attend(kernel, q, k, v, causal=causal, window=window)
        assert out.shape == (1, sum(LENGTHS), heads[0], q.shape[-1])
        out.backward(torch.ones_like(out))
        diff = (out.double() - ref).abs().max().item()
        gdiff = max((x.grad.double() - g).abs().max().item() for x, g in zip((q, k, v), ref_grads))
        report.append(f"{kernel} out {diff:.1e} grad {gdiff:.1e}")
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
        for x, g in zip((q, k, v), ref_grads):
            torch.testing.assert_close(x.grad.double(), g, rtol=0, atol=2e-5)
    print(f"\nvs float64 reference: {'; '.join(report)}")


@UNFUSED_FLEX
@pytest.mark.parametrize("causal, window, heads", CASES)
def test_flex_attention_with_a_document_mask_agrees_on_cpu_forward(causal, window, heads):
    """torch runs FlexAttention on CPU unfused and forward only: the document mask, the window
    and GQA are checked here, its fused kernel and backward on CUDA (tests/gpu)."""
    q, k, v = (x.detach() for x in _qkv(*heads))
    ref = _reference(q, k, v, causal=causal, window=window)
    with torch.no_grad():
        out = _attend("flex", q, k, v, causal=causal, window=window)
    print(f"\nflex vs float64 reference: out {(out.double() - ref).abs().max().item():.1e}")
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


@UNFUSED_FLEX
@pytest.mark.parametrize("lengths", [(300, 1, 127, 129, 211), (128, 256, 128), (5, 900, 3, 116), (64,)])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_block_mask_from_segment_lengths_is_torchs_own(lengths, causal):
    """The tiles come from the segment lengths on the host (no compile of the mask per length):
    the same skipped, full and partial tiles as create_block_mask's evaluation of the mask over
    the whole grid, and the same attention, over packed rows of several 128-position tiles."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    stream = _stream(lengths)
    n = stream.total
    doc = stream.document_ids()
    ok = (doc[:, None] == doc[None, :]) & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
    mine = kernels.segment_block_mask(stream, causal=causal, window=None, device=torch.device("cpu"))
    ref = create_block_mask(lambda b, h, q, k: ok[q, k], None, None, n, n, device="cpu", _compile=False)
    assert torch.equal(mine.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(mine.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(mine.to_dense(), ref.to_dense())
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mine), flex_attention(q, k, v, block_mask=ref),
                               rtol=0, atol=1e-6)


def test_compiled_flex_attention_compiles_once_for_every_length_of_two_tiles_or_more():
    """A run's micro-batches have many packed lengths: the compiled FlexAttention must trace once
    and serve them all, not recompile at the second length (step 2 on a GPU). The first length
    has 2 tiles, as many as the key/value heads, the trap duck sizing falls into. Forward only
    (CPU FlexAttention has no backward), through torch's CPU compiler."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    attend = kernels._flex_attention.__wrapped__(True)  # a fresh compiled function, not the cached one
    g = torch.Generator().manual_seed(0)
    outs = []
    for lengths in ((100, 156), (300, 212), (384, 640, 20), (129, 2, 400)):
        stream = _stream(lengths)
        q = torch.randn(1, 4, stream.total, 16, generator=g)
        k, v = (torch.randn(1, 2, stream.total, 16, generator=g) for _ in range(2))
        mask = kernels.segment_block_mask(stream, causal=True, window=None, device=torch.device("cpu"))
        with torch.no_grad():
            outs.append((attend(q, k, v, block_mask=mask, enable_gqa=True), (q, k, v, stream)))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    out, (q, k, v, stream) = outs[-1]  # and the compiled kernel attends as the reference does
    with torch.no_grad():
        ref = kernels.packed("eager", q, k, v, stream, causal=True, window=None, scale=None, dropout=0.0)
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=0, atol=2e-5)
    torch._dynamo.reset()


def test_grouped_query_attention_keeps_its_few_key_value_heads_for_backward():
    """What SDPA saves for backward on the packed path: K and V with their 2 heads, never
    repeated to the query's 8 (which would keep 4x their memory per layer)."""
    q, k, v = _qkv(8, 2)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _attend("sdpa", q, k, v, causal=True, window=None)
    assert saved
    per_segment = [s for s in saved if len(s) == 4]
    assert all(s[1] in (2, 8) for s in per_segment), saved
    assert sum(s[1] == 2 for s in per_segment) >= 2 * len(LENGTHS)  # K and V of every segment, unrepeated
    assert sum(s[1] == 8 for s in per_segment) <= 2 * len(LENGTHS)  # only the query and the output


def test_the_auto_kernel_on_cpu_is_the_sdpa_loop_and_a_layout_of_another_batch_is_refused():
    q, k, v = _qkv(4, 2)
    assert kernels.resolve("auto", q, dropout=0.0) == "sdpa"
    with pytest.raises(ValueError, match="flash-attn runs bf16/fp16 on CUDA only"):
        kernels.resolve("flash", q, dropout=0.0)
    assert kernels.resolve("flex", q, dropout=0.1) == "sdpa"  # FlexAttention has no attention dropout
    with segments(Segments(stream=_stream(LENGTHS[:-1]), causal=True)), \
            pytest.raises(ValueError, match=r"1 row\(s\) of 64 positions, but the micro-batch layout packs 62"):
        segment_attention(torch.nn.Module(), q, k, v, None)


# ----------------------------------------------------------------------------- through the model


def _tiny_samples(spec):
    rng = np.random.default_rng(5)
    return [FakeSample("a", spec, rng, images=[(48, 32), (16, 40)], clips=[0.6], text=20),
            FakeSample("b", spec, rng, clips=[0.9, 0.3], text=50),
            FakeSample("c", spec, rng, images=[(24, 80)], text=7)]


@UNFUSED_FLEX
def test_the_tiny_model_gives_one_loss_under_every_cpu_kernel():
    """Loss and gradients of a packed micro-batch (images, clips, GQA decoder) under sdpa and
    eager; the loss under flex (forward only on CPU)."""
    spec = tiny()
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD)
    mb = collate(_tiny_samples(spec), patch=spec.vision.patch, packed=True, pad_id=0)
    results = {}
    for kernel in CPU_KERNELS:
        for layer in layers:
            layer.zero_grad()
        with kernels.using(kernel):
            loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
        loss.backward()
        results[kernel] = (loss.item(), [p.grad.clone() for layer in layers for p in layer.parameters()])
    with kernels.using("flex"), torch.no_grad():
        flex = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens]))).item()
    worst = max((a - b).abs().max().item() for a, b in zip(results["sdpa"][1], results["eager"][1]))
    print(f"\ntiny packed loss: sdpa {results['sdpa'][0]:.7f}, eager {results['eager'][0]:.7f}, flex {flex:.7f}; "
          f"max |grad sdpa - grad eager| {worst:.1e}")
    assert results["eager"][0] == pytest.approx(results["sdpa"][0], rel=1e-6)
    assert flex == pytest.approx(results["sdpa"][0], rel=1e-6)
    for a, b in zip(results["sdpa"][1], results["eager"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _count_host_reads(layers, carrier) -> int:
    fresh = tuple(t.clone() for t in carrier)  # a micro-batch no layer has seen yet
    with torch.no_grad(), HostReads() as reads:
        run_layers(layers, fresh)
    return reads.count


def _deeper(layers, kinds):
    """The same layers with every block of `kinds` run three times (a deeper model's forward)."""
    out = []
    for layer in layers:
        out += [layer] * (3 if any(layer.name.startswith(k) for k in kinds) else 1)
    return out


def test_host_reads_per_micro_batch_do_not_grow_with_the_layers():
    """Reading the segment lengths to the host (a GPU sync) happens once per micro-batch and
    stage, whatever the number of blocks: tripling every encoder and decoder block adds none."""
    spec = tiny()
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD)
    mb = collate(_tiny_samples(spec), patch=spec.vision.patch, packed=True, pad_id=0)
    base = _count_host_reads(layers, mb.carrier)
    deep = _count_host_reads(_deeper(layers, ("vision.block", "audio.block", "llm.block")), mb.carrier)
    assert base > 0
    assert deep == base, f"{deep - base} more host reads with 2 more of each block"


@pytest.mark.parametrize("case", ["qwen2_vl", "qwen2_audio", "llava_clip_mistral"])
def test_host_reads_do_not_grow_with_the_blocks_of_hugging_face_models(case, request):
    """Qwen2-VL's vision blocks get the carried cu_seqlens in one call (transformers would split
    per image with a .tolist() per block); Qwen2-Audio's clips; the decoders' samples."""
    folder = request.getfixturevalue(case)
    spec = spec_from_folder(folder)
    layers = build_hf_layers(spec, seed=0)
    rng = np.random.default_rng(0)
    mb = collate_hf([media_sample(spec, rng), media_sample(spec, rng), text_sample(rng)], spec=spec,
                    packed=True, pad_id=0)
    blocks = ("vision.block", "audio.block", "llm.block")
    base = _count_host_reads(layers, mb.carrier)
    deep = _count_host_reads(_deeper(layers, blocks), mb.carrier)
    assert deep == base, f"{deep - base} more host reads with 2 more of each block"


def test_qwen2_vl_vision_blocks_attend_once_over_all_images(qwen2_vl, monkeypatch):
    """One attention call per vision block for two images, with the carried image layout."""
    spec = spec_from_folder(qwen2_vl)
    layers = build_hf_layers(spec, seed=0)
    rng = np.random.default_rng(3)
    mb = collate_hf([media_sample(spec, rng), media_sample(spec, rng)], spec=spec, packed=True, pad_id=0)
    calls = []
    real = kernels.packed

    def spy(kernel, query, key, value, stream, **kw):
        calls.append((query.shape[2], stream.lengths, kw["causal"]))
        return real(kernel, query, key, value, stream, **kw)

    monkeypatch.setattr(kernels, "packed", spy)
    x = mb.carrier
    for layer in layers:
        if layer.name == "llm.embed":
            break
        x = layer(x)
    images = layout.read(mb.carrier[C.LAYOUT]).image.lengths
    assert len(images) == 2
    assert calls == [(sum(images), images, False)] * spec.vision.blocks


def test_hugging_face_layouts_are_transformers_own_segments(qwen2_vl, qwen2_audio):
    """Qwen2-VL: transformers' get_vision_cu_seqlens (each temporal frame its own segment);
    Qwen2-Audio: (L - 1) // 2 + 1 positions per clip of L valid frames."""
    from transformers.vision_utils import get_vision_cu_seqlens

    grid = torch.tensor([[2, 4, 6], [1, 2, 2], [1, 6, 4]])
    cu = layout.read(layout.encode([1], layout.image_segments(grid.tolist()), [])).image.cu_seqlens
    assert torch.equal(cu, get_vision_cu_seqlens(grid))
    rng = np.random.default_rng(4)
    for folder in (qwen2_vl, qwen2_audio):
        spec = spec_from_folder(folder)
        mb = collate_hf([media_sample(spec, rng), media_sample(spec, rng)], spec=spec, packed=True, pad_id=0)
        lay = layout.read(mb.carrier[C.LAYOUT])
        if spec.audio is None:
            assert torch.equal(lay.image.cu_seqlens, get_vision_cu_seqlens(mb.carrier[C.IMAGE_GRID]))
        else:
            frames = mb.carrier[C.AUDIO_FRAMES]
            assert list(lay.audio.lengths) == ((frames - 1) // 2 + 1).tolist() and len(frames) == 2


def test_a_micro_batch_collated_for_another_audio_stride_is_a_one_line_error():
    spec = tiny()
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD)
    mb = collate(_tiny_samples(spec)[1:2], patch=spec.vision.patch, packed=True, pad_id=0, audio_stride=3)
    audio_embed = next(layer for layer in layers if layer.name == "audio.embed")
    with pytest.raises(ValueError, match=r"audio clip 0 has 45 encoder positions but the micro-batch's layout "
                                         r"says 30; collate it with audio_stride=model.audio.conv_stride \(2\)"):
        audio_embed(mb.carrier)


@UNFUSED_FLEX
def test_a_sliding_window_decoder_gives_one_loss_under_every_cpu_kernel(llava_clip_mistral):
    """Mistral with an 8-token window, shorter than the samples: packed loss under sdpa, eager
    and flex, and the padded (dense-mask) loss."""
    from mmpipe.model.hf.media import preprocess_image

    from . import hf_cases as H

    spec = spec_from_folder(llava_clip_mistral)
    layers = build_hf_layers(spec, seed=0)
    samples = [H.Sample(s.key, s.input_ids, s.labels, [preprocess_image(spec, b) for b in s.images], [])
               for s in H.llava_samples(spec, np.random.default_rng(0))]
    assert min(len(s.input_ids) for s in samples) > 8
    losses = {}
    with torch.no_grad():
        for kernel, packed in (("sdpa", True), ("eager", True), ("flex", True), ("sdpa", False)):
            mb = collate_hf(samples, spec=spec, packed=packed, pad_id=0)
            with kernels.using(kernel):
                losses[kernel, packed] = token_loss(run_layers(layers, mb.carrier),
                                                    (mb.targets, torch.tensor([1.0 / mb.label_tokens]))).item()
    print(f"\nmistral window 8: {losses}")
    ref = losses["sdpa", True]
    assert all(v == pytest.approx(ref, rel=1e-6) for v in losses.values()), losses


BLOCKS = [(0, 3), (8, 13), (22, 32), (33, 34), (45, 55)]
"""Image blocks [start, end) of the LENGTHS row (Gemma 3's images): one that fills its segment's head, one
longer than WINDOW, one that ends its segment, a one-position block, and one inside the longest segment."""


def _blocks() -> torch.Tensor:
    out = torch.full((sum(LENGTHS),), -1, dtype=torch.long)
    for k, (a, b) in enumerate(BLOCKS):
        out[a:b] = k
    return out


def _block_reference(q, k, v, *, window: int | None) -> torch.Tensor:
    """Dense float64 attention of transformers' Gemma 3 masks: same segment and (causal or same block),
    and with a window k > q - window."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    blocks, i = _blocks(), torch.arange(doc.shape[0])
    seen = (i[None, :] <= i[:, None]) | ((blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0))
    allowed = (doc[:, None] == doc[None, :]) & seen
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def _attend_blocks(kernel: str, q, k, v, *, window: int | None) -> torch.Tensor:
    with kernels.using(kernel), segments(Segments(stream=_stream(LENGTHS), causal=True, blocks=_blocks())):
        out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5,
                                   sliding_window=window)
    return out


@UNFUSED_FLEX
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
def test_image_blocks_attend_both_ways_under_every_kernel(window):
    """Segments.blocks (Gemma 3's images): sdpa and eager in output and gradients, flex forward (CPU),
    equal the dense reference; a block longer than the window sees its whole self forward, the window
    bounding only the keys behind a query; flash-attn is refused by name."""
    ref_in = _qkv(4, 2)
    ref = _block_reference(*ref_in, window=window)
    ref.backward(torch.ones_like(ref))
    for kernel in (*CPU_KERNELS, "flex"):
        q, k, v = _qkv(4, 2) if kernel != "flex" else (x.detach() for x in _qkv(4, 2))
        with torch.set_grad_enabled(kernel != "flex"):
            out = _attend_blocks(kernel, q, k, v, window=window)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
        if kernel != "flex":
            out.backward(torch.ones_like(out))
            for x, r in zip((q, k, v), ref_in):
                torch.testing.assert_close(x.grad.double(), r.grad.double(), rtol=0, atol=2e-5)
    causal = _reference(*(x.detach() for x in _qkv(4, 2)), causal=True, window=window)
    assert (causal - ref).abs().max() > 1e-3  # the blocks matter
    with pytest.raises(ValueError, match="train.attention=flash cannot attend bidirectionally"):
        kernels.resolve("flash", ref, dropout=0.0, blocks=True)
