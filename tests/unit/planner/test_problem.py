"""The planner's inputs are one typed value: every planning entry takes a `PlanProblem` (and only
what varies per call, at most 6 parameters in all), a RunConfig becomes one in one function
(`config.plan_problem`), and plan.encoders is parsed in one place (`Placement.parse`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from mmpipe.planner import api
from mmpipe.planner.command import run_plan
from mmpipe.planner.problem import Placement, PlanProblem

from .helpers import hardware, model

PACKAGE = Path(__file__).resolve().parents[3] / "mmpipe"
ENTRIES = [api.plan_stages, api.stage_memory_warnings, api.plan_step, api.StepPlanner, api.resolve_ladder,
           api.choose_layout, api.choose_encoders, api.consider_recut, run_plan]
"""Every entry that plans (the api's, and `mmpipe plan`'s)."""
BELOW_THE_PROBLEM = {"build_cost_model", "validate_trainable"}
"""Exports that take a problem's fields one by one because PlanProblem is built on them."""


def _params(entry) -> list[inspect.Parameter]:
    return list(inspect.signature(entry).parameters.values())


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_every_planning_entry_takes_the_problem_first_and_at_most_six_parameters(entry):
    params = _params(entry)
    hints = typing.get_type_hints(entry.__init__ if inspect.isclass(entry) else entry)
    assert params[0].name == "problem" and hints["problem"] is PlanProblem, entry.__name__
    assert len(params) <= 6, (entry.__name__, [p.name for p in params])
    assert not {p.name for p in params} & {f.name for f in dataclasses.fields(PlanProblem)}, entry.__name__


def test_no_export_of_the_api_takes_the_problems_fields_one_by_one():
    fields = {f.name for f in dataclasses.fields(PlanProblem)} - {"placement"} | {"encoders"}
    loose = {}
    for name in api.__all__:
        obj = getattr(api, name)
        plain_class = inspect.isclass(obj) and not dataclasses.is_dataclass(obj)
        if name in BELOW_THE_PROBLEM or not (inspect.isfunction(obj) or plain_class):
            continue
        taken = {p.name for p in _params(obj)} & fields
        if len(taken) > 1:
            loose[name] = sorted(taken)
    assert loose == {}
    planning = {e.__name__ for e in ENTRIES} - {"run_plan"}
    assert planning <= set(api.__all__)


def _calls(name: str) -> set[str]:
    """Modules of the package that call `name` (a bare or attribute call)."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                full = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    else called
                if full == name or called == name:
                    out.add(str(path.relative_to(PACKAGE.parent)))
    return out


def test_plan_encoders_is_parsed_in_one_place_and_the_problem_built_in_one():
    assert _calls("Placement.parse") == {"mmpipe/config.py"}  # check_run and plan_problem
    text = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    assert not [str(p) for p, t in text.items() if "def parse_encoders" in t or "def resolve_encoders" in t]
    # the model-free shape check belongs to the grammar, and only the config's own section and
    # the parse call it
    assert _calls("check_encoders_value") == {"mmpipe/config.py", "mmpipe/planner/problem.py"}
    # a RunConfig becomes the planner's inputs in config.plan_problem alone
    assert _calls("PlanProblem") == {"mmpipe/config.py"}
    assert {"mmpipe/runtime/stages.py", "mmpipe/commands.py"} <= _calls("plan_problem")


def test_a_placement_is_parsed_once_and_gives_its_config_value_back():
    omni, llava = model("omni-7b"), model("llava-1.5-7b")
    auto = Placement.parse("auto", omni)
    assert auto.auto and auto.to_config() == "auto" and auto.name == "auto"
    assert [c.name for c in auto.candidates(omni)] == ["stages", "spread", "vision spread", "audio spread", "nested",
                                                     "vision nested", "audio nested"]
    audio = Placement.parse({"audio": "spread"}, omni)
    assert audio.mapping == {"vision": "stages", "audio": "spread"} and audio.spread == ("audio",)
    assert audio.given == "{audio: spread}" and audio.candidates(omni) == (audio,)
    assert Placement.parse(audio.to_config(), omni) == audio  # a relaunch resolves to the same placement
    assert Placement.parse("stages", llava) == Placement.staged(llava) == Placement.of({"vision": "stages"})
    with pytest.raises(ValueError, match="plan.encoders=spread: model"):
        Placement.parse("spread", dataclasses.replace(llava, vision=None))


def test_the_config_builds_the_problem_the_run_and_the_plan_command_use():
    from mmpipe.cli import load
    from mmpipe.config import plan_problem, training_precision

    rc = load(["model=qwen2-vl-7b", "hardware=h100", "parallel.pp=4", "parallel.dp=2", "train.global_batch=64",
               "train.micro_batches=8", "train.trainable=[vision.proj]", "train.lora.r=8", "train.lora.parts=[llm]",
               "plan.encoders=spread", "plan.memory_headroom=0.1"], job="test")
    problem = plan_problem(rc)
    assert problem == PlanProblem(
        model=rc.model, hardware=hardware("h100"), trainable=("vision.proj",), micro_batches=8, policy="data-aware",
        global_batch=64, pp=4, dp=2, devices=None, replicas=1, precision=training_precision(rc), memory_headroom=0.1,
        lora=rc.train.lora, placement=Placement.parse("spread", rc.model))
    assert problem.replica_count == 1 and problem.cost_model().dp == 2
    across = plan_problem(load(["parallel.pp=2", "parallel.dp=2", "train.global_batch=8", "train.micro_batches=2",
                                "plan.across_replicas=true"], job="test"))
    assert across.replicas is None and across.replica_count == 2
    auto = plan_problem(load(["parallel.pp=auto", "parallel.dp=auto", "parallel.devices=4"], job="test"))
    assert (auto.pp, auto.dp, auto.devices) == (None, None, 4)
    with pytest.raises(ValueError, match="parallel.dp=auto: choose the layout first"):
        auto.cost_model()
