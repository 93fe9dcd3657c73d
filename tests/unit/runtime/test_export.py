"""`mmpipe export` never destroys what a user owns: it refuses an `out` that is, is inside or
contains a folder the export reads (the model's source, a composition's part, the checkpoint),
refuses a folder of files it did not write (overwrite=true too), writes again into its own
earlier output (the README exports twice to one folder), and a failed export (a missing layer
file, a full disk) leaves the folder it would have replaced byte for byte as it was."""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest

from mmpipe import export_folder
from mmpipe.cli import load, main
from mmpipe.export_folder import MANIFEST, check_out
from mmpipe.model.hf import build_layers, save_layer_states
from mmpipe.model.hf.demo import model_overrides
from mmpipe.runtime.checkpoint import commit
from mmpipe.runtime.preflight import write_run_config

export_module = importlib.import_module("mmpipe.model.hf.export")  # the package's `export` is the function


def _tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative name -> sha256), and every folder (-> 'dir')."""
    out = {}
    for p in sorted(folder.rglob("*")):
        out[str(p.relative_to(folder))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def llava_run(hf_checkpoints, tmp_path_factory):
    """A LLaVA run directory with a committed checkpoint of the layers as loaded (step0)."""
    run = tmp_path_factory.mktemp("export") / "run"
    rc = load([*model_overrides("llava", hf_checkpoints), f"hydra.run.dir={run}"], job="test")
    write_run_config(rc)
    save_layer_states(build_layers(rc.model, seed=rc.train.seed), rc.model, run / "checkpoints" / "step0")
    commit(run / "checkpoints" / "step0", step=0, files={}, topology={}, schedule={})
    return run


def test_exporting_into_a_source_folder_is_refused_and_touches_nothing(capsys, llava_run, hf_checkpoints, tmp_path):
    source = hf_checkpoints["llava"]
    parent = source.parent
    before = _tree(parent)
    link = tmp_path / "link"
    link.symlink_to(source)
    cases = [
        (source, f"out={source} is model.path={source}, a folder the export reads: writing there would replace "
                 f"the files it copies from; give another folder, e.g. out={parent / 'llava-trained'} "
                 f"(nothing was written)"),
        (link, f"out={link} is model.path={source}, a folder the export reads"),  # through a symlink
        (source / "sub", f"out={source / 'sub'} is inside model.path={source}, a folder the export reads; "
                         f"give another folder"),
        (parent, f"out={parent} contains model.path={source}, a folder the export reads; give another folder"),
        (llava_run, f"out={llava_run} contains the checkpoint being exported ({llava_run / 'checkpoints' / 'step0'})"),
    ]
    for out, message in cases:
        for extra in ([], ["overwrite=true"]):  # overwrite never lets it write into a source
            assert main(["export", str(llava_run), f"out={out}", *extra]) == 2
            err = _error(capsys)
            assert err.startswith("mmpipe export: error: " + message), err
    assert _tree(parent) == before
    assert not (source / "sub").exists()


def test_every_source_of_a_composition_is_protected(tmp_path):
    parts = {k: tmp_path / k.split(".")[1] for k in ("model.vision.path", "model.llm.path", "model.projector.path")}
    tok = tmp_path / "tok"
    for p in [*parts.values(), tok]:
        p.mkdir()
    sources = {**{k: str(v) for k, v in parts.items()}, "data.tokenizer": str(tok)}
    for key, folder in sources.items():
        with pytest.raises(ValueError, match=rf"^out={folder} is {key}={folder}, a folder the export reads"):
            check_out(folder, sources)
    assert check_out(tmp_path / "new", sources) == (tmp_path / "new").resolve()


def test_files_mmpipe_did_not_write_are_refused_even_with_overwrite(capsys, llava_run, tmp_path):
    """Issue 34: `overwrite=true` deleted a user's precious.txt beside an earlier export. It
    replaces only what an export wrote (its manifest); anything else is named and kept."""
    from transformers import LlavaForConditionalGeneration

    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's own weights")
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("keep me")
    before = _tree(out)
    for extra in ([], ["export.overwrite=true"]):
        assert main(["export", str(llava_run), f"out={out}", *extra]) == 2
        assert _error(capsys) == (f"mmpipe export: error: out={out} holds files mmpipe export did not write "
                                  f"(config.json, model.safetensors, notes.txt); overwrite=true replaces only an "
                                  f"earlier export's files: move them out or give a new or empty folder "
                                  f"(nothing was written)")
        assert _tree(out) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary folder left beside it

    export = tmp_path / "export"  # an earlier export, a user's file put beside it
    assert main(["export", str(llava_run), f"out={export}"]) == 0
    (export / "precious.txt").write_text("mine")
    kept = _tree(export)
    assert main(["export", str(llava_run), f"out={export}", "overwrite=true"]) == 2
    assert "holds files mmpipe export did not write (precious.txt)" in _error(capsys)
    assert _tree(export) == kept
    (export / "precious.txt").unlink()
    with (export / "config.json").open("a") as f:  # the export's own file, changed: overwrite replaces it
        f.write(" ")
    assert main(["export", str(llava_run), f"out={export}"]) == 2
    assert _error(capsys).endswith("changed since (config.json); add overwrite=true to replace them, or give a new "
                                   "or empty folder (nothing was written)")
    assert main(["export", str(llava_run), f"out={export}", "overwrite=true"]) == 0
    capsys.readouterr()
    LlavaForConditionalGeneration.from_pretrained(export)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]


def test_a_file_added_while_the_export_runs_is_refused_not_deleted(llava_run, tmp_path, monkeypatch):
    """The folder is checked again just before the swap: a file put there meanwhile survives."""
    out = tmp_path / "trained"
    assert main(["export", str(llava_run), f"out={out}"]) == 0
    real_finish = export_folder._finish

    def user_writes_meanwhile(folder, about):
        (out / "late.txt").write_text("written during the export")
        real_finish(folder, about)

    monkeypatch.setattr(export_folder, "_finish", user_writes_meanwhile)
    assert main(["export", str(llava_run), f"out={out}", "overwrite=true"]) == 2
    assert (out / "late.txt").read_text() == "written during the export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained"]


def test_an_export_is_readable_as_the_umask_says(capsys, llava_run, tmp_path):
    """Issue 34: the folder was 0700 and its safetensors 0600, so a serving account could not
    read them; under umask 022 the folder is 0755 and every file 0644."""
    out = tmp_path / "served" / "model"
    mask = os.umask(0o022)
    try:
        assert main(["export", str(llava_run), f"out={out}"]) == 0
    finally:
        os.umask(mask)
    capsys.readouterr()
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert oct(out.parent.stat().st_mode & 0o777) == "0o755"
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


def test_exporting_twice_to_one_folder_works_and_a_users_change_stops_the_third(capsys, llava_run, tmp_path):
    """The README's flow: the same export twice into one folder (its manifest marks it as the
    export's own); a file the user added or changed afterwards makes it theirs."""
    out = tmp_path / "trained"
    assert main(["export", str(llava_run), f"out={out}"]) == 0
    first = _tree(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == set(first) - {MANIFEST}
    assert all(manifest["files"][n] == (out / n).stat().st_size for n in manifest["files"])
    assert main(["export", str(llava_run), f"out={out}"]) == 0
    assert "mmpipe export: wrote" in capsys.readouterr().out
    assert _tree(out) == first  # the same bytes again (the manifest holds no time)
    (out / "README.md").write_text("my model card")
    assert main(["export", str(llava_run), f"out={out}"]) == 2
    assert "holds files mmpipe export did not write (README.md)" in _error(capsys)
    (out / "README.md").unlink()
    with (out / "config.json").open("a") as f:
        f.write(" ")
    assert main(["export", str(llava_run), f"out={out}"]) == 2
    assert "changed since (config.json); add overwrite=true" in _error(capsys)


def _broken_checkpoint(run: Path, tmp_path: Path) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "step0", broken)
    (broken / "layer_05-model_states.pt").unlink()
    return broken


