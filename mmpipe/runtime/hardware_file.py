"""Hardware descriptions a run writes for later runs to plan with: what `mmpipe profile`
measured, and what `mmpipe train`'s step-time re-fit learned (`write_calibrated`).

Each is a `hardware` config group file in a config folder of the run's own,
RUN_DIR/conf/hardware/NAME.yaml (the shipped conf/ is never overwritten), which
`mmpipe train --config-dir=RUN_DIR/conf hardware=NAME` composes like a preset; it carries
`measured_for`, the model it was measured with (config.hardware_spec refuses it for another).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import yaml

from mmpipe.config import RunConfig, hardware_spec
from mmpipe.paths import shell_word
from mmpipe.planner.api import HardwareSpec, StepCalibration, calibrated_hardware, hardware_to_dict

CALIBRATED_PREFIX = "calibrated-"
"""Name of a training re-fit's hardware: this prefix and the name of the hardware it re-fitted."""


def hardware_file(run_dir: str | os.PathLike, name: str) -> Path:
    """Where a run writes the hardware description NAME."""
    return Path(run_dir) / "conf" / "hardware" / f"{name}.yaml"


def use_line(path: Path) -> str:
    """The command that trains with the hardware file at `path`."""
    if path.parent.name != "hardware":
        return f"put it in DIR/hardware/, then mmpipe train --config-dir=DIR hardware={path.stem}"
    return f"mmpipe train {shell_word(f'--config-dir={path.parent.parent}')} hardware={path.stem}"


def write_hardware_file(path: Path, hw: HardwareSpec, *, model: str, header: str, device: str | None) -> None:
    """Write `hw` as a hardware config for `model`, measured on `device` (host.training_device),
    under the comment lines `header`."""
    doc = hardware_to_dict(hw)
    doc["measured_for"] = model
    doc["device"] = device
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(comment + yaml.safe_dump(_plain(doc), sort_keys=False))


def write_calibrated(rc: RunConfig, calibration: StepCalibration | None) -> str:
    """At the end of a training run (rank 0): write the run's hardware with the re-fit's
    constants (`calibrated_hardware`) as RUN_DIR/conf/hardware/calibrated-<hardware>.yaml when
    the fit has seen enough steps; return the line the run's summary ends with. The file's
    fixed costs are the fit's b and c themselves (the fit is bounded: never below 0)."""
    needed = calibration.min_steps if calibration is not None else StepCalibration().min_steps
    seen = calibration.observed if calibration is not None else 0
    if calibration is None or not calibration.fitted:
        return (f"calibrated hardware: none written ({seen} steps measured, the step-time re-fit "
                f"needs {needed}; train more steps to calibrate)")
    base = hardware_spec(rc)
    # Re-fitting a calibrated file calibrates it further under the same name.
    name = CALIBRATED_PREFIX + base.name.removeprefix(CALIBRATED_PREFIX)
    hw = dataclasses.replace(calibrated_hardware(base, calibration.coef), name=name)
    path = hardware_file(rc.run_dir, name)
    fit = calibration.describe()
    use = use_line(path)
    write_hardware_file(path, hw, model=rc.model.name, device=rc.hardware.get("device"), header=(
        f"Calibrated by `mmpipe train` in {rc.run_dir}: hardware {base.name} re-fitted on the last "
        f"{len(calibration.history)} of {seen} steps\n"
        f"(model {rc.model.name}, pp={rc.parallel.pp} x dp={rc.parallel.dp}, plan.policy={rc.plan.policy}).\n"
        f"Fit: measured step = a * compute + b * micro_batches + c (compute: the simulated 1F1B makespan on\n"
        f"{base.name} without its fixed costs; bounded a > 0, b >= 0, c >= 0; Huber-weighted, "
        f"{calibration.down_weighted} outlier step(s) down-weighted)\n"
        f"with {fit} (out of sample, over the last {len(calibration.errors)} steps).\n"
        f"peak_flops and link_gbps are divided by a, every per-op time multiplied by it; "
        f"micro_batch_overhead_s = b, step_overhead_s = c.\n"
        f"Use: {use}   (or mmpipe plan with the same arguments; valid for model {rc.model.name} only)"))
    return f"calibrated hardware: {path} ({fit}); use: {use}"


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
