"""Baseline policies of docs/spec.md section 7, each tuned as a user would.

- `ds-default`: DeepSpeed `parameters` partition; each replica takes a contiguous slice of
  the step in stream order, cut into equal consecutive micro-batches, padded.
- `llava-grouped`: LLaVA's `group_by_modality_length` inside the step (multimodal and
  text-only pooled apart, megabatches of dp*b shuffled, each sorted by length and dealt
  greedily to the replica with the least load); padded; `parameters` partition.
- `packed-ffd`: Megatron/NeMo style: encoders with the first LLM chunk on stage 0, LLM blocks
  split evenly; each replica's slice packed first-fit-decreasing by LLM length into packs of
  max(longest sample, 4096) tokens; one pack per micro-batch.

Tuning (`tune_baseline`): the fastest setting that fits in memory over the planned steps,
among micro-batch counts M, 2M, 4M, ... up to one sample per micro-batch (packed-ffd: pack
lengths 1/2x, 1x, 2x the default, never below the longest sample), each with recompute off
and on (all stages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpipe.planner.cost import CostModel
from mmpipe.planner.partition import StagePlan, packed_ffd_partition, parameters_partition
from mmpipe.planner.samples import SampleTable
from mmpipe.planner.stage_cost import StageCosts, stage_costs
from mmpipe.planner.step import Replicas, StepEval, evaluate_step

BASELINES = ("ds-default", "llava-grouped", "packed-ffd")
"""Baseline policy names."""
PACK_TOKENS = 4096
"""Default pack length of packed-ffd (or the longest sample, whichever is larger)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselinePlan:
    """A tuned baseline over the planned steps."""

    policy: str
    """Baseline name."""
    setting: str
    """The chosen tuning, e.g. `m=16 recompute=off`."""
    stage_plan: StagePlan
    """Its partition and recompute."""
    packing: bool
    """Packed (True) or padded micro-batches."""
    steps: tuple[Replicas, ...]
    """Per step, per replica, the micro-batches (rows of the sample table)."""
    evals: tuple[StepEval, ...]
    """The simulated outcome of each step."""

    @property
    def fits(self) -> bool:
        return all(e.fits for e in self.evals)

    @property
    def mean_step_time(self) -> float:
        return float(np.mean([e.step_time for e in self.evals])) if self.evals else 0.0


def slices(rows: Sequence[int], dp: int) -> list[list[int]]:
    """Contiguous, nearly equal slices of the step in stream order, one per replica."""
    return [list(map(int, part)) for part in np.array_split(np.asarray(rows, dtype=int), dp)]


def ds_default_step(rows: Sequence[int], *, dp: int, m: int) -> Replicas:
    """Each replica: its slice cut into m equal consecutive micro-batches."""
    out = []
    for part in slices(rows, dp):
        k = max(1, min(m, len(part)))
        out.append([list(map(int, mb)) for mb in np.array_split(np.asarray(part, dtype=int), k)
                    if len(mb)] if part else [])
    return out


def llava_grouped_step(table: SampleTable, rows: Sequence[int], *, dp: int, m: int,
                       seed: int = 0) -> Replicas:
    """LLaVA `group_by_modality_length` restricted to the step's samples."""
    rng = np.random.default_rng(seed)
    rows = list(rows)
    length = table.tokens[:, 4]
    multimodal = (table.tokens[:, [1, 3]].sum(axis=1) > 0)
    b = max(1, math.ceil(len(rows) / (dp * m)))
    size = dp * b

    def megabatches(pool: list[int]) -> list[list[int]]:
        perm = [pool[i] for i in rng.permutation(len(pool))]
        return [perm[i:i + size] for i in range(0, len(perm), size)]

    mm = megabatches([r for r in rows if multimodal[r]])
    lang = megabatches([r for r in rows if not multimodal[r]])
    extra: list[int] = []
    for group in (mm, lang):
        if group and len(group[-1]) < size:
            extra += group.pop()
    body = mm + lang
    body = [body[i] for i in rng.permutation(len(body))]
    extra.sort(key=lambda r: -length[r])
    body += [extra[i:i + size] for i in range(0, len(extra), size)]
    out: Replicas = [[] for _ in range(dp)]
    for mega in body:
        mega = sorted(mega, key=lambda r: -length[r])
        for r, chunk in enumerate(_even_chunks(mega, length, dp)):
            if chunk:
                out[r].append(chunk)
    return out


def _even_chunks(indices: list[int], length: np.ndarray, k: int) -> list[list[int]]:
    """LLaVA's split_to_even_chunks: strided when uneven, else greedy least-length."""
    if len(indices) % k:
        return [indices[i::k] for i in range(k)]
    per = len(indices) // k
    chunks: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for r in indices:
        j = min((c for c in range(k) if len(chunks[c]) < per), key=lambda c: load[c])
        chunks[j].append(r)
        load[j] += float(length[r])
    return chunks


