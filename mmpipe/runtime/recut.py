"""A re-cut (plan.recut=auto), both sides: the ranks' `Recut` (whether to re-cut, the request
they leave in the run directory when they stop for one, the gain measured after the relaunch)
and the launcher's part (taking the request, the config it relaunches the ranks with).

The ranks decide (`Recut.consider`, with planner/api.py: `consider_recut`), commit a checkpoint,
write RECUT_REQUEST (`Recut.request`) and end normally. mmpipe's launcher (commands.run_train) then takes the
request, appends it to RECUT_HISTORY and starts the ranks again with the new cut as
`plan.stages` / `plan.recompute` and `train.resume=RUN_DIR`: the layout-changing resume
(runtime/reshard.py) carries the weights, optimizer state, schedule and reader positions over.
Relaunching, not rebuilding DeepSpeed's PipelineEngine in place: the engine fixes its stage's
modules, process groups and optimizer at construction and has no API to re-partition.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.model.spec import layer_names
from mmpipe.planner.api import (
    HardwareSpec,
    Placement,
    PlanProblem,
    StagePlan,
    StepCalibration,
    calibrated_hardware,
    consider_recut,
    describe_gain,
)

__all__ = ["RECUT_HISTORY", "RECUT_REQUEST", "Recut", "clear_request", "last_recut", "recut_config",
           "take_request"]

RECUT_REQUEST = "recut_request.json"
"""Written by rank 0 when the ranks stop for a re-cut; taken by the launcher."""
RECUT_HISTORY = "recuts.jsonl"
"""Every re-cut of the run, one JSON line each (step, old and new cut, predicted gain)."""


def clear_request(run_dir: Path) -> None:
    """Drop a request left by a launch that is over (a launcher stopped before taking it)."""
    (run_dir / RECUT_REQUEST).unlink(missing_ok=True)


def take_request(run_dir: Path) -> dict | None:
    """The ranks' re-cut request, moved into the run's history; None when they did not ask."""
    path = run_dir / RECUT_REQUEST
    if not path.is_file():
        return None
    request = json.loads(path.read_text())
    with (run_dir / RECUT_HISTORY).open("a") as f:
        f.write(json.dumps(request) + "\n")
    path.unlink()
    return request


def last_recut(run_dir: Path, step: int) -> dict | None:
    """The re-cut made at `step` (a relaunched run's resumed step), None if the run did not re-cut there."""
    path = run_dir / RECUT_HISTORY
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in reversed(lines) if r.get("step") == step), None)


def recut_config(rc: RunConfig, request: dict) -> RunConfig:
    """The run's config on the requested cut, resuming from its own directory."""
    names = layer_names(rc.model)
    stages = tuple((names[a], names[b - 1]) for a, b in request["new"])
    # the run's placement, as resolved, stays (the request holds its Placement.to_config())
    encoders = request.get("encoders") or rc.plan.encoders
    return replace(rc, plan=replace(rc.plan, stages=stages, recompute=tuple(request["new_recompute"]),
                                    encoders=encoders),
                   train=replace(rc.train, resume=str(rc.run_dir)))


