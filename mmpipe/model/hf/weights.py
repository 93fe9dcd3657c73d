"""Per-layer loading from safetensors checkpoints: each rank reads only its own layers' tensors.

Stored key names differ between transformers versions (transformers 4 Hub checkpoints keep
`language_model.model.layers...`, `vision_tower.vision_model...`; transformers 5 modules are
`model.language_model.layers...`, `model.vision_tower...`). The map from stored to module
names is transformers' own checkpoint conversion mapping (`get_model_conversion_mapping` and
`rename_source_key`, what `from_pretrained` applies), run on the meta-device model, so every
layout transformers loads, mmpipe loads. Only the safetensors headers are read to build the
index; a layer then opens the files holding its tensors (memory-mapped) and copies those alone.
"""

from __future__ import annotations

import functools
import json
import resource
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from mmpipe.model.hf.arch import read_config
from mmpipe.model.hf.family import family_of
from mmpipe.model.hf.skeleton import LM, PROJECTOR, owned_keys, skeleton
from mmpipe.model.spec import HFSource, ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorRef:
    """Where one tensor of the model is stored."""

    file: str
    """The safetensors file."""
    key: str
    """Its name in that file."""
    folder: str
    """The checkpoint folder (named in errors)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadReport:
    """What loading one layer cost."""

    layer: str
    """Pipeline layer name."""
    tensors: int
    """Tensors read."""
    bytes: int
    """Bytes read."""
    seconds: float
    """Wall time of the reads and copies."""
    peak_rss_mb: float
    """The process's peak resident memory after the load (VmHWM)."""


LOAD_LOG: list[LoadReport] = []
"""Every layer load of this process, in order (the runtime may log them per stage)."""


