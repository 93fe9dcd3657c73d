"""Shared builders for the planner tests (plain functions, no conftest)."""

from __future__ import annotations

from pathlib import Path

import yaml

from mmpipe.model.group import model_from_group
from mmpipe.model.spec import ModelSpec
from mmpipe.planner.hardware import HardwareSpec, hardware_from_dict

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"  # the shipped configs
WORKLOADS = ROOT / "data" / "workloads"


def model(name: str) -> ModelSpec:
    """A model preset as `model=NAME` builds it (the 7B presets through their inline Hub configs)."""
    return model_from_group(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())).spec


def hardware(name: str) -> HardwareSpec:
    doc = yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text())
    return hardware_from_dict(doc)
