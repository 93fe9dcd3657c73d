"""Hugging Face models trained through the real `mmpipe train` (launcher, DeepSpeed pipeline, the
shipped shards) compute what transformers computes.

For LLaVA, Qwen2-VL (pp=3; its step mixes video clips, one of an odd frame count, images and text
from the shipped video mix, as the Qwen2.5-VL and Omni steps do), Qwen2-Audio, a composition (CLIP +
a Qwen2 causal LM with tied embeddings + a projector from another folder), LLaVA-OneVision (its
step holds clips of 7 to 20 frames, images and text from the shipped video mix), LLaVA-NeXT (pp=3),
Qwen3-VL (pp=3, cut between the tower's DeepStack blocks and between the decoder layers that add the
DeepStack features), Qwen2.5-VL (pp=2, cut between a full-attention and a
windowed vision block), the Qwen2.5-Omni thinker (pp=3, the vision and the audio tower on
different stages) and Gemma 3 (pp=2, the cut between a sliding and a full decoder layer; the reference
gets Gemma3Processor's token_type_ids, so each image attends bidirectionally on both sides): one SGD
step through the pipeline gives the loss of the transformers model's own
forward on the same samples (`train.record_samples=true` says which), and the same updated
parameters as its own backward and step, read back through `mmpipe export` (so the export loads with
the original class). The reference builds its inputs from the raw tar members with the checkpoint's
processors and chat template (tests/distributed/hf_reference.py), never with mmpipe's data code. For
LLaVA and Omni the exported step-1 model also reproduces the run's step-2 loss on step 2's samples.
Omni at pp=2 x dp=2 with ZeRO-1, one replica reading only samples without audio, gives the same
step. The `-spread` case (LLaVA-OneVision's tiles) runs with the tower spread over the stages
(plan.encoders: a pre-pass and a post-pass around the pipeline), the `-nested` case (Qwen3-VL's
DeepStack features at pp=3) and the Omni ZeRO-1 case (its audio tower) with the tower nested (the
same shares encoded inside DeepSpeed's 1F1B steps). A short Omni run shows the loss falling.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import torch

from mmpipe.model.hf.demo import model_overrides
from tests.distributed.hf_reference import SHARDS, Reference, raw_samples

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
    # clips (every frame a tile, pooled 2x2, one newline each), tiles, anyres_max_4, one-tile multi-image
    # samples; the tower spread (plan.encoders): each stage encodes its share of the tiles
    "llava-onevision-spread": ["parallel.pp=2", "train.steps=1", "plan.encoders=spread"],
    "llava-next": ["parallel.pp=3", "train.steps=1"],  # a middle stage carries the tiles' states and image sizes
    # InternVL's tiles and thumbnails, the cut inside the tower: stage 1 gets every tile's states
    "internvl": ["parallel.pp=2", "train.steps=1", "plan.stages=[vision.embed:vision.block.0,vision.block.1:llm.head]"],
    # Gemma 3: the cut between a sliding and a full decoder layer, each image a bidirectional block on both stages
    "gemma3": ["parallel.pp=2", "train.steps=1", "plan.stages=[vision.embed:llm.block.0,llm.block.1:llm.head]"],
    # block 0's DeepStack state crosses stages 0 -> 1 before its merger; the two merged features enter
    # llm.block.0 and llm.block.1, on different stages, so one crosses stages 1 -> 2 (and its gradient back)
    "qwen3-vl": ["parallel.pp=3", "train.steps=1",
                 "plan.stages=[vision.embed:vision.block.1,vision.block.2:llm.block.0,llm.block.1:llm.head]"],
    # the tower nested over the three stages (encoded inside the 1F1B steps): the DeepStack features
    # reach their decoder layers from the ranks that encoded them
    "qwen3-vl-nested": ["parallel.pp=3", "train.steps=1", "plan.encoders=nested"],
    # the cut falls after a full-attention vision block, before a windowed one: the window order crosses
    "qwen2.5-vl": ["parallel.pp=2", "train.steps=1",
                   "plan.stages=[vision.embed:vision.block.1,vision.block.2:llm.head]"],
    # each tower on its own stage; + the exported step-1 model's loss on step 2
    "qwen2.5-omni": ["parallel.pp=3", "train.steps=2",
                     "plan.stages=[vision.embed:vision.proj,audio.embed:llm.block.0,llm.block.1:llm.head]"],
}
NEXT_LOSS = ("llava", "qwen2.5-omni")
"""Cases whose exported step-1 model must reproduce the run's step-2 loss."""
VIDEO_CASES = ("qwen2-vl", "llava-onevision", "qwen2.5-vl", "qwen2.5-omni")
"""Cases whose first step must hold video, image and text-only samples (from the shipped video mix)."""
OFF_STAGE = ("-spread", "-nested")
"""A case name ending so: the same model with plan.encoders=spread or nested."""
LOSS_RTOL = 1e-5
UPDATE_RTOL = 5e-4  # fp32 summation order differs (micro-batches vs one batch); a wrong or missing tensor is O(1)
"""Largest |pipeline - reference| of an updated tensor, relative to the reference's largest update
of that tensor (LR x its largest gradient, at least LR x 1e-4): the gradient difference, in fp32."""


