"""The `model` config group, in any of its forms, as a ModelSpec.

- mmpipe's own figures (`model=tiny`, the planner-only `omni-7b`): `spec_from_dict`;
- a Hugging Face source (`model=hf model.path=DIR`, `model=compose ...`, the 7B presets stating
  their Hub config inline): `mmpipe.model.hf.spec_from_settings`, imported only then (it pulls in
  transformers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmpipe.model.spec import ModelSpec, spec_from_dict

PATH_KEYS = ("path", "vision", "audio", "llm", "projector")
"""Where a Hugging Face group names folders (`path`, or `<part>.path` of a composition)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelChoice:
    """A model group, validated."""

    spec: ModelSpec
    """The architecture (and, for a Hugging Face model, its source)."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """A Hugging Face group as given, its folders absolute: run.yaml records it, so that every rank
    and `mmpipe export` rebuild the same spec from the same files. Empty for mmpipe's own figures."""
    planner_only: str | None = None
    """Why the preset can be planned but not built (`planner_only:` in its group), else None."""


def is_hf_group(group: Mapping[str, Any]) -> bool:
    """Whether a model group names a Hugging Face source (else it gives mmpipe's own figures)."""
    llm = group.get("llm")
    return "path" in group or "config" in group or (isinstance(llm, Mapping) and "path" in llm)


def model_from_group(group: Mapping[str, Any], *, resolve: Callable[[str], str] = str) -> ModelChoice:
    """The spec of a `model` group; `resolve` turns a folder as typed into the folder to read.

    Raises:
        ValueError: one line naming the key as typed (`model.path`, `model.llm.path`, ...).
    """
    group = dict(group)
    if not is_hf_group(group):
        reason = group.pop("planner_only", None)
        return ModelChoice(spec=spec_from_dict(group), planner_only=str(reason) if reason else None)
    from mmpipe.model.hf.settings import UNSET, spec_from_settings

    settings: dict[str, Any] = {}
    for key, value in group.items():
        if key == "path" and value not in UNSET:
            value = resolve(str(value))
        elif key in PATH_KEYS and isinstance(value, Mapping) and value.get("path") not in UNSET:
            value = {**value, "path": resolve(str(value["path"]))}
        settings[key] = value
    return ModelChoice(spec=spec_from_settings(settings), settings=settings)
