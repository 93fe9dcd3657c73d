"""The launcher's side of a re-cut (plan.recut=auto): the request the ranks leave in the run
directory when they stop for one, and the config the launcher relaunches them with.

The ranks decide (runtime/train.py: `_consider_recut`, planner/api.py: `consider_recut`), commit a checkpoint,
write RECUT_REQUEST and end normally. mmpipe's launcher (commands.run_train) then takes the
request, appends it to RECUT_HISTORY and starts the ranks again with the new cut as
`plan.stages` / `plan.recompute` and `train.resume=RUN_DIR`: the layout-changing resume
(runtime/reshard.py) carries the weights, optimizer state, schedule and reader positions over.
Relaunching, not rebuilding DeepSpeed's PipelineEngine in place: the engine fixes its stage's
modules, process groups and optimizer at construction and has no API to re-partition.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.model.spec import layer_names

__all__ = ["RECUT_HISTORY", "RECUT_REQUEST", "clear_request", "last_recut", "recut_config", "take_request"]

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
