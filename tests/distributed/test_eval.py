"""Validation through the real `mmpipe train` and `mmpipe eval` (launcher, DeepSpeed pipeline,
shipped shards), pp=2 x dp=2, with attention dropout on so that an evaluation that ran in train
mode, or drew random numbers, would show in the training that follows it.

Three launches: a run without evaluation (checkpoints every step); the same run resumed from its
step 1 with evaluation every 2 steps; `mmpipe eval` on the resumed run's step-4 checkpoint. The
held-out loss is recomputed in one process from the checkpoint's layers on the very samples.
"""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch

from mmpipe.cli import load, main
from mmpipe.config import tokenizer_source
from mmpipe.data.reader import iter_samples
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.paths import PACKAGE_ROOT, resolve_path
from mmpipe.runtime.batch import collate

pytestmark = pytest.mark.distributed

HELD_OUT = "data/shards/train-000007.tar"
SAMPLES = 12
COMMON = ["parallel.dp=2", "train.global_batch=8", "train.micro_batches=2", "train.steps=5", "train.warmup_steps=1",
          "train.save_every=1", "train.record_samples=true", "model.llm.attention_dropout=0.1"]
EVAL = [f"data.eval_path={HELD_OUT}", "train.eval_every=2", f"train.eval_samples={SAMPLES}"]
REL = 1e-5  # fp32 sums in another order (micro-batches and replicas vs one packed row)


def _held_out_loss(overrides: list[str], step_dir) -> tuple[float, int]:
    """One process, eval mode: the checkpoint's layers on the first SAMPLES samples of HELD_OUT
    as one packed row; the mean cross-entropy per label token, and the label tokens."""
    rc = load(overrides, job="test")
    tok = load_tokenizer(tokenizer_source(rc)[0])
    samples = list(islice(iter_samples(path=resolve_path(HELD_OUT), tokenizer=tok, spec=rc.model, dp_rank=0, dp_size=1,
                                       seed=rc.train.seed, epochs=1, root=PACKAGE_ROOT), SAMPLES))
    layers = build_layers(rc.model, seed=rc.train.seed, image_token=tok.image_id, audio_token=tok.audio_id)
    for i, layer in enumerate(layers):
        layer.load_state_dict(torch.load(step_dir / f"layer_{i:02d}-model_states.pt", weights_only=True))
        layer.eval()
    mb = collate(samples, patch=rc.model.vision.patch, packed=True, pad_id=tok.pad_id)
    with torch.no_grad():
        loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
    return loss.item(), mb.label_tokens


def _tensors(x, prefix=""):
    if torch.is_tensor(x):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{prefix}[{i}]")
    else:
        yield prefix, x


def _same_file(a, b) -> bool:
    """Every tensor equal, and every other value of a random-state file (numpy's and Python's
    states are plain numbers; elsewhere they are bookkeeping, e.g. LambdaLR's call counter, which a
    resume restarts)."""
    x = dict(_tensors(torch.load(a, map_location="cpu", weights_only=True)))
    y = dict(_tensors(torch.load(b, map_location="cpu", weights_only=True)))
    values = a.name.startswith("rng_rank")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else not values or x[k] == y[k]
                                        for k in x)


def test_held_out_loss_leaves_training_alone_and_equals_one_process(run_mmpipe, tmp_path):
    plain = run_mmpipe("train", *COMMON, name="plain")
    assert plain.code == 0, plain.out[-3000:]
    resumed = run_mmpipe("train", *COMMON, *EVAL, f"train.resume={plain.run_dir / 'checkpoints' / 'step1'}",
                         name="evaluated")
    assert resumed.code == 0, resumed.out[-3000:]
    assert (f"eval: every 2 steps and after the last, on the first {SAMPLES} samples of data.eval_path={HELD_OUT}"
            in resumed.out)

    # Evaluation on: the training is that of the run without it, to the bit: the same losses and
    # gradient norms, the same samples fed by every rank, the same weights, optimizer state and
    # random states at the end (so no evaluation drew a random number, ran dropout or moved the
    # training reader). A resumed run keeps the cadence of the steps since the run's start.
    want, got = plain.metrics()[1:], resumed.metrics()
    assert [r["step"] for r in got] == [2, 3, 4, 5]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    assert [r["step"] for r in got if "eval_loss" in r] == [2, 4, 5]
    for rank in range(4):
        assert resumed.samples(rank) == plain.samples(rank)[1:], rank
    a, b = plain.run_dir / "checkpoints" / "step5", resumed.run_dir / "checkpoints" / "step5"
    files = sorted(p.name for p in a.glob("*.pt"))
    assert sum(n.startswith("rng_rank") for n in files) == 4 and sum(n.startswith("layer_") for n in files) == 15
    for name in files:
        assert _same_file(a / name, b / name), name
    # ... and the run without evaluation reached step 4 with the very weights the evaluated run scored.
    for layer in (plain.run_dir / "checkpoints" / "step4").glob("layer_*.pt"):
        assert _same_file(layer, resumed.run_dir / "checkpoints" / "step4" / layer.name), layer.name

    # The held-out loss is the per-token mean of the checkpoint's model on the first samples of
    # data.eval_path, in eval mode, as one process computes it.
    evals = {r["step"]: r for r in got if "eval_loss" in r}
    for step in (2, 4):
        loss, label_tokens = _held_out_loss(COMMON, resumed.run_dir / "checkpoints" / f"step{step}")
        assert evals[step]["eval_loss"] == pytest.approx(loss, rel=REL), step
        assert (evals[step]["eval_samples"], evals[step]["eval_label_tokens"]) == (SAMPLES, label_tokens)
    assert evals[4]["eval_micro_batches"] >= 2  # the planner cut each replica's share
    assert evals[2]["eval_loss"] > evals[4]["eval_loss"]
    line = next(l for l in resumed.out.splitlines() if l.startswith("done: 4 steps"))
    assert (f"| eval_loss {evals[2]['eval_loss']:.3f} -> {evals[5]['eval_loss']:.3f} (3 evaluations, the last after "
            f"step 5;") in line

    # `mmpipe eval` on a committed checkpoint: the loss the run logged at that step, and nothing
    # written into the run directory.
    before = {p: p.stat().st_mtime_ns for p in resumed.run_dir.rglob("*")}
    out = tmp_path / "eval.json"
    assert main(["eval", str(resumed.run_dir), "checkpoint=step4", f"out={out}"]) == 0
    scored = json.loads(out.read_text())
    assert scored["step"] == 4 and scored["checkpoint"] == str(resumed.run_dir / "checkpoints" / "step4")
    for key in ("eval_loss", "eval_samples", "eval_tokens", "eval_label_tokens"):
        assert scored[key] == evals[4][key], key
    assert {p: p.stat().st_mtime_ns for p in resumed.run_dir.rglob("*")} == before
