"""Reader throughput: samples/s and MB/s of one worker, metadata-only against full decoding.

Modes, each over the same first N samples of a shard list, in one process (= one loader
worker):

- meta: `iter_meta`, the .json members only (media bytes are seeked past; img2dataset
  caption samples also read the caption and the image, for its header) — what planning
  ahead needs;
- records: `SampleStream.records()`: JSON, conversation, image/WAV headers, tokenization
  and the template, media still bytes;
- last stage: records + `decode_record(media=False)`;
- full: records + decoded, resized images and log-mel features (what the first stage does).

MB/s counts the tar member bytes of the samples read.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from mmpipe.data.reader import SampleStream, iter_meta
from mmpipe.data.records import decode_record
from mmpipe.data.tokenizer import Tokenizer
from mmpipe.model.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Rate:
    """One measured mode."""

    mode: str
    samples: int
    seconds: float
    megabytes: float

    @property
    def per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else float("inf")

    @property
    def mb_per_s(self) -> float:
        return self.megabytes / self.seconds if self.seconds else float("inf")


def _timed(mode: str, items: Iterator, n: int, size: Callable[[object], int]) -> Rate:
    t0 = time.perf_counter()
    count = total = 0
    for x in itertools.islice(items, n):
        count += 1
        total += size(x)
    return Rate(mode=mode, samples=count, seconds=time.perf_counter() - t0, megabytes=total / 2**20)


def _raw_bytes(raw: dict) -> int:
    return sum(len(v) for k, v in raw.items() if not k.startswith("__") and isinstance(v, bytes))


def measure(path: str, tok: Tokenizer, spec: ModelSpec, samples: int, *, root: Path | None = None) -> list[Rate]:
    """The four modes over the first `samples` samples of `path` (one pass, stream order)."""
    def stream() -> SampleStream:
        return SampleStream(path=path, tokenizer=tok, spec=spec, epochs=1, root=root)

    sizes: dict[str, int] = {}

    def rec_size(r) -> int:
        sizes[r.key] = _raw_bytes(r.raw)
        return sizes[r.key]

    rates = [_timed("records", stream().records(), samples, rec_size)]
    rates.insert(0, _timed("meta", iter_meta(path=path, root=root, spec=spec, tokenizer=tok), samples,
                           lambda km: sizes.get(km[0], 0)))
    rates.append(_timed("last stage", (decode_record(r, tok, spec, media=False) for r in stream().records()),
                        samples, lambda s: sizes.get(s.key, 0)))
    rates.append(_timed("full", (decode_record(r, tok, spec) for r in stream().records()), samples,
                        lambda s: sizes.get(s.key, 0)))
    return rates


def table(title: str, rates: list[Rate]) -> str:
    full = next(r for r in rates if r.mode == "full")
    lines = [title, f"  {'mode':<11} {'samples':>8} {'seconds':>8} {'samples/s':>10} {'MB/s':>8} {'x full':>7}"]
    for r in rates:
        lines.append(f"  {r.mode:<11} {r.samples:>8} {r.seconds:>8.2f} {r.per_s:>10.0f} {r.mb_per_s:>8.1f} "
                     f"{r.per_s / full.per_s:>7.1f}")
    return "\n".join(lines)


def bench(*, path: str, tok: Tokenizer, spec: ModelSpec, samples: int, generated: int = 5000,
          root: Path | None = None, echo: Callable[[str], None] = print) -> dict[str, list[Rate]]:
    """Measure `path`, then a generated set of `generated` samples (0: skip); print tables."""
    out = {}
    rates = measure(path, tok, spec, samples, root=root)
    echo(table(f"{path} (first {rates[0].samples} samples, one worker)", rates))
    out["given"] = rates
    if generated:
        from mmpipe.data.synth import SynthConfig, generate
        from mmpipe.data.tokenizer import load_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            generate(SynthConfig(out=Path(tmp), samples=generated, shards=16, seed=1, video_samples=0))
            gen_s = time.perf_counter() - t0
            gtok = load_tokenizer(Path(tmp) / "tokenizer.json")
            gpath = str(Path(tmp) / "shards" / "train-{000000..000015}.tar")
            rates = measure(gpath, gtok, spec, generated)
            echo(table(f"generated set: {generated} samples in 16 shards (made in {gen_s:.1f} s), one worker", rates))
            out["generated"] = rates
    for name, rs in out.items():
        meta, full = rs[0], rs[-1]
        ratio = meta.per_s / full.per_s
        echo(f"{name}: metadata-only reading is {ratio:.0f}x faster than full decoding"
             + ("" if ratio >= 10 else " (below the 10x target)"))
    return out
