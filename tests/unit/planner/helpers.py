"""Shared builders for the planner tests (plain functions, no conftest)."""

from __future__ import annotations

from pathlib import Path

import yaml

from mmpipe.model.spec import ModelSpec, spec_from_dict
from mmpipe.planner.hardware import HardwareSpec, hardware_from_dict

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "mmpipe"  # the shipped configs and data live in the package
WORKLOADS = PACKAGE / "data" / "workloads"


def model(name: str) -> ModelSpec:
    return spec_from_dict(yaml.safe_load((PACKAGE / "conf" / "model" / f"{name}.yaml").read_text()))


def hardware(name: str) -> HardwareSpec:
    return hardware_from_dict(yaml.safe_load((PACKAGE / "conf" / "hardware" / f"{name}.yaml").read_text()))
