"""Records and samples: every bad-input reason is counted with shard and key (or raised), and the
last stage's media-free decoding gives the first stage's ids."""

from __future__ import annotations

import json

import pytest

from mmpipe.data.reader import SampleStream
from mmpipe.data.records import decode_record
from mmpipe.data.skips import SampleError
from mmpipe.data.synth import write_shard

from .helpers import js, png, stream


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


def test_last_stage_decoding_without_media_gives_the_same_ids(mini_path, mini_tok, tiny_spec) -> None:
    full = list(stream(mini_path, mini_tok, tiny_spec, epochs=1))
    lean = [decode_record(r, mini_tok, tiny_spec, media=False)
            for r in stream(mini_path, mini_tok, tiny_spec, epochs=1).records()]
    assert [(s.key, s.input_ids, s.labels, s.meta) for s in lean] == \
           [(s.key, s.input_ids, s.labels, s.meta) for s in full]
    assert all(not s.images and not s.audio for s in lean)
    assert any(s.images for s in full) and any(s.audio for s in full)
    assert [s.modality for s in lean] == [s.modality for s in full]
