"""A checkpoint resumes on another layout: another parallel.pp, cut, parallel.dp and ZeRO stage
train the next steps as the uninterrupted run does (AdamW, so the moments and step counts must
carry over; fp32: only the reduction order differs between layouts).

- Tiny model, every replica reading the one stream (plan.across_replicas=true, so the samples of
  a step do not depend on dp): W trains 4 steps at ZeRO-1, pp=2 x dp=2 (saving step 2). R1
  resumes W's step 2 at ZeRO-0, pp=3 x dp=1, with both encoder towers nested (plan.encoders: the
  replicas on stages 1 and 2 start from the checkpoint and follow R1's two steps, encoding inside
  DeepSpeed's 1F1B steps), saving every
  step; it is SIGKILLed inside its first save (step 3), then started again with the same command.
  R2 resumes R1's step 3 at ZeRO-1, pp=2 x dp=2 with a cut of its own. Steps 3 and 4 of R1 and
  R2 have W's losses, gradient norms and learning rates, and R2's step-4 layer files hold W's
  weights; the start-up says what was resharded. A layout that cannot hold the model is refused
  before launch, in one line.
- Qwen2-VL (a transformers checkpoint) with LoRA on the decoder and the merger trained in full:
  ZeRO-0 pp=3 x dp=1 -> ZeRO-1 pp=2 x dp=2, the same.
"""

from __future__ import annotations

import pytest
import torch

from mmpipe.model.hf.demo import model_overrides
from tests.distributed.test_checkpoint_faults import fi

pytestmark = pytest.mark.distributed

TINY = ["train.steps=4", "train.global_batch=8", "train.micro_batches=2", "train.warmup_steps=0",
        "plan.across_replicas=true", "train.lr=3e-3"]


def _same_steps(whole, resumed, first: int) -> None:
    want = [m for m in whole.metrics() if m["step"] >= first]
    got = resumed.metrics()
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(want, got):
        assert b["lr"] == a["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])


def _same_weights(whole, resumed, step: int) -> None:
    compared = 0
    for path in sorted((whole.run_dir / "checkpoints" / f"step{step}").glob("layer_*-model_states.pt")):
        want = torch.load(path, map_location="cpu", weights_only=True)
        got = torch.load(resumed.run_dir / "checkpoints" / f"step{step}" / path.name, map_location="cpu",
                         weights_only=True)
        assert set(got) == set(want), path.name
        for k, v in want.items():
            assert float((got[k] - v).abs().max()) <= 1e-6 + 1e-4 * float(v.abs().max()), f"{path.name} {k}"
            compared += 1
    assert compared > 20


def test_resume_across_pp_dp_cut_and_zero_continues_the_run(run_mmpipe, tmp_path):
    whole = run_mmpipe("train", *TINY, "parallel.pp=2", "parallel.dp=2", "train.zero_stage=1", "train.save_every=2",
                       name="whole")
    assert whole.code == 0, whole.out[-3000:]
    step2 = whole.run_dir / "checkpoints" / "step2"
    small = run_mmpipe("train", *TINY, "parallel.pp=1", "hardware.memory_gb=0.9", f"train.resume={step2}",
                       name="small")
    assert small.code == 2 and "stage 0 (vision.embed..llm.head) needs" in small.out, small.out[-2000:]
    assert "raise parallel.pp or parallel.dp" in small.out and "Traceback" not in small.out
    assert "launching" not in small.out  # refused before any rank started

    r1_args = [*TINY, "parallel.pp=3", "parallel.dp=1", "train.zero_stage=0", "train.save_every=1",
               f"train.resume={step2}", "plan.encoders=nested"]
    killed = fi.start(tmp_path / "r1", r1_args)
    saving = tmp_path / "r1" / "checkpoints" / "step3"
    assert fi.wait_for(killed, lambda: saving.is_dir()), fi.finish(killed)[1][-3000:]
    for p in fi.ranks(killed) + [fi.psutil.Process(killed.pid)]:
        p.kill()
    fi.finish(killed)
    assert saving.is_dir() and not (saving / fi.MARKER).exists()  # the kill landed inside the save
    r1 = run_mmpipe("train", *r1_args, name="r1")
    assert r1.code == 0, r1.out[-3000:]
    assert "warning: resharded: pipeline pp=2 stages [[0, " in r1.out
    assert "-> pp=3 stages" in r1.out and "ZeRO stage 1 -> 0; replicas dp=2 -> dp=1" in r1.out
    assert "the optimizer state of every parameter (by name)" in r1.out
    assert "encoders: vision, audio nested" in r1.out  # the towers off the stage chain for R1's two steps
    _same_steps(whole, r1, 3)
    r2 = run_mmpipe("train", *TINY, "parallel.pp=2", "parallel.dp=2", "train.zero_stage=1", "train.save_final=true",
                    "plan.stages=[vision.embed:llm.block.1,llm.block.2:llm.head]",
                    f"train.resume={r1.run_dir / 'checkpoints' / 'step3'}", name="r2")
    assert r2.code == 0, r2.out[-3000:]
    assert "ZeRO stage 0 -> 1; replicas dp=1 -> dp=2" in r2.out
    _same_steps(whole, r2, 4)
    _same_weights(whole, r2, 4)


def test_lora_transformers_checkpoint_resumes_on_another_pipeline_and_zero(hf_checkpoints, run_mmpipe):
    common = [*model_overrides("qwen2-vl", hf_checkpoints), "train.steps=4", "train.global_batch=8",
              "train.micro_batches=2", "train.warmup_steps=0", "train.lora.r=4", "train.lora.alpha=8",
              "train.trainable=[vision.proj]", "plan.across_replicas=true"]
    whole = run_mmpipe("train", *common, "parallel.pp=3", "train.save_every=2", name="whole", timeout=600)
    assert whole.code == 0, whole.out[-3000:]
    moved = run_mmpipe("train", *common, "parallel.pp=2", "parallel.dp=2", "train.zero_stage=1",
                       f"train.resume={whole.run_dir / 'checkpoints' / 'step2'}", "train.save_final=true",
                       name="moved", timeout=600)
    assert moved.code == 0, moved.out[-3000:]
    assert "warning: resharded: pipeline pp=3" in moved.out
    assert "ZeRO stage 0 -> 1; replicas dp=1 -> dp=2" in moved.out
    _same_steps(whole, moved, 3)
    _same_weights(whole, moved, 4)
