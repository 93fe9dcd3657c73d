"""The tied-embedding pipeline case shared by the distributed test and its worker: a tiny
SigLIP + Qwen2 LLaVA whose input embedding is its LM head, cut so that llm.embed and llm.head
sit on different stages, and two packed micro-batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmpipe.model.hf.arch import spec_from_folder
from mmpipe.model.hf.media import preprocess_image
from mmpipe.model.spec import layer_names
from mmpipe.runtime.batch import collate_hf

from . import hf_cases as H

LR, CLIP = 0.5, 1.0


def write(root: Path) -> Path:
    return H.write_llava(root, vision="siglip", llm="qwen2", layer=-1, select="full", seed=31, tie=True)


def setup(folder: Path):
    """(spec, micro-batches, loss scale, stages): embed on stage 0, head on stage 1."""
    spec = spec_from_folder(folder)
    samples = H.llava_samples(spec, np.random.default_rng(8))
    ours = [H.Sample(s.key, s.input_ids, s.labels, [preprocess_image(spec, b) for b in s.images]) for s in samples]
    mbs = [collate_hf([s], spec=spec, packed=True, pad_id=0) for s in ours]
    names = layer_names(spec)
    cut = names.index("llm.block.1")
    scale = len(mbs) / sum(mb.label_tokens for mb in mbs)
    return spec, mbs, scale, ((0, cut), (cut, len(names)))
