"""A `model` config group that names a Hugging Face source becomes a ModelSpec: a checkpoint
folder, an inline config (the 7B presets), or a composition of unimodal checkpoints."""

from __future__ import annotations

from typing import Any, Mapping

from mmpipe.model.hf.arch import COMPOSE_KEYS, SETTINGS_KEYS, spec_from_config, spec_from_folder
from mmpipe.model.hf.compose import spec_from_compose
from mmpipe.model.spec import ModelSpec


def spec_from_settings(settings: Mapping[str, Any]) -> ModelSpec:
    """A `model` config group naming a Hugging Face source, e.g.

        name: llava-1.5-7b
        hf: {path: DIR}                                  # a checkpoint folder, or
        hf: {config: {...}, image_processor: {...}}      # an inline config (no weights), or
        hf: {compose: {vision: DIR, llm: DIR, projector: DIR, image_token_id: 32000}}

    and optionally `hf.max_seq_len`. Unknown keys are errors naming the key.
    """
    settings = dict(settings)
    name, hf = settings.pop("name", None), settings.pop("hf", None)
    if settings:
        raise ValueError(f"model.{sorted(settings)[0]} is not a setting of a Hugging Face model; "
                         f"known: name, hf")
    if not isinstance(hf, Mapping):
        raise ValueError("model.hf is missing; give hf.path, hf.config or hf.compose")
    unknown = sorted(set(hf) - set(SETTINGS_KEYS))
    if unknown:
        raise ValueError(f"model.hf.{unknown[0]} is not a setting; known: {', '.join(SETTINGS_KEYS)}")
    sources = [k for k in ("path", "config", "compose") if hf.get(k) is not None]
    if len(sources) != 1:
        raise ValueError(f"model.hf needs exactly one of path, config, compose; got {sources or 'none'}")
    max_len = hf.get("max_seq_len")
    if "path" in sources:
        return spec_from_folder(hf["path"], name=name, max_seq_len=max_len)
    if "config" in sources:
        if not name:
            raise ValueError("model.name is missing; a preset with an inline config names itself")
        return spec_from_config(hf["config"], name=name, image_processor=hf.get("image_processor"),
                                feature_extractor=hf.get("feature_extractor"), max_seq_len=max_len)
    compose = dict(hf["compose"])
    unknown = sorted(set(compose) - set(COMPOSE_KEYS))
    if unknown:
        raise ValueError(f"model.hf.compose.{unknown[0]} is not a setting; known: {', '.join(COMPOSE_KEYS)}")
    return spec_from_compose(name=name or "compose", max_seq_len=max_len, **compose)
