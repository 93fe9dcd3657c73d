import itertools
import json

import numpy as np
import pytest

from mmpipe.model.geometry import video_meta_json
from mmpipe.model.spec import layer_names
from mmpipe.planner.api import DEFAULT_HEADROOM, PlanProblem
from mmpipe.planner.baselines import BASELINES
from mmpipe.planner.command import COMPARE_STEPS, PlanInput, PlanOutput, run_plan

from .helpers import hardware, model


def _trace(path, n, seed=0, audio=True):
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            k = rng.integers(0, 3)
            obj = {"text_tokens": int(rng.integers(5, 200))}
            if k == 1:
                obj["images"] = [[int(rng.integers(16, 128)), int(rng.integers(16, 128))]]
            elif k == 2 and audio:
                obj["audio_seconds"] = [float(rng.uniform(0.5, 8))]
            fh.write(json.dumps(obj) + "\n")
    return str(path)


def _plan(tmp_path, **kw):
    args = dict(model=model("tiny"), hardware=hardware("cpu"), pp=2, dp=2, global_batch=16,
                micro_batches=2, trainable=("all",), policy="data-aware",
                trace_path=_trace(tmp_path / "t.jsonl", 40), out=str(tmp_path / "plan.json"),
                steps=None, plot=None)
    args.update(kw)
    problem, data, stages, output = _split(args)
    return run_plan(problem, data, stages=stages, output=output)


def _split(args: dict) -> tuple:
    """run_plan's keywords as its arguments: the problem (memory headroom: the config's default),
    what it reads, the user's stages, what it writes."""
    data = {k: args.pop(k) for k in ("trace_path", "samples", "source", "steps") if k in args}
    output = {k: args.pop(k) for k in ("out", "plot", "compare_schedules", "quiet") if k in args}
    stages = args.pop("stages", None)
    problem = PlanProblem(**{"memory_headroom": DEFAULT_HEADROOM, **args})
    return problem, PlanInput(**data), stages, PlanOutput(**output)


def test_plan_json_schema_tiny_cpu(tmp_path, capsys):
    plan = _plan(tmp_path, plot=str(tmp_path / "tl.png"), compare_schedules=True)
    on_disk = json.loads((tmp_path / "plan.json").read_text())
    assert on_disk == plan
    assert plan["version"] == 1 and plan["model"] == "tiny" and plan["schedule"] == "1f1b"
    assert plan["layers"] == layer_names(model("tiny"))
    st = plan["stages"]
    assert len(st) == 2 and st[0][0] == 0 and st[-1][1] == len(plan["layers"]) and st[0][1] == st[1][0]
    assert len(plan["recompute"]) == 2 and isinstance(plan["packing"], bool)
    assert len(plan["steps"]) == 2  # 40 samples // 16: two full steps
    for k, step in enumerate(plan["steps"]):
        reps = step["replicas"]
        assert len(reps) == 2
        ids = sorted(i for rep in reps for mb in rep for i in mb)
        assert ids == list(range(16 * k, 16 * (k + 1)))
        assert all(mb for rep in reps for mb in rep)
    assert len(plan["predicted"]["step_time_s"]) == 2
    out = capsys.readouterr().out
    assert "ds-default" in out and "llava-grouped" in out and "packed-ffd" in out and "bubble" in out
    assert "zb-h1" in out and "v-min" in out
    assert (tmp_path / "tl.png").stat().st_size > 1000


@pytest.mark.parametrize("policy", ["ds-default", "llava-grouped", "packed-ffd"])
def test_baseline_policies_write_valid_plans(tmp_path, policy):
    plan = _plan(tmp_path, policy=policy, steps=1)
    assert len(plan["steps"]) == 1
    ids = sorted(i for rep in plan["steps"][0]["replicas"] for mb in rep for i in mb)
    assert ids == list(range(16))
    assert plan["packing"] == (policy == "packed-ffd")


def test_stage_override_is_used(tmp_path):
    plan = _plan(tmp_path, stages=[("vision.embed", "llm.block.0"), ("llm.block.1", "llm.head")])
    assert plan["stages"] == [[0, 10], [10, 15]]


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"plan.policy='fastest' is unknown"):
        _plan(tmp_path, policy="fastest")
    with pytest.raises(ValueError, match=r"parallel.pp=16 is larger than the 15 layers"):
        _plan(tmp_path, pp=16)
    with pytest.raises(ValueError, match=r"train.trainable=\[visoin\]"):
        _plan(tmp_path, trainable=("visoin",))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text_tokens": 3}\n{"text_tokens": -1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2"):
        _plan(tmp_path, trace_path=str(bad))
    with pytest.raises(ValueError, match=r"fewer than train.global_batch=16"):
        _plan(tmp_path, trace_path=_trace(tmp_path / "short.jsonl", 5))


