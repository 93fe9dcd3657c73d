"""Shard URLs: resolving paths, splitting between replicas and loader workers, and opening them
through webdataset's opener: files, pipe: commands, http://, `::` lists, .tar.gz."""

from __future__ import annotations

import gzip

import pytest

from mmpipe.data.reader import iter_meta, iter_samples
from mmpipe.data.shards import check_shards

from .helpers import all_keys, keys, stream


def test_two_replicas_see_every_sample_once_and_nothing_in_common(mini_path, mini_tok, tiny_spec) -> None:
    everything = all_keys(mini_path)
    assert len(everything) == 40
    seen = [keys(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=r, dp_size=2, epochs=1))
            for r in range(2)]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(everything)
    assert len(seen[0]) == len(seen[1]) == 20


def test_the_rank_environment_variable_does_not_change_the_split(mini_path, mini_tok, tiny_spec, monkeypatch) -> None:
    before = keys(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=2, epochs=1))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    after = keys(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=2, epochs=1))
    assert before == after


@pytest.mark.parametrize("dp, workers", [(1, 4), (2, 2), (4, 1)])
def test_every_sample_is_read_once_across_replicas_and_workers(mini_path, mini_tok, tiny_spec, dp, workers) -> None:
    seen = []
    for r in range(dp):
        for w in range(workers):
            seen += [rec.key for rec in stream(mini_path, mini_tok, tiny_spec, dp_rank=r, dp_size=dp, epochs=1,
                                               num_workers=workers, worker_id=w, shuffle_buffer=4).records()]
    assert sorted(seen) == sorted(all_keys(mini_path)) and len(seen) == 40


def test_more_replicas_than_shards_is_an_error(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match=r"4 shard\(s\) but parallel.dp=8.*lower parallel.dp to <= 4"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=8)


def test_fewer_shards_than_readers_is_a_clear_error(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match=r"4 shard\(s\) but parallel.dp x data.num_workers = 2 x 3 = 6 readers"):
        stream(mini_path, mini_tok, tiny_spec, dp_size=2, num_workers=3)


