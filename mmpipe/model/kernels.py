"""Attention kernels for packed segments, and which one a run uses (`train.attention`).

Every kernel computes the same thing: attention inside each segment of a packed sequence
(a sample, an image, a clip), causal or bidirectional, optionally limited to a sliding window,
with grouped-query attention (fewer key/value heads than query heads) taken as it is:

- `flash`: flash-attn's varlen kernel on the carried cu_seqlens (CUDA, bf16/fp16). Each segment
  costs its own length squared; GQA and windows are native.
- `flex`: torch's FlexAttention with a document mask (CUDA, compiled). The block mask skips
  every tile outside the segments, so the cost is about the sum of squares too, rounded up to
  128 x 128 tiles. No dropout: a call with attention dropout runs `sdpa` instead.
- `sdpa`: one scaled_dot_product_attention call per segment (any device; CPU's only training
  kernel). Costs the sum of squares, plus one kernel launch per segment.
- `eager`: a dense block-diagonal mask over the whole row and plain matmul-softmax, the way
  transformers' eager attention does it: the reference the others are tested against. It pays
  (sum of lengths)^2 and keeps the full score matrix; not for training at scale.
- `auto`: flash where flash-attn imports, on CUDA, in half precision; else flex on CUDA; else
  sdpa.

Padded micro-batches (several rows with a dense mask) and unsegmented rows (LLaVA's fixed-size
images) run SDPA with that mask under every kernel but `eager`: a padded batch is the baseline
that pays for its padding, and SDPA's own dispatcher already picks its flash backend on CUDA
where no mask is needed.

GQA: flash-attn and FlexAttention take fewer key/value heads natively, and SDPA does with
`enable_gqa` on CPU and in its CUDA flash backend. SDPA's other CUDA backends (the ones that
take a mask or fp32) do not: there a masked SDPA call repeats K/V, as transformers does,
rather than fall back to SDPA's math backend, which would keep the full score matrix.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn import functional as F

from mmpipe.model.kernel_choice import KERNELS
from mmpipe.model.layout import Stream

HALF = (torch.bfloat16, torch.float16)

_selected = "auto"


def flash_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flex_importable() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


FLASH_BLOCKS = ("train.attention=flash cannot attend bidirectionally inside an image (Gemma 3's image blocks): "
                "flash-attn's varlen kernel is causal or not per call; use train.attention=auto (FlexAttention) "
                "or flex")
"""The one-line refusal of flash-attn for a model with image blocks (attention.Segments.blocks)."""


def check(name: str, *, precision: str, blocks: bool = False) -> None:
    """Refuse, in one line before launch, a kernel this machine or this precision cannot run, or one
    that cannot mask the model's image blocks (`blocks`: VisionSpec.image_blocks)."""
    if name not in KERNELS:
        raise ValueError(f"train.attention={name!r} is unknown; use one of {', '.join(KERNELS)}")
    if name == "flash" and blocks:
        raise ValueError(FLASH_BLOCKS)
    cuda = torch.cuda.is_available()
    if name == "flash":
        if not flash_importable():
            raise ValueError("train.attention=flash needs the flash-attn package, which does not import here "
                             "(pip install flash-attn --no-build-isolation); or use train.attention=auto")
        if not cuda:
            raise ValueError("train.attention=flash needs a CUDA GPU and torch sees none "
                             "(torch.cuda.is_available() is False); use train.attention=auto")
        if precision not in ("bf16", "fp16"):
            raise ValueError(f"train.attention=flash runs in bf16 or fp16 only, not train.precision={precision}; "
                             f"set train.precision=bf16 or use train.attention=auto")
    if name == "flex":
        if not flex_importable():
            raise ValueError(f"train.attention=flex needs torch.nn.attention.flex_attention, which torch "
                             f"{torch.__version__} lacks; use train.attention=auto")
        if not cuda:
            raise ValueError(f"train.attention=flex needs a CUDA GPU: torch {torch.__version__} has no "
                             f"FlexAttention backward on CPU; use train.attention=sdpa (or auto)")


def use(name: str) -> None:
    """Make `name` this process's kernel (the pipeline builder calls it with train.attention)."""
    global _selected
    if name not in KERNELS:
        raise ValueError(f"train.attention={name!r} is unknown; use one of {', '.join(KERNELS)}")
    _selected = name


def selected() -> str:
    return _selected


