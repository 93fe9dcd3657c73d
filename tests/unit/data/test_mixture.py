"""Mixtures: weighted interleaving, limits over a whole source, exact resume, config errors."""

from __future__ import annotations

import itertools
import json

import pytest

from mmpipe.paths import CONF_DIR, PACKAGE_ROOT
from mmpipe.data.mixture import Mixture, mixture_from_dicts

from .helpers import all_keys

REPO = PACKAGE_ROOT  # the shipped data resolves beside the package


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
    ({"name": "a", "path": "x.tar", "schedule": [[0, 2]]}, r"data.sources\[1\].schedule entry \[0, 2\] must be "
     r"\[step >= 1, weight > 0\], e.g. data.sources\[1\].schedule=\[\[1,4\],\[200,1\]\]"),
    ({"name": "a", "path": "x.tar", "schedule": [[5, 2], [3, 1]]}, r"schedule steps must increase \(5 then 3\)"),
])
def test_mixture_config_errors_name_the_key(entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        mixture_from_dicts([{"name": "z0", "path": "y.tar"}, entry])


def test_shipped_mixture_config_is_valid(mini_tok, tiny_spec) -> None:
    import yaml

    cfg = yaml.safe_load((CONF_DIR / "data/mixture.yaml").read_text())
    m = Mixture(sources=mixture_from_dicts(cfg["sources"]), tokenizer=mini_tok, spec=tiny_spec, root=REPO,
                epochs=1)
    assert [s.name for s in m.sources] and all(n != 0 for n in m.sizes)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_weight_schedule_moves_the_mixture_at_its_step_and_resumes_exactly(mini_data, mini_tok, tiny_spec,
                                                                             workers) -> None:
    """Weights 3:1 until step 3, then 1:3 (4 samples a step): steps 1-2 take about the 3:1 shares,
    steps 3-5 about the 1:3 ones; the same with two loader workers (the DataLoader's round-robin), and a resume
    in the middle of the schedule continues with exactly the samples that came next."""
    sources = mixture_sources(mini_data, schedule=[[3, 3]])
    sources[0]["schedule"] = [[3, 1]]

    def make():
        return Mixture(sources=mixture_from_dicts(sources), tokenizer=mini_tok, spec=tiny_spec, seed=2,
                       samples_per_step=4, num_workers=workers)

    whole = [(r.source, r.key) for r in itertools.islice(make().records(), 20)]
    picks = "".join(s for s, _ in whole)
    # each worker keeps every source within one pick of its share (two workers: within two)
    assert picks[:8].count("a") >= 6 - workers + 1 and picks[8:].count("b") >= 9 - workers + 1, picks
    assert picks == "".join(s for s, _ in (
        (r.source, r.key) for r in itertools.islice(make().records(), 20)))  # deterministic
    first = make()
    head = [(r.source, r.key) for r in itertools.islice(first.records(), 10)]
    again = make()
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert again.resume_mode == "exact"
    assert head + [(r.source, r.key) for r in itertools.islice(again.records(), 10)] == whole
