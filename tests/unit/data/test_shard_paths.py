"""data.path as users write it, checked before launch: a folder of shards or a `*.tar` glob is
read (sorted) and said so; a path matching nothing gets "matches no file" with a fix that fits
it; a file that is not a tar, an empty tar, or a tar whose first member is not a webdataset
sample's `KEY.ext` is one line naming the file, before any process starts."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile

import pytest

from mmpipe.cli import main
from mmpipe.data.reader import iter_meta
from mmpipe.data.shards import check_shards, expansions, resolve_urls
from mmpipe.paths import PACKAGE_ROOT


@pytest.fixture
def folder(mini_data, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(mini_data / "shards", out, ignore=shutil.ignore_patterns("video-*"))  # the 4 train shards
    (out / "index.json").write_text("{}")  # not a shard: left out of the folder's shards
    (out / "sub").mkdir()
    return out


def test_a_folder_is_its_tar_files_in_name_order(folder, mini_path):
    names = [f"train-{i:06d}.tar" for i in range(4)]
    assert resolve_urls(str(folder)) == [str(folder / n) for n in names]
    assert expansions(str(folder)) == [f"data.path: {folder} is a folder: its 4 shard(s) are read in name order "
                                       f"(train-000000.tar .. train-000003.tar)"]
    assert [key for key, _ in iter_meta(path=str(folder))] == [key for key, _ in iter_meta(path=mini_path)]


def test_a_glob_is_its_matches_sorted(folder, monkeypatch, tmp_path):
    assert resolve_urls(str(folder / "train-00000[13].tar")) == [str(folder / "train-000001.tar"),
                                                                  str(folder / "train-000003.tar")]
    monkeypatch.chdir(tmp_path)  # relative to the working directory, as a plain path is
    assert resolve_urls("shards/*.tar") == [str(folder / f"train-{i:06d}.tar") for i in range(4)]
    assert expansions("shards/*.tar")[0].startswith("data.path: shards/*.tar is a glob: its 4 shard(s)")
    assert expansions(str(folder / "train-000000.tar")) == []  # a plain file needs no word


def test_a_folder_without_shards_and_a_path_matching_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is a folder with no \*\.tar / \*\.tar\.gz / \*\.tgz shards in it"):
        check_shards(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError) as err:
        check_shards(str(tmp_path / "x-{0..3}.tar"))
    assert "matches no file" in str(err.value) and "mmpipe.data.synth" not in str(err.value)
    assert "a folder of *.tar shards, or a glob such as DIR/*.tar" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:  # no match of a glob is the same "matches no file"
        check_shards(str(tmp_path / "*.tar"))
    assert "matches no file" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"matches no file .*regenerate the shipped shards with `python -m "
                                                r"mmpipe.data.synth --out data/`"):
        check_shards("data/shards/train-{000100..000101}.tar", root=PACKAGE_ROOT)  # the shipped ones: it applies


def _tar(path, names):
    with tarfile.open(path, "w") as t:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 2
            t.addfile(info, io.BytesIO(b"hi"))


def test_files_that_are_not_webdataset_shards(tmp_path):
    fix = "give webdataset shards: tar files of KEY.ext members"
    (tmp_path / "notes.tar").write_text("hello, not a tar\n" * 40)
    with pytest.raises(ValueError, match=rf"^data.path: {tmp_path / 'notes.tar'} is not a tar archive \(not a tar "
                                         rf"header at byte 0 \(bad checksum\): garbage in the shard\); {fix}"):
        check_shards(str(tmp_path / "notes.tar"))
    _tar(tmp_path / "plain.tar", ["README", "a.txt"])
    with pytest.raises(ValueError, match=rf"^data.path: {tmp_path / 'plain.tar'} is a tar but not a webdataset "
                                         rf"shard: its first member 'README' is not named KEY.ext; {fix}"):
        check_shards(str(tmp_path / "plain.tar"))
    _tar(tmp_path / "empty.tar", [])
    with pytest.raises(ValueError, match=r"empty.tar is an empty tar archive \(no member\)"):
        check_shards(str(tmp_path / "empty.tar"))
    (tmp_path / "plain.tar.gz").write_bytes(gzip.compress((tmp_path / "plain.tar").read_bytes()))
    with pytest.raises(ValueError, match=r"plain.tar.gz is a tar but not a webdataset shard"):
        check_shards(str(tmp_path / "plain.tar.gz"))  # read through the decompression


def test_train_refuses_them_before_launch(capsys, tmp_path, folder):
    _tar(tmp_path / "plain.tar", ["README"])
    assert main(["train", f"data.path={tmp_path / 'plain.tar'}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mmpipe train: error: data.path: {tmp_path / 'plain.tar'} is a tar but not a webdataset shard: "
                   f"its first member 'README' is not named KEY.ext; give webdataset shards: tar files of KEY.ext "
                   f"members (e.g. 000001.jpg + 000001.json); `mmpipe shards` converts a LLaVA-style JSON into them")
    assert not (tmp_path / "run").exists()
    # a folder is said before launch (`--cfg job` would not run the checks: plan reads the same way)
    assert main(["plan", "data=shards", f"data.path={folder}", "train.global_batch=8", "parallel.pp=2",
                 "plan.steps=1", f"hydra.run.dir={tmp_path / 'plan'}"]) == 0
    assert f"mmpipe: data.path: {folder} is a folder: its 4 shard(s) are read in name order" in capsys.readouterr().out
