"""Fixtures for the data tests: the tiny model spec and a small generated shard set."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmpipe.config import PACKAGE_ROOT
from mmpipe.data.synth import SynthConfig, generate
from mmpipe.data.tokenizer import Tokenizer, load_tokenizer
from mmpipe.model.spec import ModelSpec, spec_from_dict


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return spec_from_dict(yaml.safe_load((PACKAGE_ROOT / "conf/model/tiny.yaml").read_text()))


@pytest.fixture(scope="session")
def mini_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 synthetic samples in 4 shards (every task kind appears)."""
    out = tmp_path_factory.mktemp("mini")
    generate(SynthConfig(out=out, samples=40, shards=4, seed=3))
    return out


@pytest.fixture(scope="session")
def mini_tok(mini_data: Path) -> Tokenizer:
    return load_tokenizer(mini_data / "tokenizer.json")


@pytest.fixture(scope="session")
def mini_path(mini_data: Path) -> str:
    return str(mini_data / "shards" / "train-{000000..000003}.tar")
