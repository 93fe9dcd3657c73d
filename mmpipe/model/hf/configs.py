"""transformers config objects from the JSON a spec records (one shared object per process)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mmpipe.model.hf.family import REGISTRY
from mmpipe.model.spec import HFSource


def config_from_dict(values: Mapping[str, Any], *, what: str = "model.config") -> PretrainedConfig:
    """A transformers config from a mapping shaped like config.json."""
    values = dict(values)
    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{what}.model_type={model_type!r} is not a transformers model type; "
                         f"supported: {', '.join(REGISTRY)}")
    return CONFIG_MAPPING[model_type].from_dict(values)


@functools.lru_cache(maxsize=16)
def _config_from_json(text: str) -> PretrainedConfig:
    return config_from_dict(json.loads(text))


def hf_config(src: HFSource) -> PretrainedConfig:
    """The transformers config a spec's layers are built from (one shared object per process)."""
    return _config_from_json(src.config)


def config_json(config: PretrainedConfig) -> str:
    """A config as the JSON its config.json holds (stable, so equal configs give equal specs)."""
    return json.dumps(config.to_dict(), sort_keys=True)


def __getattr__(name: str) -> Any:
    """`ARCHITECTURES`: model_type -> the transformers class mmpipe builds (and exports) for it, read
    from the family registry (family.py) when asked, since the families register after this
    module is imported."""
    if name == "ARCHITECTURES":
        return {model_type: family.architecture for model_type, family in REGISTRY.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
