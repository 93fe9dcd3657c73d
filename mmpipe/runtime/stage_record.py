"""What each rank records about itself in `RUN_DIR/stage_rank<R>.json`: its stage, replica,
layers and parameter count at start (and a Hugging Face model's load figures, its resident
memory before the model was built), and with `train.record_samples=true` a digest of its final
weights, so that runs can be checked from outside (tests, the guarantees of docs/training.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def write_stage_file(run_dir: Path, rank: int, stage: int, dp_rank: int, module, *, load: dict | None = None) -> None:
    layers = [getattr(f, "name", "") for f in module.forward_funcs]
    params = sum(p.numel() for p in module.parameters())
    record = {"rank": rank, "stage": stage, "dp_rank": dp_rank, "layers": layers, "params": params}
    if load is not None:
        record["load"] = {k: v for k, v in load.items() if k not in ("rank", "stage")}
    (run_dir / f"stage_rank{rank}.json").write_text(json.dumps(record))


def add_to_stage_file(run_dir: Path, rank: int, **fields) -> None:
    path = run_dir / f"stage_rank{rank}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def parameter_digest(module) -> str:
    """sha256 of this rank's parameters (names, dtypes and bytes, in order): equal on two
    ranks exactly when they hold the same weights."""
    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        t = p.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
