"""Checkpoint folders that hold a family's model inside a larger one (`Family.outer`): a full
Qwen2.5-Omni folder holds the thinker mmpipe trains beside a talker and a token2wav it does not.

mmpipe reads such a folder's config as the inner model's (`unwrap`), loads only the inner
model's tensors (their `<part>.` prefix is transformers' own key mapping), says so when a run
starts (`source_note`), and exports the whole folder again: the inner model's trained tensors
under their prefix, the rest and its files copied unchanged (export.py, `outer_folder`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from mmpipe.model.hf.family import Outer, families, family_of
from mmpipe.model.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterFolder:
    """A spec's checkpoint folder that holds its model inside a larger one."""

    folder: Path
    outer: Outer

    @property
    def prefix(self) -> str:
        """The inner model's tensors' prefix in the folder ("thinker.")."""
        return self.outer.part + "."


def unwrap(config: PretrainedConfig) -> PretrainedConfig:
    """The inner model's config of a larger folder's config (a full Qwen2.5-Omni config as its
    thinker's, which is what mmpipe trains); any other config unchanged."""
    for family in families():
        if family.outer is not None and config.model_type == family.outer.model_type:
            return getattr(config, f"{family.outer.part}_config")
    return config


def outer_folder(spec: ModelSpec) -> OuterFolder | None:
    """The checkpoint folder when the spec's model comes from inside a larger one (its config.json
    has its family's outer model_type), else None."""
    if spec.hf is None or family_of(spec.hf).outer is None:
        return None
    outer = family_of(spec.hf).outer
    folder = dict(spec.hf.weights).get("model")
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    return OuterFolder(folder=Path(folder), outer=outer) if config.get("model_type") == outer.model_type else None


def source_note(spec: ModelSpec) -> str | None:
    """One line for the start of a run from such a folder, else None."""
    held = outer_folder(spec)
    if held is None:
        return None
    o = held.outer
    return (f"model.path={str(held.folder)!r} is a {o.title} folder: mmpipe trains its {o.part} ({o.trains}); "
            f"{o.rest} are not loaded, and `mmpipe export` copies them unchanged into the full folder it writes")
