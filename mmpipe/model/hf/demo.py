"""Tiny Hugging Face checkpoint folders as a user has them (`mmpipe demo-checkpoints OUT`): the
model (random weights, saved by transformers' save_pretrained, every norm weight and bias moved
off its initial value so a tensor that is not loaded shows), a tokenizer trained here on the
shipped shards' conversations with a chat template in its family's format (our own wording), and
the processor config, all in one folder. Nothing is downloaded.

    folders = write_all(tmp)   # {"llava", "qwen2-vl", "qwen2-audio", "llava-next", "llava-onevision", "qwen3-vl",
                               #  "qwen2.5-vl", "qwen2.5-omni", "internvl", "gemma3", "compose-vision",
                               #  "compose-llm", "compose-projector"}

Each family's writer is its `Family.demo` (families/); what they share is demo_kit.py; the
composition's unimodal folders are written here. The test suite trains and compares these; a
user tries the real-model path on CPU with them:

    mmpipe demo-checkpoints /tmp/ckpt     # then: mmpipe train model=hf model.path=/tmp/ckpt/llava
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmpipe.model.hf.demo_kit import CLIP, TEXT_TEMPLATE, corpus, llm_config, perturb, qwen_tokenizer, save
from mmpipe.model.hf.families import FAMILIES
from mmpipe.model.hf.families.llava import TEMPLATE as LLAVA_TEMPLATE

# LLAVA_TEMPLATE and perturb are re-exported: the tests import them from here
__all__ = ["LLAVA_TEMPLATE", "MARKER", "MODELS", "model_overrides", "perturb", "write_all", "write_composition"]


def write_composition(root: Path, texts: list[str]) -> dict[str, Path]:
    """A CLIP vision model, a Qwen2 causal LM (tied embeddings, a string-content ChatML template,
    `<image>` added to its tokenizer), and a folder holding a projector for the two (a LLaVA
    checkpoint of the same widths): what `model=compose` joins."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        CLIPVisionModel,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(44)
    vision = root / "compose-vision"
    model = CLIPVisionModel(CLIPVisionConfig(**CLIP))
    perturb(model, 44)
    model.save_pretrained(vision)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(vision)
    tok = qwen_tokenizer(texts, extra=("<image>",), named={"image_token": "<image>"})
    text = llm_config("qwen2", tok, tie_word_embeddings=True)
    llm = save(Qwen2ForCausalLM(text), tok, TEXT_TEMPLATE, root / "compose-llm", 45)
    donor = LlavaForConditionalGeneration(LlavaConfig(vision_config=CLIPVisionConfig(**CLIP), text_config=text,
                                                      image_token_id=tok.convert_tokens_to_ids("<image>")))
    perturb(donor, 46)
    projector = root / "compose-projector"
    donor.save_pretrained(projector)
    return {"compose-vision": vision, "compose-llm": llm, "compose-projector": projector}


MARKER = "mmpipe-demo-checkpoints.json"
"""Written at the top of the folder write_all fills: `mmpipe demo-checkpoints` may write there again."""


def write_all(root: Path) -> dict[str, Path]:
    """Every family's demo checkpoint and the composition's folders, under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    folders = {family.demo.name: family.demo.write(root, texts) for family in FAMILIES}
    folders |= write_composition(root, texts)
    (root / MARKER).write_text(json.dumps({name: folder.name for name, folder in folders.items()}, indent=1) + "\n")
    return folders


MODELS = (*(family.demo.name for family in FAMILIES), "compose")
"""The models the folders of write_all make."""


def model_overrides(name: str, folders: dict[str, Path]) -> list[str]:
    """The `mmpipe train` overrides that select model `name` (one of MODELS) of write_all's folders."""
    if name == "compose":
        return ["model=compose", f"model.vision.path={folders['compose-vision']}",
                f"model.llm.path={folders['compose-llm']}", f"model.projector.path={folders['compose-projector']}"]
    return ["model=hf", f"model.path={folders[name]}"]