def stored_keys(folder: str | Path) -> dict[str, str]:
    """Stored tensor name -> safetensors file of a checkpoint folder (sharded or not)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: str(folder / f) for k, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights (only safetensors checkpoints load; "
                         f"re-save the model with save_pretrained(safe_serialization=True))")
    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            out.update({k: str(f) for k in handle.keys()})
    return out


def canonical_index(folder: str | Path, model: PreTrainedModel) -> dict[str, TensorRef]:
    """The model's own key (its state_dict name) -> stored tensor, for a checkpoint of that model,
    through transformers' conversion mapping. Stored keys the model does not have are left out,
    as from_pretrained ignores them; a key that needs a tensor conversion (not a rename) is an error."""
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    wanted = model.state_dict()
    out: dict[str, TensorRef] = {}
    for stored, file in sorted(stored_keys(folder).items()):
        key, converted = rename_source_key(stored, renamings, converters, model.base_model_prefix, wanted)
        if key not in wanted and stored in wanted:
            key, converted = stored, None
        if key not in wanted:
            continue
        if converted is not None:
            raise ValueError(f"{folder}: tensor {stored} needs a conversion ({converted}) that mmpipe does not "
                             f"apply; load and re-save the checkpoint with transformers first")
        out[key] = TensorRef(file=file, key=stored, folder=str(folder))
    return out


def _source_model(folder: str) -> PreTrainedModel:
    """The meta-device model of a unimodal checkpoint (the class its config.json names)."""
    config = read_config(folder, what="model=compose")
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch or "", None)
    if cls is None:
        raise ValueError(f"{folder}: config.json names no transformers class (architectures="
                         f"{config.architectures}); re-save it with save_pretrained")
    with torch.device("meta"):
        return cls(config)


def _compose_prefixes(part: str, tower: str) -> tuple[tuple[str, str, str], ...]:
    """(source class name suffix, its prefix, the composed model's prefix) of a composed part;
    `tower` is where the composed class keeps the part's tower."""
    return {"vision": (("VisionModel", "", tower + "."), ("Model", "vision_model.", tower + ".")),
            "llm": (("ForCausalLM", "model.", LM + "."), ("ForCausalLM", "lm_head.", "lm_head.")),
            "audio": (("ForConditionalGeneration", "model.encoder.", tower + "."),
                      ("Model", "encoder.", tower + "."))}[part]


def _compose_index(src: HFSource, part: str, folder: str) -> dict[str, TensorRef]:
    model = _source_model(folder)
    name = type(model).__name__
    prefixes = _compose_prefixes(part, family_of(src).towers.get(part, ""))
    rules = [(source, dst) for suffix, source, dst in prefixes if name.endswith(suffix)]
    if not rules:
        raise ValueError(f"model.{part}.path={folder!r} is a {name}; expected a "
                         f"{' or '.join('*' + s for s, _, _ in prefixes)}")
    out = {}
    for key, ref in canonical_index(folder, model).items():
        for source, dst in rules:
            if key.startswith(source):
                out[dst + key[len(source):]] = ref
                break
    return out


@functools.lru_cache(maxsize=8)
def checkpoint_index(src: HFSource) -> dict[str, TensorRef]:
    """The model's own key -> stored tensor, over every weight source of a spec."""
    model = skeleton(src)
    index: dict[str, TensorRef] = {}
    for part, folder in src.weights:
        if part == "model":
            index.update(canonical_index(folder, model))
        elif part == "projector":  # any folder holding a LLaVA / Qwen2-Audio projector
            found = {k: r for k, r in canonical_index(folder, model).items() if k.startswith(PROJECTOR + ".")}
            if not found:
                raise ValueError(f"model.projector.path={folder!r} holds no {PROJECTOR} tensors "
                                 f"of a {src.architecture}")
            index.update(found)
        else:
            index.update(_compose_index(src, part, folder))
    return index


def memory_mb(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident memory in MB. /proc is read
    because ru_maxrss survives exec, so a spawned process would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@torch.no_grad()
def load_layer(layer: nn.Module, spec: ModelSpec, name: str) -> LoadReport:
    """Copy the checkpoint tensors of pipeline layer `name` into `layer` (built by build_layer).

    Tensors no source holds keep their initialisation only where that is the point: a new
    projector of a composition. Anything else missing is an error naming the key and folder.
    """
    src = spec.hf
    if src is None:
        raise ValueError(f"model {spec.name} is mmpipe's own assembly; it has no Hugging Face checkpoint")
    start = time.perf_counter()
    index = checkpoint_index(src)
    state = layer.state_dict(keep_vars=True)
    by_file: dict[str, list[tuple[str, TensorRef]]] = defaultdict(list)
    composed = any(part != "model" for part, _ in src.weights)
    for local, key in owned_keys(spec, name).items():
        ref = index.get(key)
        if ref is None:
            if composed and key.startswith(PROJECTOR + "."):
                continue  # a new projector: random initialisation (LLaVA stage 1)
            folders = ", ".join(f for _, f in src.weights)
            raise ValueError(f"the checkpoint ({folders}) has no tensor for {key} (layer {name} of "
                             f"{src.architecture}); it does not match the model's config")
        by_file[ref.file].append((local, ref))
    tensors = nbytes = 0
    for file, refs in by_file.items():
        with safe_open(file, "pt") as handle:
            for local, ref in refs:
                t = handle.get_tensor(ref.key)
                dst = state[local]
                if t.shape != dst.shape:
                    raise ValueError(f"{ref.folder}: {ref.key} has shape {tuple(t.shape)} but layer {name} "
                                     f"needs {tuple(dst.shape)}; the checkpoint does not match its config")
                dst.copy_(t)
                tensors += 1
                nbytes += t.numel() * t.element_size()
    report = LoadReport(layer=name, tensors=tensors, bytes=nbytes, seconds=time.perf_counter() - start,
                        peak_rss_mb=memory_mb())
    LOAD_LOG.append(report)
    return report


def stored_dtype(ref: TensorRef) -> torch.dtype:
    """The dtype a tensor is stored in (read from the header only)."""
    with safe_open(ref.file, "pt") as handle:
        return _DTYPES[handle.get_slice(ref.key).get_dtype()]


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_tensor(ref: TensorRef) -> torch.Tensor:
    with safe_open(ref.file, "pt") as handle:
        return handle.get_tensor(ref.key)


def stage_load_summary(names: list[str]) -> str:
    """One line for the runtime's log: what loading a stage's layers cost in this process."""
    reports = [r for r in LOAD_LOG if r.layer in set(names)]
    if not reports:
        return "no layer loaded from a checkpoint"
    gb = sum(r.bytes for r in reports) / 1e9
    secs = sum(r.seconds for r in reports)
    return (f"loaded {len(reports)} layers, {sum(r.tensors for r in reports)} tensors, {gb:.3f} GB in "
            f"{secs:.2f} s; peak RSS {max(r.peak_rss_mb for r in reports):.0f} MB")
