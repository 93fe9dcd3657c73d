"""Fixtures for the data tests: the tiny model spec, a small generated shard set, a local HTTP server."""

from __future__ import annotations

import http.server
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from mmpipe.config import PACKAGE_ROOT
from mmpipe.data.synth import SynthConfig, generate
from mmpipe.data.tokenizer import Tokenizer, load_tokenizer
from mmpipe.model.spec import ModelSpec, spec_from_dict


@dataclass(frozen=True)
class Web:
    root: Path
    """The served folder."""
    url: str
    """http://127.0.0.1:PORT (no trailing slash)."""


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return spec_from_dict(yaml.safe_load((PACKAGE_ROOT / "conf/model/tiny.yaml").read_text()))


@pytest.fixture(scope="session")
def mini_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 synthetic samples in 4 shards (every task kind appears)."""
    out = tmp_path_factory.mktemp("mini")
    generate(SynthConfig(out=out, samples=40, shards=4, seed=3))
    return out


@pytest.fixture(scope="session")
def mini_tok(mini_data: Path) -> Tokenizer:
    return load_tokenizer(mini_data / "tokenizer.json")


@pytest.fixture(scope="session")
def mini_path(mini_data: Path) -> str:
    return str(mini_data / "shards" / "train-{000000..000003}.tar")


@pytest.fixture(scope="session")
def web(mini_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    """An HTTP server on 127.0.0.1 (a thread) serving a folder that holds the mini shards under
    shards/; tests may write more files into `web.root`. `/cut/NAME` announces NAME's full
    length but sends only half of it, then closes the connection."""
    root = tmp_path_factory.mktemp("www")
    shutil.copytree(mini_data / "shards", root / "shards")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):
            super().__init__(*args, directory=str(root), **kw)

        def do_GET(self):
            if not self.path.startswith("/cut/"):
                return super().do_GET()
            data = (root / self.path[5:]).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Web(root=root, url=f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


@pytest.fixture
def deadline():
    """Fail a test that reads over the network if it has not finished in 60 s (instead of hanging)."""
    def expired(*_):
        raise TimeoutError("the test took more than 60 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
