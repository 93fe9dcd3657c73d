"""Every config composes and validates; mistakes fail fast with the key, the value and the fix."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from mmpipe.cli import load, main
from mmpipe.config import parse_stages, stages_to_bounds
from mmpipe.paths import CONF_DIR


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("trace") / "trace_small.jsonl"
    p.write_text('{"text_tokens": 30, "images": [[336, 336]]}\n' * 4)
    return str(p)


def _overrides_for(group: str, name: str, trace: str, folders: dict[str, Path]) -> list[str]:
    from mmpipe.model.hf.demo import model_overrides

    extra = {"trace": ["data.path=" + trace]}.get(name, [])
    if group == "model" and name != "tiny":
        extra = ["data=trace", "data.path=" + trace]
    if group == "model" and name in ("hf", "compose"):  # a folder to read: the tiny test checkpoints
        return [*model_overrides("llava" if name == "hf" else name, folders), *extra]
    return [f"{group}={name}", *extra]


@pytest.mark.parametrize("group", ["model", "data", "hardware"])
def test_every_yaml_in_conf_composes_and_validates(group, trace, request):
    names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert names
    folders = request.getfixturevalue("hf_checkpoints") if group == "model" else {}
    for name in names:
        rc = load(_overrides_for(group, name, trace, folders), job="test")
        assert rc.parallel.pp >= 1


def test_every_recipe_composes_and_validates(trace, request):
    """Each recipe, launched as its header says; the model folders it names (placeholders the user
    replaces) are the tiny test checkpoints here."""
    for path in sorted((CONF_DIR / "recipes").glob("*.yaml")):
        text = path.read_text()
        head = text.splitlines()[:3]
        assert head[0] == "# @package _global_", f"{path.name} must be a global package"
        launch = next((l for l in head if l.startswith("# mmpipe ")), None)
        assert launch, f"{path.name} must give its launch command"
        # pasted into a shell and read by Hydra's grammar, a shard list stays one value, braces and all
        for word in shlex.split(launch[2:])[2:]:
            if word.startswith("data.path="):
                from hydra.core.override_parser.overrides_parser import OverridesParser

                parsed = OverridesParser.create().parse_overrides([word])[0]
                assert "{" not in word or "{" in parsed.value(), f"{path.name}: {word} loses its braces"
        extra = ["data.path=" + trace] if "data: trace" in text or "- override /data: trace" in text else []
        folders = re.findall(r"(model\.(?:\w+\.)?path)=\S+", launch)
        if folders:
            f = request.getfixturevalue("hf_checkpoints")
            family = next((k for k in ("omni", "audio", "onevision", "next", "qwen3", "qwen2.5-vl", "llava")
                           if k in path.stem), "")
            mine = {"model.path": f[{"omni": "qwen2.5-omni", "audio": "qwen2-audio", "onevision": "llava-onevision",
                                     "next": "llava-next", "qwen3": "qwen3-vl", "qwen2.5-vl": "qwen2.5-vl",
                                     "llava": "llava"}.get(family, "qwen2-vl")],
                    "model.vision.path": f["compose-vision"],
                    "model.llm.path": f["compose-llm"], "model.projector.path": f["compose-projector"]}
            extra += [f"{key}={mine[key]}" for key in folders]
        rc = load([f"recipes={path.stem}", *extra], job="test")
        for line in text.splitlines():  # the recipe's own settings took effect
            if line.startswith("  pp:"):
                assert rc.parallel.pp == int(line.split(":")[1])
            if line.startswith("  trainable:"):
                listed = line.split("[")[1].split("]")[0]
                assert list(rc.train.trainable) == [t.strip() for t in listed.split(",") if t.strip()]
            if line.startswith("    r:"):  # train.lora
                assert rc.train.lora.r == int(line.split(":")[1])


def test_unknown_key_names_the_key_and_the_nearest_real_one(capsys):
    assert main(["train", "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "train.stpes=3: no such config key; did you mean train.steps?" in err


def test_process_count_must_match_pp_times_dp(capsys):
    assert main(["train", "parallel.pp=2", "parallel.dp=2", "launcher.nproc=2"]) == 2
    err = capsys.readouterr().err
    assert "launcher.nproc=2 does not equal parallel.pp * parallel.dp = 2 * 2 = 4" in err


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=40"], "parallel.pp=40 exceeds the 15 layers of model tiny"),
    (["train.global_batch=15", "parallel.dp=2", "parallel.pp=1"],
     "train.global_batch=15 is not divisible by parallel.dp=2"),
    (["train.micro_batches=20"], "train.micro_batches=20 exceeds the 16 samples"),
    (["plan.policy=fastest"], "plan.policy='fastest' is unknown"),
    (["train.trainable=[visoin]"], "train.trainable entry 'visoin' is unknown"),
    (["data.on_error=ignore"], "data.on_error='ignore' is unknown; use skip or raise"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite='ignore' is unknown; use stop or skip"),
    (["train.keep_last=-1"], "train.keep_last=-1 must be a non-negative integer"),
    (["train.on_nonfinite=skip", "train.precision=bf16"],
     "train.on_nonfinite=skip withholds a step's update in mmpipe's gradient hook, which runs with "
     "train.precision=fp32 and ZeRO stage 0 only (now precision=bf16, ZeRO stage 1"),
    (["model.llm.heads=5"], "model.llm.hidden=128 is not divisible by model.llm.heads=5"),
    (["train.attention=fast"], "train.attention='fast' is unknown; use auto, flash, flex, sdpa, eager"),
])
def test_config_mistakes_fail_before_launch(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's refusals")
@pytest.mark.parametrize("overrides, message", [
    (["train.attention=flash"], "train.attention=flash needs the flash-attn package, which does not import here"),
    (["train.attention=flex"], "train.attention=flex needs a CUDA GPU: torch 2."),
])
def test_an_attention_kernel_this_machine_cannot_run_fails_before_launch(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


LAYERS = ["vision.embed", "vision.block.0", "vision.proj", "llm.embed", "llm.block.0", "llm.block.1", "llm.head"]


def test_stage_override_parses_both_syntaxes():
    assert parse_stages([["vision.embed", "llm.embed"], ["llm.block.0", "llm.head"]]) == (
        ("vision.embed", "llm.embed"), ("llm.block.0", "llm.head"))
    assert parse_stages("vision.embed:llm.embed,llm.block.0:llm.head") == (
        ("vision.embed", "llm.embed"), ("llm.block.0", "llm.head"))
    assert stages_to_bounds(parse_stages("vision.embed:llm.embed,llm.block.0:llm.head"), LAYERS) == [(0, 4), (4, 7)]


@pytest.mark.parametrize("stages, message", [
    ("vision.embed:llm.embed,llm.block.1:llm.head", "stage 1 starts at llm.block.1 and leaves llm.block.0 uncovered"),
    ("vision.embed:llm.embed,llm.embed:llm.head", "stage 1 starts at llm.embed and overlaps the previous stage"),
    ("vision.embed:llm.embed,llm.block.0:llm.block.1", "leaving llm.head uncovered"),
    ("vision.embed:llm.embd,llm.block.0:llm.head", "stage 0 names layer 'llm.embd', which the model does not have"),
    ("llm.embed:vision.embed,llm.block.0:llm.head", "stage 0 [llm.embed,vision.embed] is empty or reversed"),
])
def test_stage_override_must_tile_the_layers(stages, message):
    with pytest.raises(ValueError, match=None) as err:
        stages_to_bounds(parse_stages(stages), LAYERS)
    assert message in str(err.value)


def test_readme_stage_override_lines_compose():
    for line in ("plan.stages=[[vision.embed,audio.proj],[llm.embed,llm.head]]",
                 "plan.stages=[vision.embed:llm.block.1,llm.block.2:llm.head]"):
        rc = load([line], job="test")
        assert rc.stage_bounds[0][0] == 0 and rc.stage_bounds[-1][1] == len(rc.layers)


@pytest.mark.parametrize("override, message", [
    ("train.lr=abc", "train.lr='abc' must be a number"),
    ("launcher.nproc=abc", "launcher.nproc='abc' must be an integer or null"),
    ("data.epochs=0", "data.epochs=0 must be >= 1, or null to repeat the data forever"),
    ("model.llm.hiden=64", "model.llm.hiden=64: no such config key; did you mean model.llm.hidden?"),
    ("data.pth=x", "data.pth=x: no such config key; did you mean data.path?"),
    # a misspelt section (issue 34: it said `"trian=?": no such config key`): as typed, the nearest key
    ("trian.steps=3", "mmpipe train: error: trian.steps=3: no such config key; did you mean train.steps?\n"),
    ("model=qwen3", "model=qwen3: no such model config; available: compose, gemma3-12b, hf, internvl3-8b"),
    # a key cut short names the key it starts (difflib alone offered train.lr)
    ("train.zero=1", "train.zero=1: no such config key; did you mean train.zero_stage?"),
])
def test_bad_values_and_typos_are_one_line_errors(override, message, capsys):
    assert main(["train", override]) == 2
    assert message in capsys.readouterr().err


def test_stage_count_must_equal_pp(capsys):
    assert main(["train", "parallel.pp=3", "plan.stages=[[vision.embed,llm.embed],[llm.block.0,llm.head]]"]) == 2
    assert "plan.stages gives 2 stages but parallel.pp=3" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["plan.recompute=[true,false]"],
     "plan.recompute=[true,false] needs plan.stages (it gives each overridden stage's flag)"),
    (["plan.stages=[vision.embed:llm.block.1,llm.block.2:llm.head]", "plan.recompute=[true]"],
     "plan.recompute=[true] must hold one true/false per stage of plan.stages (2), e.g. "
     "plan.recompute=[false,false]"),
])
def test_recompute_override_needs_one_flag_per_overridden_stage(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["train.lora.r=-1"], "train.lora.r=-1 must be a non-negative integer (0: no adapters; 8 or 16 are usual)"),
    (["train.lora.r=8", "train.lora.parts=[llm,vison]"], "train.lora.parts entry 'vison' is unknown; use llm, "
     "vision, audio"),
    (["train.lora.r=8", "train.trainable=[vision.proj,llm]"], "train.trainable entry 'llm' is a part "
     "train.lora.parts=['llm'] adapts (its base weights stay frozen); a layer trains in full or through adapters"),
    (["train.lora.r=8", "train.lora.parts=[audio]", "model=qwen2-vl-7b"], "train.lora.parts names 'audio', which "
     "model qwen2-vl-7b does not have; use vision or llm"),
    (["train.lora.rank=8"], "train.lora.rank=8: no such config key; did you mean train.lora.r?"),
    (["train.lora.r=8", "train.lora.target_modules=[q_prj]"], "train.lora.target_modules=['q_prj'] matches no "
     "module of the llm part of model tiny, whose Linear modules are named head, mlp.down_proj, mlp.gate_proj"),
    (["train.lora.r=8", "train.lora.alpha=0"], "train.lora.alpha=0.0 must be > 0"),
    (["train.trainable=[]"], "train.trainable=[] trains nothing; use [all] or component prefixes (or adapters: "
     "train.lora.r=16)"),
])
def test_lora_mistakes_are_one_line_errors_before_launch(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("overrides, message", [
    (["plan.recut=always"], "plan.recut='always' is unknown; use off or auto"),
    (["plan.recut=auto", "plan.recut_gain=-0.1"], "plan.recut_gain=-0.1 must be a fraction >= 0"),
    (["plan.recut=auto"], "plan.recut=auto re-cuts at checkpoints: set train.save_every=N"),
    (["plan.recut=auto", "train.save_every=2", "parallel.pp=1"], "plan.recut=auto moves stage cuts, and "
     "parallel.pp=1 has none"),
])
def test_recut_mistakes_are_one_line_errors_before_launch(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_recut_refused_under_an_external_launcher(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "plan.recut=auto", "train.save_every=2"]) == 2
    assert "plan.recut=auto relaunches the ranks on the new cut, which only mmpipe's own launcher does" in \
        capsys.readouterr().err


def test_lora_settings_resolve_what_trains(capsys):
    """With adapters the default trains them alone; `all` means every layer they do not adapt."""
    rc = load(["train.lora.r=8"], job="test")
    assert rc.train.trainable == () and rc.train.lora.r == 8 and rc.train.lora.parts == ("llm",)
    assert load([], job="test").train.trainable == ("all",)
    rc = load(["train.lora.r=8", "train.trainable=[all]", "train.lora.target_modules=[q_proj,v_proj]"], job="test")
    assert rc.train.trainable == ("all",) and rc.train.lora.target_modules == ("q_proj", "v_proj")


def test_a_missing_model_folder_says_so_and_the_family_list_is_the_registry(tmp_path, capsys):
    """Issue 34: a model.path that does not exist was "not a checkpoint folder", and model=hf
    without a path listed four families of the nine mmpipe trains."""
    from mmpipe.model.hf.configs import ARCHITECTURES

    missing = tmp_path / "nowhere"
    assert main(["train", "model=hf", f"model.path={missing}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mmpipe train: error: model.path={str(missing)!r} does not exist; give a local checkpoint folder written "
        f"by save_pretrained")
    assert main(["train", "model=hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(name in err for name in ARCHITECTURES.values()) and "model=compose" in err, err


def test_plan_ladder_is_checked_in_the_config_with_one_line_naming_the_key():
    from mmpipe.config import PlanConfig

    assert PlanConfig(ladder=[512, 1024]).ladder == (512, 1024) and PlanConfig().ladder == "auto"
    with pytest.raises(ValueError, match=r"^plan\.ladder=\[512,1000\] has a rung that is not a positive multiple "
                                         r"of 128 \(FlexAttention's block\); use e\.g\. plan\.ladder=\[512,1024\]$"):
        PlanConfig(ladder=[512, 1000])
    with pytest.raises(ValueError, match=r"^plan\.ladder=\[512\] pads packed micro-batches, but plan\.policy="
                                         r"ds-default pads each row to its longest sample; use plan\.ladder=off"):
        PlanConfig(ladder=[512], policy="ds-default")
