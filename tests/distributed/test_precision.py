"""Mixed precision, ZeRO-1 and the user's DeepSpeed JSON through the real `mmpipe train`.

The numerical equality of a bf16 step and of a ZeRO-1 step with the single-process reference
is in test_equivalence.py; here: a ZeRO-1 checkpoint resumes exactly, fp16 trains where
DeepSpeed supports it on the machine (else it is refused before launch), and a DeepSpeed JSON
reaches DeepSpeed.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

pytestmark = pytest.mark.distributed

TINY = ["train.global_batch=8", "train.micro_batches=2", "train.warmup_steps=1"]


def _optimizer_shards(step_dir):
    return sorted(step_dir.glob("bf16_zero_pp_rank_*_optim_states.pt"))


def test_bf16_zero1_resume_continues_exactly(run_mmpipe):
    """pp=2 x dp=2 in bf16 under ZeRO-1 (fp32 master weights and AdamW state sharded over the
    replicas): two steps, then a resume from that checkpoint, give the four steps of one run."""
    common = ["train.precision=bf16", "parallel.dp=2", "train.steps=4", *TINY]
    whole = run_mmpipe("train", *common, "train.save_every=2", name="whole")
    assert whole.code == 0, whole.out[-3000:]
    assert "ZeRO-1 (optimizer state sharded over 2 replicas)" in whole.out
    step2 = whole.run_dir / "checkpoints" / "step2"
    shards = _optimizer_shards(step2)
    assert [p.name for p in shards] == [f"bf16_zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt"
                                        for r in (0, 1) for s in (0, 1)]
    resumed = run_mmpipe("train", *common, f"train.resume={step2}", "train.save_final=true", name="resumed")
    assert resumed.code == 0, resumed.out[-3000:]
    assert [r["step"] for r in resumed.metrics()] == [3, 4]
    assert [r["loss"] for r in resumed.metrics()] == [r["loss"] for r in whole.metrics()[2:]]
    assert [r["grad_norm"] for r in resumed.metrics()] == [r["grad_norm"] for r in whole.metrics()[2:]]

    # Same bf16 weights, and the same fp32 master weights and AdamW moments in every shard.
    a, b = whole.run_dir / "checkpoints" / "step4", resumed.run_dir / "checkpoints" / "step4"
    for layer in sorted(a.glob("layer_*-model_states.pt")):
        x, y = (torch.load(d / layer.name, map_location="cpu", weights_only=True) for d in (a, b))
        assert all(torch.equal(x[k], y[k]) for k in x), layer.name
    for shard in _optimizer_shards(a):
        x, y = (torch.load(d / shard.name, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                for d in (a, b))
        assert torch.equal(x["single_partition_of_fp32_groups"][0], y["single_partition_of_fp32_groups"][0])
        sx, sy = x["base_optimizer_state"]["state"][0], y["base_optimizer_state"]["state"][0]
        assert sx["step"] == sy["step"] == 4
        assert torch.equal(sx["exp_avg"], sy["exp_avg"]) and torch.equal(sx["exp_avg_sq"], sy["exp_avg_sq"])


def test_deepspeed_json_reaches_deepspeed_and_fp16_trains(run_mmpipe, tmp_path, capsys):
    """A user's DeepSpeed JSON is merged (a CSV monitor writes DeepSpeed's own loss log, and
    steps_per_print makes DeepSpeed print every step); fp16 (ZeRO-1, dynamic loss scale) trains
    and logs the unscaled global gradient norm where DeepSpeed's accelerator supports fp16 (a GPU,
    a CPU whose oneDNN has fp16 kernels). Where it does not, `mmpipe train train.precision=fp16`
    is one line before launch (DeepSpeed would raise "Type fp16 is not supported on your device."
    in every rank) and the JSON is shown to reach DeepSpeed in an fp32 run instead."""
    from mmpipe.cli import main
    from mmpipe.runtime.host import precision_problem

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"steps_per_print": 1,
                              "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"}}))
    problem = precision_problem("fp16", "auto")
    precision = "fp16"
    if problem:
        refused = ["train", "train.precision=fp16", f"deepspeed.config={ds}", f"hydra.run.dir={tmp_path / 'no'}"]
        assert main(refused) == 2
        assert capsys.readouterr().err.strip() == f"mmpipe train: error: {problem}"
        assert problem.startswith("train.precision=fp16: DeepSpeed does not train fp16 on this ")
        assert not (tmp_path / "no").exists()
        precision = "fp32"
    run = run_mmpipe("train", f"train.precision={precision}", "train.steps=3", *TINY, f"deepspeed.config={ds}")
    assert run.code == 0, run.out[-3000:]
    m = run.metrics()
    if precision == "fp16":
        assert ("precision: fp16 (fp32 master weights, fp16 gradient accumulation, dynamic loss scale) | ZeRO-1 (one "
                "replica: nothing to shard) | optimizer: torch AdamW (fused) in DeepSpeed DeepSpeedZeroOptimizer"
                in run.out)
        assert all(r["loss_scale"] == 2.0**16 for r in m)  # DeepSpeed's initial dynamic scale; no overflow here
    else:
        assert "precision: fp32 | ZeRO-0 | optimizer: torch AdamW (fused) |" in run.out
    for step in (1, 2, 3):
        assert f"steps: {step} loss: {m[step - 1]['loss']:0.4f}" in run.out  # DeepSpeed's own print
    with open(tmp_path / "csv" / "j" / "Train_Samples_train_loss.csv") as f:
        logged = [float(row[1]) for row in list(csv.reader(f))[1:]]
    assert logged == pytest.approx([r["loss"] for r in m], abs=1e-5)
    # the true norm (~3-5 at this loss), not the norm of the loss-scaled gradients
    assert all(1.0 < r["grad_norm"] < 20.0 for r in m)
    assert m[-1]["loss"] < m[0]["loss"] - 0.1, [r["loss"] for r in m]  # 7.65 -> 7.44 in fp32 here
