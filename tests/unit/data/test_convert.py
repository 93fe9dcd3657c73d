"""The LLaVA converter: byte-identical output, the skip report, and shards the reader accepts."""

from __future__ import annotations

import json
import os
import signal
import tarfile
import wave

import numpy as np
import pytest
import soundfile
from PIL import Image

from mmpipe.data.commands import run_convert
from mmpipe.data.convert import convert
from mmpipe.data.media import MediaLimits
from mmpipe.data.reader import SampleStream
from mmpipe.data.skips import SampleError


def write_png(path, h, w, fmt="PNG") -> None:
    Image.new("RGB", (w, h), (10, 200, 30)).save(path, format=fmt)


def write_wav(path, seconds) -> None:
    with wave.open(str(path), "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(8000)
        wf.writeframes((np.sin(np.arange(int(seconds * 8000)) / 3) * 9000).astype("<i2").tobytes())


def turn(human: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]


@pytest.fixture
def llava(tmp_path):
    """9 entries: 5 good (one needing a prepended placeholder, one .bmp, one 2-turn with audio), 4 bad."""
    img = tmp_path / "images"
    img.mkdir()
    write_png(img / "a.png", 40, 64)
    write_png(img / "b.jpg", 48, 32, "JPEG")
    write_png(img / "c.bmp", 20, 20, "BMP")
    (img / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    write_wav(tmp_path / "tone.wav", 1.25)
    items = [
        {"id": "coco/001.a", "image": "a.png", "conversations": turn("<image>\nWhat colour?", "green")},
        {"id": "002", "image": "b.jpg", "conversations": turn("What colour is it?", "green")},
        {"id": "003", "images": ["c.bmp", "a.png"], "conversations": turn("<image><image>\nSame?", "yes")},
        {"id": "004", "conversations": turn("Count to 3.", "1 2 3")},
        {"id": "005", "image": "a.png", "audio": "tone.wav",
         "conversations": turn("<image>\n<audio>\nWhat?", "a tone") + turn("Louder?", "no")},
        {"id": "bad-1", "image": "missing.png", "conversations": turn("<image>\nWhat?", "x")},
        {"id": "bad-2", "image": "broken.png", "conversations": turn("<image>\nWhat?", "x")},
        {"id": "bad-3", "conversations": [{"from": "human", "value": "no answer here"}]},
        {"id": "bad-4", "image": "a.png", "conversations": turn("<image>\n<image>\nWhat?", "x")},
    ]
    (tmp_path / "llava.json").write_text(json.dumps(items))
    return tmp_path


def files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_converting_twice_gives_identical_bytes(llava, mini_tok, tiny_spec) -> None:
    for out in ("o1", "o2"):
        convert(json_path=llava / "llava.json", out=llava / out, tokenizer=mini_tok, spec=tiny_spec,
                image_root=llava / "images", maxcount=2, progress=False)
    a, b = files(llava / "o1"), files(llava / "o2")
    assert a == b
    assert sorted(a) == ["index.json", "train-000000.tar", "train-000001.tar", "train-000002.tar"]
    with tarfile.open(llava / "o1" / "train-000000.tar") as tar:
        assert all((m.mtime, m.uid, m.gid, m.uname, m.mode) == (0, 0, 0, "", 0o644) for m in tar.getmembers())
        assert tar.getnames() == ["coco_001_a.json", "coco_001_a.0.png", "002.json", "002.0.jpg"]


def test_bad_entries_are_left_out_and_reported_by_id(llava, mini_tok, tiny_spec) -> None:
    r = convert(json_path=llava / "llava.json", out=llava / "o", tokenizer=mini_tok, spec=tiny_spec,
                image_root=llava / "images", progress=False)
    assert r.samples_in == 9 and r.samples == 5
    assert r.skipped_ids == {"missing media": ["bad-1"], "undecodable image": ["bad-2"], "no answer": ["bad-3"],
                             "placeholder mismatch": ["bad-4"]}
    assert r.prepended == 1
    text = r.summary()
    assert "wrote 5 of 9 samples" in text and "missing media: bad-1" in text
    index = json.loads((llava / "o" / "index.json").read_text())
    assert index["samples"] == 5 and index["skipped"] == {"missing media": 1, "no answer": 1,
                                                          "placeholder mismatch": 1, "undecodable image": 1}
    assert index["by_modality"]["image"]["samples"] == 3 and index["by_modality"]["image"]["images"] == 4
    assert index["by_modality"]["image+audio"]["audio_seconds"] == 1.25
    with pytest.raises(SampleError, match="llava.json sample bad-1: missing media: image file 'missing.png'"):
        convert(json_path=llava / "llava.json", out=llava / "o3", tokenizer=mini_tok, image_root=llava / "images",
                on_error="raise", progress=False)


def test_the_reader_accepts_the_shards_and_the_meta_matches(llava, mini_tok, tiny_spec) -> None:
    r = convert(json_path=llava / "llava.json", out=llava / "o", tokenizer=mini_tok, spec=tiny_spec,
                image_root=llava / "images", maxcount=3, progress=False)
    s = SampleStream(path=r.path, tokenizer=mini_tok, spec=tiny_spec, epochs=1, on_error="raise")
    got = {x.key: x for x in s}
    assert list(got) == ["coco_001_a", "002", "003", "004", "005"]
    assert got["002"].meta.images == ((48, 32),)
    assert got["002"].input_ids.count(mini_tok.image_id) > 0  # the prepended placeholder
    assert got["003"].meta.images == ((20, 20), (40, 64))
    assert got["005"].meta.audio_seconds == (1.25,) and got["005"].modality == "image+audio"
    with tarfile.open(llava / "o" / "train-000000.tar") as tar:
        obj = json.loads(tar.extractfile("002.json").read())
    assert obj["conversations"][0]["value"] == "<image>\nWhat colour is it?" and obj["id"] == "002"


def test_maxsize_cuts_shards_by_bytes(llava, mini_tok) -> None:
    r = convert(json_path=llava / "llava.json", out=llava / "o", tokenizer=mini_tok, image_root=llava / "images",
                maxsize_mb=0.008, progress=False)
    # 8 KB: the small samples share shards, the 20 KB clip of sample 005 gets a shard of its own
    assert sum(s.samples for s in r.shards) == 5 and len(r.shards) >= 3 and r.shards[-1].samples == 1
    assert any(s.samples > 1 for s in r.shards)


def test_run_convert_prints_the_report_and_the_data_path(llava, mini_data, tiny_spec, capsys) -> None:
    rc = run_convert(json_path=str(llava / "llava.json"), out=str(llava / "o"), tokenizer=str(mini_data / "tokenizer.json"),
                     model=tiny_spec, image_root=str(llava / "images"), audio_root=None, maxcount=100,
                     maxsize_mb=None, on_error="skip")
    out = capsys.readouterr().out
    assert rc == 0 and "wrote 5 of 9 samples" in out and f"data.path={llava / 'o' / 'train-000000.tar'}" in out
    rc = run_convert(json_path=str(llava / "llava.json"), out=str(llava / "o"), tokenizer=str(mini_data / "tokenizer.json"),
                     model=tiny_spec, image_root=str(llava / "images"), audio_root=None, maxcount=100,
                     maxsize_mb=None, on_error="raise")
    assert rc == 1 and "bad-1: missing media" in capsys.readouterr().err


# ---------------------------------------------------------------------------- confinement

@pytest.fixture
def rooted(tmp_path):
    """An image root with one good image, an image beside it (outside), and a converter call."""
    root = tmp_path / "root"
    root.mkdir()
    write_png(root / "in.png", 20, 30)
    write_png(tmp_path / "outside.png", 20, 30)
    return tmp_path


class Hung(Exception):
    pass


def convert_one(tmp_path, path: str, mini_tok, **kw):
    """Convert an entry with image `path` and a good one; a conversion that reads /dev/zero or
    waits on a FIFO raises Hung after 30 s instead of hanging the tests."""
    items = [{"id": "x", "image": path, "conversations": turn("<image>\nWhat?", "x")},
             {"id": "ok", "image": "in.png", "conversations": turn("<image>\nWhat?", "x")}]
    (tmp_path / "in.json").write_text(json.dumps(items))

    def hung(signum, frame):
        raise Hung(path)

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        return convert(json_path=tmp_path / "in.json", out=tmp_path / "o", tokenizer=mini_tok,
                       image_root=tmp_path / "root", progress=False, **kw)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case, says", [
    ("dotdot", "image file '../outside.png' leads out of image_root "),
    ("absolute", "is an absolute path outside image_root "),
    ("symlink out", "image file 'link.png' leads through a symlink out of image_root "),
    ("symlink to /dev/zero", "image file 'link.png' leads through a symlink out of image_root "),
    ("/dev/zero", "image file '/dev/zero' is an absolute path outside image_root "),
    ("fifo", "image file 'pipe.png' is not a regular file"),
])
def test_media_paths_must_stay_inside_their_root(rooted, mini_tok, case, says) -> None:
    root = rooted / "root"
    path = {"dotdot": "../outside.png", "absolute": str(rooted / "outside.png"), "symlink out": "link.png",
            "symlink to /dev/zero": "link.png", "/dev/zero": "/dev/zero", "fifo": "pipe.png"}[case]
    if case == "symlink out":
        (root / "link.png").symlink_to(rooted / "outside.png")
    if case == "symlink to /dev/zero":
        (root / "link.png").symlink_to("/dev/zero")
    if case == "fifo":
        os.mkfifo(root / "pipe.png")  # opening it for reading would wait for a writer forever
    r = convert_one(rooted, path, mini_tok)
    assert r.skipped_ids == {"unsafe path": ["x"]} and r.samples == 1
    assert says in r.skips.examples[0]
    with tarfile.open(rooted / "o" / "train-000000.tar") as tar:
        assert tar.getnames() == ["ok.json", "ok.0.png"]
    with pytest.raises(SampleError, match="in.json sample x: unsafe path: "):
        convert_one(rooted, path, mini_tok, on_error="raise")


