"""Shard URLs: resolving paths, splitting between replicas and loader workers, pipe: commands."""

from __future__ import annotations

import pytest

from mmpipe.data.reader import iter_meta, iter_samples

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
    with pytest.raises(FileNotFoundError, match=r"matches no file.*mmpipe.data.synth"):
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