class Recut:
    """One rank's part of plan.recut=auto, from the steps it watches to the request it leaves:
    rank 0 keeps the features of the steps planned since the last check (`note`), re-plans the
    cut on them at a checkpoint (`consider`, whose verdict every rank gets), writes the request
    the launcher relaunches on (`request`), and, in a run a re-cut relaunched, measures the gain
    the re-cut made (`measured`). One object, so the check, its request and its measurement
    share one record of the run's cut, placement and step times; the loop only calls it.

    torch.distributed is imported where the ranks use it: the launcher imports this module for
    `take_request` and `recut_config` and stays free of torch."""

    def __init__(self, rc: RunConfig, *, problem: PlanProblem, stage_plan: StagePlan, calibration: StepCalibration,
                 start: int, rank0: bool):
        self._rc = rc
        self._problem = problem
        """The run's planning problem (its placement as resolved); a check prices it with the fit."""
        self._stage_plan = stage_plan
        """The run's stage cut (what a check compares other cuts with)."""
        self._calibration = calibration
        """The run's step-time re-fit (the train loop's: it is observed step by step)."""
        self._watching = rank0 and rc.plan.recut == "auto"
        self._recent: list = []
        """Rank 0: the features of each step planned since the last check."""
        self._from = last_recut(Path(rc.run_dir), start) if rank0 and start else None
        """Rank 0 of a run relaunched by a re-cut: that re-cut's record, until its measured gain is logged."""
        self._launch_times: list[float] = []
        """Rank 0: the step time of every step since this launch, s."""

    @property
    def hardware(self) -> HardwareSpec:
        return self._problem.hardware

    @property
    def placement(self) -> Placement:
        return self._problem.placement

    def note(self, features) -> None:
        """A step the feeder planned (its samples' features), for the next check."""
        if self._watching:
            self._recent.append(features)

    def consider(self, step: int) -> dict | None:
        """plan.recut=auto, at a checkpoint before the last step: rank 0 re-plans the cut on the steps
        trained since the last check, priced with the run's step-time re-fit (the hardware config's
        costs until it has one), and every rank gets its verdict (RecutChoice.record); else None."""
        import torch.distributed as dist

        rc = self._rc
        if rc.plan.recut != "auto" or step % rc.train.save_every or step >= rc.train.steps:
            return None
        record: list = [None]
        if dist.get_rank() == 0:
            hw, fitted = self._problem.hardware, self._calibration.fitted
            if fitted:
                hw = calibrated_hardware(hw, self._calibration.coef)
            choice = consider_recut(replace(self._problem, hardware=hw), self._stage_plan, self._recent,
                                    rc.plan.recut_gain)
            self._recent.clear()
            record[0] = {**choice.record(), "priced_with": "the run's step-time fit" if fitted
                         else f"hardware {hw.name}"}
        dist.broadcast_object_list(record, src=0)
        return record[0]

    def request(self, step: int, verdict: dict, checkpoint) -> str:
        """Every rank, after the checkpoint of `step` committed: rank 0 writes the request the
        launcher relaunches on (its placement kept), and the ranks wait for it before any ends.
        Returns the line the run stops with."""
        import torch.distributed as dist

        from mmpipe.runtime.checkpoint import write_atomic

        if dist.get_rank() == 0:
            request = {"step": step, **verdict, "encoders": self.placement.to_config()}  # the relaunch keeps it
            write_atomic(Path(self._rc.run_dir) / RECUT_REQUEST, json.dumps(request).encode())
        stopped = (f"re-cut after step {step}: stages {verdict['old']} -> {verdict['new']}, "
                   f"{describe_gain(verdict)} ({verdict['priced_with']}); checkpoint {checkpoint} committed; the "
                   f"launcher relaunches the ranks on the new cut from it")
        dist.barrier()  # the request exists before any rank ends
        return stopped

    def measured(self, step: int, step_time: float) -> dict | None:
        """Rank 0, every step: in a run a re-cut relaunched, at its next checkpoint (or last step),
        the measured gain: the median step time of the steps since the relaunch against the median
        of the train.save_every steps before the re-cut (the old cut's, read from metrics.jsonl),
        each without the first step after a launch (start-up); else None."""
        cut, rc = self._from, self._rc
        measure = cut is not None and (step - cut["step"] >= rc.train.save_every or step == rc.train.steps)
        after = self._launch_times[1:] + [step_time]
        self._launch_times.append(step_time)
        if not measure:
            return None
        self._from = None
        path = Path(rc.run_dir) / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        before = [r["step_time"] for r in lines if "step_time" in r and not r.get("first_of_launch")
                  and cut["step"] - rc.train.save_every < r["step"] <= cut["step"]]
        if not after or not before:
            return None
        a, b = statistics.median(after), statistics.median(before)
        return {"after_step": cut["step"], "before_s": b, "after_s": a, "gain": b / a - 1.0,
                "predicted_gain": cut["predicted_gain"], "current_fits": cut.get("current_fits", True),
                "steps_measured": [len(before), len(after)]}


def measured_line(measured: dict) -> str:
    """The console's line for a re-cut's measured gain (`Recut.measured`)."""
    return (f"re-cut after step {measured['after_step']}: measured {measured['gain']:+.1%} faster "
            f"(median step {measured['before_s']:.3g} s -> {measured['after_s']:.3g} s; "
            f"{describe_gain(measured)})")
