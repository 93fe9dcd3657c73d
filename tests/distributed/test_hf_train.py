"""Hugging Face models trained through the real `mmpipe train` (launcher, DeepSpeed pipeline, the
shipped shards) compute what transformers computes.

For LLaVA, Qwen2-VL (pp=3), Qwen2-Audio and a composition (CLIP + a Qwen2 causal LM with tied
embeddings + a projector from another folder): one SGD step through the pipeline gives the loss of
the transformers model's own forward on the same samples (`train.record_samples=true` says which),
and the same updated parameters as its own backward and step, read back through `mmpipe export`
(so the export loads with the original class). The reference builds its inputs from the raw tar
members with the checkpoint's processors and chat template (tests/distributed/hf_reference.py),
never with mmpipe's data code. For LLaVA the exported step-1 model also reproduces the run's step-2
loss on step 2's samples. A short run shows the loss falling.
"""

from __future__ import annotations

import re

import pytest
import torch

from mmpipe.model.hf.demo import model_overrides
from tests.distributed.hf_reference import Reference, raw_samples

pytestmark = pytest.mark.distributed

LR = 2.0
COMMON = ["train.optimizer=sgd", f"train.lr={LR}", "train.warmup_steps=0", "train.grad_clip=0",
          "train.record_samples=true", "train.global_batch=8", "train.micro_batches=2",
          "train.save_every=1"]  # a checkpoint of every step, to export
CASES = {  # model: its overrides (one launch each)
    "llava": ["parallel.pp=2", "train.steps=2"],  # + the exported step-1 model's loss on step 2
    "qwen2-vl": ["parallel.pp=3", "train.steps=1"],  # a middle stage carries the 3-D M-RoPE positions
    "qwen2-audio": ["parallel.pp=2", "train.steps=1"],
    "compose": ["parallel.pp=2", "train.steps=1"],
}
LOSS_RTOL = 1e-5
UPDATE_RTOL = 5e-4  # fp32 summation order differs (micro-batches vs one batch); a wrong or missing tensor is O(1)
"""Largest |pipeline - reference| of an updated tensor, relative to the reference's largest update
of that tensor (LR x its largest gradient, at least LR x 1e-4): the gradient difference, in fp32."""


def _step_keys(run, step: int) -> list[str]:
    return [k for mb in run.samples(0)[step - 1]["micro_batches"] for k in mb]


def _reference_step(ref: Reference, model, keys: list[str]):
    raws = raw_samples(set(keys))
    batch = ref.batch([ref.sample(raws[k]) for k in keys])
    return model(**batch).loss


def _exported(ref: Reference, run, step: int, tmp_path):
    from mmpipe.cli import main

    out = tmp_path / f"export-step{step}"
    assert main(["export", str(run.run_dir), f"checkpoint=step{step}", f"out={out}"]) == 0
    return ref.model(out)


@pytest.mark.parametrize("kind", list(CASES))
def test_one_pipeline_step_equals_transformers(kind, hf_checkpoints, run_mmpipe, tmp_path):
    run = run_mmpipe("train", *model_overrides(kind, hf_checkpoints), *CASES[kind], *COMMON, timeout=600)
    assert run.code == 0, run.out[-3000:]
    assert "load: stage 0 (rank 0) loaded" in run.out
    assert all(d["load"]["peak_rss_mb"] > 0 and d["load"]["layers_loaded"] > 0 for d in run.stage_files())

    ref = Reference(kind, hf_checkpoints)
    model = ref.model()
    keys = _step_keys(run, 1)
    loss = _reference_step(ref, model, keys)
    loss.backward()
    ours = run.metrics()[0]["loss"]
    assert ours == pytest.approx(loss.item(), rel=LOSS_RTOL), (ours, loss.item())

    exported = dict(_exported(ref, run, 1, tmp_path).named_parameters())
    worst, where, compared = 0.0, "", 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(exported[name], p), f"{name} is frozen but changed"
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            want = p - LR * g
            diff = float((exported[name] - want).abs().max()) / (LR * max(float(g.abs().max()), 1e-4))
            if diff > worst:
                worst, where = diff, name
            compared += 1
    rel = abs(ours - loss.item()) / loss.item()
    print(f"\n{kind}: loss {ours:.7f} vs transformers {loss.item():.7f} (rel {rel:.1e}); largest gradient difference "
          f"{worst:.1e} ({where}) over {compared} tensors")
    assert compared > 20
    assert worst < UPDATE_RTOL, f"{where}: the update differs by {worst:.2e} of the reference's"

    if kind == "llava":  # the exported step-1 model computes the run's step-2 loss on step 2's samples
        with torch.no_grad():
            again = _reference_step(ref, _exported(ref, run, 1, tmp_path), _step_keys(run, 2))
        assert run.metrics()[1]["loss"] == pytest.approx(again.item(), rel=LOSS_RTOL)
        print(f"llava: exported step-1 model on step 2's samples {again.item():.7f} vs the run's "
              f"{run.metrics()[1]['loss']:.7f}")


def test_a_checkpoint_learns(hf_checkpoints, run_mmpipe):
    """Qwen2-Audio from its checkpoint, pp=2, AdamW: the loss falls by half a nat within 12 steps
    (from about ln(703) = 6.56, chance over its vocabulary). From step 9 on (the re-fit's 6
    warm-up steps, and the feeder two steps ahead) the micro-batches are planned with the run's
    own step-time fit, and the console says so once; the summary sets the measured peak memory
    of each stage beside the prediction."""
    run = run_mmpipe("train", *model_overrides("qwen2-audio", hf_checkpoints), "train.steps=12", "train.lr=3e-3",
                     "train.warmup_steps=2", timeout=600)
    assert run.code == 0, run.out[-3000:]
    losses = [m["loss"] for m in run.metrics()]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert [m["planned_with_fit"] for m in run.metrics()] == [False] * 8 + [True] * 4
    assert run.out.count("micro-batches are planned with this run's step-time fit from now on") == 1
    assert "step 9: micro-batches are planned with this run's step-time fit" in run.out
    assert re.search(r"memory per stage, peak of the run \(peak_rss\): stage 0 [\d.]+ GB measured, [\d.]+ GB "
                     r"predicted \([+-]\d+%\), stage 1 ", run.out), run.out[-2000:]