def test_relative_paths_resolve_against_root(mini_data, mini_tok, tiny_spec, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    got = list(iter_meta(path="shards/train-{000000..000003}.tar", root=mini_data))
    assert len(got) == 40


def test_no_matching_file_is_a_clear_error(tmp_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(FileNotFoundError, match=r"matches no file.*fix the path: give shard files"):
        iter_samples(path=str(tmp_path / "x-{0..3}.tar"), tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1)


def test_some_missing_shards_are_named(mini_data, mini_tok, tiny_spec) -> None:
    with pytest.raises(FileNotFoundError, match=r"2 of 6 shards are missing .*train-000004.tar"):
        iter_meta(path=str(mini_data / "shards" / "train-{000000..000005}.tar"))


def test_pipe_urls_read_like_files(mini_data, mini_path, mini_tok, tiny_spec) -> None:
    piped = f"pipe:cat {mini_data}/shards/train-{{000000..000003}}.tar"
    a = [(s.key, s.input_ids, s.shard) for s in stream(piped, mini_tok, tiny_spec, epochs=1, dp_size=2)]
    b = [(s.key, s.input_ids, s.shard) for s in stream(mini_path, mini_tok, tiny_spec, epochs=1, dp_size=2)]
    assert a == b and a[0][2] == "train-000000.tar"


def test_a_failing_pipe_command_is_a_corrupt_shard_naming_the_command(mini_data, mini_tok, tiny_spec) -> None:
    piped = f"pipe:cat {mini_data}/shards/train-{{000000,nope}}.tar"
    s = stream(piped, mini_tok, tiny_spec, epochs=1)
    assert len(list(s.records())) == 10
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert "exited with status 1" in s.skips.examples[0] and "No such file" in s.skips.examples[0]


# ---------------------------------------------------------------- URLs webdataset opens

def ids(s) -> list[tuple]:
    return [(r.key, r.input_ids, r.shard) for r in s.records()]


def test_shards_served_over_http_read_like_local_files(web, mini_path, mini_tok, tiny_spec, deadline) -> None:
    url = f"{web.url}/shards/train-{{000000..000003}}.tar"
    got = ids(stream(url, mini_tok, tiny_spec, epochs=1, dp_size=2, dp_rank=1))
    assert got == ids(stream(mini_path, mini_tok, tiny_spec, epochs=1, dp_size=2, dp_rank=1))
    assert len(got) == 20 and got[0][2] == "train-000001.tar"
    assert [k for k, _ in iter_meta(path=url)] == all_keys(mini_path)


@pytest.mark.parametrize("how", ["file cut short", "connection cut"])
def test_a_truncated_shard_over_http_is_a_counted_corrupt_shard(web, mini_data, mini_tok, tiny_spec, how,
                                                               deadline) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    name = f"t-{how[0]}.tar"
    (web.root / name).write_bytes(good[:5000] if how == "file cut short" else good)
    first = f"{web.url}/{name}" if how == "file cut short" else f"{web.url}/cut/{name}"
    s = stream(f"{first}::{web.url}/shards/train-000001.tar", mini_tok, tiny_spec, epochs=1)
    got = [r.key for r in s.records()]
    second = all_keys(str(mini_data / "shards" / "train-000001.tar"))
    assert got[-len(second):] == second and len(got) < 10 + len(second)
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert s.skips.examples[0].startswith(f"{name}: corrupt shard: ")
    if how == "connection cut":
        assert "curl exited with status 18 (the transfer ended early)" in s.skips.examples[0]


def test_a_missing_http_shard_is_a_counted_error_naming_it(web, mini_tok, tiny_spec, deadline) -> None:
    s = stream(f"{web.url}/shards/train-{{000000,999999}}.tar", mini_tok, tiny_spec, epochs=1)
    assert len(list(s.records())) == 10
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert s.skips.examples[0].startswith("train-999999.tar: corrupt shard: curl exited with status 22 "
                                          "(the server answered with an HTTP error such as 404)")


def test_double_colon_joins_brace_lists_of_any_kind(web, mini_data, mini_path, mini_tok, tiny_spec,
                                                    deadline) -> None:
    local = str(mini_data / "shards" / "train-{000000..000001}.tar")
    joined = f"{local}::pipe:cat {mini_data}/shards/train-000002.tar::{web.url}/shards/train-000003.tar"
    assert ids(stream(joined, mini_tok, tiny_spec, epochs=1, dp_size=2)) == \
        ids(stream(mini_path, mini_tok, tiny_spec, epochs=1, dp_size=2))
    assert len(check_shards(joined, dp_size=4)) == 4


def test_gzipped_shards_read_like_plain_ones_and_a_cut_one_is_corrupt(web, mini_data, mini_path, mini_tok,
                                                                      tiny_spec, tmp_path, deadline) -> None:
    for i in range(4):
        raw = (mini_data / "shards" / f"train-00000{i}.tar").read_bytes()
        (tmp_path / f"z-{i}.tar.gz").write_bytes(gzip.compress(raw, mtime=0))
    (web.root / "z-1.tar.gz").write_bytes((tmp_path / "z-1.tar.gz").read_bytes())
    path = f"{tmp_path}/z-0.tar.gz::{web.url}/z-1.tar.gz::pipe:cat {tmp_path}/z-{{2..3}}.tar.gz"
    assert [r[:2] for r in ids(stream(path, mini_tok, tiny_spec, epochs=1))] == \
        [r[:2] for r in ids(stream(mini_path, mini_tok, tiny_spec, epochs=1))]
    whole = (tmp_path / "z-0.tar.gz").read_bytes()
    (tmp_path / "z-0.tar.gz").write_bytes(whole[:len(whole) // 2])
    s = stream(str(tmp_path / "z-{0..1}.tar.gz"), mini_tok, tiny_spec, epochs=1)
    assert len(list(s.records())) < 20
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert s.skips.examples[0].startswith("z-0.tar.gz: corrupt shard: gzip data cut or damaged")


@pytest.mark.parametrize("path, message", [
    ("s3://bucket/train-{0..3}.tar", r"no opener for s3:// URLs .* pipe:aws s3 cp s3://bucket/train-\{0..9\}.tar -"),
    ("${NOPE_DIR}/train-0.tar", r"\$\{NOPE_DIR\} is read from the environment variable WDS_NOPE_DIR"),
    ("a.tar::", r"has an empty entry"),
])
def test_urls_that_cannot_be_opened_are_errors_before_reading(path, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_shards(path)


def test_a_missing_download_program_is_an_error_before_reading(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(ValueError, match="reads http:// URLs with `curl`, which is not installed"):
        check_shards("http://127.0.0.1:9/train-{0..3}.tar")


def test_environment_variables_expand_as_in_webdataset(mini_data, monkeypatch) -> None:
    monkeypatch.setenv("WDS_MINI", str(mini_data))
    assert check_shards("${MINI}/shards/train-{000000..000003}.tar") == \
        [str(mini_data / "shards" / f"train-00000{i}.tar") for i in range(4)]
