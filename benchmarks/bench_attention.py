"""Attention benchmark: packed kernels against SDPA per segment, and the planner's assumption
that a packed micro-batch's attention costs the sum of its segments' squares (docs/spec.md §6).

    python benchmarks/bench_attention.py                   # CUDA: bf16, 16k tokens, 16 heads / 4 KV heads, d=128
    python benchmarks/bench_attention.py --tokens 2048     # CPU: fp32, smaller defaults

A fixed number of tokens is split into 1, 4, 16, 64 and 256 equal segments and into one
long-tailed mix; for each split and each kernel this machine runs (CUDA: flash where flash-attn
imports, flex, sdpa, and eager up to --dense-max tokens; CPU: sdpa and eager), one causal GQA
attention call is timed forward + backward (median of --repeats after a warm-up that also
compiles FlexAttention). Printed per row: milliseconds, sum of s^2, and milliseconds per 10^6
s^2. Where cost follows sum s^2 that last column stays flat down the splits; the dense eager
kernel pays (sum s)^2 whatever the split, so its column grows with the number of segments.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmpipe.model import kernels, layout
from mmpipe.model.attention import Segments, segment_attention, segments


def splits(tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for n in (1, 4, 16, 64, 256):
        if tokens // n >= 8:
            out.append((f"{n} x {tokens // n}", [tokens // n] * n))
    tail, left, size = [], tokens, tokens // 2
    while left > 0:  # halving lengths: one long sample and many short ones
        size = max(8, min(size, left))
        tail.append(size)
        left -= size
        size //= 2
    out.append((f"mixed {len(tail)}", tail))
    return out


def time_call(kernel: str, stream: layout.Stream, q, k, v, repeats: int) -> float:
    def once():
        for x in (q, k, v):
            x.grad = None
        with kernels.using(kernel), segments(Segments(stream=stream, causal=True)):
            out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5)
        out.backward(torch.ones_like(out))

    once()  # warm-up (and FlexAttention's compilation)
    times = []
    for _ in range(repeats):
        if q.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384 if cuda else 2048)
    ap.add_argument("--heads", type=int, default=16 if cuda else 4)
    ap.add_argument("--kv-heads", type=int, default=4 if cuda else 2)
    ap.add_argument("--head-dim", type=int, default=128 if cuda else 32)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16" if cuda else "fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dense-max", type=int, default=16384 if cuda else 4096,
                    help="largest token count the dense eager kernel runs (it keeps the T x T scores)")
    args = ap.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    names = ["sdpa"]
    if cuda:
        names = (["flash"] if kernels.flash_importable() and dtype != torch.float32 else []) + ["flex", "sdpa"]
    if args.tokens <= args.dense_max:
        names.append("eager")
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, args.tokens, args.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (args.heads, args.kv_heads, args.kv_heads))
    print(f"{device.type} {torch.cuda.get_device_name() if cuda else ''} torch {torch.__version__}: "
          f"{args.tokens} tokens, {args.heads} heads / {args.kv_heads} KV heads, d={args.head_dim}, {args.dtype}, "
          f"causal, forward + backward, median of {args.repeats}")
    print(f"{'split':<14}{'sum s^2':>14}  " + "".join(f"{n + ' ms':>12}{'ms/1e6 s^2':>12}" for n in names)
          + ("  speed-up over sdpa" if len(names) > 1 else ""))
    for label, lengths in splits(args.tokens):
        stream = layout.read(layout.encode(lengths, [], []).to(device)).llm
        sq = sum(n * n for n in lengths)
        ms = {n: time_call(n, stream, q, k, v, args.repeats) for n in names}
        row = "".join(f"{ms[n]:>12.2f}{ms[n] / (sq / 1e6):>12.4f}" for n in names)
        speedup = ", ".join(f"{n} {ms['sdpa'] / ms[n]:.1f}x" for n in names if n != "sdpa")
        print(f"{label:<14}{sq:>14,}  {row}  {speedup}")


if __name__ == "__main__":
    main()
