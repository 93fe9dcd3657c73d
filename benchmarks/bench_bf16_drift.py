"""How far bf16 rounding alone moves a short training run: single-process controls for
`mmpipe train train.precision=bf16` against fp32 (no DeepSpeed, no pipeline).

Each mode trains the same model on the same steps (the first global_batch samples of the stream
per step, loss = mean over the step's label tokens, AdamW with mmpipe's betas/eps, lr schedule
and global-norm clipping) and prints its loss and pre-clip gradient norm per step:

  fp32            fp32 weights and compute
  fp32-bf16init   the same, from the initial weights rounded to bf16 (where DeepSpeed's
                  BF16_Optimizer starts its fp32 master copy)
  autocast        fp32 master weights, bf16 compute by torch.autocast (another bf16 path)
  bf16-master     bf16 weights and compute, fp32 master weights and fp32 gradients (what
                  DeepSpeed's BF16_Optimizer does, written out in one process)

Usage (the GPU test's WIDE model, about 10 s a step per mode on 2 CPU cores):
  python benchmarks/bench_bf16_drift.py --steps 12 model.llm.hidden=1024 model.llm.mlp=2816 \
      model.llm.heads=16 model.llm.kv_heads=8 model.llm.blocks=8 model.vision.proj=[1024,1024] \
      model.audio.proj=[1024]
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch

from mmpipe.cli import load
from mmpipe.config import tokenizer_source
from mmpipe.data.reader import iter_samples
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.paths import PACKAGE_ROOT, resolve_path
from mmpipe.runtime.batch import collate
from mmpipe.runtime.pipeline import lr_lambda

MODES = ("fp32", "fp32-bf16init", "autocast", "bf16-master")


def steps_of(rc, tok, steps: int):
    stream = iter_samples(path=resolve_path(rc.data.path), tokenizer=tok, spec=rc.model, dp_rank=0, dp_size=1,
                          seed=rc.train.seed, epochs=None, root=PACKAGE_ROOT)
    for _ in range(steps):
        yield [next(stream) for _ in range(rc.train.global_batch)]


def train(rc, tok, mode: str, steps: int) -> list[tuple[float, float]]:
    t = rc.train
    media = dict(image_token=tok.image_id, audio_token=tok.audio_id, video_token=tok.video_id)
    layers = build_layers(rc.model, seed=t.seed, **media)
    masters = [p for layer in layers for p in layer.parameters()]
    if mode != "fp32":  # every other mode starts from the bf16-rounded initial weights
        with torch.no_grad():
            for p in masters:
                p.copy_(p.to(torch.bfloat16))
    compute = layers
    if mode == "bf16-master":
        compute = build_layers(rc.model, seed=t.seed, **media)
        for layer in compute:
            layer.to(torch.bfloat16)
    lows = [p for layer in compute for p in layer.parameters()]
    opt = torch.optim.AdamW(masters, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup=t.warmup_steps, total=t.steps))
    out = []
    for samples in steps_of(rc, tok, steps):
        if mode == "bf16-master":
            with torch.no_grad():
                for lo, hi in zip(lows, masters):
                    lo.copy_(hi)
        mb = collate(samples, patch=rc.model.vision.patch, packed=True, pad_id=tok.pad_id,
                     temporal_patch=rc.model.vision.video.temporal_patch)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        with ctx:
            loss = token_loss(run_layers(compute, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
        loss.backward()
        if mode == "bf16-master":
            for lo, hi in zip(lows, masters):
                hi.grad = None if lo.grad is None else lo.grad.float()
                lo.grad = None
        norm = float(torch.nn.utils.clip_grad_norm_(masters, t.grad_clip if t.grad_clip > 0 else math.inf))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append((float(loss), norm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("overrides", nargs="*", help="mmpipe config overrides (model.llm.hidden=1024 ...)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rc = load([f"train.steps={args.steps}", *args.overrides], job="bench")
    tok = load_tokenizer(tokenizer_source(rc)[0])
    rows = {}
    for mode in args.modes.split(","):
        rows[mode] = train(rc, tok, mode, args.steps)
        losses = " ".join(f"{loss:.3f}" for loss, _ in rows[mode])
        norms = " ".join(f"{n:.2f}" for _, n in rows[mode])
        tail = sum(loss for loss, _ in rows[mode][-3:]) / min(3, len(rows[mode]))
        print(f"{mode:14s} loss  {losses} | mean of last 3 {tail:.3f}", flush=True)
        print(f"{'':14s} norm  {norms}", flush=True)


if __name__ == "__main__":
    main()
