"""A Hugging Face model family (one transformers class mmpipe trains) as one declaration, and the
registry the shared machinery dispatches through.

Each family lives in one file of `mmpipe/model/hf/families/` that builds a `Family`: its
transformers class and model_type, its towers and how their pipeline layers are cut and built,
its positions rule, its processors, its checks and its demo checkpoint. The shared modules
(arch.py, skeleton.py, build.py, positions.py, video.py, media.py, demo.py, outer.py) hold the
machinery every family uses and ask `family_for(config)` / `family_named(model_type)` for the
rest, so adding a family that needs no new capability is one new file plus one line in
`families/__init__.py`'s list.

The families register themselves when `mmpipe.model.hf` is imported: its `__init__` imports
`families`, whose list calls `register`. Python runs a package's `__init__` before any of its
modules, so every lookup here sees them all; the registry lives here (below the families, which
import the shared modules) so that no module imports one that imports it back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from torch import nn
    from transformers import PretrainedConfig

    from mmpipe.model.spec import AudioSpec, HFSource, ModelSpec, VisionSpec

Check = Callable[["PretrainedConfig", str], None]
"""(config, what) -> None, or a one-line ValueError naming what mmpipe cannot run."""
VisionRule = Callable[["PretrainedConfig", Mapping[str, Any], "Mapping[str, Any] | None", str, bool], "VisionSpec"]
"""(config, image processor config, video processor config or None, what, use_audio_in_video) ->
the tower's VisionSpec, its processors checked against it."""
AudioRule = Callable[["PretrainedConfig", Mapping[str, Any], str], "AudioSpec"]
"""(config, feature extractor config, what) -> the audio tower's AudioSpec."""
ProcessorDefault = Callable[["PretrainedConfig"], dict[str, Any]]
"""config -> the processor config transformers' defaults give it (an inline preset without one)."""
SettingsCheck = Callable[[Mapping[str, Any], "PretrainedConfig", str], None]
"""(processor_config.json's top level, config, what) -> None, or a one-line ValueError."""
PartsRule = Callable[["PretrainedConfig", str, str, str], tuple[tuple[str, str], ...]]
"""(config, component, kind, block index or "") -> (attribute, module path) of each module of a
tower layer (`vision.block.3`: "vision", "block", "3")."""
LayerRule = Callable[["ModelSpec", str, dict[str, "nn.Module"]], "nn.Module"]
"""(spec, layer name, its materialised parts) -> the pipeline layer."""
BlockRule = Callable[["ModelSpec", int, dict[str, "nn.Module"]], "nn.Module"]
"""(spec, decoder block index, its parts) -> the pipeline layer `llm.block.<index>`."""
PositionsRule = Callable[["ModelSpec", Sequence[int], Sequence[Any], Sequence[Any]], "np.ndarray"]
"""(spec, a sample's token ids, its ImageInputs, its VideoInputs) -> its 3-D positions [3, n]."""
DemoWriter = Callable[[Path, list[str]], Path]
"""(root folder, the corpus its tokenizer is trained on) -> the demo checkpoint folder it wrote."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer:
    """A checkpoint folder that holds the family's model inside a larger one (a full Qwen2.5-Omni
    folder: thinker, talker, token2wav). mmpipe trains the inner model; export writes the whole
    folder again, the rest copied unchanged (outer.py)."""

    model_type: str
    """The folder's config.json model_type."""
    part: str
    """The inner model: its config is the folder config's `<part>_config`, its tensors `<part>.*`."""
    title: str
    """The folder as messages name it ("a full <title> folder")."""
    trains: str
    """What of the inner model trains, for the run's first line ("audio and vision towers, LLM")."""
    rest: str
    """What mmpipe does not load ("the talker and token2wav")."""
    files: tuple[str, ...]
    """Files only the rest reads, which export copies along."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Demo:
    """The family's tiny demo checkpoint (`mmpipe demo-checkpoints`, the tests)."""

    name: str
    """Its folder and model name (`mmpipe train model=hf model.path=OUT/<name>`)."""
    write: DemoWriter


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Family:
    """Everything mmpipe knows of one transformers class that the shared machinery does not.

    Every field is given by each family (none has a default); None marks a capability the
    family lacks. A family is one object, compared and hashed as such (`eq=False`). How many
    LLM tokens an image, a video or a clip takes (what the planner counts from headers,
    `mmpipe.model.geometry`) is the VisionSpec / AudioSpec that `vision` / `audio` return:
    their resize rule, merge, tiles, pooling and windows are the family's token-count rule.
    """

    model_type: str
    """config.json's model_type, the registry key."""
    architecture: str
    """The transformers class mmpipe builds, loads and exports (`getattr(transformers, ...)`)."""
    title: str
    """The family as messages name it ("Qwen2.5-Omni")."""
    text_types: tuple[str, ...]
    """Decoder model_types its text config may have (transformers' LLM classes it runs)."""
    towers: Mapping[str, str]
    """Component ("vision", "audio") -> the tower's module path in the transformers model."""
    check: Check | None
    """What the shared checks do not refuse of a config (the text type and the class are shared)."""
    vision: VisionRule | None
    """The vision tower's figures (and with them its image and video token counts); None: no tower."""
    audio: AudioRule | None
    """The audio tower's figures (and with them its clip token counts); None: no tower."""
    image_processors: tuple[str, ...]
    """Image processor classes its checkpoints name (config files' image_processor_type, without a
    Fast / Pil suffix) whose geometry mmpipe checks (media.py)."""
    default_image_processor: ProcessorDefault | None
    """An inline preset's image processor config when it gives none; None exactly when `vision` is."""
    default_feature_extractor: ProcessorDefault | None
    """An inline preset's feature extractor config when it gives none; None exactly when `audio` is."""
    video_processor: str | None
    """transformers' video processor class paired with the model (its dotted path, as
    video_processing_auto pairs them); None: mmpipe feeds the family no video."""
    processor_settings: SettingsCheck | None
    """Check of a folder's processor_config.json placeholder settings against the config."""
    layer_parts: PartsRule
    """Which transformers modules each tower layer holds (the LLM's are shared: skeleton.py)."""
    tower_layer: LayerRule
    """The pipeline layer of `vision.*` / `audio.*` from its parts."""
    llm_block: BlockRule | None
    """A decoder block of the family's own (Qwen3-VL's DeepStack); None: transformers' decoder layer
    as layers.HFLLMBlock, taking 3-D positions where `positions` is set."""
    positions: PositionsRule | None
    """Its 3-D M-RoPE positions of a sample (each Qwen class's get_rope_index); None: 1-D RoPE
    positions (the carrier's own)."""
    audio_in_video: bool
    """Whether it reads a video's audio track interleaved with its frames (use_audio_in_video)."""
    outer: Outer | None
    """A larger checkpoint folder it is trained from, inside; None: none."""
    demo: Demo
    """Its tiny demo checkpoint."""

    def __post_init__(self) -> None:
        if (self.vision is None) != (self.default_image_processor is None):
            raise ValueError(f"family {self.model_type}: vision and default_image_processor go together")
        if (self.audio is None) != (self.default_feature_extractor is None):
            raise ValueError(f"family {self.model_type}: audio and default_feature_extractor go together")
        missing = {c for c in ("vision", "audio") if getattr(self, c) is not None} - set(self.towers)
        if missing:
            raise ValueError(f"family {self.model_type}: no tower path for {', '.join(sorted(missing))}")


FIELDS = tuple(f.name for f in fields(Family))
"""Every field a family declares."""

_REGISTRY: dict[str, Family] = {}
REGISTRY: Mapping[str, Family] = MappingProxyType(_REGISTRY)
"""model_type -> Family, in registration order (families/__init__.py's list); read-only."""


def register(family: Family) -> Family:
    """Add a family to the registry (families/__init__.py calls this for its list)."""
    if family.model_type in _REGISTRY and _REGISTRY[family.model_type] is not family:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    _REGISTRY[family.model_type] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_REGISTRY.values())


def family_named(model_type: str) -> Family:
    """The family of a model_type; a one-line ValueError listing the supported ones otherwise."""
    family = _REGISTRY.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(_REGISTRY)}")
    return family


def family_for(config: PretrainedConfig) -> Family:
    """The family of a transformers config (by its model_type)."""
    return family_named(config.model_type)


def family_of(src: HFSource) -> Family:
    """The family of a spec's Hugging Face source (its config JSON's model_type, without building
    the config)."""
    return family_named(json.loads(src.config).get("model_type"))
