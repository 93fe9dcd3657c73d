"""A `model` config group that names a Hugging Face source becomes a ModelSpec: a checkpoint
folder (`model=hf`), an inline config (the 7B presets), or a composition of unimodal
checkpoints (`model=compose`). Errors name each key as the user types it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmpipe.model.hf.arch import spec_from_config, spec_from_folder, supported_models
from mmpipe.model.hf.compose import spec_from_compose
from mmpipe.model.spec import ModelSpec

FOLDER_KEYS = ("name", "path", "max_seq_len", "use_audio_in_video")
"""`model=hf` (conf/model/hf.yaml)."""
CONFIG_KEYS = ("name", "config", "image_processor", "feature_extractor", "video_processor", "max_seq_len",
               "use_audio_in_video")
"""A preset stating its transformers config inline (conf/model/llava-1.5-7b.yaml ...)."""
COMPOSE_KEYS = ("name", "vision", "audio", "llm", "projector", "vision_feature_layer", "vision_feature_select_strategy",
                "projector_hidden_act", "image_token_id", "audio_token_id", "max_seq_len")
"""`model=compose` (conf/model/compose.yaml); vision, audio, llm and projector are {path: DIR}."""
PARTS = ("vision", "audio", "llm", "projector")
UNSET = (None, "", "???")
"""Values that mean "not given" (`???` is Hydra's mandatory marker, left unresolved)."""


def spec_from_settings(group: Mapping[str, Any]) -> ModelSpec:
    """The spec of a `model` group naming a Hugging Face source, one of

        name: null                # model=hf: the folder's name
        path: DIR                 # a checkpoint folder written by save_pretrained
        ---
        name: qwen2-vl-7b         # a preset: the Hub config.json and processor config, inline (no weights)
        config: {...}
        image_processor: {...}    # or feature_extractor: {...}; video_processor: {...} (default: the image one)
        ---
        name: null                # model=compose
        vision: {path: DIR}       # or audio: {path: DIR}
        llm: {path: DIR}
        projector: {path: null}   # a folder holding a projector (a LLaVA checkpoint, an export), or null
        vision_feature_layer: -2  # ... (conf/model/compose.yaml)

    each with an optional `max_seq_len`, and for Qwen2.5-Omni `use_audio_in_video` (a clip's audio
    track interleaved with its frames; transformers takes it as a processor and forward argument,
    which no checkpoint file records). Unknown keys and missing values are errors naming the key.
    """
    group = dict(group)
    llm = group.get("llm")
    if isinstance(llm, Mapping) and "path" in llm:
        return _compose(group)
    form, keys = ("path", FOLDER_KEYS) if "path" in group else ("config", CONFIG_KEYS)
    _known(group, keys, f"model={'hf' if form == 'path' else group.get('name')}")
    name, max_len = group.get("name"), group.get("max_seq_len")
    audio_in_video = group.get("use_audio_in_video") or False
    if not isinstance(audio_in_video, bool):
        raise ValueError(f"model.use_audio_in_video={audio_in_video!r} must be true or false")
    if form == "path":
        if group["path"] in UNSET:
            raise ValueError(f"model.path is not set; give model.path=DIR, a local checkpoint folder written by "
                             f"save_pretrained of {supported_models()}")
        return spec_from_folder(str(group["path"]), name=name, max_seq_len=max_len,
                                use_audio_in_video=audio_in_video)
    if not isinstance(group.get("config"), Mapping):
        raise ValueError(f"model.config={group.get('config')!r} must be a mapping shaped like config.json")
    if not name:
        raise ValueError("model.name is missing; a preset with an inline config names itself")
    return spec_from_config(group["config"], name=name, image_processor=group.get("image_processor"),
                            feature_extractor=group.get("feature_extractor"), max_seq_len=max_len,
                            video_processor=group.get("video_processor"), use_audio_in_video=audio_in_video)


def _known(group: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(group) - set(keys))
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a setting of {what}; known: {', '.join(keys)}")


def _compose(group: dict[str, Any]) -> ModelSpec:
    _known(group, COMPOSE_KEYS, "model=compose")
    folders: dict[str, str | None] = {}
    for part in PARTS:
        value = group.pop(part, None)
        if value is None:
            folders[part] = None
            continue
        if not isinstance(value, Mapping) or set(value) - {"path"}:
            extra = sorted(set(value) - {"path"}) if isinstance(value, Mapping) else [repr(value)]
            raise ValueError(f"model.{part}.{extra[0]} is not a setting of model=compose; give model.{part}.path=DIR")
        path = value.get("path")
        folders[part] = None if path in UNSET else str(path)
    if folders["llm"] is None:
        raise ValueError("model.llm.path is not set; give model.llm.path=DIR, a local Llama / Mistral / Qwen2 "
                         "causal LM folder written by save_pretrained")
    options = {k: v for k, v in group.items() if k != "name" and v not in UNSET}
    return spec_from_compose(name=group.get("name") or "compose", **folders, **options)
