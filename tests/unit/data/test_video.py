"""Video clips: the header figures PyAV reads without decoding, the frames decoded (only the planned
ones, equal to transformers' own PyAV reader's), and hostile containers as counted skips, never a
crash or a hang."""

from __future__ import annotations

import json
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

from mmpipe.data import video as V
from mmpipe.data.media import MediaLimits
from mmpipe.data.reader import SampleStream
from mmpipe.data.records import make_record
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.data.synth import write_shard
from mmpipe.data.synth_video import write_mp4
from mmpipe.model.geometry import VideoMeta, video_frame_indices

from .helpers import js


def frames(n: int, h: int = 48, w: int = 64, seed: int = 0) -> list[np.ndarray]:
    """Frames that differ from each other everywhere (a wrong order or index shows)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return [np.roll(base, 7 * i, axis=1) for i in range(n)]


def clip(n: int = 16, fps: int = 8, h: int = 48, w: int = 64, tone: bool = False) -> bytes:
    t = np.sin(np.arange(n * 8000 // fps) / 5.0) * 0.3 if tone else None
    return write_mp4(frames(n, h, w), fps, t)


def faststart(data: bytes, tmp_path: Path) -> bytes:
    """The same clip with its index (moov) before the data, as streaming MP4s have it."""
    import av

    src, dst = tmp_path / "in.mp4", tmp_path / "fast.mp4"
    src.write_bytes(data)
    with av.open(str(src)) as i, av.open(str(dst), "w", format="mp4", options={"movflags": "+faststart"}) as o:
        s = o.add_stream_from_template(i.streams.video[0])
        for p in i.demux(i.streams.video[0]):
            if p.dts is not None:
                p.stream = s
                o.mux(p)
    return dst.read_bytes()


def stts(data: bytes, *, count: int | None = None, delta: int | None = None) -> bytes:
    """The clip with its sample-time table's first entry rewritten: `count` frames of `delta` ticks
    (what the header then declares: frame count, duration, frame rate)."""
    i = data.find(b"stts")
    head = data[:i + 12]
    c, d = struct.unpack(">II", data[i + 12:i + 20])
    return head + struct.pack(">II", c if count is None else count, d if delta is None else delta) + data[i + 20:]


def test_the_header_gives_frames_rate_size_and_audio_without_decoding():
    assert V.probe_video(clip(16, 8, 48, 64)) == VideoMeta(frames=16, fps=8.0, height=48, width=64)
    with_tone = V.probe_video(clip(12, 6, 32, 40, tone=True))
    assert (with_tone.frames, with_tone.fps, with_tone.seconds) == (12, 6.0, 2.0)
    assert with_tone.has_audio and with_tone.audio_rate == 8000 and with_tone.audio_seconds == pytest.approx(2.0)


def test_only_the_planned_frames_are_decoded_and_they_are_transformers_frames(tmp_path, monkeypatch):
    from transformers.video_utils import load_video

    data = clip(24, 8)
    path = tmp_path / "c.mp4"
    path.write_bytes(data)
    meta = V.probe_video(data)
    for indices in ((0, 3, 6, 9), (1, 2, 23), tuple(range(24))):
        theirs, their_meta = load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: indices)
        ours = V.decode_frames(data, indices, meta)
        assert ours.dtype == np.uint8 and np.array_equal(ours, theirs), indices
        assert (their_meta.total_num_frames, their_meta.fps, their_meta.height, their_meta.width) == (
            meta.frames, meta.fps, meta.height, meta.width)
    converted = []
    from av.video import reformatter  # decode_frames makes one converter per clip from this class

    real = reformatter.VideoReformatter

    class Counting:
        def __init__(self):
            self.inner = real()

        def reformat(self, frame, **kw):
            converted.append(frame.pts)
            return self.inner.reformat(frame, **kw)

    monkeypatch.setattr(reformatter, "VideoReformatter", Counting)
    V.decode_frames(data, (2, 5), meta)
    assert len(converted) == 2  # frames not picked are decoded past, never converted, and none after the last


def test_tiny_frames_are_resized_like_images_and_padded_to_whole_temporal_patches(tiny_spec):
    from dataclasses import replace

    v = replace(tiny_spec.vision, video=replace(tiny_spec.vision.video, sample="all"))
    data = clip(5, 5, 40, 56)
    out = V.decode_video(data, v, V.probe_video(data))
    assert out.frames.shape == (6, 32, 64, 3)  # 40 x 56 -> 32 x 64 (multiples of 16); 5 frames + 1 repeated
    assert np.array_equal(out.frames[5], out.frames[4]) and not np.array_equal(out.frames[4], out.frames[3])
    picked = video_frame_indices(tiny_spec.vision.video, 16, 8.0)
    assert picked == (0, 2, 4, 6, 8, 10, 12, 14)  # 4 frames a second of a 2 s clip at 8 fps


@pytest.fixture
def deadline():
    def expired(*_):
        raise TimeoutError("reading the hostile clips took more than 60 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def hostile(tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    good = clip(16, 8)
    return {  # key: (reason, the KEY.0.mp4 member)
        "cut": ("undecodable video", good[:len(good) // 2]),  # the index (at the end) is lost
        "cutdata": ("undecodable video", faststart(good, tmp_path)[:len(good) // 2]),  # header whole, frames missing
        "garbage": ("undecodable video", bytes(range(256)) * 20),
        "empty": ("undecodable video", b""),
        "audioonly": ("undecodable video", audio_only()),
        "noframes": ("undecodable video", stts(good, count=0)),
        "billion": ("media too large", stts(good, count=10**9)),  # data.max_video_frames
        "eons": ("media too large", stts(good, delta=2**31 - 1)),  # 16 frames of 36 hours: max_video_seconds
        "oneframe": ("undecodable video", clip(1, 8)),  # too short for one temporal patch of the frame rule
        "huge": ("media too large", clip(4, 4, 64, 128)),  # 8192 pixels per frame > max_image_pixels below
    }


def audio_only() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        a = c.add_stream("aac", rate=8000, layout="mono")
        f = av.AudioFrame.from_ndarray(np.zeros((1, 8000), np.float32), format="fltp", layout="mono")
        f.sample_rate = 8000
        for p in [*a.encode(f), *a.encode()]:
            c.mux(p)
    return buf.getvalue()


LIMITS = MediaLimits(max_image_pixels=5000)


def test_hostile_clips_are_counted_skips_naming_shard_and_key(tmp_path, mini_tok, tiny_spec, deadline, capsys):
    cases = hostile(tmp_path)
    members = [m for k, (_, data) in cases.items() for m in (js(k, "<video>\nWhat moves?", "a shape"),
                                                              (f"{k}.0.mp4", data))]
    members += [js("zgood", "<video>\nWhat moves?", "a shape"), ("zgood.0.mp4", clip(16, 8))]
    write_shard(tmp_path / "v-0.tar", members)
    s = SampleStream(path=str(tmp_path / "v-0.tar"), tokenizer=mini_tok, spec=tiny_spec, epochs=1, limits=LIMITS,
                     skips=SkipCounter.for_run(tmp_path, dp_rank=0))
    kept = list(s)
    assert [x.key for x in kept] == ["zgood"] and kept[0].videos[0].frames.shape == (8, 48, 64, 3)
    journal = {j["key"]: j for j in map(json.loads, (tmp_path / "skips.jsonl").read_text().splitlines())}
    assert {k: (j["reason"], j["shard"]) for k, j in journal.items()} == {
        k: (reason, "v-0.tar") for k, (reason, _) in cases.items()}
    assert "data.max_video_frames=36,000" in journal["billion"]["detail"]
    assert "data.max_video_seconds=1200" in journal["eons"]["detail"]
    assert "data.max_image_pixels=5,000" in journal["huge"]["detail"]
    assert "no video stream" in journal["audioonly"]["detail"]
    assert "declares no frames" in journal["noframes"]["detail"]
    assert "the data ends after" in journal["cutdata"]["detail"]  # found only by decoding: the header is whole
    assert "too short for one temporal patch" in journal["oneframe"]["detail"]


def test_limits_and_broken_headers_are_found_before_any_frame_is_decoded(tmp_path, mini_tok, tiny_spec, monkeypatch):
    def never(*_a, **_k):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(V, "decode_frames", never)
    for key, (reason, data) in hostile(tmp_path).items():
        if key == "cutdata":
            continue  # its header is whole: only decoding finds the missing frames
        raw = {"json": js(key, "<video>\nWhat moves?", "x")[1], "0.mp4": data, "__key__": key, "__url__": "v.tar"}
        with pytest.raises(SampleError) as err:
            make_record(raw, mini_tok, tiny_spec, limits=LIMITS)
        assert err.value.reason == reason, key
    with pytest.raises(ValueError, match=r"data\.max_video_seconds=0 must be > 0"):
        MediaLimits(max_video_seconds=0)


def test_hostile_clips_are_counted_skips_for_a_transformers_checkpoint(tmp_path, hf_checkpoints, deadline):
    """The same hostile shard read for LLaVA-OneVision (its folder's tokenizer, chat template and
    video processor, set to sample 8 frames a clip as the 7B preset samples 32): every clip is the
    same counted skip naming shard and key; the one-frame clip is refused by OneVision's own frame
    rule (8 frames asked of 1), the truncated data by the decode that feeds its video processor;
    the good clip reaches the model as the processor's 8 frames."""
    import shutil

    from mmpipe.data.chat import templater_for
    from mmpipe.model.hf.arch import spec_from_folder

    folder = tmp_path / "ov"
    shutil.copytree(hf_checkpoints["llava-onevision"], folder)
    proc = json.loads((folder / "processor_config.json").read_text())
    proc["video_processor"] |= {"do_sample_frames": True, "num_frames": 8}
    (folder / "processor_config.json").write_text(json.dumps(proc))
    spec = spec_from_folder(folder)
    tok = templater_for(folder, spec, key="model.path")
    cases = hostile(tmp_path)
    members = [m for k, (_, data) in cases.items() for m in (js(k, "<video>\nWhat moves?", "a shape"),
                                                              (f"{k}.0.mp4", data))]
    members += [js("zgood", "<video>\nWhat moves?", "a shape"), ("zgood.0.mp4", clip(16, 8))]
    write_shard(tmp_path / "v-0.tar", members)
    s = SampleStream(path=str(tmp_path / "v-0.tar"), tokenizer=tok, spec=spec, epochs=1, limits=LIMITS,
                     skips=SkipCounter.for_run(tmp_path, dp_rank=0))
    kept = list(s)
    side = spec.vision.image_size
    assert [x.key for x in kept] == ["zgood"]
    assert kept[0].videos[0].grid[0] == 8 and kept[0].videos[0].pixels.shape == (8, 3, side, side)
    journal = {j["key"]: j for j in map(json.loads, (tmp_path / "skips.jsonl").read_text().splitlines())}
    assert {k: (j["reason"], j["shard"]) for k, j in journal.items()} == {
        k: (reason, "v-0.tar") for k, (reason, _) in cases.items()}
    assert "data.max_video_frames=36,000" in journal["billion"]["detail"]
    assert "data.max_video_seconds=1200" in journal["eons"]["detail"]
    assert "no video stream" in journal["audioonly"]["detail"]
    assert "declares no frames" in journal["noframes"]["detail"]
    assert "the data ends after" in journal["cutdata"]["detail"]
    assert "8 frames cannot be sampled from a clip of 1" in journal["oneframe"]["detail"]


def test_an_audio_track_decodes_whole_and_a_bad_one_is_a_counted_reason():
    """Omni's use_audio_in_video reads a clip's tone track: the waveform the clip was written with
    (AAC-coded: close, not equal), at its rate, at least as long as the header says; a clip without
    audio, garbage and a cut container are `undecodable video` SampleErrors, not PyAV exceptions."""
    good = clip(16, 8, tone=True)
    meta = V.probe_video(good)
    wave, rate = V.decode_audio_track(good)
    assert rate == meta.audio_rate == 8000 and len(wave) >= round(meta.audio_seconds * rate)
    tone = np.sin(np.arange(16 * 8000 // 8) / 5.0) * 0.3
    mid = slice(2000, 14000)  # away from the codec's edges
    assert np.corrcoef(wave[mid], tone[mid])[0, 1] > 0.95
    for data, why in ((clip(16, 8), "no audio track"), (bytes(range(256)) * 20, ""), (good[:len(good) // 2], "")):
        with pytest.raises(SampleError) as err:
            V.decode_audio_track(data)
        assert err.value.reason == "undecodable video" and why in str(err.value), str(err.value)
