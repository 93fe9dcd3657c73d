"""The shard reader: replica split, reproducible order, and counted (or raised) bad samples."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import wave

import numpy as np
import pytest
from PIL import Image

from mmpipe.data.reader import SampleStream, iter_meta, iter_samples
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.synth import write_shard
from mmpipe.data.template import text_tokens
from mmpipe.model.geometry import audio_frames, features


def keys(stream) -> list[str]:
    return [s.key for s in stream]


def all_keys(mini_path: str) -> list[str]:
    return [k for k, _ in iter_meta(path=mini_path, epochs=1)]


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


@pytest.mark.parametrize("shuffle_buffer", [0, 8])
def test_two_passes_with_the_same_arguments_are_identical(mini_path, mini_tok, tiny_spec, shuffle_buffer) -> None:
    def run():
        return [(s.key, s.input_ids, s.labels, [i.tobytes() for i in s.images], [a.tobytes() for a in s.audio])
                for s in iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=1, dp_size=2,
                                      seed=5, epochs=1, shuffle_buffer=shuffle_buffer)]
    assert run() == run()


def test_shuffle_depends_on_seed_and_epoch_and_keeps_the_set(mini_path, mini_tok, tiny_spec) -> None:
    def order(seed: int, epochs: int = 1):
        return keys(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1,
                                 seed=seed, epochs=epochs, shuffle_buffer=16))
    a, b = order(1), order(2)
    assert a != b and sorted(a) == sorted(b) == sorted(all_keys(mini_path))
    two = order(1, epochs=2)
    assert two[:40] == a and two[40:] != a and sorted(two[40:]) == sorted(a)


def test_stream_order_without_shuffle_repeats_each_epoch_and_forever(mini_path, mini_tok, tiny_spec) -> None:
    one = keys(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=2, epochs=1))
    forever = iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=2)
    assert [s.key for s in itertools.islice(forever, 3 * len(one))] == one * 3


def test_samples_match_the_metadata_path_and_the_planner_rules(mini_path, mini_tok, tiny_spec) -> None:
    metas = list(iter_meta(path=mini_path, dp_rank=1, dp_size=2, spec=tiny_spec))
    samples = list(iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=1, dp_size=2, epochs=1))
    assert [(s.key, s.meta) for s in samples] == metas
    mods = set()
    for s in samples:
        f = features(tiny_spec, s.meta)
        assert len(s.input_ids) == len(s.labels) == f.llm_len
        assert s.input_ids.count(mini_tok.image_id) == sum(f.image_tokens)
        assert s.input_ids.count(mini_tok.audio_id) == sum(f.audio_tokens)
        assert [a.shape for a in s.audio] == [(tiny_spec.audio.mel_bins, audio_frames(tiny_spec.audio, sec))
                                              for sec in s.meta.audio_seconds]
        assert [(i.shape[0] // 8) * (i.shape[1] // 8) for i in s.images] == list(f.image_positions)
        assert s.modality == f.modality
        mods.add(s.modality)
    assert {"text", "image", "audio"} <= mods


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


def test_more_replicas_than_shards_is_an_error(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match=r"4 shard\(s\) but parallel.dp=8.*lower parallel.dp to <= 4"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=8)


def test_bad_option_values_name_the_key(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match="data.on_error='ignore'"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1, on_error="ignore")
    with pytest.raises(ValueError, match="dp_rank=2 is outside 0..1"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=2, dp_size=2)


# ---------------------------------------------------------------- bad samples

def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _wav(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(1)
        wf.setframerate(8000)
        wf.writeframes(np.full(int(seconds * 8000), 128, np.uint8).tobytes())
    return buf.getvalue()


def _json(key: str, human: str, answer: str, **meta) -> tuple[str, bytes]:
    conv = [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]
    obj = {"id": key, "conversations": conv} | ({"meta": meta} if meta else {})
    return f"{key}.json", json.dumps(obj).encode()


@pytest.fixture
def bad_shards(tmp_path, mini_tok) -> str:
    """Shard 0: two good samples around garbage png, empty answer, missing wav; shard 1: a good one."""
    write_shard(tmp_path / "bad-0.tar", [
        _json("a-good", "<image>\nWhat shape is in the image?", "a red square"), ("a-good.0.png", _png()),
        _json("b-garbage", "<image>\nWhat shape is in the image?", "a red square"), ("b-garbage.0.png", b"garbage"),
        _json("c-empty", "What is 2 plus 2?", ""),
        _json("d-nowav", "<audio>\nWhat do you hear?", "silence"),
        _json("e-good", "<audio>\nWhat do you hear?", "silence"), ("e-good.0.wav", _wav()),
        _json("f-toomany", "<image>\nWhat?", "a red square"), ("f-toomany.0.png", _png()),
        ("f-toomany.1.png", _png()),
    ])
    n = text_tokens([{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4"}], mini_tok)
    write_shard(tmp_path / "bad-1.tar", [_json("g-good", "What is 2 plus 2?", "4", text_tokens=n)])
    return str(tmp_path / "bad-{0..1}.tar")


def test_bad_samples_are_skipped_and_counted_by_reason(bad_shards, mini_tok, tiny_spec) -> None:
    skips = SkipCounter()
    got = keys(iter_samples(path=bad_shards, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1,
                            epochs=1, skips=skips))
    assert got == ["a-good", "e-good", "g-good"]
    assert skips.as_dict() == {"empty answer": 1, "missing media": 1, "placeholder mismatch": 1,
                               "undecodable image": 1}
    assert skips.summary() == ("skipped 4 samples: 1 empty answer, 1 missing media, "
                               "1 placeholder mismatch, 1 undecodable image")
    assert any("bad-0.tar sample b-garbage" in e for e in skips.examples)


def test_counts_accumulate_on_the_stream_object(bad_shards, mini_tok, tiny_spec) -> None:
    stream = SampleStream(path=bad_shards, tokenizer=mini_tok, spec=tiny_spec, epochs=2)
    assert len(list(stream)) == 6
    assert stream.skips.total == 8


def test_raise_mode_names_shard_and_key(bad_shards, mini_tok, tiny_spec) -> None:
    it = iter_samples(path=bad_shards, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1, on_error="raise")
    assert next(it).key == "a-good"
    with pytest.raises(SampleError, match=r"bad-0.tar sample b-garbage: undecodable image"):
        next(it)


def test_too_long_samples_are_skipped(mini_path, mini_tok, tiny_spec) -> None:
    short = dataclasses.replace(tiny_spec, llm=dataclasses.replace(tiny_spec.llm, max_seq_len=40))
    skips = SkipCounter()
    kept = list(iter_samples(path=mini_path, tokenizer=mini_tok, spec=short, dp_rank=0, dp_size=1, epochs=1,
                             skips=skips))
    assert kept and all(len(s.input_ids) <= 40 for s in kept)
    assert skips.as_dict() == {"too long": 40 - len(kept)}
    assert len(list(iter_meta(path=mini_path, spec=short))) == len(kept)


def test_meta_path_skips_what_it_can_see_without_media(bad_shards) -> None:
    skips = SkipCounter()
    got = list(iter_meta(path=bad_shards, skips=skips))
    assert skips.as_dict() == {"missing meta": 5, "empty answer": 1}
    assert [k for k, _ in got] == ["g-good"]


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


def test_an_epoch_without_any_usable_sample_stops_the_stream(tmp_path, mini_tok, tiny_spec) -> None:
    write_shard(tmp_path / "e-0.tar", [_json("x", "hi", "")])
    with pytest.raises(ValueError, match="no usable sample in shard.*1 empty answer"):
        next(iter_samples(path=str(tmp_path / "e-0.tar"), tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1))
