"""A checkpoint resumes on another pipeline layout (ZeRO stage 0): another parallel.pp and
another cut train the next steps as the uninterrupted run does.

One run trains 4 steps at pp=2 (saving steps 2 and 4); a second resumes its step 2 at pp=3, the
planner cutting where it likes. It is a LoRA run with a projector trained in full, so the
optimizer holds adapters and whole tensors, and the layer files only what trains: the resumed
steps' losses and global gradient norms equal the uninterrupted run's, and so does every trained
tensor at step 4 (fp32; the reduction order differs between the layouts), and the start-up says
what was resharded. A ZeRO-1 checkpoint is refused on another layout, in one line.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

COMMON = ["train.steps=4", "train.lora.r=4", "train.lora.alpha=8", "train.lora.parts=[llm,vision]",
          "train.trainable=[audio.proj]", "train.global_batch=8", "train.micro_batches=2", "train.warmup_steps=0"]


def test_resume_on_another_pipeline_layout_continues_the_run(run_mmpipe):
    whole = run_mmpipe("train", *COMMON, "parallel.pp=2", "train.save_every=2", name="whole")
    assert whole.code == 0, whole.out[-3000:]
    step2 = whole.run_dir / "checkpoints" / "step2"
    moved = run_mmpipe("train", *COMMON, "parallel.pp=3", f"train.resume={step2}", "train.save_final=true",
                       name="moved")
    assert moved.code == 0, moved.out[-3000:]
    assert "warning: resharded: pipeline pp=2 stages [[0, " in moved.out and "-> pp=3 stages" in moved.out
    assert "the optimizer state of every parameter (by name)" in moved.out
    for a, b in zip(whole.metrics()[2:], moved.metrics()):
        assert (a["step"], a["lr"]) == (b["step"], b["lr"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert len(moved.metrics()) == 2
    compared = 0
    for path in sorted((whole.run_dir / "checkpoints" / "step4").glob("layer_*-model_states.pt")):
        want = torch.load(path, map_location="cpu", weights_only=True)
        got = torch.load(moved.run_dir / "checkpoints" / "step4" / path.name, map_location="cpu", weights_only=True)
        assert set(got) == set(want), path.name
        for k, v in want.items():
            assert float((got[k] - v).abs().max()) <= 1e-6 + 1e-4 * float(v.abs().max()), f"{path.name} {k}"
            compared += 1
    assert compared > 20

    zero1 = run_mmpipe("train", *COMMON, "parallel.pp=3", "train.zero_stage=1", f"train.resume={step2}",
                       name="zero1")
    assert zero1.code != 0
    assert ("a resume on another pipeline layout remaps the optimizer state under ZeRO stage 0 only"
            in zero1.out), zero1.out[-2000:]