@contextmanager
def using(name: str) -> Iterator[None]:
    """Run a block with another kernel (tests, benchmarks)."""
    before = selected()
    use(name)
    try:
        yield
    finally:
        use(before)


def resolve(name: str, query: torch.Tensor, *, dropout: float, blocks: bool = False) -> str:
    """The kernel a packed call runs under the choice `name`; `blocks`: the call has bidirectional
    blocks (Gemma 3's images), which flash-attn's causal varlen kernel cannot mask."""
    if name == "auto":
        if query.is_cuda and query.dtype in HALF and flash_importable() and not blocks:
            return "flash"
        name = "flex" if query.is_cuda else "sdpa"
    if name == "flash" and blocks:
        raise ValueError(FLASH_BLOCKS)
    if name == "flash" and (not query.is_cuda or query.dtype not in HALF):
        raise ValueError(f"train.attention=flash got {query.dtype} tensors on {query.device}; flash-attn runs "
                         f"bf16/fp16 on CUDA only: set train.precision=bf16 or use train.attention=auto")
    if name == "flex" and dropout > 0:
        return "sdpa"  # FlexAttention has no attention dropout
    return name


def describe(name: str, *, cuda: bool, precision: str, blocks: bool = False) -> str:
    """What `name` runs on this machine at this precision (for the start-up line); `blocks`: the
    model has image blocks, which `auto` never gives flash-attn."""
    if name == "auto":
        if cuda and precision != "fp32" and flash_importable() and not blocks:
            return "auto: flash-attn varlen"
        return "auto: FlexAttention, document mask" if cuda else "auto: SDPA per segment"
    return {"flash": "flash-attn varlen", "flex": "FlexAttention, document mask", "sdpa": "SDPA per segment",
            "eager": "eager, dense block-diagonal mask"}[name]


def compiles(name: str, *, cuda: bool, precision: str, dropout: float = 0.0, blocks: bool = False) -> bool:
    """Whether the choice `name` runs packed rows through a kernel compiled per sequence length
    on this machine (FlexAttention on CUDA): where plan.ladder=auto pads micro-batches to a few
    lengths. flash-attn's varlen kernel and SDPA take any length without a compile."""
    if not cuda or dropout > 0:  # no CUDA: SDPA; attention dropout: flex runs sdpa (`resolve`)
        return False
    if name == "auto":
        return blocks or not (precision != "fp32" and flash_importable())
    return name == "flex"


# ----------------------------------------------------------------------------- kernels
# Each takes query [1, H, T, d], key/value [1, Hkv, T, d] of one packed row and returns
# [1, T, H, d] (transformers' attention-function layout).


