"""Regenerate the shipped synthetic multimodal dataset and its tokenizer, byte for byte.

    python -m mmpipe.data.synth --out data/ [--samples 2000] [--seed 0] [--shards 8]
        [--video-samples 256] [--video-shards 8]

Writes `OUT/shards/train-000000.tar ...` (webdataset shards: KEY.json, KEY.0.png, ...,
KEY.0.wav, ...), the video mix `OUT/shards/video-000000.tar ...` (moving-shape clips,
KEY.0.mp4, interleaved with image and text samples), `OUT/shards/index.json` (counts per shard
and by modality) and `OUT/tokenizer.json` (byte-level BPE trained on the train set's
conversations; the video set's text is tokenized by it, not trained on, so adding the video set
left the train shards as they were). The same arguments always give identical files: every
sample draws from its own seeded rng, tar members are written in sorted order with fixed mtime,
owner and mode, and the clips are encoded bit-exactly (mmpipe.data.synth_video).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from mmpipe.data.synth_tasks import (
    Draft, audio_task, image_audio_task, image_task, multi_image_task, text_task,
)
from mmpipe.data.synth_video import video_task
from mmpipe.data.template import PLACEHOLDER, text_tokens
from mmpipe.data.tokenizer import DEFAULT_VOCAB, Tokenizer, build_tokenizer
from mmpipe.model.geometry import modality_name, video_meta_json

TASKS: tuple[tuple[str, Callable[[random.Random], Draft], float], ...] = (
    ("text", text_task, 0.38),
    ("image", image_task, 0.32),
    ("multi-image", multi_image_task, 0.10),
    ("audio", audio_task, 0.16),
    ("image+audio", image_audio_task, 0.04),
)
"""(name, generator, share of the samples)."""

DEFAULT_SAMPLES = 2000
"""Samples of the shipped set."""

VIDEO_CYCLE: tuple[str, ...] = ("video", "text", "image", "video", "audio", "video", "text")
"""Tasks of the video mix, in turn (3 clips in 7 samples). Sample i goes to video shard i % 8,
and 7 is prime to 8, so every shard, and every run of a few samples in it, mixes them."""
DEFAULT_VIDEO_SAMPLES = 256
"""Samples of the shipped video mix."""

MAX_TEXT_TOKENS = 960
"""No generated conversation is longer (the tiny model's max_seq_len is 1024)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SynthConfig:
    """What to generate."""

    out: Path
    """Output folder (shards/ and tokenizer.json go inside)."""
    samples: int = DEFAULT_SAMPLES
    """Samples in all shards together."""
    seed: int = 0
    """Seeds every sample's content."""
    shards: int = 8
    """Shard files (sample i goes to shard i % shards)."""
    vocab: int = DEFAULT_VOCAB
    """Tokenizer vocabulary bound."""
    video_samples: int = DEFAULT_VIDEO_SAMPLES
    """Samples of the video mix (0: no video set)."""
    video_shards: int = 8
    """Shard files of the video mix (video-000000.tar ...)."""

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"--shards={self.shards} must be >= 1")
        if self.samples < self.shards:
            raise ValueError(f"--samples={self.samples} must be >= --shards={self.shards} (no empty shard)")
        if self.video_samples and (self.video_shards < 1 or self.video_samples < self.video_shards):
            raise ValueError(f"--video-samples={self.video_samples} must be 0 or >= --video-shards="
                             f"{self.video_shards} >= 1 (no empty shard)")


def plan_tasks(n: int, seed: int) -> list[str]:
    """The task of each sample: shares rounded to counts, then shuffled by the seed."""
    counts = [int(n * share) for _, _, share in TASKS]
    counts[0] += n - sum(counts)
    names = [name for (name, _, _), c in zip(TASKS, counts) for _ in range(c)]
    random.Random(f"tasks:{seed}").shuffle(names)
    return names


def make_drafts(n: int, seed: int) -> list[Draft]:
    makers = {name: fn for name, fn, _ in TASKS}
    return [makers[name](random.Random(f"sample:{seed}:{i}")) for i, name in enumerate(plan_tasks(n, seed))]


def make_video_drafts(n: int, seed: int) -> list[Draft]:
    """The video mix: VIDEO_CYCLE's tasks in turn, each sample from its own seeded rng."""
    makers = {"video": video_task, "text": text_task, "image": image_task, "audio": audio_task}
    return [makers[VIDEO_CYCLE[i % len(VIDEO_CYCLE)]](random.Random(f"video-sample:{seed}:{i}")) for i in range(n)]


def corpus(drafts: Sequence[Draft]) -> list[str]:
    """Conversation text for tokenizer training, placeholders taken out (they are specials)."""
    return [piece for d in drafts for t in d.conversations for piece in PLACEHOLDER.split(t["value"])
            if piece and not PLACEHOLDER.fullmatch(piece)]


def sample_json(key: str, d: Draft, tok: Tokenizer) -> dict:
    n_text = text_tokens(d.conversations, tok)
    if n_text > MAX_TEXT_TOKENS:
        raise RuntimeError(f"synthetic sample {key} ({d.task}) has {n_text} text tokens > {MAX_TEXT_TOKENS}")
    meta = {
        "text_tokens": n_text,
        "images": [[h, w] for h, w in d.image_sizes],
        "audio_seconds": list(d.audio_seconds),
    }
    if d.videos:
        meta["videos"] = [video_meta_json(m) for m in d.video_meta]
    return {"id": key, "task": d.task, "conversations": d.conversations, "meta": meta}


