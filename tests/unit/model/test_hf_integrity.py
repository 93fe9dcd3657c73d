"""A damaged checkpoint folder is one line before launch (no process, no run directory), naming
the key, the folder and the file: config.json that is not JSON, a weight file cut short or with
bytes after its tensors, a shard its index lists but the folder lacks, a file this user cannot
read, tensors whose shapes disagree with config.json. Only headers are read."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil

import pytest

from mmpipe.cli import main


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in err, err
    return err


def _train(folder, tmp_path) -> int:
    return main(["train", "model=hf", f"model.path={folder}", "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}"])


@pytest.fixture
def llava(hf_checkpoints, tmp_path):
    folder = tmp_path / "llava"
    shutil.copytree(hf_checkpoints["llava"], folder)
    return folder


@pytest.fixture(scope="module")
def sharded(hf_checkpoints, tmp_path_factory):
    """The demo LLaVA re-saved by transformers in 4 shards with model.safetensors.index.json."""
    from transformers import LlavaForConditionalGeneration

    folder = tmp_path_factory.mktemp("sharded") / "llava"
    LlavaForConditionalGeneration.from_pretrained(hf_checkpoints["llava"]).save_pretrained(folder,
                                                                                          max_shard_size="100KB")
    for p in hf_checkpoints["llava"].iterdir():
        if not p.name.startswith("model") and not (folder / p.name).exists():
            shutil.copy(p, folder / p.name)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def test_a_config_that_is_not_json(capsys, llava, tmp_path):
    (llava / "config.json").write_text('{"model_type": "llava",\n')
    assert _train(llava, tmp_path) == 2
    assert _error(capsys) == (f"mmpipe train: error: model.path='{llava}': {llava / 'config.json'} is not valid JSON "
                              f"(line 2 column 1: Expecting property name enclosed in double quotes); restore the "
                              f"file or re-save the model with save_pretrained")
    assert not (tmp_path / "run").exists()


def test_a_weight_file_cut_short_or_too_long(capsys, llava, tmp_path):
    path = llava / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 1000)
    assert _train(llava, tmp_path) == 2
    assert _error(capsys) == (f"mmpipe train: error: model.path={llava}: model.safetensors is cut short: its header "
                              f"describes {size} bytes, the file holds {size - 1000} (1000 missing); copy or download "
                              f"it again")
    os.truncate(path, 5)
    assert _train(llava, tmp_path) == 2
    assert "model.safetensors holds 5 bytes, not a safetensors file (cut short?)" in _error(capsys)
    os.truncate(path, 0)
    path.write_bytes(b"\0" * size + b"junk")
    assert _train(llava, tmp_path) == 2
    assert "model.safetensors: its header is not valid JSON" in _error(capsys)
    assert not (tmp_path / "run").exists()


def test_bytes_after_the_last_tensor(capsys, hf_checkpoints, llava, tmp_path):
    with (llava / "model.safetensors").open("ab") as f:
        f.write(b"x" * 10)
    assert _train(llava, tmp_path) == 2
    assert _error(capsys).startswith(f"mmpipe train: error: model.path={llava}: model.safetensors has 10 bytes after "
                                     f"its last tensor")


def test_a_shard_missing_from_the_index(capsys, sharded, tmp_path):
    folder = tmp_path / "llava"
    shutil.copytree(sharded, folder)
    (folder / "model-00003-of-00004.safetensors").unlink()
    assert _train(folder, tmp_path) == 2
    assert _error(capsys) == (f"mmpipe train: error: model.path={folder}: 1 of the 4 files its "
                              f"model.safetensors.index.json lists is missing (model-00003-of-00004.safetensors); "
                              f"copy or download the whole checkpoint")
    (folder / "model.safetensors.index.json").write_text("{")
    assert _train(folder, tmp_path) == 2
    assert "model.safetensors.index.json is not valid JSON with a weight_map" in _error(capsys)
    assert not (tmp_path / "run").exists()


def test_an_index_naming_a_tensor_its_file_lacks(capsys, sharded, tmp_path):
    folder = tmp_path / "llava"
    shutil.copytree(sharded, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key + ".extra"] = index["weight_map"][key]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _train(folder, tmp_path) == 2
    assert f"model.safetensors.index.json lists 1 tensor(s) that its files do not hold (first: {key}.extra" \
        in _error(capsys)


def test_a_file_this_user_cannot_read(capsys, llava, tmp_path, monkeypatch):
    """Tests run as root, whom chmod does not stop: the open itself is made to fail."""
    real_open = pathlib.Path.open

    def refuse(self, *args, **kwargs):
        if self.name == "model.safetensors":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refuse)
    assert _train(llava, tmp_path) == 2
    assert _error(capsys) == (f"mmpipe train: error: model.path={llava}: cannot read model.safetensors (Permission "
                              f"denied); make it readable by this user")


def test_shapes_that_disagree_with_the_config(capsys, llava, tmp_path):
    config = json.loads((llava / "config.json").read_text())
    config["text_config"]["intermediate_size"] *= 2
    (llava / "config.json").write_text(json.dumps(config))
    assert _train(llava, tmp_path) == 2
    mlp = config["text_config"]["intermediate_size"]
    assert _error(capsys) == (
        f"mmpipe train: error: model.path={llava}: model.safetensors holds "
        f"language_model.model.layers.0.mlp.down_proj.weight of shape (32, {mlp // 2}), but the model its config.json "
        f"describes needs (32, {mlp}) (model.language_model.layers.0.mlp.down_proj.weight); the weights and "
        f"config.json are of different models: use the config they were saved with")


def test_a_composition_names_the_part(capsys, hf_checkpoints, tmp_path):
    llm = tmp_path / "llm"
    shutil.copytree(hf_checkpoints["compose-llm"], llm)
    os.truncate(llm / "model.safetensors", 100)
    assert main(["train", "model=compose", f"model.vision.path={hf_checkpoints['compose-vision']}",
                 f"model.llm.path={llm}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert _error(capsys).startswith(f"mmpipe train: error: model.llm.path={llm}: model.safetensors is ")
