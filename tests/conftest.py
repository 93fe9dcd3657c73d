"""Fixtures shared by the unit and the distributed tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the tests package (shared cases) imports as tests.unit.model...
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny Hugging Face checkpoint folders (model, tokenizer with a chat template, processor
    config) by name: llava, qwen2-vl, qwen2-audio, compose-vision / compose-llm /
    compose-projector, llava-next and llava-onevision (mmpipe/model/hf/demo.py)."""
    from mmpipe.model.hf.demo import write_all

    return write_all(tmp_path_factory.mktemp("hf-checkpoints"))

