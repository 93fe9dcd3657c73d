"""Hostile media and the skip log: whatever a decoder raises on one sample is a counted reason
with shard and key (in skips.jsonl), or one clear error with on_error=raise."""

from __future__ import annotations

import io
import json
import struct
import wave
import zlib

import pytest

from mmpipe.data.media import MediaLimits
from mmpipe.data.reader import SampleStream
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.synth import write_shard

from .helpers import js, png


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header says w x h pixels (a decompression bomb as far as any header check can
    tell; its data is a few bytes of zeros)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(1000))) + chunk(b"IEND", b""))


def wav_header(rate: int, frames: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(1)
        wf.setframerate(rate)
        wf.writeframes(bytes([128]) * frames)
    return buf.getvalue()


# Hostile media: each becomes a counted reason, whatever the decoder raises.
HOSTILE = {
    "decompression bomb": ("media too large", [js("k", "<image>\nWhat?", "red"),
                                               ("k.0.png", png_header(20000, 20000))]),
    "over max_image_pixels": ("media too large", [js("k", "<image>\nWhat?", "red"),
                                                  ("k.0.png", png_header(9000, 9000))]),
    "truncated image": ("undecodable image", [js("k", "<image>\nWhat?", "red"), ("k.0.png", png(60, 60)[:90])]),
    "garbage image": ("undecodable image", [js("k", "<image>\nWhat?", "red"), ("k.0.jpg", bytes(range(256)) * 4)]),
    "image over max_member_mb": ("media too large", [js("k", "<image>\nWhat?", "red"),
                                                     ("k.0.png", png(30, 40) + bytes(3 * 2**20))]),
    "0-byte wav": ("undecodable audio", [js("k", "<audio>\nWhat?", "silence"), ("k.0.wav", b"")]),
    "garbage flac": ("undecodable audio", [js("k", "<audio>\nWhat?", "silence"), ("k.0.flac", b"fLaC" + bytes(99))]),
    "a 1 Hz clip of 2000 s": ("media too large", [js("k", "<audio>\nWhat?", "silence"),
                                                  ("k.0.wav", wav_header(1, 2000))]),
    "nested json": ("bad json", [("k.json", b"[" * 100000 + b"]" * 100000)]),
    "infinite meta": ("bad json", [("k.json", b'{"conversations": [{"from": "human", "value": "<image>"}, '
                                              b'{"from": "gpt", "value": "x"}], "meta": {"images": [[Infinity, 3]]}}'),
                                   ("k.0.png", png())]),
}
LIMITS = MediaLimits(max_member_bytes=2 * 2**20)  # the default limits, but 2 MB members


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_media_are_counted_skips_with_shard_and_key_in_the_journal(tmp_path, mini_tok, tiny_spec, case,
                                                                         capsys) -> None:
    reason, members = HOSTILE[case]
    write_shard(tmp_path / "h-0.tar", members + [js("z-good", "<image>\nWhat?", "red"), ("z-good.0.png", png())])
    skips = SkipCounter.for_run(tmp_path, dp_rank=0)
    s = SampleStream(path=str(tmp_path / "h-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1, skips=skips,
                     limits=LIMITS)
    assert [x.key for x in s] == ["z-good"]
    assert s.skips.as_dict() == {reason: 1}
    lines = [json.loads(l) for l in (tmp_path / "skips.jsonl").read_text().splitlines()]
    assert [(l["reason"], l["shard"], l["key"], l["dp_rank"]) for l in lines] == [(reason, "h-0.tar", "k", 0)]
    assert capsys.readouterr().err.startswith(f"skipped h-0.tar sample k: {reason}: ")
    with pytest.raises(SampleError, match=f"^h-0.tar sample k: {reason}: "):
        list(SampleStream(path=str(tmp_path / "h-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1,
                          on_error="raise", limits=LIMITS))


def test_skips_are_printed_up_to_a_limit_per_reason_and_all_journaled(tmp_path, mini_tok, tiny_spec,
                                                                      capsys) -> None:
    bad = [m for i in range(8) for m in (js(f"b{i}", "<image>\nWhat?", "red"), (f"b{i}.0.png", b"\x89PNG junk"))]
    bad += [js("e0", "Hi?", " ")]
    write_shard(tmp_path / "r-0.tar", bad + [js("z-good", "<image>\nWhat?", "red"), ("z-good.0.png", png())])
    s = SampleStream(path=str(tmp_path / "r-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1,
                     skips=SkipCounter.for_run(tmp_path, dp_rank=0))
    assert [x.key for x in s] == ["z-good"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 + 1 + 1, err
    assert [e.split(": undecodable image: ")[0] for e in err[:5]] == [f"skipped r-0.tar sample b{i}" for i in range(5)]
    assert err[5] == (f"skipped more samples for 'undecodable image'; they are counted in the summary and listed "
                      f"in {tmp_path / 'skips.jsonl'}")
    assert err[6].startswith("skipped r-0.tar sample e0: empty answer")
    keys = [json.loads(l)["key"] for l in (tmp_path / "skips.jsonl").read_text().splitlines()]
    assert keys == [f"b{i}" for i in range(8)] + ["e0"]


