"""The strict tar reader: a damaged shard is one counted `corrupt shard`, never a silent end; an
unsafe member name is a counted skip, never a sample key."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from mmpipe.data.reader import SampleStream, iter_meta, iter_samples
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.template import text_tokens

from .helpers import js, keys, png, stream


def test_garbage_in_the_middle_of_a_shard_is_a_corrupt_shard(tmp_path, mini_data, mini_tok, tiny_spec) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    # the third sample's first header overwritten: python's tarfile would end the shard silently
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


def test_a_truncated_shard_counts_the_samples_its_index_lists_after_the_cut(mini_data, mini_tok, tiny_spec,
                                                                             tmp_path) -> None:
    """A cut shard loses every sample after the cut: the index.json beside it says how many."""
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    (tmp_path / "t-0.tar").write_bytes(good[:5000])  # cut inside the second sample
    whole = len(list(iter_meta(path=str(mini_data / "shards" / "train-000000.tar"))))
    (tmp_path / "index.json").write_text(json.dumps({"shards": [{"file": "t-0.tar", "samples": whole}]}))
    skips = SkipCounter(journal=tmp_path / "skips.jsonl")
    got = keys(iter_samples(path=str(tmp_path / "t-0.tar"), tokenizer=mini_tok, spec=tiny_spec,
                            dp_rank=0, dp_size=1, epochs=1, skips=skips))
    assert len(got) == 1 and whole == 10
    assert skips.as_dict() == {"corrupt shard": 9}
    assert skips.summary() == "skipped 9 samples: 9 corrupt shard"
    assert "(9 of its 10 samples lost, 1 read before the damage)" in skips.examples[0]
    line = json.loads((tmp_path / "skips.jsonl").read_text())
    assert (line["shard"], line["lost"]) == ("t-0.tar", 9)


def text_sample(key: str, tok) -> tuple[str, bytes]:
    conv = [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4"}]
    return js(key, conv[0]["value"], conv[1]["value"], meta={"text_tokens": text_tokens(conv, tok)})


def write_tar(path, members: list[tuple[str, bytes]], pax_paths: dict[int, str] | None = None) -> None:
    """A tar with exactly these member names (tarfile writes them as given); member i gets a
    pax `path` record from pax_paths[i] (the only way to carry a NUL in a name)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if pax_paths and i in pax_paths:
                info.pax_headers = {"path": pax_paths[i]}
            tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("name, pax, why", [
    ("../../x", None, "'..' path component"),
    ("/etc/x", None, "absolute path"),
    ("a/../../x", None, "'..' path component"),
    ("x", "evil\0x", "NUL or another control character"),
    ("x\ny", None, "NUL or another control character"),
    ("C:/x", None, "absolute path"),
    ("..\\x", None, "backslash"),
])
def test_unsafe_member_names_are_counted_skips_never_keys(tmp_path, mini_tok, tiny_spec, name, pax, why) -> None:
    bad_json, bad_png = js(name, "<image>\nWhat?", "red"), (f"{name}.0.png", png())
    members = [text_sample("a", mini_tok), bad_json, bad_png, text_sample("z", mini_tok)]
    pax_paths = {1: f"{pax}.json", 2: f"{pax}.0.png"} if pax else None
    write_tar(tmp_path / "u-0.tar", members, pax_paths)
    s = stream(str(tmp_path / "u-0.tar"), mini_tok, tiny_spec, epochs=1)
    assert keys(s.records()) == ["a", "z"]
    assert s.skips.as_dict() == {"unsafe member name": 1}  # one per would-be sample, not per member
    assert s.skips.examples[0].startswith("u-0.tar: unsafe member name: member ") and why in s.skips.examples[0]
    skips = SkipCounter()
    assert [k for k, _ in iter_meta(path=str(tmp_path / "u-0.tar"), skips=skips)] == ["a", "z"]
    assert skips.as_dict() == {"unsafe member name": 1}
    with pytest.raises(SampleError, match="^u-0.tar: unsafe member name"):
        list(stream(str(tmp_path / "u-0.tar"), mini_tok, tiny_spec, epochs=1, on_error="raise").records())


def test_a_suffix_that_would_overwrite_the_readers_fields_is_unsafe(tmp_path, mini_tok, tiny_spec) -> None:
    write_tar(tmp_path / "u-0.tar", [js("a", "What is 2 plus 2?", "4"), ("a.__key__", b"../../etc")])
    s = stream(str(tmp_path / "u-0.tar"), mini_tok, tiny_spec, epochs=1)
    assert keys(s.records()) == ["a"]
    assert s.skips.as_dict() == {"unsafe member name": 1} and "reserved" in s.skips.examples[0]
