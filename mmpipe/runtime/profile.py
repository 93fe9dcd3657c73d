"""`mmpipe profile`: measure the configured model's layers on this machine, fit the cost
model's constants to them, and write a hardware description the planner uses instead of a
preset (`mmpipe train hardware=<name>`).

Every layer of the model is timed forward and backward, in one process with the torch
threads a training rank gets, on micro-batches of increasing size that mix images, audio
clips and text. Per layer kind, the fit finds the fixed per-pass time and the efficiency of
the cost model's curve

    time = overhead(kind) + FLOPs * (T + half_tokens) / (T * peak * efficiency(kind))

on forward + backward time (backward counted in forwards as the cost model counts it), and a
two-process gloo ping-pong measures the link latency and bandwidth between stages.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from mmpipe.config import RunConfig, hardware_spec
from mmpipe.model.geometry import audio_frames, audio_positions, audio_tokens, image_grid, image_tokens
from mmpipe.model.layers import build_layers, token_loss
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import HardwareSpec, build_cost_model
from mmpipe.runtime.batch import collate
from mmpipe.runtime.hardware_file import hardware_file, use_line, write_hardware_file
from mmpipe.runtime.host import threads_per_rank

IMAGE_TOKEN, AUDIO_TOKEN = 5, 6

# (images as (side px, count), clips as (seconds, count), text samples as (tokens, count))
SHAPES = (
    ((16, 1), (0.3, 1), (24, 1)),
    ((32, 2), (1.0, 1), (64, 2)),
    ((64, 2), (2.0, 2), (128, 2)),
    ((96, 3), (3.0, 2), (256, 2)),
    ((128, 4), (4.0, 3), (256, 4)),
    ((128, 8), (6.0, 4), (512, 3)),
)


@dataclass(frozen=True, slots=True)
class _Sample:
    key: str
    input_ids: list[int]
    labels: list[int]
    images: list[np.ndarray]
    audio: list[np.ndarray]


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One layer timed on one micro-batch shape."""

    layer: str
    """Layer name."""
    tokens: float
    """Tokens of the layer's stream in the micro-batch."""
    sq_tokens: float
    """Sum of squared sequence lengths of the stream (per sample, image or clip)."""
    fwd_s: float
    """Median forward time."""
    bwd_s: float
    """Median backward time."""


def synthetic_micro_batch(spec: ModelSpec, shape, rng: np.random.Generator):
    """A micro-batch mixing images, clips and text, plus its stream sizes per layer kind."""
    (side, n_img), (secs, n_clip), (text, n_text) = shape
    samples, v, a = [], spec.vision, spec.audio
    streams = {"vpos": [], "vtok": [], "apos": [], "atok": [], "llm": []}
    for i in range(max(n_img, n_clip, n_text)):
        ids: list[int] = [1]
        images, clips = [], []
        if v is not None and i < n_img:
            gh, gw = image_grid(v, side, side)
            images.append(rng.integers(0, 256, (gh * v.patch, gw * v.patch, 3), dtype=np.uint8))
            n = image_tokens(v, side, side)
            ids += [IMAGE_TOKEN] * n
            streams["vpos"].append(gh * gw)
            streams["vtok"].append(n)
        if a is not None and i < n_clip:
            clips.append(rng.standard_normal((a.mel_bins, audio_frames(a, secs))).astype(np.float32))
            n = audio_tokens(a, secs)
            ids += [AUDIO_TOKEN] * n
            streams["apos"].append(audio_positions(a, secs))
            streams["atok"].append(n)
        if i < n_text:
            ids += [int(x) for x in rng.integers(10, 500, text)]
        streams["llm"].append(len(ids))
        samples.append(_Sample(str(i), ids, list(ids), images, clips))
    patch = v.patch if v is not None else 1
    return collate(samples, patch=patch, packed=True, pad_id=0, audio_stride=a.conv_stride if a else 1), streams


_STREAM_OF = {"vision.embed": "vpos", "vision.block": "vpos", "vision.proj": "vtok", "audio.embed": "apos",
              "audio.block": "apos", "audio.proj": "atok", "llm.embed": "llm", "llm.block": "llm",
              "llm.norm": "llm", "llm.head": "llm"}


