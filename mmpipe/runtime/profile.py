"""`mmpipe profile`: measure the configured model on this machine, fit the cost model's
constants to it, and write a hardware description the planner uses instead of a preset
(`mmpipe train --config-dir RUN_DIR/conf hardware=measured-<model>`; `mmpipe plan` likewise).

1. **Layers.** Every layer of the model (mmpipe's own, or a transformers checkpoint's with
   `model=hf` / `model=compose`: vision, audio and decoder blocks, projectors, embeddings,
   norm, head) is timed forward and backward, in one process with the torch threads a
   training rank gets, on the device training uses (a GPU where the backend is NCCL) and in
   the run's precision, on packed micro-batches of 1 to 32 consecutive samples of the run's
   data (decoded by the checkpoint's own processors). Per layer kind, the fit finds the fixed
   per-pass time and the efficiency of the cost model's curve

       time = overhead(kind) + FLOPs * (T + half_tokens) / (T * peak * efficiency(kind))

   on forward + backward time (backward counted in forwards as the cost model counts it).
2. **The engine and memory** (runtime/engine_probe.py): a real `parallel.pp`-stage DeepSpeed
   pipeline trains steps of the run's data cut into 1 to 16 micro-batches; the bounded robust
   fit of the training re-fit turns their times into the per-micro-batch and per-step fixed
   costs (and the scale of the layer figures in a running pipeline), and each rank's resident
   set before its model and its peaks in the steps into the fixed resident set
   (`reserved_gb`) and the slack on every planned byte (`memory_slack`). Stages 0 and 1 time
   sends between them (the link).

Every measurement goes to RUN_DIR/profile.json, the fits to the hardware file's header.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from mmpipe.config import RunConfig, hardware_spec
from mmpipe.data.records import decode_record
from mmpipe.data.skips import SampleError, SkipCounter
from mmpipe.model.geometry import features
from mmpipe.model.layers import build_layers, token_loss
from mmpipe.model.spec import ModelSpec, layer_names
from mmpipe.planner.api import (
    HardwareSpec,
    StepCalibration,
    build_cost_model,
    calibrated_hardware,
    hardware_to_dict,
    layer_stream,
    packed_streams,
)
from mmpipe.runtime.batch import MicroBatch, collate_for
from mmpipe.runtime.engine_probe import ProbeResult, probe_engine
from mmpipe.runtime.hardware_file import hardware_file, use_line, write_hardware_file
from mmpipe.runtime.hf_run import load_templater
from mmpipe.runtime.host import resolve_backend, threads_per_rank, training_device
from mmpipe.runtime.pipeline import media_tokens
from mmpipe.runtime.stages import choose_stages
from mmpipe.runtime.stream import make_stream

SIZES = (1, 2, 4, 8, 16, 32)
"""Samples per profiled micro-batch: one of each size, consecutive samples of the run's data."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One layer timed on one micro-batch."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileBatch:
    """A packed micro-batch of the run's data, with the stream sizes the cost model prices."""

    micro_batch: MicroBatch
    """Its tensors, as the feeder makes them."""
    tokens: np.ndarray
    """[K] tokens of every stream (planner.samples.STREAMS)."""
    squares: np.ndarray
    """[K] sum of squared sequence lengths of every stream."""


def profile_batches(rc: RunConfig, tokenizer, *, sizes: tuple[int, ...] = SIZES) -> list[ProfileBatch]:
    """Packed micro-batches of growing size, of consecutive samples of the run's data (media
    decoded by the checkpoint's processors for a Hugging Face model, as training decodes them);
    samples that cannot be used are passed over, as training skips them."""
    stream = make_stream(rc, tokenizer=tokenizer, dp_rank=0, skips=SkipCounter())
    records = iter(stream.records())
    out = []
    for k in sizes:
        samples, feats = [], []
        for rec in records:
            try:
                samples.append(decode_record(rec, tokenizer, rc.model, media=True, limits=stream.limits))
            except SampleError:
                continue
            feats.append(features(rc.model, rec.meta))
            if len(samples) == k:
                break
        if not samples:
            break
        tokens, squares = packed_streams(feats)
        out.append(ProfileBatch(micro_batch=collate_for(rc.model, samples, packed=True, pad_id=tokenizer.pad_id),
                                tokens=tokens, squares=squares))
    if len(out) < 3:
        raise ValueError(f"data.path={rc.data.path!r}: mmpipe profile needs at least {sum(sizes[:3])} usable samples "
                         f"of model {rc.model.name} to time its layers on micro-batches of 1 to {sizes[-1]} samples")
    return out