def test_data_aware_not_slower_than_baselines_on_7b_slice(tmp_path):
    trace = tmp_path / "mix.jsonl"
    rng = np.random.default_rng(7)
    with open(trace, "w") as fh:
        for _ in range(128):
            if rng.random() < 0.8:
                fh.write(json.dumps({"text_tokens": int(rng.integers(10, 400)), "images": [[336, 336]]}) + "\n")
            else:
                fh.write(json.dumps({"text_tokens": int(rng.integers(500, 3000))}) + "\n")
    problem = PlanProblem(model=model("llava-1.5-7b"), hardware=hardware("h100"), pp=4, dp=2, global_batch=64,
                          micro_batches=4, trainable=("vision.proj", "llm"), policy="data-aware",
                          memory_headroom=DEFAULT_HEADROOM)
    plan = run_plan(problem, PlanInput(trace_path=str(trace)), output=PlanOutput(quiet=True))
    ours = np.mean(plan["predicted"]["step_time_s"])
    assert plan["predicted"]["fits"]
    for name, b in plan["predicted"]["baselines"].items():
        assert ours <= np.mean(b["step_time_s"]), name
    assert ours >= np.mean(plan["predicted"]["lower_bound_s"])
    # each rank's compute: at most the step, and together at least the bound (the step's compute
    # at peak over the ranks), so bound / mean busy caps the efficiency idle-free ranks could reach
    busy = np.asarray(plan["predicted"]["busy_s"])
    assert busy.shape == (len(plan["steps"]), 2, 4)
    for k, (t, lower) in enumerate(zip(plan["predicted"]["step_time_s"], plan["predicted"]["lower_bound_s"])):
        assert busy[k].max() <= t and lower <= busy[k].mean() < busy[k].max(), k


def test_a_small_step_is_explained_in_the_report(tmp_path, capsys):
    _plan(tmp_path, pp=4, dp=2, global_batch=16, steps=1)
    out = capsys.readouterr().out
    assert ("small step: each replica gets 8 samples per step for 4 stages; 1F1B with m equal micro-batches "
            "idles (pp-1)/(m+pp-1) of the step, 27.3% even at one sample per micro-batch") in out
    _plan(tmp_path, pp=2, dp=1, global_batch=40, steps=1)
    assert "small step" not in capsys.readouterr().out  # 40 samples for 2 stages


def test_plan_from_shards_is_the_plan_of_their_metadata_as_a_trace(tmp_path):
    """`mmpipe plan data=shards` reads each sample's metadata (no media) in stream order: the
    same plan as a trace of those lines."""
    from mmpipe.cli import main
    from mmpipe.data.reader import iter_meta
    from mmpipe.paths import PACKAGE_ROOT

    shards = "::".join(str(PACKAGE_ROOT / "data" / "shards" / f"{name}-{{000000..000007}}.tar")
                       for name in ("video", "train"))  # the default data.path of data=shards
    keys, metas = zip(*itertools.islice(iter_meta(path=shards, epochs=1), 32))
    assert any(m.videos for m in metas)
    trace = tmp_path / "meta.jsonl"
    trace.write_text("".join(json.dumps({"text_tokens": m.text_tokens, "images": [list(i) for i in m.images],
                                         "audio_seconds": list(m.audio_seconds),
                                         "videos": [video_meta_json(v) for v in m.videos]}) + "\n" for m in metas))
    assert main(["plan", "data=shards", f"plan.out={tmp_path / 'a.json'}", "model=tiny", "hardware=cpu",
                 "parallel.pp=2", "parallel.dp=2", "train.global_batch=16", "train.micro_batches=2",
                 "plan.steps=2", "plan.encoders=stages"]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    b = _plan(tmp_path, trace_path=str(trace), steps=2, quiet=True)
    assert a["sample_keys"] == list(keys[:32]) and len(a["steps"]) == 2
    assert a["steps"] == b["steps"] and a["stages"] == b["stages"] and a["predicted"] == b["predicted"]


def test_policies_are_compared_over_the_steps_every_one_planned(tmp_path, capsys):
    """The data-aware plan covers every step, the baselines beside it the first COMPARE_STEPS:
    the mean row compares them all over those shared steps, and says over how many."""
    light, heavy = {"text_tokens": 20}, {"text_tokens": 150, "images": [[128, 128]]}
    trace = tmp_path / "steps.jsonl"  # 8 light steps, then 2 heavy ones only data-aware plans
    trace.write_text("".join(json.dumps(light if i < 32 else heavy) + "\n" for i in range(40)))
    plan = _plan(tmp_path, global_batch=4, trace_path=str(trace))
    pred = plan["predicted"]
    times = {"data-aware": pred["step_time_s"], **{b: v["step_time_s"] for b, v in pred["baselines"].items()}}
    assert len(times["data-aware"]) == 10 and {len(times[b]) for b in BASELINES} == {COMPARE_STEPS} == {8}
    out = capsys.readouterr().out
    cells = [float(c.rstrip("s")) for c in next(l for l in out.splitlines() if l.startswith("mean ")).split()[1:]]
    shared = [np.mean(pred["lower_bound_s"][:8])] + [np.mean(times[p][:8]) for p in ("data-aware", *BASELINES)]
    assert cells == pytest.approx(shared, abs=6e-4)  # printed to the millisecond
    assert np.mean(times["data-aware"]) > np.mean(times["data-aware"][:8]) + 0.01  # not over its own 10 steps
    assert "mean: over the 8 steps every policy planned (steps 0-7) of 10" in out
    assert "predicted mean step time of data-aware over its 10 steps" in out
