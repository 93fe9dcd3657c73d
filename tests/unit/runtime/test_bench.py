"""`mmpipe bench` and `mmpipe report` on the same runs: one encoder placement for every policy
(stated in each row), and the same steady-state samples/s and ranking from both commands. The
runs are recorded per-step timings written where `mmpipe train` would write them; no process
is launched."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from mmpipe.cli import load, main
from mmpipe.measure import rank
from mmpipe.report import configurations, load_runs
from mmpipe.runtime import bench

STEPS = 10
SAMPLES = 12
RECORDED = {
    # slow warm-up, then alternating fast and slow steps: 60 samples/s in the steady state, but
    # the median of the per-step rates over every step (warm-up included) says 40
    "data-aware": [2.0, 2.0] + [0.1, 0.3] * 4,
    "packed-ffd": [0.25] * STEPS,  # 48 samples/s however it is read
    "ds-default": [0.4] * STEPS,  # 30
}
"""Step times of steps 1..10 of every run of each policy, s."""
PER_POLICY_AUTO = {"data-aware": {"vision": "stages", "audio": "spread"}}
"""What plan.encoders=auto resolves to for each policy (both towers spread for the others, as a
ds-default run once chose on its own)."""


def _resolved(policy: str, value: object) -> dict[str, str]:
    if value == "auto":
        return dict(PER_POLICY_AUTO.get(policy, {"vision": "spread", "audio": "spread"}))
    return {"vision": str(value), "audio": str(value)}


def _records(policy: str) -> list[dict]:
    return [{"step": s, "loss": 7.0 - s / 10, "samples": SAMPLES, "tokens": 100 * SAMPLES, "step_time": t,
             "samples_per_s": SAMPLES / t, "tokens_per_s": 100 * SAMPLES / t, "engine_time": 0.9 * t,
             "bubble": 0.3, "prediction_error": 0.1, "overhead_s": 0.1 * t, "plan_s": 0.01, "feed_s": 0.02,
             "bound_fraction": 0.5, "first_of_launch": s == 1}
            for s, t in enumerate(RECORDED[policy], start=1)]


@pytest.fixture
def fake_train(monkeypatch):
    """`mmpipe train` as bench launches it: writes the run's overrides and recorded metrics."""
    launched: list[list[str]] = []

    def run(cmd, **_):
        launched.append(cmd)
        args = cmd[cmd.index("train") + 1:]
        given = dict(a.split("=", 1) for a in args)
        run_dir = Path(given["hydra.run.dir"])
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([a for a in args
                                                                           if not a.startswith("hydra.")]))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(given["plan.policy"])))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    return launched


def _bench(tmp_path: Path, *extra: str) -> tuple[Path, list[bench.PolicyFigures], list[tuple[str, object]]]:
    out = tmp_path / "bench"
    rc = load(["bench.policies=[data-aware,packed-ffd,ds-default]", "bench.rounds=2", f"bench.steps={STEPS}",
               f"hydra.run.dir={out}", *extra], job="bench")
    asked: list[tuple[str, object]] = []

    def resolve(policy: str, value: object) -> dict[str, str]:
        asked.append((policy, value))
        return _resolved(policy, value)

    return out, bench.run_bench(rc, [f"bench.steps={STEPS}"], resolve), asked


def test_every_policy_runs_with_the_placement_resolved_once(tmp_path, fake_train, capsys):
    out, figures, asked = _bench(tmp_path)
    assert asked == [("data-aware", "auto")]  # plan.encoders=auto resolved once, for data-aware
    assert len(fake_train) == 6  # 3 policies x 2 rounds
    assert all(c.count("plan.encoders={vision: stages, audio: spread}") == 1 for c in fake_train)
    rows = json.loads((out / "bench.json").read_text())
    assert [(r["policy"], r["encoders"]) for r in rows] == [("data-aware", "audio spread"),
                                                           ("packed-ffd", "audio spread"),
                                                           ("ds-default", "audio spread")]
    table = capsys.readouterr().out
    assert "encoders audio spread for every policy (plan.encoders=auto resolved once, for data-aware)" in table
    assert all(line.split()[1:3] == ["audio", "spread"] for line in table.splitlines()
               if line.startswith(("data-aware ", "packed-ffd ", "ds-default ")))


def test_placements_asked_for_are_stated_in_each_row(tmp_path, fake_train):
    out, figures, asked = _bench(tmp_path, "bench.encoders=[stages,auto]")
    rows = {r["policy"]: r["encoders"] for r in json.loads((out / "bench.json").read_text())}
    assert rows == {"data-aware/stages": "stages", "data-aware/auto": "audio spread",
                    "packed-ffd/stages": "stages", "packed-ffd/auto": "spread",
                    "ds-default/stages": "stages", "ds-default/auto": "spread"}
    ran = {(c[c.index("train") + 1:][-1], next(a for a in c if a.startswith("plan.policy="))) for c in fake_train}
    assert ("plan.encoders=spread", "plan.policy=ds-default") in ran  # each run gets its row's placement
    assert ("plan.encoders={vision: stages, audio: spread}", "plan.policy=data-aware") in ran


def test_report_gives_the_figures_and_ranking_bench_gives_of_the_same_runs(tmp_path, fake_train, capsys,
                                                                            monkeypatch):
    out, figures, _ = _bench(tmp_path)
    by_bench = {r["policy"]: r["samples_per_s"] for r in json.loads((out / "bench.json").read_text())}
    assert by_bench == pytest.approx({"data-aware": 60.0, "packed-ffd": 48.0, "ds-default": 30.0})
    assert all(r["steps"] == 2 * (STEPS - 2) for r in json.loads((out / "bench.json").read_text()))

    configs, common = configurations(load_runs([str(out)]))
    assert common == list(range(3, STEPS + 1))  # the warm-up of every run left out, the same steps
    by_report = {c.label.removeprefix("plan.policy="): c.throughput.samples_per_s for c in configs}
    assert by_report == pytest.approx(by_bench)
    assert rank(by_report) == rank(by_bench) == ["data-aware", "packed-ffd", "ds-default"]

    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(out), "hydra.run.dir=drawn"]) == 0
    printed = capsys.readouterr().out
    for policy, sps in by_bench.items():
        assert f"plan.policy={policy}: 2 runs, {2 * STEPS} steps, " in printed
        assert f"{sps:.1f} samples/s" in printed.split(f"plan.policy={policy}: ")[1].splitlines()[0]
    assert ("fastest first (each over the same 8 steps of every run (steps 3-10); the first 2 steps of each launch "
            "not timed): plan.policy=data-aware 60.0 samples/s, plan.policy=packed-ffd 48.0 samples/s, "
            "plan.policy=ds-default 30.0 samples/s") in printed