def kind_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def _float_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if t.is_floating_point() and t.requires_grad]


def _prepare(inp):
    if isinstance(inp, torch.Tensor):
        return inp.detach().requires_grad_(inp.is_floating_point())
    return tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in inp)


def measure_layers(spec: ModelSpec, *, repeats: int, seed: int = 0) -> list[Measurement]:
    """Forward and backward time of every layer on every profiling shape."""
    layers = build_layers(spec, seed=seed, image_token=IMAGE_TOKEN, audio_token=AUDIO_TOKEN)
    names = layer_names(spec)
    rng = np.random.default_rng(seed)
    out: list[Measurement] = []
    for shape in SHAPES:
        mb, streams = synthetic_micro_batch(spec, shape, rng)
        x = mb.carrier
        for name, layer in zip(names, layers):
            stream = streams[_STREAM_OF[kind_of(name)]]
            fwd, bwd = [], []
            for _ in range(repeats + 1):  # the first run warms up
                inp = _prepare(x)
                t0 = time.perf_counter()
                y = layer(inp)
                t1 = time.perf_counter()
                outs = _float_outputs(y)
                if name == "llm.head":  # the head's cost includes the loss over the vocabulary
                    y = token_loss(y, (mb.targets, torch.tensor([1.0])))
                    outs = [y]
                    t1 = time.perf_counter()
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                t2 = time.perf_counter()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                layer.zero_grad(set_to_none=True)
            out.append(Measurement(layer=name, tokens=float(sum(stream)), sq_tokens=float(sum(s * s for s in stream)),
                                   fwd_s=statistics.median(fwd[1:]), bwd_s=statistics.median(bwd[1:])))
            with torch.no_grad():
                x = layer(_prepare(x))
            if isinstance(x, tuple):
                x = tuple(t.detach() for t in x)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """The fitted constants and how well they explain the measurements."""

    hardware: HardwareSpec
    """The base hardware with measured figures filled in."""
    median_error: float
    """Median |predicted / measured - 1| over all layer measurements (fwd + bwd)."""
    backward_ratio: dict[str, float]
    """Measured backward / forward time per kind (the cost model assumes 2 for trainable)."""


def fit_hardware(base: HardwareSpec, spec: ModelSpec, measurements: list[Measurement], *,
                 trainable: tuple[str, ...]) -> Fit:
    cost = build_cost_model(model=spec, hardware=base, trainable=trainable, dp=1)
    by_name = {l.name: l for l in cost.layers}
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    ratio: dict[str, list[float]] = {}
    for m in measurements:
        lc = by_name[m.layer]
        if m.tokens <= 0:
            continue
        flops = lc.lin_flops * m.tokens + lc.attn_flops * m.sq_tokens
        passes = 1.0 + lc.bwd_factor  # the cost model's forward-equivalents for fwd + bwd
        rows.setdefault(lc.kind, []).append((m.tokens, flops, (m.fwd_s + m.bwd_s) / passes, m.fwd_s + m.bwd_s))
        if m.fwd_s > 0:
            ratio.setdefault(lc.kind, []).append(m.bwd_s / m.fwd_s)
    peak = max(f / t for r in rows.values() for _, f, t, _ in r if t > 0)

    def solve(h: float) -> tuple[dict[str, float], dict[str, float], float]:
        eff, ovh, errs = {}, {}, []
        for kind, r in rows.items():
            tok = np.array([x[0] for x in r])
            xs = np.array([x[1] for x in r]) * (tok + h) / tok
            ts = np.array([x[2] for x in r])
            A = np.stack([np.ones_like(xs), xs], axis=1)
            (o, b), *_ = np.linalg.lstsq(A / ts[:, None], np.ones_like(ts), rcond=None)  # relative error
            if o < 0:
                o, b = 0.0, float(np.sum(xs / ts) / np.sum((xs / ts) ** 2))
            # Overhead-bound kinds (norms, embeddings) barely constrain the slope: keep their
            # efficiency within (0, 1] of the measured peak.
            b = max(b, 1.0 / peak)
            ovh[kind], eff[kind] = float(o), float(min(1.0, 1.0 / (b * peak)))
            errs += list(np.abs((o + b * xs) / ts - 1.0))
        return eff, ovh, float(np.median(errs))

    best = min((solve(h) + (h,) for h in (0.0, 4.0, 16.0, 32.0, 64.0, 128.0, 256.0)), key=lambda s: s[2])
    eff, ovh, err, h = best
    hw = replace(base, peak_flops=peak, half_tokens=max(h, 1e-6), max_efficiency=max(eff.values()),
                 kind_efficiency=eff, kind_overhead_s=ovh)
    return Fit(hardware=hw, median_error=err,
               backward_ratio={k: statistics.median(v) for k, v in ratio.items()})