def test_allow_outside_roots_reads_outside_files_but_never_devices(rooted, mini_tok) -> None:
    r = convert_one(rooted, "../outside.png", mini_tok, allow_outside_roots=True)
    assert r.samples == 2 and not r.skipped_ids
    r = convert_one(rooted, "/dev/zero", mini_tok, allow_outside_roots=True)
    assert r.skipped_ids == {"unsafe path": ["x"]} and "is not a regular file" in r.skips.examples[0]


def test_a_file_over_max_member_mb_is_refused(rooted, mini_tok) -> None:
    big = rooted / "root" / "big.png"
    big.write_bytes((rooted / "root" / "in.png").read_bytes())
    os.truncate(big, 64 * 2**30)  # sparse: 64 GB that must not be read whole
    r = convert_one(rooted, "big.png", mini_tok, limits=MediaLimits(max_member_bytes=2**20))
    assert r.skipped_ids == {"media too large": ["x"]}
    assert "image file 'big.png' is larger than data.max_member_mb=1" in r.skips.examples[0]


# ---------------------------------------------------------------------------- input shapes and formats

def test_onevision_sharegpt_and_messages_shapes(tmp_path, mini_tok, tiny_spec) -> None:
    write_png(tmp_path / "a.png", 40, 64)
    write_png(tmp_path / "b.jpg", 48, 32, "JPEG")
    x = (0.3 * np.sin(np.arange(12000) / 5)).astype(np.float32)
    soundfile.write(tmp_path / "tone.flac", x, 8000, subtype="PCM_24")
    soundfile.write(tmp_path / "float.wav", x, 16000, subtype="FLOAT")
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731
    items = [
        {"id": "ov", "image": ["a.png", "b.jpg"],  # LLaVA-OneVision multi-image
         "conversations": turn("<image>\n<image>\nSame shape?", "no")},
        {"id": "m1", "images": ["b.jpg"],  # messages with typed parts, paths at the top
         "messages": [user({"type": "image"}, {"type": "text", "text": "Colour?"}),
                      {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]},
        {"id": "m2", "messages": [user({"type": "image", "path": "a.png"}, {"type": "audio", "path": "tone.flac"},
                                       {"type": "text", "text": "What?"}),
                                  {"role": "assistant", "content": "a tone"}]},
        {"id": "sg", "audio": "float.wav",  # ShareGPT user/assistant speakers
         "conversations": [{"from": "user", "value": "<audio>\nLoud?"}, {"from": "assistant", "value": "no"}]},
        {"id": "sys", "messages": [{"role": "system", "content": "Be brief."}, user({"type": "text", "text": "Hi"}),
                                   {"role": "assistant", "content": "Hi"}]},
        {"id": "twice", "images": ["a.png"], "messages": [user({"type": "image", "path": "a.png"}),
                                                          {"role": "assistant", "content": "x"}]},
        {"id": "neither", "image": "a.png"},
    ]
    (tmp_path / "in.json").write_text(json.dumps(items))
    r = convert(json_path=tmp_path / "in.json", out=tmp_path / "o", tokenizer=mini_tok, spec=tiny_spec,
                progress=False)
    assert r.skipped_ids == {"bad conversation": ["sys", "twice", "neither"]}
    got = {s.key: s for s in SampleStream(path=r.path, tokenizer=mini_tok, spec=tiny_spec, epochs=1,
                                          on_error="raise")}
    assert list(got) == ["ov", "m1", "m2", "sg"]
    assert got["ov"].meta.images == ((40, 64), (48, 32))
    assert got["m1"].meta.images == ((48, 32),)
    assert got["m2"].modality == "image+audio" and got["m2"].meta.audio_seconds == (1.5,)
    assert got["sg"].meta.audio_seconds == (0.75,)
    with tarfile.open(tmp_path / "o" / "train-000000.tar") as tar:
        names = tar.getnames()
        m2 = json.loads(tar.extractfile("m2.json").read())
        assert tar.extractfile("m2.0.flac").read() == (tmp_path / "tone.flac").read_bytes()  # stored as it is
        assert tar.extractfile("sg.0.wav").read() == (tmp_path / "float.wav").read_bytes()
    assert "m2.0.flac" in names and "sg.0.wav" in names
    assert m2["conversations"] == [{"from": "human", "value": "<image>\n<audio>\nWhat?"},
                                   {"from": "gpt", "value": "a tone"}]


def test_llava_video_entries_become_container_members_with_their_header_meta(tmp_path, mini_tok, tiny_spec) -> None:
    """LLaVA-Video entries (`"video": "clip.mp4"`, `<video>` in the text) under shards.video_root: the
    container is stored as it is, its meta read from the header, confined to the root like images."""
    from mmpipe.data.synth_video import write_mp4
    from mmpipe.data.video import probe_video
    from mmpipe.model.geometry import features, video_meta_from_json

    vids = tmp_path / "videos"
    vids.mkdir()
    rng = np.random.default_rng(0)
    good = write_mp4([rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(9)], 6,
                     np.sin(np.arange(12000) / 4.0) * 0.3)
    (vids / "a.mp4").write_bytes(good)
    (vids / "garbage.mp4").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "outside.mp4").write_bytes(good)
    items = [
        {"id": "v1", "video": "a.mp4", "conversations": turn("<video>\nWhat moves?", "a red square")},
        {"id": "v2", "video": "a.mp4", "conversations": turn("What moves?", "a red square")},  # placeholder added
        {"id": "v3", "messages": [{"role": "user", "content": [{"type": "video", "path": "a.mp4"},
                                                               {"type": "text", "text": "What moves?"}]},
                                  {"role": "assistant", "content": "a square"}]},
        {"id": "bad-garbage", "video": "garbage.mp4", "conversations": turn("<video>\nWhat?", "x")},
        {"id": "bad-outside", "video": "../outside.mp4", "conversations": turn("<video>\nWhat?", "x")},
        {"id": "bad-count", "video": "a.mp4", "conversations": turn("<video>\n<video>\nWhat?", "x")},
    ]
    (tmp_path / "v.json").write_text(json.dumps(items))
    report = convert(json_path=tmp_path / "v.json", out=tmp_path / "out", tokenizer=mini_tok, spec=tiny_spec,
                     video_root=vids, progress=False)
    assert report.skips.as_dict() == {"undecodable video": 1, "unsafe path": 1, "placeholder mismatch": 1}
    assert report.skipped_ids["unsafe path"] == ["bad-outside"] and report.prepended == 1
    assert report.index["by_modality"]["video"]["videos"] == 3
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members["v1.0.mp4"] == good  # the container as it is
    meta = json.loads(members["v2.json"])["meta"]
    assert json.loads(members["v2.json"])["conversations"][0]["value"] == "<video>\nWhat moves?"
    assert video_meta_from_json(meta["videos"][0]) == probe_video(good)
    assert meta["videos"][0]["audio"] == {"seconds": pytest.approx(1.5), "rate": 8000}
    s = SampleStream(path=str(tmp_path / "out" / "train-000000.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1)
    got = list(s)
    assert [x.key for x in got] == ["v1", "v2", "v3"] and s.skips.total == 0
    for x in got:
        assert x.input_ids.count(mini_tok.video_id) == sum(features(tiny_spec, x.meta).video_tokens) > 0
        assert x.videos[0].frames.shape == (6, 48, 64, 3)  # 9 frames at 6 fps, 4 a second: 6 picked
