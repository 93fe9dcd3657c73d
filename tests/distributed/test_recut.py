"""plan.recut=auto re-cuts a running pipeline, as a user sees it: a run started on a cut that
leaves stage 0 one layer is re-planned at its step-2 checkpoint on the samples it trained, the
ranks stop, the launcher relaunches them on the planner's cut from that checkpoint, and the run
goes on to its last step: the same losses, gradient norms and final weights as the run that
keeps its cut (fp32; the micro-batches of a step may be grouped otherwise on another cut), with
the re-cut logged (metrics.jsonl, recuts.jsonl) and its measured gain logged after the next
steps. At step 4 the new cut is kept (no re-cut back and forth)."""

from __future__ import annotations

import json
import re

import pytest

from tests.distributed.test_reshard import _same_steps, _same_weights

pytestmark = pytest.mark.distributed

RUN = ["train.steps=6", "train.save_every=2", "train.global_batch=8", "train.micro_batches=2",
       "plan.stages=[vision.embed:vision.embed,vision.block.0:llm.head]"]


def test_auto_recut_relaunches_on_a_better_cut_and_the_run_continues(run_mmpipe):
    kept = run_mmpipe("train", *RUN, name="kept")
    assert kept.code == 0, kept.out[-3000:]
    cut = run_mmpipe("train", *RUN, "plan.recut=auto", name="cut")
    assert cut.code == 0, cut.out[-3000:]
    assert "mmpipe train: re-cut after step 2: stages [[0, 1], [1, 15]] -> [[0, " in cut.out
    assert "relaunching 2 processes from its checkpoint" in cut.out and "warning: resharded: pipeline pp=2" in cut.out
    # one `done:` line for the run: the launch before the re-cut reports its steps so far
    ends = [l for l in cut.out.splitlines() if l.startswith(("done:", "so far:"))]
    assert len(ends) == 2 and ends[0].startswith("so far: 2 steps in "), ends
    assert re.search(r"^done: 4 steps in [\d.]+s \(steps 3-6, from the checkpoint of step 2\)", cut.out, re.M)
    history = [json.loads(line) for line in (cut.run_dir / "recuts.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["step"] == 2 and history[0]["predicted_gain"] > 0.05
    new = history[0]["new"]
    assert new != [[0, 1], [1, 15]]

    lines = cut.metrics()
    assert [m["step"] for m in lines] == list(range(1, 7))
    _same_steps(kept, cut, 1)
    assert lines[1]["recut"]["recut"] and lines[1]["recut"]["new"] == new
    assert lines[3]["recut"]["recut"] is False and lines[3]["recut"]["old"] == new  # kept at step 4
    measured = [m["recut_measured"] for m in lines if "recut_measured" in m]
    assert len(measured) == 1 and measured[0]["after_step"] == 2 and measured[0]["after_s"] > 0
    assert [m["first_of_launch"] for m in lines] == [True, False, True, False, False, False]
    _same_weights(kept, cut, 6)
