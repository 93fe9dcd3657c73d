"""One optimizer step through the pipeline equals a single-process full-batch step.

The run goes through the real `mmpipe train` (launcher, DeepSpeed PipelineEngine, webdataset
shards); the reference recomputes the step in one process on the very samples the pipeline
recorded, with the loss as the mean over all label tokens of the step.
"""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from mmpipe.cli import load
from mmpipe.config import PROJECT_ROOT, resolve_path, tokenizer_source
from mmpipe.data.reader import iter_meta, iter_samples
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.model.layers import build_layers, run_layers, token_loss
from mmpipe.model.spec import layer_names
from mmpipe.runtime.batch import collate

pytestmark = pytest.mark.distributed

CASES = {
    # name: overrides (data-aware chooses its own micro-batch count; ds-default keeps train.micro_batches)
    "pp2": ["parallel.pp=2", "parallel.dp=1", "train.global_batch=10", "train.micro_batches=3"],
    "pp3": ["parallel.pp=3", "parallel.dp=1", "train.global_batch=9", "train.micro_batches=4",
            "plan.policy=ds-default"],  # padded micro-batches, a fixed count, a middle stage
    "pp2xdp2": ["parallel.pp=2", "parallel.dp=2", "train.global_batch=12", "train.micro_batches=3"],
    "pp2xdp2-across": ["parallel.pp=2", "parallel.dp=2", "train.global_batch=12", "train.micro_batches=3",
                       "plan.across_replicas=true"],  # the planner deals the step to the replicas
}
COMMON = ["train.steps=1", "train.optimizer=sgd", "train.lr=0.5", "train.warmup_steps=0",
          "train.grad_clip=1.0", "train.record_samples=true"]


def _reference(overrides: list[str], keys_by_replica: list[list[str]]):
    rc = load(overrides, job="test")
    tok = load_tokenizer(tokenizer_source(rc)[0])
    samples, want = {}, {k for keys in keys_by_replica for k in keys}
    for s in iter_samples(path=resolve_path(rc.data.path), tokenizer=tok, spec=rc.model, dp_rank=0,
                          dp_size=1, seed=rc.train.seed, epochs=1, root=PROJECT_ROOT):
        if s.key in want:
            samples[s.key] = s
        if len(samples) == len(want):
            break
    ordered = [samples[k] for keys in keys_by_replica for k in keys]
    layers = build_layers(rc.model, seed=rc.train.seed, image_token=tok.image_id, audio_token=tok.audio_id)
    params = [p for l in layers for p in l.parameters()]
    mb = collate(ordered, patch=rc.model.vision.patch, packed=True, pad_id=tok.pad_id)
    loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
    loss.backward()
    if rc.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, rc.train.grad_clip)
    with torch.no_grad():
        for p in params:
            p -= rc.train.lr * p.grad
    return rc, layers, loss.item()


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_step_equals_full_batch_step(case, run_mmpipe):
    overrides = CASES[case] + COMMON
    run = run_mmpipe("train", *overrides)
    assert run.code == 0, run.out[-3000:]
    dp = 2 if "dp2" in case else 1
    across = "plan.across_replicas=true" in overrides
    pp = int(case[2])
    micro = int(next(o for o in overrides if o.startswith("train.micro_batches")).split("=")[1])

    # The first and last stage of each replica fed exactly the same micro-batches.
    stage_of = {d["rank"]: (d["stage"], d["dp_rank"]) for d in run.stage_files()}
    firsts = {dpr: r for r, (st, dpr) in stage_of.items() if st == 0}
    lasts = {dpr: r for r, (st, dpr) in stage_of.items() if st == pp - 1}
    keys_by_replica = []
    for r in range(dp):
        fed_first, fed_last = run.samples(firsts[r]), run.samples(lasts[r])
        assert fed_first == fed_last
        mbs = fed_first[0]["micro_batches"]
        assert all(mbs) and len(mbs) >= 2
        if "plan.policy=ds-default" in overrides:
            assert len(mbs) == micro
        keys_by_replica.append([k for mb in mbs for k in mb])
    all_keys = [k for ks in keys_by_replica for k in ks]
    assert len(set(all_keys)) == len(all_keys)  # no sample in two replicas
    if across:  # one step covers the first global_batch samples of the whole stream
        first = islice(iter_meta(path=resolve_path("data/shards/train-{000000..000007}.tar"), dp_rank=0, dp_size=1,
                                 epochs=1, root=PROJECT_ROOT), 12)
        assert sorted(all_keys) == sorted(k for k, _ in first)

    rc, ref_layers, ref_loss = _reference(CASES[case] + COMMON, keys_by_replica)
    assert run.metrics()[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)

    names = layer_names(rc.model)
    ckpt = run.run_dir / "checkpoints" / "step1"
    worst = 0.0
    for i, layer in enumerate(ref_layers):
        saved = torch.load(ckpt / f"layer_{i:02d}-model_states.pt", map_location="cpu", weights_only=True)
        ref = layer.state_dict()
        assert set(saved) == set(ref), names[i]
        for k, v in ref.items():
            diff = float((saved[k] - v).abs().max())
            assert diff <= 1e-6 + 1e-4 * float(v.abs().max()), f"{names[i]}.{k} differs by {diff:.3g}"
            worst = max(worst, diff)
    assert worst < 1e-5
