"""The synthetic dataset: byte-reproducible, self-consistent meta, and the shipped copy."""

from __future__ import annotations

import io
import json
import tarfile
import wave
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from mmpipe.paths import PACKAGE_ROOT
from mmpipe.data.reader import iter_meta
from mmpipe.data.synth import VIDEO_CYCLE, SynthConfig, generate
from mmpipe.data.synth_tasks import COLOURS, PLAIN_BACKGROUNDS
from mmpipe.data.template import count_placeholders, count_videos, parse_conversation, text_tokens
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.data.video import decode_frames, probe_video
from mmpipe.model.geometry import video_meta_from_json


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generating_twice_gives_identical_bytes_and_another_seed_does_not(tmp_path) -> None:
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        generate(SynthConfig(out=tmp_path / name, samples=24, shards=2, seed=seed, video_samples=4, video_shards=1))
    a, b, c = files(tmp_path / "a"), files(tmp_path / "b"), files(tmp_path / "c")
    assert sorted(a) == ["shards/index.json", "shards/train-000000.tar", "shards/train-000001.tar",
                         "shards/video-000000.tar", "tokenizer.json"]
    assert a == b  # the clips too: the encoders run bit-exactly
    assert a["shards/train-000000.tar"] != c["shards/train-000000.tar"]
    assert a["shards/video-000000.tar"] != c["shards/video-000000.tar"]


def test_the_video_set_leaves_the_train_shards_and_their_tokenization_as_they_were(tmp_path) -> None:
    generate(SynthConfig(out=tmp_path / "with", samples=24, shards=2, seed=7, video_samples=7, video_shards=1))
    generate(SynthConfig(out=tmp_path / "without", samples=24, shards=2, seed=7, video_samples=0))
    with_, without = files(tmp_path / "with"), files(tmp_path / "without")
    assert with_["shards/train-000000.tar"] == without["shards/train-000000.tar"]
    assert with_["shards/train-000001.tar"] == without["shards/train-000001.tar"]
    assert with_["tokenizer.json"] == without["tokenizer.json"]


def read_shards(root: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted((root / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                assert (m.mtime, m.uid, m.gid, m.uname, m.mode) == (0, 0, 0, "", 0o644)
                key, suffix = m.name.split(".", 1)
                samples.setdefault(key, {})[suffix] = tar.extractfile(m).read()
    return samples


def test_every_sample_is_consistent_with_its_meta(mini_data, mini_tok) -> None:
    samples = read_shards(mini_data)
    assert len(samples) == 40 + 14
    for key, members in samples.items():
        obj = json.loads(members["json"])
        assert obj["id"] == key
        turns = parse_conversation(obj["conversations"])
        n_img, n_aud = count_placeholders(turns)
        n_vid = count_videos(turns)
        assert sorted(members) == sorted(["json"] + [f"{i}.png" for i in range(n_img)]
                                         + [f"{i}.wav" for i in range(n_aud)] + [f"{i}.mp4" for i in range(n_vid)])
        meta = obj["meta"]
        assert meta["text_tokens"] == text_tokens(obj["conversations"], mini_tok)
        sizes = [list(Image.open(io.BytesIO(members[f"{i}.png"])).size[::-1]) for i in range(n_img)]
        assert meta["images"] == sizes
        for i, sec in enumerate(meta["audio_seconds"]):
            with wave.open(io.BytesIO(members[f"{i}.wav"])) as wf:
                assert (wf.getframerate(), wf.getnchannels()) == (8000, 1)
                assert wf.getnframes() / 8000 == sec and 0.3 <= sec <= 6.0
        for i, stored in enumerate(meta.get("videos", [])):  # the header says what the meta says
            header = probe_video(members[f"{i}.mp4"])
            assert header == video_meta_from_json(stored)
            assert 1.0 <= header.seconds <= 3.0 and header.fps in (4, 6, 8) and 32 <= min(header.height, header.width)
            frames = decode_frames(members[f"{i}.mp4"], tuple(range(header.frames)), header)
            assert frames.shape == (header.frames, header.height, header.width, 3)
    kinds = [next((k for k, m in (("video", "0.mp4"), ("image", "0.png"), ("audio", "0.wav")) if m in samples[f"v{i:06d}"]),
                  "text") for i in range(14)]
    assert kinds == [VIDEO_CYCLE[i % len(VIDEO_CYCLE)] for i in range(14)]


def test_colours_named_in_answers_are_visible_in_the_picture(mini_data) -> None:
    named = {**COLOURS, **PLAIN_BACKGROUNDS}
    checked = 0
    for members in read_shards(mini_data).values():
        turns = json.loads(members["json"])["conversations"]
        if sorted(members) != ["0.png", "json"]:
            continue
        px = np.asarray(Image.open(io.BytesIO(members["0.png"])).convert("RGB")).reshape(-1, 3)
        for word in turns[1]["value"].replace(",", " ").split():
            if word in named:
                assert (px == named[word]).all(axis=1).any(), (word, turns)
                checked += 1
    assert checked >= 5


def test_index_counts_add_up(mini_data) -> None:
    index = json.loads((mini_data / "shards" / "index.json").read_text())
    assert index["samples"] == 54 == sum(s["samples"] for s in index["shards"])
    assert [s["samples"] for s in index["shards"]] == [10, 10, 10, 10, 7, 7]
    total = Counter()
    for s in index["shards"]:
        total.update(s["by_modality"])
    assert dict(total) == index["by_modality"]
    assert set(index["by_modality"]) == {"text", "image", "audio", "image+audio", "video"}
    assert index["videos"] == index["by_modality"]["video"] == 6


def test_shipped_data_matches_its_index_and_stays_small() -> None:
    data = PACKAGE_ROOT / "data"  # shipped inside the package, beside the data code
    index = json.loads((data / "shards" / "index.json").read_text())
    size = sum(p.stat().st_size for p in [*(data / "shards").rglob("*"), data / "tokenizer.json"] if p.is_file())
    assert size <= 10 * 2**20
    got = Counter()
    sets = index["sets"]
    path = "::".join(str(data / "shards" / sets[name]["path"]) for name in ("video", "train"))
    for _, meta in iter_meta(path=path):
        got["video" if meta.videos else "image+audio" if meta.images and meta.audio_seconds else
            "image" if meta.images else "audio" if meta.audio_seconds else "text"] += 1
    assert dict(got) == index["by_modality"] and sum(got.values()) == index["samples"] >= 2000
    assert sets["video"]["samples"] == 256 and index["videos"] == got["video"] >= 100
    assert load_tokenizer(data / "tokenizer.json").vocab_size == index["tokenizer"]["vocab_size"]
