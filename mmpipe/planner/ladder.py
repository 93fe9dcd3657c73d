"""A length ladder for packed micro-batches (plan.ladder): the few LLM row lengths they are
padded up to, so that compiled attention kernels see a handful of shapes.

The data-aware planner packs micro-batches of every length; FlexAttention compiled with
torch.compile recompiles (or goes dynamic) for a new sequence length. With a ladder, a packed
LLM row of `n` tokens is padded to the smallest rung >= n by one padding segment that attends
only to itself and carries no labels (runtime/batch.py), and the planner prices the padded
length: the micro-batch's LLM stream is `rung` tokens long and its padding segment adds
`(rung - n)^2` to the stream's squared lengths (`padded_streams`, used by every price of a
micro-batch in `stage_cost`).

How the rungs are made (`geometric_rungs`): geometric between the shortest and the longest
packed length of the probe steps the run plans its stages on, rounded up to multiples of the
kernel's block (128 for FlexAttention), at most MAX_RUNGS. Geometric because the padding a
rung adds is then bounded *relative to the micro-batch* (at most the ratio between rungs, minus
one, plus one block), whatever its length; equal steps would pad short micro-batches by more
than their own length. Eight rungs keep the warm-up compile to eight shapes while, on the
spans packed micro-batches cover (a factor of 4 to 30 between the shortest and the longest),
the ratio between rungs stays 1.2 to 1.6. Past the top rung the ladder goes on with the same
ratio (`pad_to`), so a longer micro-batch in a later step still gets one of few shapes, just
not one compiled before step 1.

Pure: no torch; every rank derives the same ladder from the same probe steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

FLEX_BLOCK = 128
"""FlexAttention's block size (its default BLOCK_SIZE): rungs are multiples of it, so a padded
row fills whole tiles."""
MAX_RUNGS = 8
"""The most rungs `plan.ladder=auto` makes (and an explicit list may give)."""
LLM_STREAM = 4
"""The LLM stream's index in samples.STREAMS (the only stream a ladder pads)."""
OPTIONS = ("auto", "off")
"""plan.ladder's words; any other value is a list of rungs."""


@dataclass(frozen=True, slots=True)
class Ladder:
    """The lengths packed LLM rows are padded to."""

    rungs: tuple[int, ...]
    """Rising rung lengths, tokens (multiples of `block`)."""
    block: int = FLEX_BLOCK
    """What every length past the top rung is rounded up to as well."""

    def __post_init__(self) -> None:
        if not self.rungs or any(b <= a for a, b in zip(self.rungs, self.rungs[1:])) or self.rungs[0] < 1:
            raise ValueError(f"a ladder needs rising positive rungs, got {list(self.rungs)}")

    @property
    def ratio(self) -> float:
        """The growth past the top rung: the top two rungs' ratio (2 for a single rung)."""
        return self.rungs[-1] / self.rungs[-2] if len(self.rungs) > 1 else 2.0

    def pad_to(self, n: int) -> int:
        """The length a packed row of `n` LLM tokens is padded to: the smallest rung >= n; past
        the top rung, the next rung of the same geometric growth (rounded up to the block)."""
        for r in self.rungs:
            if n <= r:
                return r
        top = self.rungs[-1]
        while top < n:
            top = _round_up(top * self.ratio, self.block)
        return top

    def pad_array(self, n: np.ndarray) -> np.ndarray:
        """`pad_to` of every entry of a float array (the planner prices fractional shares too)."""
        r = np.asarray(self.rungs, dtype=float)
        idx = np.searchsorted(r, n, side="left")
        out = np.where(idx < len(r), r[np.minimum(idx, len(r) - 1)], 0.0)
        beyond = idx >= len(r)
        if beyond.any():
            out[beyond] = [self.pad_to(math.ceil(x)) for x in np.asarray(n)[beyond]]
        return np.where(n > 0, out, 0.0)

    def text(self) -> str:
        """`128, 256, 512` (for messages and the start-up line)."""
        return ", ".join(str(r) for r in self.rungs)


