"""A length ladder for packed micro-batches (plan.ladder): the few LLM row lengths they are
padded up to, so that compiled attention kernels see a handful of shapes.

The data-aware planner packs micro-batches of every length; FlexAttention compiled with
torch.compile recompiles (or goes dynamic) for a new sequence length. With a ladder, a packed
LLM row of `n` tokens is padded to the smallest rung >= n by one padding segment that attends
only to itself and carries no labels (runtime/batch.py), and the planner prices the padded
length: the micro-batch's LLM stream is `rung` tokens long and its padding segment adds
`(rung - n)^2` to the stream's squared lengths (`padded_streams`, used by every price of a
micro-batch in `stage_cost`).

How the rungs are made (`choose_ladder`, for plan.ladder=auto): the planner plans the first
steps of the data with the run's cut and costs, and the rungs are the at most MAX_RUNGS
multiples of the kernel's block (128 for FlexAttention) that minimise the padding those packed
rows would get (an exact dynamic programme over their lengths rounded up to the block; the top
rung is the longest). The planner's rows recur from step to step (the same micro-batch count
and size profile over similar samples), so rungs placed where the rows fall pad least: on the
bundled workloads (qwen2-vl-7b on vision-dynamic, omni-7b on omni-mix, H100 preset, 10 steps)
this costs 5.6% and 4.0% of predicted step time, where geometric rungs over the same span
(equal ratios, the obvious alternative) cost 6.8% and 6.3%. Eight rungs keep the warm-up to
eight shapes. A row longer than the top rung pads to the next of PAST_TOP_GROWTH-spaced
lengths above it (`pad_to`): a later step with longer rows still gets one of a few shapes,
just not one compiled before step 1.

Pure: no torch; every rank derives the same ladder from the same probe steps.
"""

from __future__ import annotations

import bisect
import itertools
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
PAST_TOP_GROWTH = 1.25
"""A row longer than the top rung pads to the top rung times this (rounded up to the block),
or that times this again, and so on: few extra shapes, each at most 25% (plus a block) of
padding."""
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

    def pad_to(self, n: int) -> int:
        """The length a packed row of `n` LLM tokens is padded to: the smallest rung >= n; past
        the top rung, the first of the top rung grown by PAST_TOP_GROWTH again and again
        (rounded up to the block) that holds it."""
        for r in self.rungs:
            if n <= r:
                return r
        top = self.rungs[-1]
        while top < n:
            top = _round_up(top * PAST_TOP_GROWTH, self.block)
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


def choose_ladder(lengths: Iterable[int], *, count: int = MAX_RUNGS, block: int = FLEX_BLOCK) -> Ladder:
    """plan.ladder=auto's ladder for packed rows of these LLM lengths (the micro-batches the
    planner makes on the probe steps): the at most `count` multiples of `block` that minimise
    the rows' summed padding, the longest row's rounded length among them."""
    rows = sorted(int(n) for n in lengths if n > 0)
    if not rows:
        return Ladder((block,), block)
    cands = sorted({_round_up(n, block) for n in rows})
    at = [0] + [bisect.bisect_right(rows, c) for c in cands]  # rows up to each candidate
    prefix = [0, *itertools.accumulate(rows)]

    def pad(i: int, j: int) -> int:
        """Padding of the rows above cands[i - 1] (all rows for i = 0) up to cands[j], to it."""
        lo, hi = at[i], at[j + 1]
        return cands[j] * (hi - lo) - (prefix[hi] - prefix[lo])

    n = len(cands)
    # best[k][j]: least padding of the rows up to cands[j] with k rungs, the top one cands[j]
    best = [[math.inf] * n for _ in range(count + 1)]
    back = [[-1] * n for _ in range(count + 1)]
    for j in range(n):
        best[1][j] = pad(0, j)
    for k in range(2, count + 1):
        for j in range(n):
            for i in range(j):
                v = best[k - 1][i] + pad(i + 1, j)
                if v < best[k][j]:
                    best[k][j], back[k][j] = v, i
    k = min(range(1, count + 1), key=lambda k: (best[k][n - 1], k))
    rungs, j = [], n - 1
    while j >= 0 and k >= 1:
        rungs.append(cands[j])
        j, k = back[k][j], k - 1
    return Ladder(tuple(reversed(rungs)), block)


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
