"""Why a sample was dropped, and a counter of drops that the run summary prints.

A bad sample never stops a run with `data.on_error=skip`: the reader counts it under a short,
stable reason ("undecodable image", "empty answer", ...) and moves on. With
`data.on_error=raise` the same error is raised instead, naming shard and key.

A counter made for a run (`SkipCounter.for_run`) also logs every drop: one JSON line per drop
in `RUN_DIR/skips.jsonl`, and on stderr the first few drops of each reason, then one line
saying that the rest of that reason are only in the file.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Reasons are plain strings so that summaries read naturally; these are all the reader emits.
BAD_JSON = "bad json"
MISSING_JSON = "missing json"
MISSING_META = "missing meta"
BAD_CONVERSATION = "bad conversation"
NO_ANSWER = "no answer"
EMPTY_ANSWER = "empty answer"
PLACEHOLDER_MISMATCH = "placeholder mismatch"
MISSING_MEDIA = "missing media"
UNDECODABLE_IMAGE = "undecodable image"
UNDECODABLE_AUDIO = "undecodable audio"
UNDECODABLE_VIDEO = "undecodable video"
"""A video container PyAV cannot open or decode: no video stream, no frames, a cut or corrupt
clip, fewer frames decoded than its header declares, a clip too short for the model's frame rule."""
NO_ENCODER = "no encoder"
TOO_LONG = "too long"
META_MISMATCH = "meta mismatch"
CORRUPT_SHARD = "corrupt shard"
UNSAFE_NAME = "unsafe member name"
MEDIA_TOO_LARGE = "media too large"
UNSAFE_PATH = "unsafe path"
"""The converter's: a media path that leads out of image_root / audio_root (`..`, an absolute
path, a symlink), or names something other than a regular file (a device, a FIFO)."""

REASONS: tuple[str, ...] = (
    BAD_JSON, MISSING_JSON, MISSING_META, BAD_CONVERSATION, NO_ANSWER, EMPTY_ANSWER,
    PLACEHOLDER_MISMATCH, MISSING_MEDIA, UNDECODABLE_IMAGE, UNDECODABLE_AUDIO, UNDECODABLE_VIDEO, NO_ENCODER,
    TOO_LONG, META_MISMATCH, CORRUPT_SHARD, UNSAFE_NAME, MEDIA_TOO_LARGE, UNSAFE_PATH,
)
ECHO_PER_REASON = 5
"""Drops of each reason a run prints on stderr before it only counts them (and writes them to
skips.jsonl)."""


class SampleError(ValueError):
    """A sample that cannot be used: `reason` is one of REASONS, `detail` says what was seen."""

    def __init__(self, reason: str, detail: str, *, shard: str = "", key: str = "", lost: int = 1) -> None:
        self.reason = reason
        self.detail = detail
        self.shard = shard
        self.key = key
        self.lost = lost
        """Samples this drop stands for: 1 for a sample; for a corrupt shard, the samples after the
        damage (from the shard's index.json; at least 1 when no index lists the shard)."""
        super().__init__(self._message())

    def __reduce__(self):
        # Crosses DataLoader worker processes inside Sample.dropped; the default would call
        # SampleError(message) and fail.
        return (_rebuild, (self.reason, self.detail, self.shard, self.key, self.lost))

    def at(self, *, shard: str, key: str) -> "SampleError":
        """The same error, located in a shard and sample key."""
        return SampleError(self.reason, self.detail, shard=shard, key=key, lost=self.lost)

    def _message(self) -> str:
        where = " ".join(x for x in (self.shard, f"sample {self.key}" if self.key else "") if x)
        return f"{where + ': ' if where else ''}{self.reason}: {self.detail}"


def _rebuild(reason: str, detail: str, shard: str, key: str, lost: int) -> SampleError:
    return SampleError(reason, detail, shard=shard, key=key, lost=lost)


@dataclass(kw_only=True, slots=True)
class SkipCounter:
    """Samples dropped by the reader, counted by reason (shared by every pass of a stream)."""

    counts: Counter[str] = field(default_factory=Counter)
    """Samples dropped per reason (a corrupt shard counts the samples it lost)."""
    examples: list[str] = field(default_factory=list)
    """The first few drop messages (shard, key, detail), for logs."""
    max_examples: int = 5
    """How many messages `examples` keeps."""
    journal: Path | None = None
    """Append one JSON line per drop here (a run's skips.jsonl); None: count only."""
    echo: int = 0
    """Print the first `echo` drops of each reason on stderr, then one line saying the rest
    are in the journal (0: print nothing)."""
    fields: dict = field(default_factory=dict)
    """Added to every journal line (e.g. the replica that read the sample)."""
    events: Counter[str] = field(default_factory=Counter)
    """Drops per reason as they were reported (a corrupt shard is one event and many samples)."""

    @classmethod
    def for_run(cls, run_dir: str | Path, **fields) -> "SkipCounter":
        """A counter that logs every drop to RUN_DIR/skips.jsonl and the first few on stderr."""
        return cls(journal=Path(run_dir) / "skips.jsonl", echo=ECHO_PER_REASON, fields=fields)

    def add(self, err: SampleError) -> None:
        self.counts[err.reason] += err.lost
        self.events[err.reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(str(err))
        if self.journal is not None:
            line = {"reason": err.reason, "shard": err.shard, "key": err.key, "detail": err.detail, "lost": err.lost,
                    **self.fields}
            # One write per line on an O_APPEND descriptor: the replicas of a run share the file.
            fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(line) + "\n").encode())
            finally:
                os.close(fd)
        n = self.events[err.reason]
        if self.echo and n <= self.echo:
            print(f"skipped {err}", file=sys.stderr, flush=True)
        if self.echo and n == self.echo + 1:
            print(f"skipped more samples for {err.reason!r}; they are counted in the summary"
                  + (f" and listed in {self.journal}" if self.journal else ""), file=sys.stderr, flush=True)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """E.g. `skipped 3 samples: 2 undecodable image, 1 empty answer` (`skipped 0 samples`)."""
        n = self.total
        head = f"skipped {n} sample{'' if n == 1 else 's'}"
        if not self.events:
            return head
        parts = [f"{c} {r}" for r, c in sorted(self.counts.items(), key=lambda rc: (-rc[1], rc[0]))]
        return f"{head}: {', '.join(parts)}"

    def merge(self, other: "SkipCounter") -> None:
        """Add another counter's drops (e.g. gathered from other replicas)."""
        self.counts.update(other.counts)
        self.events.update(other.events)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[:max(0, room)])

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def __str__(self) -> str:
        return self.summary()