def _round_up(x: float, block: int) -> int:
    return max(block, int(math.ceil(x / block)) * block)


def geometric_rungs(low: int, high: int, *, count: int = MAX_RUNGS, block: int = FLEX_BLOCK) -> tuple[int, ...]:
    """At most `count` rising multiples of `block`, geometric from `low` to `high` (each
    rounded up; the last is `high` rounded up)."""
    lo, hi = _round_up(low, block), _round_up(max(low, high), block)
    if count < 2 or lo == hi:
        return (hi,)
    ratio = (hi / lo) ** (1.0 / (count - 1))
    out = sorted({_round_up(lo * ratio ** i, block) for i in range(count - 1)} | {hi})
    return tuple(out)


def choose_ladder(lengths: Iterable[int], *, count: int = MAX_RUNGS, block: int = FLEX_BLOCK) -> Ladder:
    """plan.ladder=auto's ladder for packed micro-batches of these LLM lengths (the micro-batches
    the planner makes on the probe steps): geometric rungs from the shortest to the longest."""
    ls = [int(n) for n in lengths if n > 0]
    if not ls:
        return Ladder((block,), block)
    return Ladder(geometric_rungs(min(ls), max(ls), count=count, block=block), block)


def parse_ladder(value: object) -> str | tuple[int, ...]:
    """plan.ladder as typed: `auto`, `off`, or a rising list of positive multiples of the block
    (at most MAX_RUNGS). ValueError in one line naming the key, the value and the fix."""
    if isinstance(value, str):
        if value in OPTIONS:
            return value
        raise ValueError(f"plan.ladder={value!r} is unknown; use auto, off, or rising multiples of "
                         f"{FLEX_BLOCK}, e.g. plan.ladder=[512,1024,2048]")
    if isinstance(value, Sequence) and value and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        rungs = tuple(int(r) for r in value)
        shown = "[" + ",".join(str(r) for r in rungs) + "]"
        if any(r <= 0 or r % FLEX_BLOCK for r in rungs):
            fixed = sorted({_round_up(r, FLEX_BLOCK) for r in rungs})
            raise ValueError(f"plan.ladder={shown} has a rung that is not a positive multiple of {FLEX_BLOCK} "
                             f"(FlexAttention's block); use e.g. plan.ladder=[{','.join(map(str, fixed))}]")
        if any(b <= a for a, b in zip(rungs, rungs[1:])):
            raise ValueError(f"plan.ladder={shown} must rise; use "
                             f"plan.ladder=[{','.join(map(str, sorted(set(rungs))))}]")
        if len(rungs) > MAX_RUNGS:
            raise ValueError(f"plan.ladder={shown} has {len(rungs)} rungs, more than {MAX_RUNGS} (each is a kernel "
                             f"compile); give at most {MAX_RUNGS}, or plan.ladder=auto")
        return rungs
    raise ValueError(f"plan.ladder={value!r} is not auto, off or a list of rungs; use e.g. "
                     f"plan.ladder=[512,1024,2048] (multiples of {FLEX_BLOCK})")


def padded_streams(ladder: Ladder | None, T: np.ndarray, S2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stream tokens and squared lengths [n_mb, K] of packed micro-batches once their LLM rows
    are padded up the ladder: the LLM stream is the rung long, and the padding segment (its own
    attention segment) adds its length squared. Unchanged without a ladder."""
    if ladder is None or T.shape[0] == 0:
        return T, S2
    n = T[:, LLM_STREAM]
    pad = ladder.pad_array(n) - n
    T, S2 = T.copy(), S2.copy()
    T[:, LLM_STREAM] += pad
    S2[:, LLM_STREAM] += pad * pad
    return T, S2


def pad_tokens(ladder: Ladder | None, n: np.ndarray) -> np.ndarray:
    """Padding tokens [n_mb] of packed micro-batches with `n` LLM tokens each (0 without a
    ladder)."""
    n = np.asarray(n, dtype=float)
    return np.zeros_like(n) if ladder is None else ladder.pad_array(n) - n
