"""The DeepSpeed config a run hands to deepspeed.initialize, the user's JSON merged over it, and
the mistakes in either that must stop before any process starts."""

from __future__ import annotations

import json

import pytest

from mmpipe.cli import load, main
from mmpipe.runtime.dsconfig import OWNED, UNTESTED_DEEPSPEED_ENV, deepspeed_config, require_tested_deepspeed


def _one_line_error(capsys, *overrides: str) -> str:
    assert main(["train", *overrides, "hydra.run.dir=/nonexistent/never-made"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("overrides, config", [
    ([], {"zero": 0, "bf16": None, "fp16": None, "clip": 0.0}),  # fp32: mmpipe clips
    (["train.precision=bf16"], {"zero": 1, "bf16": {"enabled": True}, "fp16": None, "clip": 1.0,
                                "data_types": {"grad_accum_dtype": "fp32"}}),
    (["train.precision=fp16"], {"zero": 1, "bf16": None, "fp16": {"enabled": True, "loss_scale": 0}, "clip": 1.0}),
    (["train.zero_stage=1", "train.grad_clip=0.5"], {"zero": 1, "bf16": None, "fp16": None, "clip": 0.5}),
])
def test_precision_and_zero_stage_become_deepspeed_settings(overrides, config):
    cfg = deepspeed_config(load(overrides, job="test"))
    assert cfg["zero_optimization"] == {"stage": config["zero"]}
    assert cfg.get("bf16") == config["bf16"] and cfg.get("fp16") == config["fp16"]
    assert cfg["gradient_clipping"] == config["clip"]
    if "data_types" in config:
        assert cfg["data_types"] == config["data_types"]
    assert cfg["train_batch_size"] == cfg["gradient_accumulation_steps"] == 4  # micro_batches x dp


def test_user_json_passes_through_and_merges_into_sections(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"steps_per_print": 5, "csv_monitor": {"enabled": True, "output_path": "m"},
                                "zero_optimization": {"reduce_bucket_size": 1000}}))
    rc = load(["train.precision=bf16", f"deepspeed.config={path}"], job="test")
    from mmpipe.runtime.dsconfig import load_user_config

    cfg = deepspeed_config(rc, user=load_user_config(rc.deepspeed.config))
    assert cfg["steps_per_print"] == 5
    assert cfg["csv_monitor"] == {"enabled": True, "output_path": "m"}
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}  # merged, stage kept
    assert cfg["bf16"] == {"enabled": True}


@pytest.mark.parametrize("content, message", [
    ('{"gradient_clipping": 2.0}', "sets gradient_clipping: mmpipe clips by the gradient norm of the whole model "
                                   "across all stages; use train.grad_clip"),
    ('{"bf16": {"enabled": true}}', "sets bf16.enabled: mmpipe sets the precision; use train.precision=fp32|bf16|fp16"),
    ('{"zero_optimization": {"stage": 2}}',
     "sets zero_optimization.stage: mmpipe sets the ZeRO stage (the pipeline engine runs 0 or 1); use "
     "train.zero_stage=0|1"),
    ('{"train_micro_batch_size_per_gpu": 2, "optimizer": {}}',
     "sets train_micro_batch_size_per_gpu: mmpipe plans the micro-batches of every step itself; use "
     "train.global_batch and train.micro_batches (also refused: optimizer)"),
    ('{"steps_per_print": 1,}', "is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ('[1, 2]', "holds a JSON list, not an object of DeepSpeed settings"),
])
def test_bad_or_refused_deepspeed_json_is_one_line_before_launch(content, message, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(content)
    err = _one_line_error(capsys, f"deepspeed.config={path}")
    assert f"deepspeed.config={path}" in err and message in err


def test_missing_deepspeed_json_is_one_line(capsys):
    err = _one_line_error(capsys, "deepspeed.config=nowhere/ds.json")
    assert "deepspeed.config=nowhere/ds.json: no such file" in err


def test_every_owned_key_has_a_reason_naming_what_to_do():
    for key, why in OWNED.items():
        assert why and ("use " in why or "remove it" in why), key


@pytest.mark.parametrize("override, message", [
    ("train.zero_stage=2", "train.zero_stage=2 is not supported: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1"),
    ("train.precision=fp8", "train.precision='fp8' is unknown; use fp32, bf16, fp16"),
    ("train.precision=bf16 train.zero_stage=0", "train.zero_stage=0 with train.precision=bf16"),
    ("train.precision=fp16 train.zero_stage=0", "train.zero_stage=0 with train.precision=fp16"),
])
def test_precision_and_zero_mistakes_name_the_key(override, message, capsys):
    assert message in _one_line_error(capsys, *override.split())


def test_untested_deepspeed_is_refused_unless_overridden(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.20.1")
    monkeypatch.delenv(UNTESTED_DEEPSPEED_ENV, raising=False)
    with pytest.raises(ValueError, match=r"deepspeed 0\.20\.1 is installed, but mmpipe patches DeepSpeed internals "
                                         rf"that it tested with deepspeed 0\.19\.8 only.*{UNTESTED_DEEPSPEED_ENV}=1"):
        require_tested_deepspeed()
    monkeypatch.setenv(UNTESTED_DEEPSPEED_ENV, "1")
    require_tested_deepspeed()