def measure_link(*, sizes=(1 << 10, 1 << 20), repeats: int = 20) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) of one gloo send between two local processes."""
    import torch.multiprocessing as mp

    from mmpipe.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pingpong, args=(r, port, sizes, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    (n0, t0), (n1, t1) = result
    bandwidth = (n1 - n0) / max(t1 - t0, 1e-9) / 1e9
    latency = max(t0 - n0 / (bandwidth * 1e9), 1e-6)
    return latency, bandwidth


def _pingpong(rank: int, port: int, sizes, repeats: int, q) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    times = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            runs.append((time.perf_counter() - t0) / 2)
        times.append((n, statistics.median(runs)))
    if rank == 0:
        q.put(times)
    dist.destroy_process_group()


def run_profile(rc: RunConfig, *, out: str | None, repeats: int) -> Path:
    """Measure, fit, write the hardware YAML; return its path."""
    if rc.model.hf is not None:  # its layers take its processors' inputs, which synthetic_micro_batch does not make
        raise ValueError(f"mmpipe profile measures mmpipe's own model; model {rc.model.name} is a Hugging Face model, "
                         f"which it cannot profile yet: plan it with a hardware preset (hardware=h100, a100, cpu)")
    threads = threads_per_rank(rc.parallel.pp * rc.parallel.dp)
    torch.set_num_threads(threads)
    base = hardware_spec(rc)
    print(f"mmpipe profile: model {rc.model.name}, {threads} torch thread(s) per rank "
          f"(as a pp={rc.parallel.pp} x dp={rc.parallel.dp} run on {os.cpu_count()} cores)", flush=True)
    ms = measure_layers(rc.model, repeats=repeats, seed=rc.train.seed)
    fit = fit_hardware(base, rc.model, ms, trainable=rc.train.trainable)
    latency, bandwidth = measure_link()
    name = f"measured-{rc.model.name}"
    hw = replace(fit.hardware, name=name, link_latency_s=latency, link_gbps=bandwidth)
    path = Path(out) if out else hardware_file(rc.run_dir, name)
    use = use_line(path)
    write_hardware_file(path, hw, model=rc.model.name, header=(
        f"Measured by `mmpipe profile model={rc.model.name}` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, {threads} thread(s) per rank), {time.strftime('%Y-%m-%d')}.\n"
        f"Use: {use}   (valid for model {rc.model.name} only)\n"
        f"Fit: median error {fit.median_error:.1%} per layer; measured backward/forward by kind: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(fit.backward_ratio.items()))))
    print(f"{'kind':<14}{'efficiency':>11}{'overhead':>11}{'bwd/fwd':>9}")
    for k in sorted(hw.kind_efficiency):
        print(f"{k:<14}{hw.kind_efficiency[k]:>11.3f}{hw.kind_overhead_s[k] * 1e6:>9.0f}us"
              f"{fit.backward_ratio.get(k, math.nan):>9.2f}")
    print(f"peak {hw.peak_flops / 1e9:.1f} GFLOP/s, half_tokens {hw.half_tokens:g}, link {latency * 1e6:.0f}us "
          f"+ {bandwidth:.2f} GB/s; fit median error {fit.median_error:.1%}")
    print(f"wrote {path}\n  use: {use}")
    return path
