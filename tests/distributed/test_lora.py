"""LoRA through the real `mmpipe train` (launcher, DeepSpeed pipeline, the shipped shards) is PEFT's
LoRA on the transformers model.

Qwen2-VL at pp=2 (adapters on the decoder, the merger trained in full: ms-swift's lora_llm recipe)
and the Qwen2.5-Omni thinker at pp=3 (adapters on the decoder and the audio tower, each tower on
its own stage), two SGD steps each (with MMPIPE_LORA_ALL_FAMILIES=1 also LLaVA, LLaVA-NeXT,
OneVision, Qwen2-Audio, Qwen3-VL and Qwen2.5-VL, some with tower adapters):
- step 1's loss is PEFT's on the same samples (`train.record_samples=true` says which), from the
  adapters the run started with: lora_A as exported after step 1 (its gradient is zero while
  lora_B is zero, so step 1 leaves it as it was) and lora_B = 0;
- the exported step-1 adapter folder loads with `PeftModel.from_pretrained(<source model>, DIR)`
  and holds PEFT's own step-1 update of every adapter (and of the merger) within fp32 tolerance;
  loaded, it reproduces the run's step-2 loss on step 2's samples;
- every base weight of the checkpoint is bit-identical to the source checkpoint's;
- `merge=true` writes the model PEFT's `merge_and_unload()` gives, tensor for tensor.
The reference builds its inputs from the raw tar members with the checkpoint's processors and chat
template (tests/distributed/hf_reference.py), never with mmpipe's data code.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mmpipe.model.hf.demo import model_overrides
from tests.distributed.hf_reference import Reference, raw_samples
from tests.distributed.test_hf_train import COMMON, LOSS_RTOL, LR, UPDATE_RTOL, _step_keys

pytestmark = pytest.mark.distributed

LORA = ["train.lora.r=4", "train.lora.alpha=8"]
CASES = {  # model: (overrides, the module trained in full beside the adapters, adapters on a tower)
    "qwen2-vl": (["parallel.pp=2", *LORA, "train.trainable=[vision.proj]"], "visual.merger", False),
    "qwen2.5-omni": (["parallel.pp=3", *LORA, "train.lora.parts=[llm,audio]",
                      "plan.stages=[vision.embed:vision.proj,audio.embed:llm.block.0,llm.block.1:llm.head]"],
                     None, True),
}
MORE = {  # the other families, run with MMPIPE_LORA_ALL_FAMILIES=1 (about 20 s each; CI runs the two above)
    "llava": (["parallel.pp=2", *LORA, "train.lora.parts=[llm,vision]",
               "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,fc1,fc2]"],
              None, True),
    "llava-next": (["parallel.pp=3", *LORA], None, False),
    "llava-onevision": (["parallel.pp=2", *LORA], None, False),
    "qwen2-audio": (["parallel.pp=2", *LORA, "train.trainable=[audio.proj]"],
                    "audio_tower.layer_norm|multi_modal_projector", False),  # the layer holds the tower's last norm
    "qwen3-vl": (["parallel.pp=3", *LORA, "train.trainable=[vision.proj]",
                  "plan.stages=[vision.embed:vision.block.1,vision.block.2:llm.block.0,llm.block.1:llm.head]"],
                 "visual.merger|visual.deepstack_merger_list", False),
    "qwen2.5-vl": (["parallel.pp=2", *LORA, "train.lora.parts=[llm,vision]",
                    "plan.stages=[vision.embed:vision.block.1,vision.block.2:llm.head]"], None, True),
}
if os.environ.get("MMPIPE_LORA_ALL_FAMILIES") == "1":
    CASES.update(MORE)


def _export(run, tmp_path, step: int, *extra: str):
    from mmpipe.cli import main

    out = tmp_path / f"export-step{step}{'-'.join(('',) + extra)}"
    assert main(["export", str(run.run_dir), f"checkpoint=step{step}", f"out={out}", *extra]) == 0
    return out


def _loss(ref: Reference, model, keys: list[str]):
    raws = raw_samples(set(keys))
    return ref.loss(model, [ref.sample(raws[k]) for k in keys])


@pytest.mark.parametrize("kind", list(CASES))
def test_lora_pipeline_steps_equal_peft(kind, hf_checkpoints, run_mmpipe, tmp_path):
    from peft import PeftModel

    overrides, full, tower = CASES[kind]
    run = run_mmpipe("train", *model_overrides(kind, hf_checkpoints), *overrides, *COMMON, "train.steps=2",
                     timeout=600)
    assert run.code == 0, run.out[-3000:]
    assert "LoRA (peft): r=4, alpha=8" in run.out
    ref = Reference(kind, hf_checkpoints)
    step1 = _export(run, tmp_path, 1)
    config = json.loads((step1 / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8

    # PEFT's step 1 from the run's initial adapters
    model = PeftModel.from_pretrained(ref.model(), step1, is_trainable=True)
    with torch.no_grad():
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.zero_()
    source = ref.model()  # the source checkpoint, unchanged: what the run started from
    with torch.no_grad():
        base = dict(source.named_parameters())
        for n, p in model.named_parameters():
            if ".modules_to_save." in n:
                p.copy_(base[n.removeprefix("base_model.model.").replace(".modules_to_save.default", "")])
    loss = _loss(ref, model, _step_keys(run, 1))
    loss.backward()
    ours = run.metrics()[0]["loss"]
    assert ours == pytest.approx(loss.item(), rel=LOSS_RTOL), (ours, loss.item())

    worst, where, compared, towers = 0.0, "", 0, 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        want = p.detach() - LR * g
        diff = float((start[n] - want).abs().max()) / (LR * max(float(g.abs().max()), 1e-4))
        if diff > worst:
            worst, where = diff, n
        compared += 1
        towers += ".lora_B." in n and "language_model" not in n and float(g.abs().max()) > 0
    print(f"\n{kind}: loss {ours:.7f} vs PEFT {loss.item():.7f}; largest update difference {worst:.1e} ({where}) "
          f"over {compared} tensors")
    assert compared >= 2 * 7 * 2
    assert worst < UPDATE_RTOL, f"{where}: the update differs by {worst:.2e} of PEFT's"
    saved = [n for n, _ in model.named_parameters() if ".modules_to_save." in n]
    assert bool(towers) == tower, "a tower's adapters learned nothing (the step held no media?)" if tower else towers
    if full is None:
        assert not saved
    else:  # the projector, trained in full, travels as PEFT's modules_to_save
        assert saved and all(any(f in n for f in full.split("|")) for n in saved), saved

    # the exported step-1 adapters give the run's step-2 loss
    with torch.no_grad():
        again = _loss(ref, PeftModel.from_pretrained(ref.model(), step1), _step_keys(run, 2))
    assert run.metrics()[1]["loss"] == pytest.approx(again.item(), rel=LOSS_RTOL)

    # after two steps, the merged export is PEFT's merge_and_unload of the step-2 adapter folder on
    # the source model, tensor for tensor: every base weight is still the source's, bit for bit
    merged = dict(ref.model(_export(run, tmp_path, 2, "merge=true")).state_dict())
    theirs = PeftModel.from_pretrained(ref.model(), _export(run, tmp_path, 2)).merge_and_unload().state_dict()
    assert set(merged) == set(theirs)
    for n, t in theirs.items():
        assert torch.equal(merged[n], t), n
    adapted = {n for n, t in source.state_dict().items() if not torch.equal(merged[n], t)}
    assert any("language_model" in n for n in adapted), "the merged export holds no adapter's update"
