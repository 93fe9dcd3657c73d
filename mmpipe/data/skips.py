"""Why a sample was dropped, and a counter of drops that the run summary prints.

A bad sample never stops a run with `data.on_error=skip`: the reader counts it under a short,
stable reason ("undecodable image", "empty answer", ...) and moves on. With
`data.on_error=raise` the same error is raised instead, naming shard and key.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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
NO_ENCODER = "no encoder"
TOO_LONG = "too long"
META_MISMATCH = "meta mismatch"
CORRUPT_SHARD = "corrupt shard"
UNSAFE_NAME = "unsafe member name"

REASONS: tuple[str, ...] = (
    BAD_JSON, MISSING_JSON, MISSING_META, BAD_CONVERSATION, NO_ANSWER, EMPTY_ANSWER,
    PLACEHOLDER_MISMATCH, MISSING_MEDIA, UNDECODABLE_IMAGE, UNDECODABLE_AUDIO, NO_ENCODER,
    TOO_LONG, META_MISMATCH, CORRUPT_SHARD, UNSAFE_NAME,
)


class SampleError(ValueError):
    """A sample that cannot be used: `reason` is one of REASONS, `detail` says what was seen."""

    def __init__(self, reason: str, detail: str, *, shard: str = "", key: str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.shard = shard
        self.key = key
        super().__init__(self._message())

    def __reduce__(self):
        # Crosses DataLoader worker processes inside Sample.dropped; the default would call
        # SampleError(message) and fail.
        return (_rebuild, (self.reason, self.detail, self.shard, self.key))

    def at(self, *, shard: str, key: str) -> "SampleError":
        """The same error, located in a shard and sample key."""
        return SampleError(self.reason, self.detail, shard=shard, key=key)

    def _message(self) -> str:
        where = " ".join(x for x in (self.shard, f"sample {self.key}" if self.key else "") if x)
        return f"{where + ': ' if where else ''}{self.reason}: {self.detail}"


def _rebuild(reason: str, detail: str, shard: str, key: str) -> SampleError:
    return SampleError(reason, detail, shard=shard, key=key)


@dataclass(kw_only=True, slots=True)
class SkipCounter:
    """Samples dropped by the reader, counted by reason (shared by every pass of a stream)."""

    counts: Counter[str] = field(default_factory=Counter)
    """Drops per reason."""
    examples: list[str] = field(default_factory=list)
    """The first few drop messages (shard, key, detail), for logs."""
    max_examples: int = 5
    """How many messages `examples` keeps."""

    def add(self, err: SampleError) -> None:
        self.counts[err.reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """E.g. `skipped 3 samples: 2 undecodable image, 1 empty answer` (`skipped 0 samples`)."""
        n = self.total
        head = f"skipped {n} sample{'' if n == 1 else 's'}"
        if not n:
            return head
        parts = [f"{c} {r}" for r, c in sorted(self.counts.items(), key=lambda rc: (-rc[1], rc[0]))]
        return f"{head}: {', '.join(parts)}"

    def merge(self, other: "SkipCounter") -> None:
        """Add another counter's drops (e.g. gathered from other replicas)."""
        self.counts.update(other.counts)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[:max(0, room)])

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def __str__(self) -> str:
        return self.summary()
