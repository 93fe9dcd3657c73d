"""How the per-tensor loops of DeepSpeed's BF16_Optimizer (0.19.8) scale with the number of
parameter tensors, on this device, for a fixed parameter count: the per-micro-batch gradient
accumulation into fp32 (`update_hp_grads`: a cast and an add per tensor), the per-step norm
(`get_global_norm_of_tensors`: one `.float().norm()` per tensor, stacked) and clipping (a `mul_`
per tensor), each against the flat or `torch._foreach` form of the same work, next to the fused
AdamW update of the flat fp32 partition (one call whatever the count).

Usage: python benchmarks/bench_optimizer_loops.py [--params 20000000] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, device: str, repeat: int = 5) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def measure(count: int, n: int, dev: str, flat32: torch.Tensor) -> list[float]:
    """Times (ms) of the loops and their flat/foreach forms over `count` tensors."""
    size = n // count
    low = [torch.randn(size, device=dev, dtype=torch.bfloat16) for _ in range(count)]
    low_flat = torch.cat(low)
    hp = list(flat32[:size * count].split(size))

    def acc_loop():
        for h, g in zip(hp, low):
            h.add_(g.to(torch.float32))

    def acc_flat():
        flat32[:size * count].add_(low_flat.to(torch.float32))

    def norm_loop():
        torch.stack([t.float().norm(2) for t in hp]).pow(2).sum().sqrt()

    def norm_foreach():
        torch.stack(torch._foreach_norm(hp)).pow(2).sum().sqrt()

    def clip_loop():
        for t in hp:
            t.mul_(0.999)

    def clip_foreach():
        torch._foreach_mul_(hp, 0.999)

    return [timed(f, dev) for f in (acc_loop, acc_flat, norm_loop, norm_foreach, clip_loop, clip_foreach)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=20_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev, n = args.device, args.params
    flat32 = torch.zeros(n, device=dev)
    master = torch.randn(n, device=dev).requires_grad_()
    master.grad = torch.randn(n, device=dev)
    adam = torch.optim.AdamW([master], lr=1e-3, fused=True)
    adam_ms = timed(adam.step, dev)
    print(f"{n:,} parameters on {dev}; fused AdamW step on the flat fp32 partition: {adam_ms:.1f} ms")
    print(f"{'tensors':>8} {'accumulate: loop':>17} {'flat':>7} {'norm: loop':>11} {'foreach':>8} "
          f"{'clip: loop':>11} {'foreach':>8}  (ms)")
    for count in (16, 64, 256, 1024, 4096):
        row = measure(count, n, dev, flat32)
        print(f"{count:>8} {row[0]:>17.2f} {row[1]:>7.2f} {row[2]:>11.2f} {row[3]:>8.2f} {row[4]:>11.2f} "
              f"{row[5]:>8.2f}")


if __name__ == "__main__":
    main()
