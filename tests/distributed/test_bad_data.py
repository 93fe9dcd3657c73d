"""`mmpipe train` over a shard set full of bad samples: every sample is trained or accounted for
by reason, shard and key (data.on_error=skip), or the run ends on one line (on_error=raise)."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from mmpipe.data.synth import write_shard
from mmpipe.paths import PACKAGE_ROOT

pytestmark = pytest.mark.distributed


def png_header(w: int, h: int) -> bytes:
    """A PNG that says w x h pixels in its header (a decompression bomb to any header check)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(1000))) + chunk(b"IEND", b""))


def png(h: int = 32, w: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def pixels_damaged(data: bytes) -> bytes:
    """The PNG with its compressed pixels overwritten and the chunk CRC fixed: the header and
    every CRC check pass, decoding fails."""
    b = bytearray(data)
    i = b.index(b"IDAT")
    n = int.from_bytes(b[i - 4:i], "big")
    b[i + 8:i + 20] = b"\xff" * 12
    b[i + 4 + n:i + 8 + n] = zlib.crc32(bytes(b[i:i + 4 + n])).to_bytes(4, "big")
    return bytes(b)


def js(key: str, human: str, answer: str = "red") -> tuple[str, bytes]:
    obj = {"id": key, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]}
    return f"{key}.json", json.dumps(obj).encode()


def shipped_samples(n: int) -> list[list[tuple[str, bytes]]]:
    """The members of the first n samples of the shipped shard (good ones, with their meta)."""
    groups: dict[str, list[tuple[str, bytes]]] = {}
    with tarfile.open(PACKAGE_ROOT / "data" / "shards" / "train-000000.tar") as tar:
        for m in tar.getmembers():
            key = m.name.split(".")[0]
            if key not in groups and len(groups) == n:
                break
            groups.setdefault(key, []).append((m.name, tar.extractfile(m).read()))
    return list(groups.values())


BAD = {  # key: (reason, members)
    "b-json": ("bad json", [("b-json.json", b'{"conversations": [')]),
    "b-missing": ("missing media", [js("b-missing", "<image>\nWhat colour?")]),
    "b-png": ("undecodable image", [js("b-png", "<image>\nWhat colour?"), ("b-png.0.png", png()[:100])]),
    "b-garbage": ("undecodable image", [js("b-garbage", "<image>\nWhat?"), ("b-garbage.0.png", bytes(range(256)) * 8)]),
    "b-wav": ("undecodable audio", [js("b-wav", "<audio>\nWhat do you hear?", "silence"), ("b-wav.0.wav", b"")]),
    "b-bomb": ("media too large", [js("b-bomb", "<image>\nWhat?"), ("b-bomb.0.png", png_header(20000, 20000))]),
    "b-long": ("too long", [js("b-long", "Repeat: " + "7 " * 200_000)]),
}


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory) -> tuple[Path, list[str], list[str]]:
    """Three shards: good samples among every kind of bad one, a shard cut short, and an image
    whose pixels fail behind a valid header. Exactly 8 usable samples (2 steps of 4), the last
    one after every bad sample, so a 2-step run reads all of it.

    Returns the folder, the usable keys, and the keys lost with the cut shard.
    """
    out = tmp_path_factory.mktemp("bad-shards")
    good = shipped_samples(8)
    keys = [g[0][0].split(".")[0] for g in good]
    bad = list(BAD.values())
    shard0 = good[0] + bad[0][1] + good[1] + bad[1][1] + bad[2][1] + good[2] + bad[3][1] + bad[4][1] + good[3] \
        + bad[5][1] + bad[6][1]
    write_shard(out / "bad-000000.tar", shard0)
    # shard 1: two good samples, then the tar ends in the middle of a third (lost with the shard)
    write_shard(out / "bad-000001.tar", good[4] + good[5] + good[7])
    whole = (out / "bad-000001.tar").read_bytes()
    with tarfile.open(out / "bad-000001.tar") as tar:
        cut = next(m for m in tar.getmembers() if m.name.startswith(keys[7])).offset_data + 10
    (out / "bad-000001.tar").write_bytes(whole[:cut])
    damaged = [("p-damaged.json", js("p-damaged", "<image>\nWhat colour?")[1]),
               ("p-damaged.0.png", pixels_damaged(png(64, 64)))]
    write_shard(out / "bad-000002.tar", good[6] + damaged)
    return out, sorted(keys[:7] + ["p-damaged"]), [keys[7]]


def bad_run(run_mmpipe, shards: Path, *extra: str, name: str):
    return run_mmpipe("train", f"data.path='{shards}/bad-{{000000..000002}}.tar'", "data.epochs=1", "train.steps=2",
                      "train.global_batch=4", "train.micro_batches=2", "train.record_samples=true", *extra, name=name)


def test_bad_samples_are_skipped_and_every_one_is_accounted_for(run_mmpipe, bad_shards) -> None:
    shards, usable, lost = bad_shards
    run = bad_run(run_mmpipe, shards, name="skip")
    assert run.code == 0, run.out[-3000:]
    assert "done: 2 steps" in run.out
    fed = sorted(k for step in run.samples(0) for mb in step["micro_batches"] for k in mb)
    assert fed == usable  # p-damaged trains with a blank image (both stages keep the same samples)
    lines = [json.loads(l) for l in (run.run_dir / "skips.jsonl").read_text().splitlines()]
    got = sorted((l["reason"], l["shard"], l["key"]) for l in lines)
    want = sorted([(reason, "bad-000000.tar", key) for key, (reason, _) in BAD.items()]
                  + [("corrupt shard", "bad-000001.tar", ""), ("undecodable image", "bad-000002.tar", "p-damaged")])
    assert got == want
    corrupt = next(l for l in lines if l["reason"] == "corrupt shard")
    assert "unexpected end of data in member " + lost[0] in corrupt["detail"]  # what the cut shard took
    assert ("skipped 9 samples (1 bad json, 1 corrupt shard, 1 media too large, 1 missing media, 1 too long, "
            "1 undecodable audio, 3 undecodable image)") in run.out
    for key, (reason, _) in BAD.items():  # fewer than 5 of a reason: each on the console
        assert f"skipped bad-000000.tar sample {key}: {reason}: " in run.out
    assert "Traceback" not in run.out


def test_on_error_raise_ends_the_run_with_one_line(run_mmpipe, bad_shards) -> None:
    shards, _, _ = bad_shards
    run = bad_run(run_mmpipe, shards, "data.on_error=raise", name="raise")
    assert run.code == 2, run.out[-3000:]
    errors = [l for l in run.out.splitlines() if "error:" in l]
    # the first bad sample in shard order (members are sorted: b-bomb comes first), said once
    assert errors == ["mmpipe train: error: bad-000000.tar sample b-bomb: media too large: image refused as a "
                      "decompression bomb (Image size (400000000 pixels) exceeds limit of 178956970 pixels, could be "
                      "decompression bomb DOS attack.); data.max_image_pixels=64,000,000"], run.out[-3000:]
    assert run.out.count("b-bomb") == 1
    assert "Traceback" not in run.out
