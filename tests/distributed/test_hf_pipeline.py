"""A Hugging Face model with tied embeddings trains through DeepSpeed's pipeline as in one
process: llm.embed and llm.head on different stages hold one weight (TiedLayerSpec), whose
gradient is all-reduced between them and counted once by the global gradient clip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mmpipe.model.hf.build import build_layers  # noqa: E402
from mmpipe.model.layers import run_layers, token_loss  # noqa: E402
from mmpipe.model.spec import layer_names  # noqa: E402
from mmpipe.runtime.launch import launch  # noqa: E402
from tests.unit.model import hf_pipeline_case as case  # noqa: E402

pytestmark = pytest.mark.distributed
WORKER = str(Path(__file__).with_name("hf_pipeline_worker.py"))


def test_tied_embedding_across_stages_equals_one_process(tmp_path):
    folder = case.write(tmp_path)
    out = tmp_path / "ckpt"
    assert launch([sys.executable, WORKER, str(folder), str(out)], nproc=2, timeout_s=300) == 0

    spec, mbs, scale, _ = case.setup(folder)
    layers = build_layers(spec, seed=0)
    params = list({id(p): p for l in layers for p in l.parameters()}.values())
    loss = sum(token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([scale / len(mbs)])))
               for mb in mbs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, case.CLIP)
    with torch.no_grad():
        for p in params:
            p -= case.LR * p.grad
    assert json.loads((out / "loss.json").read_text())["loss"] == pytest.approx(loss.item(), rel=1e-5)

    names = layer_names(spec)
    for i, layer in enumerate(layers):
        path = out / "step1" / f"layer_{i:02d}-model_states.pt"
        if names[i] == "llm.head":
            assert not path.exists()  # the head is the embedding module, saved once with llm.embed
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        for k, v in layer.state_dict().items():
            torch.testing.assert_close(saved[k], v, rtol=1e-4, atol=1e-6, msg=f"{names[i]}.{k}")
    embed = layers[names.index("llm.embed")].embed.weight
    for rank in (0, 1):  # both stages' copies of the tied weight took the same, whole-model step
        torch.testing.assert_close(torch.load(out / f"tied_rank{rank}.pt"), embed.detach(), rtol=1e-4, atol=1e-6)
