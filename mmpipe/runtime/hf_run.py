"""What running a Hugging Face model adds to the runtime (docs/hf.md): the run's templater, the
checks before launch (a planner-only preset, memory), and each rank's load report. (`mmpipe
export` is runtime/export.py.)

mmpipe's own tiny model goes through the same functions and takes the paths it always took.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmpipe.config import RunConfig, tokenizer_source, training_precision

GIB = 2**30


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- tokenizer


def load_templater(rc: RunConfig):
    """The run's tokenizer, in the preflight and in every rank: mmpipe's `tokenizer.json` (a
    Tokenizer, as mmpipe's own model always had it) or a checkpoint folder's tokenizer and chat
    template (a ChatTemplate). For a Hugging Face model its media token ids must be the model's
    placeholders (the ids its embedding layer replaces).

    Raises:
        ValueError / FileNotFoundError: one line naming the key the tokenizer came from.
    """
    from mmpipe.data.chat import templater_for
    from mmpipe.data.tokenizer import check_vocab, load_tokenizer

    path, key = tokenizer_source(rc)
    tok = templater_for(path, rc.model, key=key) if Path(path).is_dir() else load_tokenizer(path)
    if rc.model.hf is None:
        check_vocab(tok, rc.model.llm.vocab)
        return tok
    from mmpipe.model.hf import placeholder_tokens
    from mmpipe.model.hf.build import video_token

    for kind, want, got in zip(("image", "audio", "video"), (*placeholder_tokens(rc.model), video_token(rc.model)),
                               (tok.image_id, tok.audio_id, getattr(tok, "video_id", None))):
        if want >= 0 and got != want:
            raise ValueError(f"{key}={path!r}: its {kind} token is id {got}, but model {rc.model.name} replaces id "
                             f"{want} ({kind}_token_id of its config) with {kind} features; give the model's own "
                             f"tokenizer")
    if tok.vocab_size > rc.model.llm.vocab:
        raise ValueError(f"{key}={path!r} has {tok.vocab_size} tokens but model {rc.model.name} embeds "
                         f"{rc.model.llm.vocab}; give the model's own tokenizer")
    return tok


# ----------------------------------------------------------------------------- before launch


def check_model(rc: RunConfig) -> str | None:
    """What must hold before `mmpipe train` launches anything: the model can be built (not a
    planner-only preset) and, for a Hugging Face model, its weight files are whole and match its
    config (headers only) and its weights, gradients and optimizer states fit this machine.
    Returns the memory line to print (None for mmpipe's own model).

    Raises:
        ValueError: one line naming the model and what it needs.
    """
    if rc.planner_only:
        raise ValueError(f"model={rc.model.name} is a planner-only composition ({rc.planner_only}): there is "
                         f"nothing to build or train; plan it with `mmpipe plan model={rc.model.name} data=trace "
                         f"data.path=FILE.jsonl`, or train one encoder at a time (model=compose, model=hf)")
    from mmpipe.model.lora import check_adapters

    check_adapters(rc.model, rc.train.lora)  # parts that would silently train nothing
    if rc.model.hf is None:
        return None
    if rc.model.hf.weights:  # a cut, missing or misshapen weight file: now, not in every rank after launch
        from mmpipe.model.hf.integrity import check_weights

        check_weights(rc.model.hf)
    return check_memory_fits(rc)


def balanced_stages(sizes: Sequence[int], pp: int) -> list[tuple[int, int]]:
    """The cut of `sizes` into `pp` contiguous non-empty stages whose largest sum is smallest:
    binary search on that sum, each candidate filled greedily (fewest stages); a stage is then
    split further while there are fewer than pp (splitting never raises a sum)."""
    def cut(limit: int) -> list[tuple[int, int]]:
        stages, start, total = [], 0, 0
        for i, s in enumerate(sizes):
            if i > start and total + s > limit:
                stages.append((start, i))
                start, total = i, 0
            total += s
        return stages + [(start, len(sizes))]

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(cut(mid)) <= pp else (mid + 1, hi)
    stages = cut(lo)
    while len(stages) < pp:
        i = max(range(len(stages)), key=lambda k: stages[k][1] - stages[k][0])
        a, b = stages[i]
        stages[i:i + 1] = [(a, a + 1), (a + 1, b)]
    return stages


def device_memory(rc: RunConfig) -> tuple[int, str]:
    """(bytes, what) one process may hold: its GPU's memory, or this machine's RAM on CPU."""
    import torch

    gpu = rc.launcher.backend == "nccl" or (rc.launcher.backend == "auto" and torch.cuda.is_available())
    if gpu and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return int(props.total_memory), f"GPU memory ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def check_memory_fits(rc: RunConfig) -> str:
    """Static memory (weights, gradients, optimizer states; activations come on top) of each stage
    of the user's stages, else of the cut that balances it best (no cut needs less), against the
    device: each stage against its GPU; on CPU, every local rank against the machine's RAM."""
    from mmpipe.model.hf import check_memory, estimate_memory

    spec, pp, dp = rc.model, rc.parallel.pp, rc.parallel.dp
    tp = training_precision(rc)  # the bytes the planner prices, as the run will hold them
    shards = dp if tp.zero_stage == 1 else 1
    sizes = dict(weight_bytes=tp.element_bytes, grad_bytes=tp.element_bytes,
                 optimizer_bytes=tp.optimizer_bytes() / shards)
    stages = rc.stage_bounds
    if stages is None:
        singles = estimate_memory(spec, stages=[(i, i + 1) for i in range(len(rc.layers))],
                                  trainable=rc.train.trainable, lora=rc.train.lora, **sizes)
        stages = balanced_stages([s.bytes for s in singles], pp)
    est = estimate_memory(spec, stages=stages, trainable=rc.train.trainable, lora=rc.train.lora, **sizes)
    budget, what = device_memory(rc)
    per_stage = " + ".join(_size(e.bytes) for e in est)
    params = sum(e.params for e in est)
    train = sum(e.trainable for e in est)
    how = (f"{tp.describe()}: {tp.element_bytes} bytes per weight, {tp.param_bytes(trainable=True, dp=dp):g} per "
           f"trained parameter with its gradient and optimizer state; {params:,} parameters held, "
           f"{train:,} training")
    if what != "RAM":
        check_memory(est, budget_bytes=budget, what="per GPU")
        return (f"memory: stages hold {per_stage} of weights, gradients and optimizer states ({how}); "
                f"{_size(budget)} of {what} each, activations on top")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or (rc.launcher.nproc or pp * dp))
    need = sum(e.bytes for e in est) * dp if local >= pp * dp else max(e.bytes for e in est) * local
    line = (f"model {spec.name} needs {_size(need)} of RAM for the weights, gradients and optimizer states "
            f"of its {local} processes here before any activation (stages of {per_stage} x {dp} replica(s); "
            f"{how})")
    if need > budget:
        raise ValueError(f"{line}, but this machine has {_size(budget)} of RAM; freeze layers "
                         f"(train.trainable), or use GPUs (one stage per device) or more machines")
    return f"memory: {line}; this machine has {_size(budget)} of RAM"


# ----------------------------------------------------------------------------- after loading


def load_report(layers: Sequence[str]) -> dict[str, Any]:
    """What building this rank's layers cost: tensors read from checkpoints, seconds, bytes (from
    mmpipe.model.hf.LOAD_LOG), and the process's peak resident memory (and GPU memory) after it."""
    from mmpipe.model.hf.weights import LOAD_LOG, memory_mb, stage_load_summary

    layers = list(layers)
    if "llm.head" in layers and "llm.embed" not in layers and any(r.layer == "llm.embed" for r in LOAD_LOG):
        layers.append("llm.embed")  # a tied head: this stage built (and loaded) its own copy of the embedding
    reports = [r for r in LOAD_LOG if r.layer in set(layers)]
    out: dict[str, Any] = {"layers_loaded": len(reports), "tensors": sum(r.tensors for r in reports),
                           "bytes": sum(r.bytes for r in reports), "seconds": round(sum(r.seconds for r in reports), 3),
                           "peak_rss_mb": round(memory_mb(), 1), "summary": stage_load_summary(layers)}
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def format_load_line(reports: Sequence[dict[str, Any]]) -> str:
    """One start-up line: each rank's stage, what it loaded and its peak memory."""
    parts = []
    for r in reports:
        gpu = f", peak GPU {r['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in r else ""
        what = (f"{r['layers_loaded']} layers, {r['tensors']} tensors, {_size(r['bytes'])} in {r['seconds']:.2f} s"
                if r["layers_loaded"] else "nothing from a checkpoint")
        parts.append(f"stage {r['stage']} (rank {r['rank']}) loaded {what}; peak RSS {r['peak_rss_mb']:.0f} MB{gpu}")
    return "load: " + " | ".join(parts)
