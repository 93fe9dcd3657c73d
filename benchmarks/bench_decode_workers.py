"""data.decode_workers against the feeder thread: a training thread that holds the GIL for
--compute seconds a step (Python work, as kernel launches are) beside a first-stage feeder
on the shipped data. Prints per round and setting the feeder's feed_s, the step time the
consumer saw and this process's CPU seconds a step (the decoding's, in the thread).

    python benchmarks/bench_decode_workers.py --batch 64 --steps 3 --workers 2 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from mmpipe.cli import load
from mmpipe.config import tokenizer_source
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.runtime.feed import StepFeeder
from mmpipe.runtime.stages import choose_stages


def run(batch: int, steps: int, workers: int, compute: float) -> tuple[float, float, float]:
    rc = load([f"train.global_batch={batch}", f"train.steps={steps}", "plan.refit=false",
               f"data.decode_workers={workers}"], job="bench")
    tok = load_tokenizer(tokenizer_source(rc)[0])
    f = StepFeeder(rc, tokenizer=tok, dp_rank=0, stage_plan=choose_stages(rc, tok).plan, media=True, steps=steps)
    feed, cpu0, t0 = [], 0.0, 0.0
    try:
        for k in range(steps):
            if k == 1:  # the first step waits for the feeder's start; time the rest
                cpu0, t0 = time.process_time(), time.perf_counter()
            feed.append(f.next_step().feed_seconds)
            end = time.thread_time() + compute
            while time.thread_time() < end:
                pass
    finally:
        f.close()
    n = steps - 1
    return statistics.median(feed[1:]), (time.perf_counter() - t0) / n, (time.process_time() - cpu0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compute", type=float, default=0.3)
    a = ap.parse_args()
    print("round  decode_workers  feed_s  step_s  cpu_s/step")
    for r in range(a.rounds):
        for w in (0, a.workers):  # alternated, so the machine's load falls on both
            feed, step, cpu = run(a.batch, a.steps, w, a.compute)
            print(f"{r:5d}  {w:14d}  {feed:6.3f}  {step:6.3f}  {cpu:10.3f}", flush=True)


if __name__ == "__main__":
    main()