def test_a_failed_export_leaves_the_earlier_one_as_it_was(capsys, llava_run, tmp_path, monkeypatch):
    out = tmp_path / "trained"
    assert main(["export", str(llava_run), f"out={out}"]) == 0
    capsys.readouterr()
    before = _tree(out)
    broken = _broken_checkpoint(llava_run, tmp_path)
    assert main(["export", str(llava_run), f"checkpoint={broken}", f"out={out}"]) == 2
    assert _error(capsys).startswith(f"mmpipe export: error: {broken / 'layer_05-model_states.pt'} is missing: "
                                     f"checkpoint {broken} has no state of layer 5")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "trained"]

    # a full disk while writing the shards: one line naming the file, the old export kept whole
    real_save = export_module.save_file

    def full_disk(tensors, path, metadata=None):
        real_save(dict(list(tensors.items())[:1]), path, metadata=metadata)  # a part of the shard is written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(export_module, "save_file", full_disk)
    assert main(["export", str(llava_run), f"out={out}"]) == 2
    err = _error(capsys)
    assert err.startswith("mmpipe export: error: ") and "shard-00000.tmp: No space left on device; the export to " \
        f"out={out} stopped and left that folder as it was" in err, err
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "trained"]


def test_an_export_that_fails_at_the_last_rename_restores_the_old_folder(llava_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "trained"
    assert main(["export", str(llava_run), f"out={out}"]) == 0
    before = _tree(out)
    real_replace = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # old folder moved aside, then the new one cannot take its place
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    assert main(["export", str(llava_run), f"out={out}"]) == 2
    assert "Permission denied; the export to" in _error(capsys)
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained"]


def test_merge_needs_adapters_and_a_composition_exports_merged_only(capsys, llava_run, hf_checkpoints, tmp_path):
    """merge=true on a run without adapters, and an adapter folder of a composed model (no one
    base checkpoint to load it onto), are one-line refusals that write nothing."""
    assert main(["export", str(llava_run), f"out={tmp_path / 'a'}", "merge=true"]) == 2
    assert "trained no adapters (train.lora.r=0); its export is the whole model already" in _error(capsys)
    run = tmp_path / "compose-run"
    rc = load([*model_overrides("compose", hf_checkpoints), "train.lora.r=2", f"hydra.run.dir={run}"], job="test")
    write_run_config(rc)
    from mmpipe.model.lora import adapt_layers

    layers = adapt_layers(build_layers(rc.model, seed=0), rc.model, rc.train.lora, seed=0)
    save_layer_states(layers, rc.model, run / "checkpoints" / "step0")
    commit(run / "checkpoints" / "step0", step=0, files={}, topology={}, schedule={})
    assert main(["export", str(run), f"out={tmp_path / 'b'}"]) == 2
    assert "is composed from several folders (or given inline): an adapter folder needs one base checkpoint" \
        in _error(capsys)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert main(["export", str(run), f"out={tmp_path / 'c'}", "merge=true"]) == 0
    assert (tmp_path / "c" / "model.safetensors").is_file()


def test_export_and_eval_argument_errors_come_before_any_heavy_import(llava_run, hf_checkpoints, tmp_path):
    """Issue 34: `mmpipe export` / `mmpipe eval` said a wrong argument only after 10-40 s of
    imports (torch, transformers, the model's classes). Every argument check now runs on the run
    directory's files first: the errors come with neither torch nor transformers imported."""
    import subprocess
    import sys

    source = hf_checkpoints["llava"]
    cases = [
        ["export", str(tmp_path / "nowhere"), f"out={tmp_path / 'x'}"],
        ["export", str(llava_run), "checkpoint=step9", f"out={tmp_path / 'x'}"],
        ["export", str(llava_run), f"out={source}"],
        ["eval", str(llava_run), "checkpoint=step7"],
        ["eval", str(llava_run)],
    ]
    script = ("import sys, json; from mmpipe.cli import main\n"
              "codes = [main(args) for args in json.loads(sys.argv[1])]\n"
              "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules), codes)")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[] [2, 2, 2, 2, 2]", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mmpipe export: error: {tmp_path / 'nowhere'} is not a run directory (no run.yaml); give the hydra.run.dir "
        f"of a `mmpipe train` run",
        f"mmpipe export: error: checkpoint=step9: {llava_run / 'checkpoints' / 'step9'} is not a committed checkpoint "
        f"of {llava_run} (committed: step0); save with train.save_every=N or train.save_final=true",
        f"mmpipe export: error: out={source} is model.path={source}, a folder the export reads: writing there would "
        f"replace the files it copies from; give another folder, e.g. out={source.parent / 'llava-trained'} "
        f"(nothing was written)",
        f"mmpipe eval: error: checkpoint=step7: {llava_run / 'checkpoints' / 'step7'} is not a committed checkpoint "
        f"of {llava_run} (committed: step0)",
        f"mmpipe eval: error: give data.path=SHARDS, the held-out shards to score ({llava_run} set no "
        f"data.eval_path)"]