def modality(d: Draft) -> str:
    return modality_name(bool(d.images), bool(d.audio), bool(d.videos))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar with the given members in sorted order and fixed metadata (byte-reproducible)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in sorted(members):
            _add(tar, name, data)
    path.write_bytes(buf.getvalue())


def members_of(key: str, d: Draft, tok: Tokenizer) -> list[tuple[str, bytes]]:
    js = json.dumps(sample_json(key, d, tok), ensure_ascii=False, separators=(",", ":"))
    out = [(f"{key}.json", js.encode("utf-8"))]
    out += [(f"{key}.{i}.png", b) for i, b in enumerate(d.images)]
    out += [(f"{key}.{i}.wav", b) for i, b in enumerate(d.audio)]
    out += [(f"{key}.{i}.mp4", b) for i, b in enumerate(d.videos)]
    return out


def _write_set(shard_dir: Path, prefix: str, key: str, drafts: Sequence[Draft], n_shards: int, tok: Tokenizer,
               totals: dict) -> list[dict]:
    """Write one set's shards (sample i to shard i % n_shards, key `{key}{i:06d}`); returns their
    index entries and adds to `totals`."""
    shards = []
    for s in range(n_shards):
        members: list[tuple[str, bytes]] = []
        by_mod: Counter[str] = Counter()
        for i in range(s, len(drafts), n_shards):
            d = drafts[i]
            entries = members_of(f"{key}{i:06d}", d, tok)
            members += entries
            totals["lens"].append(json.loads(entries[0][1])["meta"]["text_tokens"])
            by_mod[modality(d)] += 1
            totals["tasks"][d.task] += 1
            totals["images"] += len(d.images)
            totals["clips"] += len(d.audio)
            totals["seconds"] += sum(d.audio_seconds)
            totals["videos"] += len(d.videos)
            totals["video_frames"] += sum(m.frames for m in d.video_meta)
            totals["video_seconds"] += sum(m.seconds for m in d.video_meta)
        name = f"{prefix}-{s:06d}.tar"
        write_shard(shard_dir / name, members)
        shards.append({"file": name, "samples": sum(by_mod.values()), "by_modality": dict(sorted(by_mod.items()))})
        totals["modality"].update(by_mod)
    return shards


def generate(cfg: SynthConfig) -> dict:
    """Write the dataset and tokenizer; returns the index (also written as shards/index.json)."""
    drafts = make_drafts(cfg.samples, cfg.seed)
    tok = build_tokenizer(corpus(drafts), vocab_size=cfg.vocab)
    shard_dir = cfg.out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    tok.save(cfg.out / "tokenizer.json")

    totals: dict = {"lens": [], "tasks": Counter(), "modality": Counter(), "images": 0, "clips": 0, "seconds": 0.0,
                    "videos": 0, "video_frames": 0, "video_seconds": 0.0}
    shards = _write_set(shard_dir, "train", "s", drafts, cfg.shards, tok, totals)
    paths = {"train": f"train-{{000000..{cfg.shards - 1:06d}}}.tar"}
    if cfg.video_samples:
        video = make_video_drafts(cfg.video_samples, cfg.seed)
        shards += _write_set(shard_dir, "video", "v", video, cfg.video_shards, tok, totals)
        paths["video"] = f"video-{{000000..{cfg.video_shards - 1:06d}}}.tar"
    lens = totals["lens"]
    index = {
        "version": 1,
        "generator": "python -m mmpipe.data.synth",
        "seed": cfg.seed,
        "samples": cfg.samples + cfg.video_samples,
        "sets": {name: {"path": path, "samples": n} for (name, path), n in
                 zip(paths.items(), (cfg.samples, cfg.video_samples))},
        "shards": shards,
        "by_modality": dict(sorted(totals["modality"].items())),
        "by_task": dict(sorted(totals["tasks"].items())),
        "images": totals["images"],
        "audio_clips": totals["clips"],
        "audio_seconds": round(totals["seconds"], 3),
        "videos": totals["videos"],
        "video_frames": totals["video_frames"],
        "video_seconds": round(totals["video_seconds"], 3),
        "text_tokens": {"min": min(lens), "mean": round(sum(lens) / len(lens), 1), "max": max(lens),
                        "total": sum(lens)},
        "tokenizer": {"file": "tokenizer.json", "vocab_size": tok.vocab_size},
    }
    (shard_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mmpipe.data.synth", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("data"), help="output folder (default: data)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples in total")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--video-samples", type=int, default=DEFAULT_VIDEO_SAMPLES, help="samples of the video mix (0: none)")
    p.add_argument("--video-shards", type=int, default=8)
    args = p.parse_args(argv)
    cfg = SynthConfig(out=args.out, samples=args.samples, seed=args.seed, shards=args.shards,
                      video_samples=args.video_samples, video_shards=args.video_shards)
    index = generate(cfg)
    mods = ", ".join(f"{v} {k}" for k, v in index["by_modality"].items())
    t = index["text_tokens"]
    print(f"wrote {index['samples']} samples in {len(index['shards'])} shards to {cfg.out / 'shards'}: {mods}")
    print(f"  {index['images']} images, {index['audio_clips']} audio clips ({index['audio_seconds']:.0f} s), "
          f"{index['videos']} videos ({index['video_frames']} frames, {index['video_seconds']:.0f} s), "
          f"text tokens min {t['min']} / mean {t['mean']} / max {t['max']}")
    print(f"  tokenizer {cfg.out / 'tokenizer.json'}: {index['tokenizer']['vocab_size']} entries")


if __name__ == "__main__":
    main()
