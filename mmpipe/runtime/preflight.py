"""Checks and files made before any process starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import yaml

from mmpipe.config import PROJECT_ROOT, RunConfig, resolve_path


def check_data(rc: RunConfig) -> None:
    """The shards and the tokenizer exist (a clear error now, not a hang in every rank later)."""
    from mmpipe.data.reader import check_shards
    from mmpipe.data.tokenizer import check_vocab, load_tokenizer

    if rc.data.kind != "shards":
        raise ValueError(f"data.kind={rc.data.kind!r}: mmpipe train reads webdataset shards; use data=synthetic "
                         f"or a data config with kind: shards")
    paths = [s["path"] for s in rc.data.sources] if rc.data.sources else [rc.data.path]
    for path in paths:
        check_shards(resolve_path(path), root=PROJECT_ROOT, dp_size=rc.parallel.dp,
                     num_workers=rc.data.num_workers)
    tok = load_tokenizer(resolve_path(rc.data.tokenizer or "data/tokenizer.json"))
    check_vocab(tok, rc.model.llm.vocab)


def to_plain(rc: RunConfig) -> dict:
    """The run's config as plain YAML-able values (what the workers read back)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        return x

    out = {k: plain(getattr(rc, k)) for k in ("model", "parallel", "train", "data", "plan", "launcher", "profile",
                                              "pretrained", "shards", "bench", "deepspeed")}
    out["hardware"] = plain(dict(rc.hardware))
    out["model"] = {k: v for k, v in out["model"].items() if v is not None}
    return out


def write_run_config(rc: RunConfig) -> Path:
    run_dir = Path(rc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(to_plain(rc), sort_keys=False))
    return path
