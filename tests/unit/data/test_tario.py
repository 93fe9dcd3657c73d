"""The strict tar reader: a damaged shard is one counted `corrupt shard`, never a silent end."""

from __future__ import annotations

import pytest

from mmpipe.data.reader import SampleStream, iter_meta, iter_samples
from mmpipe.data.skips import SampleError, SkipCounter

from .helpers import keys


def test_garbage_in_the_middle_of_a_shard_is_a_corrupt_shard(tmp_path, mini_data, mini_tok, tiny_spec) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    # the third sample's first header overwritten: python's tarfile would end the shard silently
    import tarfile

    with tarfile.open(mini_data / "shards" / "train-000000.tar") as tar:
        members = tar.getmembers()
    keys = list(dict.fromkeys(m.name.split(".")[0] for m in members))
    first_key = keys[0]
    third = next(m for m in members if m.name.startswith(keys[2] + "."))
    bad = good[:third.offset] + b"\x07garbage" * 64 + good[third.offset + 512:]
    (tmp_path / "g-0.tar").write_bytes(bad)
    s = SampleStream(path=str(tmp_path / "g-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    # the second sample might have had more members after the damage: dropped with the rest
    assert [x.key for x in s] == [first_key]
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert "not a tar header" in s.skips.examples[0]


def test_a_shard_without_its_end_blocks_is_corrupt(tmp_path, mini_data, mini_tok, tiny_spec) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    end = good.rstrip(b"\0")
    (tmp_path / "c-0.tar").write_bytes(end + b"\0" * (-len(end) % 512))
    s = SampleStream(path=str(tmp_path / "c-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    assert len(list(s)) == 9  # the last sample may be incomplete: dropped with the shard's tail
    assert s.skips.as_dict() == {"corrupt shard": 1}


def test_a_truncated_shard_is_counted_once_and_the_next_shard_still_read(mini_data, mini_tok, tiny_spec,
                                                                         tmp_path) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    (tmp_path / "t-0.tar").write_bytes(good[:5000])  # cut inside the second sample's wav
    (tmp_path / "t-1.tar").write_bytes((mini_data / "shards" / "train-000001.tar").read_bytes())
    skips = SkipCounter()
    got = keys(iter_samples(path=str(tmp_path / "t-{0..1}.tar"), tokenizer=mini_tok, spec=tiny_spec,
                            dp_rank=0, dp_size=1, epochs=1, skips=skips))
    first = [k for k, _ in iter_meta(path=str(mini_data / "shards" / "train-000000.tar"))]
    second = [k for k, _ in iter_meta(path=str(mini_data / "shards" / "train-000001.tar"))]
    assert got == first[:1] + second
    assert skips.as_dict() == {"corrupt shard": 1}
    assert skips.examples[0].startswith("t-0.tar: corrupt shard: unexpected end of data")
    with pytest.raises(SampleError, match=r"^t-0.tar: corrupt shard"):
        list(iter_samples(path=str(tmp_path / "t-{0..1}.tar"), tokenizer=mini_tok, spec=tiny_spec,
                          dp_rank=0, dp_size=1, epochs=1, on_error="raise"))
