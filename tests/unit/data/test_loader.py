"""The DataLoader bridge: worker processes give the in-process order and positions."""

from __future__ import annotations

from mmpipe.data.loader import loader

from .helpers import stream


def test_in_process_worker_interleaving_matches_a_dataloader(mini_path, mini_tok, tiny_spec) -> None:
    def make():
        return stream(mini_path, mini_tok, tiny_spec, dp_rank=1, dp_size=2, num_workers=2, epochs=2, shuffle_buffer=5)
    inproc = [r.key for r in make().records()]
    s = make()
    via_dl = [(r.key, r.worker) for r in loader(s, records=True)]
    assert [k for k, _ in via_dl] == inproc and len(inproc) == 40
    assert {w for _, w in via_dl} == {0, 1}
    assert s.state_dict()["workers"] == [{"epoch": 1, "offset": 10}, {"epoch": 1, "offset": 10}]
