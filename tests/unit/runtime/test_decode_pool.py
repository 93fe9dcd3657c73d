"""data.decode_workers: the next steps' micro-batches decoded and collated in worker processes."""

from __future__ import annotations

import os
import time

import pytest
import torch

from mmpipe.cli import load
from mmpipe.config import tokenizer_source
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.runtime import feed
from mmpipe.runtime.feed import StepFeeder
from mmpipe.runtime.host import decode_workers
from mmpipe.runtime.procpool import WorkerDied
from mmpipe.runtime.stages import choose_stages


@pytest.fixture(scope="module")
def setup():
    rc = load(["train.global_batch=32", "train.steps=2", "plan.refit=false"], job="test")
    tok = load_tokenizer(tokenizer_source(rc)[0])
    return rc, tok, choose_stages(rc, tok).plan


def _feeder(setup, workers: int, steps: int, **over) -> StepFeeder:
    rc, tok, plan = setup
    rc = load([f"train.global_batch={over.pop('batch', 32)}", f"train.steps={steps}", "plan.refit=false",
               f"data.decode_workers={workers}", *over.pop("more", [])], job="test")
    return StepFeeder(rc, tokenizer=tok, dp_rank=0, stage_plan=plan, media=True, steps=steps, **over)


def _steps(f: StepFeeder, n: int) -> list:
    try:
        return [f.next_step() for _ in range(n)]
    finally:
        f.close()


def test_workers_build_the_same_micro_batches_as_the_thread(setup):
    thread, workers = (_steps(_feeder(setup, w, 2), 2) for w in (0, 2))
    for a, b in zip(thread, workers):
        assert [m.keys for m in a.micro_batches] == [m.keys for m in b.micro_batches]
        assert a.reader_state == b.reader_state
        for x, y in zip(a.micro_batches, b.micro_batches):
            assert (x.tokens, x.label_tokens) == (y.tokens, y.label_tokens)
            assert torch.equal(x.targets, y.targets)
            assert len(x.carrier) == len(y.carrier)
            assert all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(x.carrier, y.carrier))
    assert sum(p.micro_batches[0].carrier[3].numel() for p in workers) > 0  # image / video patches crossed


def _burn(seconds: float) -> None:
    """GIL-holding Python work: `seconds` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


DECODE_S = 0.05   # per sample: 8 samples a step
COMPUTE_S = 0.24  # per step, in the consuming (training) thread
STEPS = 4


def _consume(setup, workers: int) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds of steps 2..STEPS) over a feeder's life."""
    cpu0 = time.process_time()
    # the image / audio / text shards: their real decoding is a few ms a step, beside the burn
    f = _feeder(setup, workers, STEPS, batch=8, more=["data.path='data/shards/train-{000000..000007}.tar'"])
    try:
        f.next_step()
        _burn(COMPUTE_S)
        t0 = time.perf_counter()
        for _ in range(STEPS - 1):
            f.next_step()
            _burn(COMPUTE_S)
        wall = time.perf_counter() - t0
    finally:
        f.close()
    return time.process_time() - cpu0, wall


def test_decoding_in_workers_overlaps_the_training_thread(setup, monkeypatch):
    real = feed.decode_record

    def slow(*args, **kw):
        _burn(DECODE_S)
        return real(*args, **kw)

    monkeypatch.setattr(feed, "decode_record", slow)
    cpu_thread, wall_thread = _consume(setup, 0)
    cpu_workers, wall_workers = _consume(setup, 1)
    decode_total = DECODE_S * 8 * STEPS
    print(f"cpu: thread {cpu_thread:.2f} s, workers {cpu_workers:.2f} s (decode burn {decode_total:.2f} s); "
          f"wall of {STEPS - 1} steps: thread {wall_thread:.2f} s, workers {wall_workers:.2f} s")
    # the decoding is no longer this process's: the training thread does not pay for it (CPU
    # time, which other load on the machine hardly changes; reading and planning stay here)
    compute_total = COMPUTE_S * STEPS
    assert cpu_thread > compute_total + 0.9 * decode_total  # in the thread, it does
    assert cpu_workers < compute_total + 0.5 * decode_total
    # a step takes about max(compute, feed), not their sum; on a loaded 2-core machine the wall
    # clock says little, so only this, generously: never slower than the thread
    assert wall_workers < 1.15 * wall_thread


def test_a_worker_that_raises_gives_one_error_in_the_training_thread(setup, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(feed, "decode_record", broken)
    f = _feeder(setup, 1, 1, batch=8)
    with pytest.raises(RuntimeError, match="decoder bug") as err:
        _steps(f, 1)
    assert "in broken" in str(err.value.__cause__)  # the worker's traceback


def test_a_worker_that_dies_gives_one_error_not_a_hang(setup, monkeypatch):
    monkeypatch.setattr(feed, "decode_record", lambda *a, **k: os.kill(os.getpid(), 9))
    f = _feeder(setup, 1, 1, batch=8)
    pids = f._pool.pids
    with pytest.raises(WorkerDied, match=r"mmpipe-decode-0 \(pid \d+\) was killed by SIGKILL while working on samples"):
        _steps(f, 1)
    time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_close_ends_the_workers(setup):
    f = _feeder(setup, 2, 1, batch=8)
    pids = f._pool.pids
    assert len(pids) == 2 and all(os.path.exists(f"/proc/{p}") for p in pids)
    _steps(f, 1)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_auto_keeps_small_ranks_in_the_thread():
    assert [decode_workers("auto", n) for n in (1, 2, 3, 4, 8, 16, 64)] == [0, 0, 0, 2, 4, 4, 4]
    assert decode_workers(3, 1) == 3


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_value_is_one_line_naming_the_key(value):
    with pytest.raises(ValueError, match=r"data.decode_workers=.* must be auto or a whole number >= 0"):
        load([f"data.decode_workers={value}"], job="test")