def _step_keys(run, step: int) -> list[str]:
    """The keys of a step's samples, over every data-reading rank (each replica's), once each."""
    keys: dict[str, None] = {}
    for path in sorted(run.run_dir.glob("samples_rank*.jsonl")):
        rank = int(path.stem.removeprefix("samples_rank"))
        keys.update((k, None) for mb in run.samples(rank)[step - 1]["micro_batches"] for k in mb)
    return list(keys)


def _reference_step(ref: Reference, model, keys: list[str]):
    raws = raw_samples(set(keys))
    return ref.loss(model, [ref.sample(raws[k]) for k in keys])


def _exported(ref: Reference, run, step: int, tmp_path):
    from mmpipe.cli import main

    out = tmp_path / f"export-step{step}"
    assert main(["export", str(run.run_dir), f"checkpoint=step{step}", f"out={out}"]) == 0
    return ref.model(out)


@pytest.mark.parametrize("kind", list(CASES))
def test_one_pipeline_step_equals_transformers(kind, hf_checkpoints, run_mmpipe, tmp_path):
    case, kind = kind, kind.removesuffix(OFF_STAGE[0]).removesuffix(OFF_STAGE[1])
    run = run_mmpipe("train", *model_overrides(kind, hf_checkpoints), *CASES[case], *COMMON, timeout=600)
    assert run.code == 0, run.out[-3000:]
    if case.endswith(OFF_STAGE):
        assert re.search(rf"^encoders: vision {case.rsplit('-', 1)[1]}", run.out, re.M), run.out[:3000]
        assert sum(d["encoded_samples"] > 0 for d in run.stage_files()) >= 2  # not all on one rank
    assert "load: stage 0 (rank 0) loaded" in run.out
    assert all(d["load"]["peak_rss_mb"] > 0 and d["load"]["layers_loaded"] > 0 for d in run.stage_files())
    _check_step(kind, hf_checkpoints, run, tmp_path, next_loss=kind in NEXT_LOSS)


def _check_step(kind, hf_checkpoints, run, tmp_path, *, next_loss=False, video=True):
    """Step 1's loss and updated parameters (the gradients) equal transformers' on its samples
    (`video`: a VIDEO_CASES run on the shipped video mix, whose step must hold every kind)."""
    ref = Reference(kind, hf_checkpoints)
    model = ref.model()
    keys = _step_keys(run, 1)
    if video and kind in VIDEO_CASES:  # videos (Qwen2-VL: one of an odd frame count), images and text-only samples
        raws = raw_samples(set(keys)).values()
        assert all(any(r[m] for r in raws) for m in ("videos", "images")), keys
        assert any(not r["videos"] and not r["images"] for r in raws), keys
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
    towers = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0
              and any(t in n for t in ("visual", "vision_tower", "audio_tower"))]
    assert towers, "the step held no image or clip: the tower's gradients compare nothing"
    assert worst < UPDATE_RTOL, f"{where}: the update differs by {worst:.2e} of the reference's"

    if next_loss:  # the exported step-1 model computes the run's step-2 loss on step 2's samples
        with torch.no_grad():
            again = _reference_step(ref, _exported(ref, run, 1, tmp_path), _step_keys(run, 2))
        assert run.metrics()[1]["loss"] == pytest.approx(again.item(), rel=LOSS_RTOL)
        print(f"{kind}: exported step-1 model on step 2's samples {again.item():.7f} vs the run's "
              f"{run.metrics()[1]['loss']:.7f}")