def packed(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, stream: Stream, *,
           causal: bool, window: int | None, scale: float | None, dropout: float,
           blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention inside each segment of `stream` with the resolved `kernel`; `blocks` (causal only):
    a block id per position, -1 outside any; a block's positions also see each other forward
    (attention.Segments.blocks)."""
    if kernel == "flash":
        if blocks is not None:
            raise ValueError("flash-attn cannot mask bidirectional image blocks; resolve() picks another kernel")
        return _flash(query, key, value, stream, causal=causal, window=window, scale=scale, dropout=dropout)
    if kernel == "flex":
        return _flex(query, key, value, stream, causal=causal, window=window, scale=scale, blocks=blocks)
    if kernel == "eager":
        mask = _document_mask(stream, causal=causal, window=window, dtype=query.dtype, blocks=blocks)
        return eager(query, key, value, mask, scale=scale, dropout=dropout)
    return _sdpa_loop(query, key, value, stream, causal=causal, window=window, scale=scale, dropout=dropout,
                      blocks=blocks)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: torch.Tensor | None,
         causal: bool, scale: float | None, dropout: float) -> torch.Tensor:
    """SDPA [B, H, T, d] -> [B, H, T, d], key/value heads repeated only where SDPA's backend for
    this call has no GQA (see the module docstring)."""
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.is_cuda and (mask is not None or query.dtype not in HALF):
        key, value = repeat_kv(key, query.shape[1]), repeat_kv(value, query.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


def eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *,
          scale: float | None, dropout: float) -> torch.Tensor:
    """Matmul, additive mask, fp32 softmax, matmul (transformers' eager attention) -> [B, T, H, d]."""
    key, value = repeat_kv(key, query.shape[1]), repeat_kv(value, query.shape[1])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def window_mask(n: int, window: int, dtype: torch.dtype, device: torch.device, *, causal: bool = True) -> torch.Tensor:
    """Additive [n, n] causal mask of a sliding window: query q sees keys q-window < k <= q
    (transformers' `sliding_window_overlay` on a causal mask); `causal=False`: the window's lower
    bound only (k > q - window), for a mask that is causal already or causal-or-same-block."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    mask = torch.zeros((n, n), dtype=dtype, device=device)
    hidden = k <= q - window
    return mask.masked_fill_(hidden | (k > q) if causal else hidden, torch.finfo(dtype).min)


def block_allowed(blocks: torch.Tensor, *, window: int | None) -> torch.Tensor:
    """Boolean [n, n] of one causal segment with image blocks: causal or same block (id >= 0), and
    with a window, k > q - window (transformers' Gemma 3 masks: blockwise_overlay OR'd into the
    causal mask, sliding_window_overlay AND'd on top)."""
    i = torch.arange(blocks.shape[0], device=blocks.device)
    allowed = (i[None, :] <= i[:, None]) | ((blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0))
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return allowed


def _sdpa_loop(query, key, value, stream: Stream, *, causal, window, scale, dropout, blocks=None) -> torch.Tensor:
    parts, start = [], 0
    masks = None
    if blocks is not None:  # one explicit mask per segment (causal or same block, and the window), made once
        masks = stream.derived.get(("sdpa_block_masks", window, str(query.device)))  # per micro-batch
        if masks is None:
            bounds = [0, *itertools.accumulate(stream.lengths)]
            masks = [block_allowed(blocks[a:b].to(query.device), window=window) for a, b in zip(bounds, bounds[1:])]
            stream.derived[("sdpa_block_masks", window, str(query.device))] = masks
    for i, n in enumerate(stream.lengths):
        sl = slice(start, start + n)
        if masks is not None and n > 1:
            parts.append(sdpa(query[:, :, sl], key[:, :, sl], value[:, :, sl], mask=masks[i], causal=False,
                              scale=scale, dropout=dropout))
            start += n
            continue
        windowed = causal and window is not None and n > window
        parts.append(sdpa(query[:, :, sl], key[:, :, sl], value[:, :, sl],
                          mask=window_mask(n, window, query.dtype, query.device) if windowed else None,
                          causal=causal and n > 1 and not windowed, scale=scale, dropout=dropout))
        start += n
    return (torch.cat(parts, dim=2) if parts else query).transpose(1, 2)


def _document_mask(stream: Stream, *, causal: bool, window: int | None, dtype: torch.dtype,
                   blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Additive [T, T] block-diagonal mask of the stream's segments (the dense reference)."""
    doc = stream.document_ids()
    i = torch.arange(doc.shape[0], device=doc.device)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        if blocks is not None:
            allowed &= block_allowed(blocks, window=window)
        else:
            allowed &= i[None, :] <= i[:, None]
            if window is not None:
                allowed &= i[:, None] - i[None, :] < window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _flash(query, key, value, stream: Stream, *, causal, window, scale, dropout) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]: flash-attn's varlen layout
    cu, longest = stream.cu_seqlens, stream.max_len
    out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale,
                                 causal=causal, window_size=(window - 1, 0) if causal and window else (-1, -1))
    return out[None]


FLEX_BLOCK = 128
"""FlexAttention's tile (its default sparse block size): the block mask says, per 128 x 128 tile,
whether it is skipped, computed whole, or computed under the mask; packed lengths that are
multiples of it (the planner's length ladder) leave no ragged tail tile."""


def _flex(query, key, value, stream: Stream, *, causal, window, scale, blocks=None) -> torch.Tensor:
    key_ = ("flex_block_mask", causal, window, str(query.device), blocks is not None)
    block_mask = stream.derived.get(key_)
    if block_mask is None:
        block_mask = segment_block_mask(stream, causal=causal, window=window, device=query.device, blocks=blocks)
        stream.derived[key_] = block_mask
    out = _flex_attention(query.is_cuda)(query, key, value, block_mask=block_mask, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _segment_mask_mod(doc: torch.Tensor, *, causal: bool, window: int | None, blocks: torch.Tensor | None = None):
    if blocks is not None and causal:
        return _block_mask_mod(doc, blocks, window=window)

    def same_segment(_b, _h, q_idx, kv_idx):  # the graph every family without image blocks compiles
        ok = doc[q_idx] == doc[kv_idx]
        if causal:
            ok = ok & (kv_idx <= q_idx)
            if window is not None:
                ok = ok & (q_idx - kv_idx < window)
        return ok

    return same_segment


def _block_mask_mod(doc: torch.Tensor, blocks: torch.Tensor, *, window: int | None):
    def same_segment_causal_or_block(_b, _h, q_idx, kv_idx):
        seen = (kv_idx <= q_idx) | ((blocks[q_idx] == blocks[kv_idx]) & (blocks[q_idx] >= 0))
        ok = (doc[q_idx] == doc[kv_idx]) & seen
        if window is not None:
            ok = ok & (q_idx - kv_idx < window)
        return ok

    return same_segment_causal_or_block


def segment_block_mask(stream: Stream, *, causal: bool, window: int | None, device: torch.device,
                       blocks: torch.Tensor | None = None):
    """FlexAttention's BlockMask of the stream's segments (document mask, causal or not).

    torch's create_block_mask finds the tiles by evaluating the mask over the whole [T, T] grid:
    compiled, that is a torch.compile of the mask per sequence length; uncompiled, a dense
    T x T tensor. The tiles of a document mask follow from the segment lengths alone, so they are
    computed here on the host from `stream.lengths` (no compile, no device sync, O(tiles)) and
    handed over with BlockMask.from_kv_blocks; the mask function only decides inside the tiles
    the segments cut. A sliding window, or image blocks (`blocks`: attention.Segments.blocks), take
    create_block_mask's path."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    doc = stream.document_ids()
    if blocks is not None:
        blocks = blocks.to(device=doc.device, dtype=torch.int32)
    mask_mod = _segment_mask_mod(doc, causal=causal, window=window, blocks=blocks if causal else None)
    n = stream.total
    if (window is not None or blocks is not None) and causal:
        return create_block_mask(mask_mod, None, None, n, n, device=device, _compile=device.type == "cuda")
    tiles = -(-n // FLEX_BLOCK)
    starts = torch.arange(tiles) * FLEX_BLOCK
    ends = torch.clamp(starts + FLEX_BLOCK, max=n) - 1
    bounds = torch.tensor(stream.lengths, dtype=torch.long).cumsum(0)
    first = torch.searchsorted(bounds, starts, right=True)  # the segment of each tile's first position
    last = torch.searchsorted(bounds, ends, right=True)
    q_first, q_last = first[:, None], last[:, None]
    k_first, k_last = first[None, :], last[None, :]
    touching = (q_first <= k_last) & (k_first <= q_last)  # some query and key of the tiles share a segment
    whole = (ends - starts + 1) == FLEX_BLOCK
    one = (first == last) & whole  # a full tile inside one segment
    full = one[:, None] & one[None, :] & (q_first == k_first)
    rows = torch.arange(tiles)
    if causal:  # a tile left of the diagonal: every key precedes every query; the diagonal: partly
        below = rows[None, :] < rows[:, None]
        touching = (touching & below) | (rows[None, :] == rows[:, None])
        full = full & below
    partial = touching & ~full

    def tile_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = m.sum(dim=1, dtype=torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)  # chosen tiles first
        return (count[None, None].to(device, non_blocking=True),
                order[None, None].contiguous().to(device, non_blocking=True))

    kv_num, kv_idx = tile_lists(partial)
    full_num, full_idx = tile_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


@functools.cache
def _flex_attention(compiled: bool):
    """FlexAttention compiled (CUDA: its fused Triton kernel), or as is (CPU: torch's unfused
    reference, forward only, keeping the score matrix; tests). Compiled with the sequence length
    dynamic from the first call, and without duck sizing: one compile (forward and backward)
    serves every micro-batch length of two tiles or more. Duck sizing gives sizes that happen to
    be equal one symbol, so the first call's tile count equal to the number of key/value heads
    (or the head size) becomes a guard, and the next length recompiles: the 5-25 s recompile seen
    in step 2 on an H200 (tests/unit/model/test_attention.py counts the graphs on CPU). A
    micro-batch of one tile (128 positions or fewer) still compiles once more: torch specializes
    sizes of 1. The compile happens in the first step (there is no warm-up before step 1); the
    on-disk cache (launcher.cache_dir) keeps it for the next launch."""
    import torch.fx.experimental._config  # torch's shape settings: no public switch for duck sizing
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    kernel = torch.compile(flex_attention, dynamic=True)

    def attend(*args, **kwargs):
        # read when a call is traced, not when its guards are checked
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return kernel(*args, **kwargs)

    return attend
