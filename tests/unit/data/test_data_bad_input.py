"""Every bad-input reason is counted with shard and key, or raised at the first with on_error=raise."""

from __future__ import annotations

import io
import json
import struct
import wave
import zlib

import numpy as np
import pytest
from PIL import Image

from mmpipe.data.media import MediaLimits
from mmpipe.data.reader import SampleStream
from mmpipe.data.records import decode_record
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.synth import write_shard


def png(h: int = 30, w: int = 40) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(1)
        wf.setframerate(8000)
        wf.writeframes(np.full(int(seconds * 8000), 128, np.uint8).tobytes())
    return buf.getvalue()


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


def js(key: str, human: str, answer: str, **extra) -> tuple[str, bytes]:
    obj = {"id": key, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}], **extra}
    return f"{key}.json", json.dumps(obj).encode()


CASES = {
    "missing json": [("k.0.png", png())],
    "bad json": [("k.json", b"{not json")],
    "bad conversation": [("k.json", json.dumps({"conversations": [{"from": "bot", "value": "x"}]}).encode())],
    "no answer": [("k.json", json.dumps({"conversations": [{"from": "human", "value": "hi"}]}).encode())],
    "empty answer": [js("k", "What is 2 plus 2?", "  ")],
    "placeholder mismatch": [js("k", "<image>\nWhat?", "red"), ("k.0.png", png()), ("k.1.png", png())],
    "missing media": [js("k", "<audio>\nWhat do you hear?", "silence")],
    "undecodable image": [js("k", "<image>\nWhat?", "red"), ("k.0.png", b"\x89PNG garbage")],
    "undecodable audio": [js("k", "<audio>\nWhat?", "silence"), ("k.0.wav", b"RIFF....WAVEjunk")],
    "meta mismatch": [js("k", "<image>\nWhat?", "red", meta={"text_tokens": 3, "images": [[99, 99]]}),
                      ("k.0.png", png())],
    "too long": [js("k", "<image>\n" + "count 1 2 3 4 5 6 7 8 9 " * 60, "red"), ("k.0.png", png())],
}
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


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_reason_is_counted_with_shard_and_key_then_raised_in_raise_mode(tmp_path, mini_tok, tiny_spec,
                                                                             reason) -> None:
    write_shard(tmp_path / "x-0.tar", CASES[reason] + [js("z-good", "<image>\nWhat?", "red"), ("z-good.0.png", png())])
    path = str(tmp_path / "x-0.tar")
    s = SampleStream(path=path, tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    assert [x.key for x in s] == ["z-good"]
    assert s.skips.as_dict() == {reason: 1}
    assert s.skips.examples[0].startswith(f"x-0.tar sample k: {reason}: ")
    with pytest.raises(SampleError, match=f"^x-0.tar sample k: {reason}"):
        list(SampleStream(path=path, tokenizer=mini_tok, spec=tiny_spec, epochs=1, on_error="raise"))


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


def test_garbage_in_the_middle_of_a_shard_is_a_corrupt_shard(tmp_path, mini_data, mini_tok, tiny_spec) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    # the third sample's first header overwritten: python's tarfile would end the shard silently
    import tarfile

    with tarfile.open(mini_data / "shards" / "train-000000.tar") as tar:
        members = tar.getmembers()
    keys = list(dict.fromkeys(m.name.split(".")[0] for m in members))
    first_key = keys[0]
    third = next(m for m in members if m.name.startswith(keys[2] + "."))
    bad = good[:third.offset] + b"\x07garbage" * 64 + good[third.offset + 512:]
    (tmp_path / "g-0.tar").write_bytes(bad)
    s = SampleStream(path=str(tmp_path / "g-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    # the second sample might have had more members after the damage: dropped with the rest
    assert [x.key for x in s] == [first_key]
    assert s.skips.as_dict() == {"corrupt shard": 1}
    assert "not a tar header" in s.skips.examples[0]


def test_a_shard_without_its_end_blocks_is_corrupt(tmp_path, mini_data, mini_tok, tiny_spec) -> None:
    good = (mini_data / "shards" / "train-000000.tar").read_bytes()
    end = good.rstrip(b"\0")
    (tmp_path / "c-0.tar").write_bytes(end + b"\0" * (-len(end) % 512))
    s = SampleStream(path=str(tmp_path / "c-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    assert len(list(s)) == 9  # the last sample may be incomplete: dropped with the shard's tail
    assert s.skips.as_dict() == {"corrupt shard": 1}


def test_pixel_damage_behind_a_valid_header_is_found_at_decode_and_can_be_blanked(tmp_path, mini_tok,
                                                                                   tiny_spec) -> None:
    data = bytearray(png(64, 64))
    idat = data.index(b"IDAT")
    data[idat + 8:idat + 20] = b"\xff" * 12  # corrupt the compressed pixels, fix nothing else
    import zlib

    length = int.from_bytes(data[idat - 4:idat], "big")
    data[idat + 4 + length:idat + 8 + length] = zlib.crc32(bytes(data[idat:idat + 4 + length])).to_bytes(4, "big")
    write_shard(tmp_path / "p-0.tar", [js("k", "<image>\nWhat?", "red"), ("k.0.png", bytes(data))])
    s = SampleStream(path=str(tmp_path / "p-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    rec = next(s.records())  # the header and CRCs are fine
    assert decode_record(rec, mini_tok, tiny_spec, media=False).input_ids == rec.input_ids
    assert s.decode(rec) is None and s.skips.as_dict() == {"undecodable image": 1}
    blank = decode_record(rec, mini_tok, tiny_spec, blank=True)
    assert blank.images[0].shape == (64, 64, 3) and not blank.images[0].any()
    assert [e.reason for e in blank.dropped] == ["undecodable image"]