def packed_ffd_step(table: SampleTable, rows: Sequence[int], *, dp: int,
                    pack_len: int) -> Replicas:
    """Each replica's slice packed first-fit-decreasing by LLM length; one pack per micro-batch."""
    length = table.tokens[:, 4]
    out: Replicas = []
    for part in slices(rows, dp):
        packs: list[list[int]] = []
        room: list[float] = []
        for r in sorted(part, key=lambda r: -length[r]):
            for j, free in enumerate(room):
                if length[r] <= free:
                    packs[j].append(r)
                    room[j] -= length[r]
                    break
            else:
                packs.append([r])
                room.append(pack_len - length[r])
        out.append(packs)
    return out


def settings(policy: str, table: SampleTable, steps: Sequence[Sequence[int]], *, dp: int,
             micro_batches: int) -> list[tuple[str, int]]:
    """The settings a user tries (docs/spec.md section 7): micro-batch counts M, 2M, 4M, ... up
    to one sample per micro-batch, or (packed-ffd) pack lengths 1/2x, 1x and 2x the default,
    never below the longest sample. (label, value) pairs, without repeats."""
    n_rep = max(1, max((math.ceil(len(s) / dp) for s in steps), default=1))
    out: list[tuple[str, int]] = []
    if policy == "packed-ffd":
        longest = int(max((table.tokens[r, 4] for s in steps for r in s), default=1))
        base = max(longest, PACK_TOKENS)
        for f in (0.5, 1.0, 2.0):
            out.append((f"pack={max(longest, int(base * f))}", max(longest, int(base * f))))
    else:
        m = max(1, micro_batches)
        while True:
            out.append((f"m={min(m, n_rep)}", min(m, n_rep)))
            if m >= n_rep:
                break
            m *= 2
    return list(dict(out).items())


def baseline_step(policy: str, table: SampleTable, rows: Sequence[int], *, dp: int, value: int,
                  seed: int = 0) -> Replicas:
    """One step of a baseline at one setting (micro-batch count, or pack length)."""
    if policy == "ds-default":
        return ds_default_step(rows, dp=dp, m=value)
    if policy == "llava-grouped":
        return llava_grouped_step(table, rows, dp=dp, m=value, seed=seed)
    return packed_ffd_step(table, rows, dp=dp, pack_len=value)


def fitting_baseline_step(policy: str, sc: StageCosts, table: SampleTable, rows: Sequence[int], *,
                          dp: int, micro_batches: int) -> Replicas:
    """One step of a baseline as a run of it plans it on the run's stages: as the user set it
    (train.micro_batches; packed-ffd: the default pack length) when that fits in memory (less
    the headroom), else as a user who ran out of memory would retry: the next setting of
    section 7 that holds less (2M, 4M, ... micro-batches; half-length packs) and fits; the
    least over memory if none does."""
    options = settings(policy, table, [rows], dp=dp, micro_batches=micro_batches)
    if policy == "packed-ffd":  # default first, then the shorter packs
        options = [options[1], options[0]] if len(options) > 1 else options
    least: tuple[float, Replicas] | None = None
    for _, value in options:
        rep = baseline_step(policy, table, rows, dp=dp, value=value)
        ev = evaluate_step(sc, table, rep, packing=policy == "packed-ffd")
        if ev.fits:
            return rep
        over = float((ev.peak_bytes / ev.usable).max())
        if least is None or over < least[0]:
            least = (over, rep)
    assert least is not None
    return least[1]


def tune_baseline(policy: str, cost: CostModel, table: SampleTable, steps: Sequence[Sequence[int]],
                  *, pp: int, dp: int, micro_batches: int) -> BaselinePlan:
    """The fastest fitting setting of a baseline over the given steps (rows of `table`)."""
    if policy not in BASELINES:
        raise ValueError(f"plan.policy={policy!r} is not a baseline; use {', '.join(BASELINES)}")
    kinds = [l.kind for l in cost.layers]
    if policy == "packed-ffd":
        stages = packed_ffd_partition(kinds, pp)
    else:
        stages = parameters_partition([l.params for l in cost.layers], pp)
    best: BaselinePlan | None = None
    for label, value in settings(policy, table, steps, dp=dp, micro_batches=micro_batches):
        for rc in (False, True):
            sp = StagePlan(stages=list(stages), recompute=[rc] * pp)
            sc = stage_costs(cost, sp.stages, sp.recompute)
            packing = policy == "packed-ffd"
            plans = [baseline_step(policy, table, rows, dp=dp, value=value, seed=k)
                     for k, rows in enumerate(steps)]
            evals = tuple(evaluate_step(sc, table, p, packing=packing) for p in plans)
            cand = BaselinePlan(policy=policy, setting=f"{label} recompute={'on' if rc else 'off'}",
                                stage_plan=sp, packing=packing, steps=tuple(plans), evals=evals)
            if best is None or _better(cand, best):
                best = cand
    assert best is not None
    return best


def _better(a: BaselinePlan, b: BaselinePlan) -> bool:
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        over_a = max(float((e.peak_bytes / e.usable).max()) for e in a.evals)
        over_b = max(float((e.peak_bytes / e.usable).max()) for e in b.evals)
        return over_a < over_b
    return a.mean_step_time < b.mean_step_time
