"""What a plan reads: a workload trace (one JSON object per line, one line per sample, docs/spec.md
section 1), or shard metadata handed in by the command line (the planner imports no data
package), as each sample's features."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmpipe.model.geometry import SampleFeatures, SampleMeta, features, meta_from_json
from mmpipe.model.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInput:
    """What `mmpipe plan` reads: a trace or shard metadata, and how many of its steps."""

    trace_path: str | None = None
    """A JSONL trace (docs/spec.md section 1); or"""
    samples: Sequence[tuple[str, SampleMeta]] | None = None
    """(key, metadata) of each sample in stream order (`mmpipe plan data=shards`),"""
    source: str = ""
    """named by this (the data.path) in messages."""
    steps: int | None = None
    """plan.steps: the first K full steps (None: every full step)."""


def read_trace(path: str | Path) -> Iterator[SampleMeta]:
    """Stream a JSONL workload trace; a malformed line is an error naming its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r}: no such trace file")
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            yield meta_from_json(obj, where=where)


def read_samples(model: ModelSpec, data: PlanInput) -> tuple[list[SampleFeatures], list[str], str]:
    """Features, error labels and a name of the input: a trace, or shard metadata."""
    trace_path, samples, source = data.trace_path, data.samples, data.source
    if (trace_path is None) == (samples is None):
        raise ValueError("give a trace (data=trace data.path=FILE.jsonl) or shards (data=shards)")
    if trace_path is not None:
        trace = Path(trace_path)
        feats = [features(model, meta, where=f"{trace.name} sample {i} (line {i + 1})")
                 for i, meta in enumerate(read_trace(trace))]
        return feats, [f"{trace.name} line {i + 1} (sample {i})" for i in range(len(feats))], \
            trace_path
    assert samples is not None
    feats = [features(model, meta, where=f"shard sample {key!r} (sample {i})")
             for i, (key, meta) in enumerate(samples)]
    return feats, [f"shard sample {key!r} (sample {i})" for i, (key, _) in enumerate(samples)], \
        source or "(shards)"
