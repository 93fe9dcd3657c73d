"""Workload traces: one JSON object per line, one line per sample (docs/spec.md section 1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mmpipe.model.geometry import SampleMeta, meta_from_json


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
