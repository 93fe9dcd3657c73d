"""Reader at scale: rank x worker split, records vs decode, exact resume, pipe: URLs, limits."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from mmpipe.config import PACKAGE_ROOT
from mmpipe.data.mixture import Mixture, mixture_from_dicts
from mmpipe.data.reader import SampleStream, iter_meta, loader
from mmpipe.data.records import decode_record

REPO = PACKAGE_ROOT  # the shipped configs and data live in the package


def stream(path, tok, spec, **kw) -> SampleStream:
    return SampleStream(path=path, tokenizer=tok, spec=spec, **kw)


def all_keys(path: str) -> list[str]:
    return [k for k, _ in iter_meta(path=path)]


@pytest.mark.parametrize("dp, workers", [(1, 4), (2, 2), (4, 1)])
def test_every_sample_is_read_once_across_replicas_and_workers(mini_path, mini_tok, tiny_spec, dp, workers) -> None:
    seen = []
    for r in range(dp):
        for w in range(workers):
            seen += [rec.key for rec in stream(mini_path, mini_tok, tiny_spec, dp_rank=r, dp_size=dp, epochs=1,
                                               num_workers=workers, worker_id=w, shuffle_buffer=4).records()]
    assert sorted(seen) == sorted(all_keys(mini_path)) and len(seen) == 40


def test_in_process_worker_interleaving_matches_a_dataloader(mini_path, mini_tok, tiny_spec) -> None:
    def make():
        return stream(mini_path, mini_tok, tiny_spec, dp_rank=1, dp_size=2, num_workers=2, epochs=2, shuffle_buffer=5)
    inproc = [r.key for r in make().records()]
    s = make()
    via_dl = [(r.key, r.worker) for r in loader(s, records=True)]
    assert [k for k, _ in via_dl] == inproc and len(inproc) == 40
    assert {w for _, w in via_dl} == {0, 1}
    assert s.state_dict()["workers"] == [{"epoch": 1, "offset": 10}, {"epoch": 1, "offset": 10}]


def test_fewer_shards_than_readers_is_a_clear_error(mini_path, mini_tok, tiny_spec) -> None:
    with pytest.raises(ValueError, match=r"4 shard\(s\) but parallel.dp x data.num_workers = 2 x 3 = 6 readers"):
        stream(mini_path, mini_tok, tiny_spec, dp_size=2, num_workers=3)


def test_last_stage_decoding_without_media_gives_the_same_ids(mini_path, mini_tok, tiny_spec) -> None:
    full = list(stream(mini_path, mini_tok, tiny_spec, epochs=1))
    lean = [decode_record(r, mini_tok, tiny_spec, media=False)
            for r in stream(mini_path, mini_tok, tiny_spec, epochs=1).records()]
    assert [(s.key, s.input_ids, s.labels, s.meta) for s in lean] == \
           [(s.key, s.input_ids, s.labels, s.meta) for s in full]
    assert all(not s.images and not s.audio for s in lean)
    assert any(s.images for s in full) and any(s.audio for s in full)
    assert [s.modality for s in lean] == [s.modality for s in full]


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


# ---------------------------------------------------------------- mixtures

def mixture_sources(mini_data, **b) -> list[dict]:
    sh = mini_data / "shards"
    return [{"name": "a", "path": str(sh / "train-{000000..000001}.tar"), "weight": 3},
            {"name": "b", "path": str(sh / "train-{000002..000003}.tar"), "weight": 1, **b}]


def test_mixture_interleaves_by_weight_deterministically(mini_data, mini_tok, tiny_spec) -> None:
    def run():
        m = Mixture(sources=mixture_from_dicts(mixture_sources(mini_data)), tokenizer=mini_tok, spec=tiny_spec,
                    seed=2, shuffle_buffer=4)
        return m, [(r.source, r.key) for r in itertools.islice(m.records(), 40)]
    m, got = run()
    assert got == run()[1]
    assert [s for s, _ in got[:8]] == list("aaba" * 2)
    assert m.realised() == {"a": 30, "b": 10}


@pytest.mark.parametrize("mode", ["first", "random"])
def test_mixture_limits_keep_n_samples_of_the_whole_source(mini_data, mini_tok, tiny_spec, mode) -> None:
    src = mixture_from_dicts(mixture_sources(mini_data, limit=7, limit_mode=mode))
    keys_b = set()
    for r in range(2):  # both replicas together keep 7
        m = Mixture(sources=src, tokenizer=mini_tok, spec=tiny_spec, dp_rank=r, dp_size=2, epochs=1, seed=5)
        got = list(m.records())
        keys_b |= {x.key for x in got if x.source == "b"}
        assert m.realised()["a"] == 10
    b_all = all_keys(str(mini_data / "shards" / "train-{000002..000003}.tar"))
    assert len(keys_b) == 7 and keys_b <= set(b_all)
    if mode == "first":
        assert keys_b == set(b_all[:7])


def test_mixture_resume_is_exact(mini_data, mini_tok, tiny_spec) -> None:
    def make():
        return Mixture(sources=mixture_from_dicts(mixture_sources(mini_data, limit=5, limit_mode="random")),
                       tokenizer=mini_tok, spec=tiny_spec, seed=1, shuffle_buffer=3, num_workers=2)
    whole = [(r.source, r.key) for r in itertools.islice(make().records(), 90)]
    first = make()
    head = [(r.source, r.key) for r in itertools.islice(first.records(), 37)]
    again = make()
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [(r.source, r.key) for r in itertools.islice(again.records(), 53)] == whole
    assert again.realised() == {s: sum(1 for x, _ in whole if x == s) for s in ("a", "b")}


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "path": "x.tar", "weight": 0}, r"data.sources\[1\].weight=0 must be a positive number"),
    ({"name": "a", "path": "x.tar", "limit": -3}, r"data.sources\[1\].limit=-3 must be a positive integer"),
    ({"name": "a", "path": "x.tar", "limit_mode": "last"}, r"data.sources\[1\].limit_mode='last' is unknown"),
    ({"name": "a", "path": "x.tar", "wieght": 2}, r"data.sources\[1\].wieght is not a setting"),
    ({"name": "z", "path": ""}, r"data.sources\[1\].path=''"),
    ({"name": "z0", "path": "x.tar"}, r"data.sources\[1\].name='z0' is used twice"),
])
def test_mixture_config_errors_name_the_key(entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        mixture_from_dicts([{"name": "z0", "path": "y.tar"}, entry])


def test_shipped_mixture_config_is_valid(mini_tok, tiny_spec) -> None:
    import yaml

    cfg = yaml.safe_load((REPO / "conf/data/mixture.yaml").read_text())
    m = Mixture(sources=mixture_from_dicts(cfg["sources"]), tokenizer=mini_tok, spec=tiny_spec, root=REPO,
                epochs=1)
    assert [s.name for s in m.sources] and all(n != 0 for n in m.sizes)


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
