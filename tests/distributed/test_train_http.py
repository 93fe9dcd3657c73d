"""`mmpipe train` on the shipped shards served over http:// by a local server."""

from __future__ import annotations

import http.server
import threading
from functools import partial

import pytest

from mmpipe.data.reader import iter_meta
from mmpipe.paths import PACKAGE_ROOT

pytestmark = pytest.mark.distributed


def test_training_reads_the_shipped_shards_over_http(run_mmpipe):
    shards = PACKAGE_ROOT / "data" / "shards"
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(shards)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/train-{{000000..000007}}.tar"
        run = run_mmpipe("train", "train.steps=2", f"data.path='{url}'", "data.tokenizer=data/tokenizer.json",
                         "train.record_samples=true", timeout=240)
    finally:
        server.shutdown()
        server.server_close()
    assert run.code == 0, run.out[-3000:]
    assert "skipped 0 samples" in run.out
    assert [r["step"] for r in run.metrics()] == [1, 2]
    assert "/train-000000.tar" in asked  # the shards came over http, from this server
    local = [k for k, _ in iter_meta(path=str(shards / "train-{000000..000007}.tar"))]
    for d in run.stage_files():
        fed = [k for step in run.samples(d["rank"]) for mb in step["micro_batches"] for k in mb]
        assert sorted(fed) == sorted(local[:32])  # 2 steps x 16 samples, in stream order
