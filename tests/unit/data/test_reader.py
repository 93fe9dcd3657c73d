"""The reader: reproducible order, epochs, shuffling, exact resume, counted (or raised) bad samples."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from mmpipe.data.reader import SampleStream, iter_meta, iter_samples
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.synth import write_shard
from mmpipe.data.template import text_tokens
from mmpipe.model.geometry import audio_frames, features

from .helpers import all_keys, js, keys, png, stream, wav


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


def test_bad_option_values_name_the_key(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match="data.on_error='ignore'"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1, on_error="ignore")
    with pytest.raises(ValueError, match="dp_rank=2 is outside 0..1"):
        iter_samples(path=mini_path, tokenizer=mini_tok, spec=tiny_spec, dp_rank=2, dp_size=2)


@pytest.fixture
def bad_shards(tmp_path, mini_tok) -> str:
    """Shard 0: two good samples around garbage png, empty answer, missing wav; shard 1: a good one."""
    write_shard(tmp_path / "bad-0.tar", [
        js("a-good", "<image>\nWhat shape is in the image?", "a red square"), ("a-good.0.png", png()),
        js("b-garbage", "<image>\nWhat shape is in the image?", "a red square"), ("b-garbage.0.png", b"garbage"),
        js("c-empty", "What is 2 plus 2?", ""),
        js("d-nowav", "<audio>\nWhat do you hear?", "silence"),
        js("e-good", "<audio>\nWhat do you hear?", "silence"), ("e-good.0.wav", wav()),
        js("f-toomany", "<image>\nWhat?", "a red square"), ("f-toomany.0.png", png()),
        ("f-toomany.1.png", png()),
    ])
    n = text_tokens([{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4"}], mini_tok)
    write_shard(tmp_path / "bad-1.tar", [js("g-good", "What is 2 plus 2?", "4", meta={"text_tokens": n})])
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


def test_meta_path_skips_what_it_can_see_without_media(bad_shards) -> None:
    skips = SkipCounter()
    got = list(iter_meta(path=bad_shards, skips=skips))
    assert skips.as_dict() == {"missing meta": 5, "empty answer": 1}
    assert [k for k, _ in got] == ["g-good"]


def test_an_epoch_without_any_usable_sample_stops_the_stream(tmp_path, mini_tok, tiny_spec) -> None:
    write_shard(tmp_path / "e-0.tar", [js("x", "hi", "")])
    with pytest.raises(ValueError, match="no usable sample in shard.*1 empty answer"):
        next(iter_samples(path=str(tmp_path / "e-0.tar"), tokenizer=mini_tok, spec=tiny_spec, dp_rank=0, dp_size=1))


def test_too_long_samples_are_skipped(mini_path, mini_tok, tiny_spec) -> None:
    short = dataclasses.replace(tiny_spec, llm=dataclasses.replace(tiny_spec.llm, max_seq_len=40))
    skips = SkipCounter()
    kept = list(iter_samples(path=mini_path, tokenizer=mini_tok, spec=short, dp_rank=0, dp_size=1, epochs=1,
                             skips=skips))
    assert kept and all(len(s.input_ids) <= 40 for s in kept)
    assert skips.as_dict() == {"too long": 40 - len(kept)}
    assert len(list(iter_meta(path=mini_path, spec=short))) == len(kept)


def test_too_long_truncate_cuts_the_answer_and_keeps_media(mini_path, mini_tok, tiny_spec) -> None:
    short = dataclasses.replace(tiny_spec, llm=dataclasses.replace(tiny_spec.llm, max_seq_len=60))
    full = {s.key: s for s in stream(mini_path, mini_tok, tiny_spec, epochs=1)}
    s = stream(mini_path, mini_tok, short, epochs=1, too_long="truncate")
    got = list(s)
    metas = dict(iter_meta(path=mini_path, spec=short, too_long="truncate", tokenizer=mini_tok))
    cut = [x for x in got if len(full[x.key].input_ids) > 60]
    assert cut and all(len(x.input_ids) == 60 for x in cut)
    for x in got:
        f = full[x.key]
        assert x.input_ids == f.input_ids[:60] and x.labels == f.labels[:60]
        assert any(t != -100 for t in x.labels)
        assert x.input_ids.count(mini_tok.image_id) == f.input_ids.count(mini_tok.image_id)
        assert metas[x.key] == x.meta
    dropped = s.skips.as_dict().get("too long", 0)
    assert dropped and len(got) + dropped == 40
    assert "prompt plus media alone need" in s.skips.examples[0]


@pytest.mark.parametrize("workers, shuffle", [(1, 0), (1, 7), (2, 7)])
@pytest.mark.parametrize("stop", [5, 20, 33])
def test_resume_continues_with_exactly_the_samples_that_came_next(mini_path, mini_tok, tiny_spec, workers,
                                                                   shuffle, stop) -> None:
    def make():
        return stream(mini_path, mini_tok, tiny_spec, dp_rank=0, dp_size=2, num_workers=workers, epochs=3,
                      shuffle_buffer=shuffle, seed=11)
    whole = [r.key for r in make().records()]
    assert len(whole) == 60  # 3 epochs of 20: stop=33 is past an epoch boundary
    first = make()
    head = [r.key for r in itertools.islice(first.records(), stop)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    again = make()
    again.load_state_dict(state)
    assert again.resume_mode == "exact"
    assert head + [r.key for r in again.records()] == whole
    assert again.consumed == len(whole)


@pytest.mark.parametrize("middle_takes", [4, 8])
def test_resume_on_another_dp_size_trains_each_sample_of_the_epochs_once(mini_path, mini_tok, tiny_spec,
                                                                         middle_takes) -> None:
    """Given every saved replica's state (`replicas`, as a checkpoint's resume passes them), readers
    of another dp size and worker count continue with exactly the samples the old readers had not
    taken: over the run's epochs, each sample once, across two such changes (dp 2 -> 4 -> 1 with 2
    workers), with the old replicas in different epochs, and (8) with the middle layout's readers
    all past the epoch the first layout left unfinished."""
    def make(dp, r, workers=1):
        return stream(mini_path, mini_tok, tiny_spec, dp_size=dp, dp_rank=r, num_workers=workers, epochs=2,
                      shuffle_buffer=7, seed=3)

    def take(reader, n):
        items = list(itertools.islice(reader.records(), n))
        return [(i.cursor["epoch"], i.key) for i in items], json.loads(json.dumps(reader.state_dict()))

    trained, states = [], []
    for r, n in ((0, 13), (1, 25)):  # replica 1 is 5 samples into epoch 1, replica 0 still in epoch 0
        got, state = take(make(2, r), n)
        trained += got
        states.append(state)
    middle = []
    for r in range(4):
        reader = make(4, r)
        reader.load_state_dict({**states[r % 2], "replicas": states})
        assert reader.resume_mode.startswith("continued (") and "dp_size 2 -> 4" in reader.resume_mode
        got, state = take(reader, middle_takes)
        trained += got
        middle.append(state)
    assert all("after" in st for st in middle)
    assert middle_takes == 4 or all(c["epoch"] == 1 for st in middle for c in st["workers"])  # still inside epochs the dp=2 readers had read part of
    last = make(1, 0, workers=2)
    last.load_state_dict({**middle[0], "replicas": middle})
    trained += [(i.cursor["epoch"], i.key) for i in last.records()]
    every = all_keys(mini_path)
    assert sorted(trained) == sorted((e, k) for e in range(2) for k in every)  # each once, none lost


def test_resume_on_another_dp_size_restarts_the_epoch(mini_path, mini_tok, tiny_spec) -> None:
    old = stream(mini_path, mini_tok, tiny_spec, dp_size=2, epochs=3)
    list(itertools.islice(old.records(), 25))  # in epoch 1
    new = stream(mini_path, mini_tok, tiny_spec, dp_size=1, epochs=3)
    new.load_state_dict(old.state_dict())
    assert new.resume_mode.startswith("approximate (dp_size 2 -> 1")
    assert len(list(new.records())) == 2 * 40  # epochs 1 and 2, from their start
    with pytest.raises(ValueError, match="state of replica 1 loaded into replica 0"):
        stream(mini_path, mini_tok, tiny_spec, dp_size=2).load_state_dict(
            stream(mini_path, mini_tok, tiny_spec, dp_size=2, dp_rank=1).state_dict())
