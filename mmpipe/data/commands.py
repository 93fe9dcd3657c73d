"""Entry points of the data commands (`mmpipe shards convert`, `mmpipe bench-data`).

The CLI parses its arguments into these typed keyword arguments; nothing here sees a
Hydra config.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmpipe.paths import override_hint
from mmpipe.data.chat import templater_for
from mmpipe.data.convert import convert
from mmpipe.data.media import DEFAULT_LIMITS, MediaLimits
from mmpipe.data.skips import SampleError
from mmpipe.data.tokenizer import check_vocab, load_tokenizer
from mmpipe.model.spec import ModelSpec


def run_convert(*, json_path: str, out: str, tokenizer: str, model: ModelSpec, image_root: str | None,
                audio_root: str | None, maxcount: int, maxsize_mb: float | None, on_error: str,
                prefix: str = "train", progress: bool | None = None, limits: MediaLimits = DEFAULT_LIMITS,
                allow_outside_roots: bool = False, video_root: str | None = None) -> int:
    """Convert a LLaVA-style JSON into shards; prints the report. Returns the exit status
    (0; 1 when on_error=raise stopped at a bad sample or nothing was written). `tokenizer`: mmpipe's
    tokenizer.json, or a Hugging Face checkpoint folder (its chat template counts the text)."""
    tok = templater_for(tokenizer, model) if Path(tokenizer).is_dir() else load_tokenizer(tokenizer)
    check_vocab(tok, model.llm.vocab)
    try:
        report = convert(json_path=json_path, out=out, tokenizer=tok, spec=model, image_root=image_root,
                         audio_root=audio_root, maxcount=maxcount, maxsize_mb=maxsize_mb, on_error=on_error,
                         prefix=prefix, progress=sys.stderr.isatty() if progress is None else progress,
                         limits=limits, allow_outside_roots=allow_outside_roots, video_root=video_root)
    except SampleError as err:
        print(f"mmpipe shards: error: {err} (data.on_error=raise; use skip to leave such samples out)",
              file=sys.stderr)
        return 1
    print(report.summary())
    if not report.samples:
        print("mmpipe shards: error: no sample was written", file=sys.stderr)
        return 1
    lens = report.index.get("model", {})
    if lens.get("over_max_seq_len"):
        print(f"  {lens['over_max_seq_len']} sample(s) exceed model.llm.max_seq_len={model.llm.max_seq_len} "
              f"(data.too_long decides: drop or truncate)")
    print(f"  train on it: mmpipe train {override_hint('data.path', str(report.path))} "
          f"{override_hint('data.tokenizer', str(tokenizer))}")
    return 0


def run_bench_data(*, path: str, tokenizer: str, model: ModelSpec, samples: int, generated: int = 5000,
                   root: str | None = None) -> int:
    """Reader throughput on `path` and on a generated set (see mmpipe.data.bench). Returns 0."""
    from mmpipe.data.bench import bench

    tok = load_tokenizer(tokenizer)
    check_vocab(tok, model.llm.vocab)
    bench(path=path, tok=tok, spec=model, samples=samples, generated=generated,
          root=Path(root) if root else None)
    return 0