def _layers(rc: RunConfig, tokenizer) -> list[torch.nn.Module]:
    """Every pipeline layer of the run's model in one process (weights loaded for a checkpoint)."""
    if rc.model.hf is not None:
        from mmpipe.model.hf.build import build_layers as build_hf_layers

        return build_hf_layers(rc.model, seed=rc.train.seed)
    return build_layers(rc.model, seed=rc.train.seed, **media_tokens(tokenizer))  # the ids training builds with


def _float_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if t.is_floating_point() and t.requires_grad]


def _prepare(inp):
    if isinstance(inp, torch.Tensor):
        return inp.detach().requires_grad_(inp.is_floating_point())
    return tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in inp)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The weights' and activations' dtype of each train.precision (the layers are timed in it)."""


def _clock(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _to(x, device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) else tuple(t.to(device) for t in x)


def measure_layers(spec: ModelSpec, layers: list[torch.nn.Module], batches: list[ProfileBatch], *,
                   repeats: int, device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32) -> list[Measurement]:
    """Forward and backward time of every layer on every micro-batch, on `device` in `dtype` (the
    device and precision training runs in): each layer gets the carrier the layers before it made
    (detached), and the LM head's backward starts at the loss."""
    names = layer_names(spec)
    out: list[Measurement] = []
    device = device or torch.device("cpu")
    for layer in layers:
        layer.to(device=device, dtype=dtype)
    for pb in batches:
        mb = pb.micro_batch
        x = _to(mb.carrier, device)
        targets, scale = mb.targets.to(device), torch.tensor([1.0], device=device)
        for name, layer in zip(names, layers):
            stream = layer_stream(name)
            fwd, bwd = [], []
            for _ in range(repeats + 1):  # the first run warms up
                inp = _prepare(x)
                t0 = _clock(device)
                y = layer(inp)
                t1 = _clock(device)
                outs = _float_outputs(y)
                if name == "llm.head":  # the head's cost includes the loss over the vocabulary
                    y = token_loss(y, (targets, scale))
                    outs = [y]
                    t1 = _clock(device)
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                t2 = _clock(device)
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                layer.zero_grad(set_to_none=True)
            if stream is not None:
                out.append(Measurement(layer=name, tokens=float(pb.tokens[stream]),
                                       sq_tokens=float(pb.squares[stream]),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineFit:
    """The probe pipeline's figures fitted into the cost model's fixed costs and memory terms."""

    coef: tuple[float, float, float]
    """(a, b, c) of `measured = a * compute + b * micro_batches + c` (bounded, robust)."""
    time_error: float
    """Median |measured / fitted - 1| over the probe's steps."""
    steps: int
    """Probe steps fitted."""
    resident_gb: float
    """The fixed resident set: the largest rank's memory before its model was built, GB."""
    slack: float
    """Measured bytes beyond the resident set per planned byte, less one (>= 0)."""
    memory_error: tuple[float, ...]
    """Per stage, median |measured / predicted - 1| of the peak memory over the probe's steps."""
    measure: str
    """What the probe measured memory as (peak_rss, cuda_max_allocated)."""

    def describe(self) -> str:
        a, b, c = self.coef
        return (f"Engine (a real pipeline, {self.steps} steps of 1 to 16 micro-batches): step = a * compute + "
                f"b * micro_batches + c with a={a:.3g}, b={b * 1e3:.3g} ms, c={c * 1e3:.3g} ms, median error "
                f"{self.time_error:.1%}\n"
                f"Memory ({self.measure}): resident {self.resident_gb:.3g} GB before the model + (1 + "
                f"{self.slack:.3g}) x planned bytes; median error per stage "
                + " ".join(f"{e:.1%}" for e in self.memory_error))


def fit_engine(probe: ProbeResult) -> EngineFit:
    """Fit the fixed costs (the bounded robust fit of the training re-fit, on every probe step at
    once) and the memory terms: the resident set as measured, and one slack factor on the
    planner's bytes (bounded least squares in relative error over every stage and step)."""
    steps = probe.steps
    cal = StepCalibration(window=len(steps), min_steps=len(steps))
    for st in steps:
        cal.observe(st.compute_s, st.micro_batches, st.measured_s)
    time_error = statistics.median(abs(st.measured_s / cal.predict(st.compute_s, st.micro_batches) - 1)
                                   for st in steps)
    resident = max(probe.before_model)
    planned = np.array([st.planned_bytes for st in steps])  # [steps, P]
    measured = np.array([st.peak_bytes for st in steps])
    # measured ~ resident + (1 + slack) * planned, relative to measured: one variable, bounded below by 0
    x = (planned / measured).ravel()
    y = ((measured - resident) / measured).ravel()
    slack = max(0.0, float(np.dot(x, y) / max(np.dot(x, x), 1e-300)) - 1.0)
    predicted = resident + (1 + slack) * planned
    err = tuple(float(np.median(np.abs(measured[:, s] / predicted[:, s] - 1))) for s in range(planned.shape[1]))
    return EngineFit(coef=cal.coef, time_error=float(time_error), steps=len(steps), resident_gb=resident / 1e9,
                     slack=slack, memory_error=err, measure=probe.measure)


def write_record(path: Path, measurements: list[Measurement], probe: ProbeResult) -> None:
    """Everything the profile measured, as JSON (the fits are in the hardware file's header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"layers": [asdict(m) for m in measurements],
                                "probe": {"before_model": list(probe.before_model), "measure": probe.measure,
                                          "link": probe.link, "steps": [asdict(st) for st in probe.steps]}},
                               indent=1) + "\n")


def run_profile(rc: RunConfig, *, out: str | None, repeats: int, engine_steps: int = 3) -> Path:
    """Measure, fit, write the hardware YAML; return its path."""
    threads = threads_per_rank(rc.parallel.pp * rc.parallel.dp)
    torch.set_num_threads(threads)
    base = hardware_spec(rc)
    print(f"mmpipe profile: model {rc.model.name}, {threads} torch thread(s) per rank "
          f"(as a pp={rc.parallel.pp} x dp={rc.parallel.dp} run on {os.cpu_count()} cores)", flush=True)
    tok = load_templater(rc)
    batches = profile_batches(rc, tok)
    device = torch.device("cuda") if resolve_backend(rc.launcher.backend) == "nccl" else torch.device("cpu")
    ms = measure_layers(rc.model, _layers(rc, tok), batches, repeats=repeats, device=device,
                        dtype=DTYPES[rc.train.precision])
    # the layers are timed without adapters, every weight training: a LoRA run fits the hardware's
    # constants from that (its real pipeline, timed below, runs with the adapters)
    fit = fit_hardware(base, rc.model, ms, trainable=("all",) if rc.train.lora.active else rc.train.trainable)
    layers_hw = replace(fit.hardware, micro_batch_overhead_s=0.0, step_overhead_s=0.0, reserved_gb=0.0,
                        memory_slack=0.0)
    print(f"layers: fit median error {fit.median_error:.1%}; timing steps of a real {rc.parallel.pp}-stage pipeline",
          flush=True)
    stages = choose_stages(replace(rc, hardware=hardware_to_dict(layers_hw)), tok).plan
    probe = probe_engine(rc, stages, hardware_to_dict(layers_hw), threads=threads, logs=Path(rc.run_dir) / "logs",
                         steps_each=engine_steps)
    if probe.link is not None:  # the probe simulated its steps' compute with it
        layers_hw = replace(layers_hw, link_latency_s=probe.link[0], link_gbps=probe.link[1])
    write_record(Path(rc.run_dir) / "profile.json", ms, probe)
    engine = fit_engine(probe)
    name = f"measured-{rc.model.name}"
    hw = replace(calibrated_hardware(layers_hw, engine.coef), name=name, reserved_gb=engine.resident_gb,
                 memory_slack=engine.slack)
    path = Path(out) if out else hardware_file(rc.run_dir, name)
    use = use_line(path)
    write_hardware_file(path, hw, model=rc.model.name, device=training_device(device), header=(
        f"Measured by `mmpipe profile model={rc.model.name}` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, {threads} thread(s) per rank), {time.strftime('%Y-%m-%d')}.\n"
        f"Use: {use}   (valid for model {rc.model.name} only)\n"
        f"Layers: median error {fit.median_error:.1%} per layer; measured backward/forward by kind: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(fit.backward_ratio.items())) + "\n"
        + engine.describe()))
    print(f"{'kind':<14}{'efficiency':>11}{'overhead':>11}{'bwd/fwd':>9}")
    for k in sorted(hw.kind_efficiency):
        print(f"{k:<14}{hw.kind_efficiency[k]:>11.3f}{hw.kind_overhead_s[k] * 1e6:>9.0f}us"
              f"{fit.backward_ratio.get(k, math.nan):>9.2f}")
    print(f"peak {hw.peak_flops / 1e9:.1f} GFLOP/s, half_tokens {hw.half_tokens:g}, link "
          f"{hw.link_latency_s * 1e6:.0f}us + {hw.link_gbps:.2f} GB/s; layer fit median error {fit.median_error:.1%}")
    print(engine.describe())
    print(f"wrote {path}\n  use: {use}")
    return path
