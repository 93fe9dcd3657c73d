"""Per-step metrics as JSON lines, and the progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm


class MetricsWriter:
    """Writes one JSON object per line to `path` (created with its folder); a new run starts
    the file afresh, a resumed run appends to it."""

    def __init__(self, path: Path, *, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = path.open("a" if append else "w")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class ProgressBar:
    """A tqdm bar with loss and throughput."""

    def __init__(self, total: int):
        self._bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5)

    def update(self, *, loss: float, samples_per_s: float, tokens_per_s: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{samples_per_s:.1f}",
                              tokens_s=f"{tokens_per_s:.0f}", refresh=False)
        self._bar.update(1)

    def note(self, message: str) -> None:
        """A line above the bar (printed plainly, it would land on the bar's line)."""
        self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