def _omni_shards(out: Path) -> str:
    """Two shards of the shipped samples: the first (replica 0 of 2) without any audio clip, the
    second with clips (and images beside some of them)."""
    shards = sorted(SHARDS.glob("train-*.tar"))
    groups: dict[str, list[tuple[tarfile.TarInfo, bytes]]] = {}
    with tarfile.open(shards[0]) as tar:
        for m in tar.getmembers():
            groups.setdefault(m.name.split(".")[0], []).append((m, tar.extractfile(m).read()))
    by_audio: dict[bool, list[str]] = {False: [], True: []}
    for key, members in groups.items():
        meta = json.loads(next(data for m, data in members if m.name.endswith(".json")))["meta"]
        by_audio[bool(meta["audio_seconds"])].append(key)
    out.mkdir()
    for i, audio in enumerate((False, True)):
        with tarfile.open(out / f"train-{i:06d}.tar", "w") as tar:
            for key in by_audio[audio][:24]:
                for m, data in groups[key]:
                    tar.addfile(m, io.BytesIO(data))
    return str(out / "train-{000000..000001}.tar")


def test_omni_zero1_replica_without_clips(hf_checkpoints, run_mmpipe, tmp_path):
    """Qwen2.5-Omni at pp=2 x dp=2 under ZeRO-1, the audio tower nested and the vision tower staged
    (plan.encoders), replica 0's step holding no clip (its ranks encode nothing): the step still
    equals transformers' on all its samples, the tower's gradients summed over every rank (nothing
    hangs, the audio tower learns from replica 1's clips only)."""
    path = _omni_shards(tmp_path / "shards")
    run = run_mmpipe("train", *model_overrides("qwen2.5-omni", hf_checkpoints), "parallel.pp=2", "parallel.dp=2",
                     "train.zero_stage=1", "train.steps=1", f"data.path='{path}'",
                     "plan.encoders={vision: stages, audio: nested}", *COMMON, timeout=600)
    assert run.code == 0, run.out[-3000:]
    assert "ZeRO-1 (optimizer state sharded over 2 replicas)" in run.out
    assert re.search(r"^encoders: audio nested", run.out, re.M), run.out[:3000]
    assert sum(d["encoded_samples"] > 0 for d in run.stage_files()) >= 2  # replica 1's clips over both its ranks
    raws = raw_samples(set(_step_keys(run, 1)))
    fed = [{k for mb in run.samples(int(p.stem.removeprefix("samples_rank")))[0]["micro_batches"] for k in mb}
           for p in run.run_dir.glob("samples_rank*.jsonl")]  # each replica's first and last stage
    assert {any(raws[k]["audio"] for k in keys) for keys in fed} == {False, True}  # one replica: no clip
    _check_step("qwen2.5-omni", hf_checkpoints, run, tmp_path, video=False)  # its own two shards


def test_a_checkpoint_learns(hf_checkpoints, run_mmpipe):
    """The Qwen2.5-Omni thinker from its checkpoint (images, clips, both, text: the shipped shards
    without the video mix, whose frames Omni's processor enlarges to 128 x 28^2 pixels and which
    the step test covers), pp=2, AdamW: the loss falls by half a nat within 12 steps (from about
    ln(vocabulary) = 6.6, chance). From step 9 on (the re-fit's 6 warm-up steps, and the feeder two
    steps ahead) the micro-batches are planned with the run's own step-time fit, and the console
    says so once; the summary sets the measured peak memory of each stage beside the prediction."""
    run = run_mmpipe("train", *model_overrides("qwen2.5-omni", hf_checkpoints), "train.steps=12", "train.lr=3e-3",
                     "train.warmup_steps=2", f"data.path='{SHARDS}/train-{{000000..000007}}.tar'", timeout=600)
    assert run.code == 0, run.out[-3000:]
    losses = [m["loss"] for m in run.metrics()]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert [m["planned_with_fit"] for m in run.metrics()] == [False] * 8 + [True] * 4
    assert run.out.count("micro-batches are planned with this run's step-time fit from now on") == 1
    assert "step 9: micro-batches are planned with this run's step-time fit" in run.out
    assert re.search(r"memory per stage, peak of the run \(peak_rss\): stage 0 [\d.]+ GB measured, [\d.]+ GB "
                     r"predicted \([+-]\d+%\), stage 1 ", run.out), run.out[-2000:]
