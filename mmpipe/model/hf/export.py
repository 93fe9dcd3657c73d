"""Export a trained Hugging Face model as a folder transformers loads with its original class.

`export(spec, checkpoint, out)` reads DeepSpeed's pipeline checkpoint one layer file at a time
(`layer_XX-model_states.pt`, one per layer index, `weights_only=True`), renames each tensor to
the transformers model's own key and back to the layout `save_pretrained` writes (transformers'
own reverse conversion mapping), and streams the tensors into safetensors shards; at most one
shard's worth of tensors is held at a time. Tensors no pipeline layer holds (a CLIP tower's
post-norm and the blocks after `vision_feature_layer`, SigLIP's pooling head) are copied from
the source checkpoint, so `from_pretrained` finds every key; a tied LM head is left out, as
`save_pretrained` leaves it out. Each tensor is written in the dtype its source stored (the
config's dtype for one without a source), so an export right after loading is bit-identical.
config.json and the tokenizer / processor files come from the source folders.

A thinker trained from a full Qwen2.5-Omni folder exports as that full folder again: the thinker's
tensors under `thinker.`, the talker's and token2wav's copied unchanged from the source with its
config.json and speaker file, so `Qwen2_5OmniForConditionalGeneration` (and the thinker class
alone) load it.
The output folder is guarded by mmpipe.export_folder: never a source folder of the
model, never a folder of files the export did not write, and written into a temporary sibling
that replaces it only when complete.
"""

from __future__ import annotations

import pickle
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.core_model_loading import revert_weight_conversion

from mmpipe.export_folder import check_out, staged
from mmpipe.model.hf.build import build_layer, tied_embedding
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.integrity import PART_KEYS, check_weights
from mmpipe.model.hf.outer import outer_folder
from mmpipe.model.hf.skeleton import layer_parts, materialise, owned_keys, skeleton, unowned_keys
from mmpipe.model.hf.weights import TensorRef, checkpoint_index, read_tensor, stored_dtype, stored_keys
from mmpipe.model.layers import layer_seed
from mmpipe.model.lora import merged_weight, peft_lora_config, saved_adapter_names, split_state
from mmpipe.model.spec import NO_LORA, HFSource, LoraSpec, ModelSpec, is_trainable, layer_names

ADAPTER_FILE = "adapter_model.safetensors"
"""PEFT's adapter weights file (peft.utils.SAFETENSORS_WEIGHTS_NAME)."""
SHARD_BYTES = 5 * 2**30
"""Largest shard written (transformers' own default for save_pretrained)."""
_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.json", "chat_template.jinja")
_MEDIA_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportReport:
    """What an export wrote."""

    folder: str
    """The output folder."""
    tensors: int
    """Tensors written."""
    bytes: int
    """Bytes of tensor data written."""
    shards: int
    """safetensors files."""
    copied: tuple[str, ...]
    """Keys copied from the source checkpoint (held by no pipeline layer)."""
    seconds: float
    """Wall time."""
    adapters: bool = False
    """PEFT's adapter folder (a LoRA run), not the whole model."""


class _ShardWriter:
    """Streams tensors into `model-XXXXX-of-YYYYY.safetensors` shards (or one model.safetensors)."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + size > self.limit:
                self._flush()
            self.pending[key] = t.detach().contiguous().clone()
            self.pending_bytes += size
            self.total += size

    def _flush(self) -> None:
        path = self.out / f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        import json

        if self.pending:
            self._flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return 1
        weight_map = {}
        for i, (path, keys) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return n


def _dtype(src: HFSource, key: str, index: dict[str, TensorRef]) -> torch.dtype:
    if key in index:
        return stored_dtype(index[key])
    dtype = getattr(hf_config(src), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _saved_names(src: HFSource, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model keys -> the names save_pretrained writes (transformers' reverse conversion)."""
    return revert_weight_conversion(skeleton(src), tensors)


def _copy_files(spec: ModelSpec, out: Path, tokenizer: str | Path | None) -> None:
    src = spec.hf
    folders = dict(src.weights)
    whole = folders.get("model")
    if whole is not None and (Path(whole) / "config.json").is_file():
        shutil.copy2(Path(whole) / "config.json", out / "config.json")
    else:
        config = hf_config(src).__class__.from_dict(hf_config(src).to_dict())
        config.architectures = [src.architecture]
        config.save_pretrained(out)
    media_from = whole or folders.get("vision") or folders.get("audio")
    text_from = tokenizer or whole or folders.get("llm")
    held = outer_folder(spec)
    for folder, names in ((text_from, _TEXT_FILES + ("generation_config.json",)), (media_from, _MEDIA_FILES),
                          (held.folder if held else None, held.outer.files if held else ())):
        for name in names:
            if folder is not None and (Path(folder) / name).is_file():
                shutil.copy2(Path(folder) / name, out / name)
    if not any((out / n).is_file() for n in _MEDIA_FILES):  # an inline preset: its processor config
        text = src.image_processor or src.feature_extractor
        if text:
            (out / "preprocessor_config.json").write_text(text + "\n")
        if src.video_processor and src.video_processor != src.image_processor:  # else transformers falls back
            (out / "video_preprocessor_config.json").write_text(src.video_processor + "\n")


def source_folders(spec: ModelSpec, checkpoint: str | Path, tokenizer: str | Path | None = None) -> dict[str, str]:
    """Every folder an export reads, by the key that named it: the model's checkpoint folders,
    a data.tokenizer folder, the pipeline checkpoint."""
    src = spec.hf
    out = {PART_KEYS.get(part, f"model.{part}.path"): str(folder) for part, folder in (src.weights if src else ())}
    if tokenizer is not None:
        out["data.tokenizer"] = str(tokenizer)
    out["checkpoint"] = str(checkpoint)
    return out


def export(spec: ModelSpec, checkpoint: str | Path, out: str | Path, *, seed: int = 0,
           tokenizer: str | Path | None = None, shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
           about: Mapping[str, object] | None = None, lora: LoraSpec = NO_LORA, merge: bool = False,
           trainable: tuple[str, ...] = ()) -> ExportReport:
    """Write `out` so that `spec.hf.architecture.from_pretrained(out)` loads the trained model; a
    run with adapters (`lora`) writes PEFT's adapter folder instead (`adapter_config.json`,
    `adapter_model.safetensors`, which `PeftModel.from_pretrained(<the source model>, out)`
    loads; the layers `trainable` names, trained in full beside the adapters, go in it as
    PEFT's modules_to_save), or with `merge` the whole model with every adapter merged into its
    base weight.

    Args:
        spec: the run's model (made by mmpipe.model.hf).
        checkpoint: a pipeline checkpoint folder (`RUN/checkpoints/stepN`) with one
            `layer_XX-model_states.pt` per layer index.
        out: the folder to write: new, empty, or an earlier export (its manifest says so); it is
            replaced whole when the export is complete. Never a source folder.
        seed: the run seed, for the rare tensor neither the run nor a source holds.
        tokenizer: a folder to take the tokenizer files from (default: the source's).
        shard_bytes: largest safetensors shard.
        overwrite: replace an earlier export's files that changed since it wrote them (files
            it did not write are refused with or without it).
        about: extra fields for the manifest (the run, the checkpoint).

    Raises:
        ValueError: one line; `out` is then untouched (a refused folder, a broken checkpoint).
        OSError: a write failed (a full disk); `out` is then untouched too.
    """
    if spec.hf is None:
        raise ValueError(f"model {spec.name} is mmpipe's own assembly; only Hugging Face models export")
    start = time.perf_counter()
    src, checkpoint = spec.hf, Path(checkpoint)
    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint {str(checkpoint)!r} is not a folder; give RUN_DIR/checkpoints/stepN")
    real = check_out(out, source_folders(spec, checkpoint, tokenizer), overwrite=overwrite)
    if src.weights:  # a source damaged since training: one line now, not a safetensors traceback
        check_weights(src)
    index = checkpoint_index(src) if src.weights else {}
    adapters_only = lora.active and not merge
    if adapters_only:
        base = dict(src.weights).get("model")
        held = outer_folder(spec)
        if held is not None:
            part = held.outer.part
            raise ValueError(f"model {spec.name} is the {part} of a {held.outer.title} folder, whose class "
                             f"({src.architecture}) does not load that folder: export the whole model with "
                             f"merge=true (or train from a {part} folder)")
        if base is None:
            raise ValueError(f"model {spec.name} is composed from several folders (or given inline): an adapter "
                             f"folder needs one base checkpoint to load onto; export the whole model with "
                             f"merge=true")
    with staged(real, {"checkpoint": str(checkpoint.resolve()), **(about or {})}, overwrite=overwrite) as tmp:
        if adapters_only:
            report = _write_adapters(spec, checkpoint, tmp, lora=lora, trainable=trainable, base=base, seed=seed)
        else:
            report = _write(spec, checkpoint, tmp, index=index, seed=seed, tokenizer=tokenizer,
                            shard_bytes=shard_bytes, lora=lora)
    return ExportReport(folder=str(out), tensors=report[0], bytes=report[1], shards=report[2], copied=report[3],
                        seconds=time.perf_counter() - start, adapters=adapters_only)


def _layer_state(checkpoint: Path, i: int, name: str) -> dict[str, torch.Tensor]:
    """Pipeline layer i's saved state dict (DeepSpeed's `layer_XX-model_states.pt`)."""
    path = checkpoint / f"layer_{i:02d}-model_states.pt"
    if not path.is_file():
        raise ValueError(f"{path} is missing: checkpoint {checkpoint} has no state of layer {i} ({name})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{path} cannot be read ({first}); the checkpoint is damaged: export another "
                         f"one (checkpoint=stepN)") from None


def _layer_tensors(spec: ModelSpec, checkpoint: Path, i: int, name: str, seed: int, *,
                   lora: LoraSpec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Pipeline layer i's (base tensors under their unwrapped names, adapter tensors). A LoRA
    checkpoint holds only what trained; the frozen tensors it leaves out are the layer as the run
    built it (build_layer: the source checkpoint's tensors, or the seeded initialisation). Any
    other checkpoint must hold every tensor (the caller's key check says which are missing)."""
    base, adapters = split_state(_layer_state(checkpoint, i, name))
    missing = set(owned_keys(spec, name)) - set(base)
    if missing and lora.active:
        built = build_layer(spec, name, seed=seed).state_dict()
        base.update({k: built[k] for k in missing if k in built})
    return base, adapters


def _merge(tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], lora: LoraSpec,
           name: str) -> dict[str, torch.Tensor]:
    """A layer's base tensors under their unwrapped names, each adapter merged into its weight."""
    base, adapters = tensors
    for key in adapters:
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = adapters.get(key.replace(".lora_A.", ".lora_B."))
            if b is None or f"{module}.weight" not in base:
                raise ValueError(f"layer {name}: the checkpoint's adapter {key} has no lora_B or base weight; "
                                 f"it is damaged")
            base[f"{module}.weight"] = merged_weight(base[f"{module}.weight"], adapters[key], b, lora)
    return base


def _write_adapters(spec: ModelSpec, checkpoint: Path, out: Path, *, lora: LoraSpec, trainable: tuple[str, ...],
                    base: str, seed: int) -> tuple[int, int, int, tuple[str, ...]]:
    """PEFT's adapter folder of a LoRA run: every adapter tensor under PEFT's saved name and the
    LoraConfig naming exactly the adapted modules (so that no other module of the whole model,
    a tower's q_proj under parts=[llm], gets one when PEFT loads it); the layers trained in full
    (train.trainable: a projector) as PEFT's `modules_to_save`, their trained tensors beside."""
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    whole: list[str] = []
    tie = tied_embedding(spec)
    for i, name in enumerate(layer_names(spec)):
        full = is_trainable(name, trainable) and not lora.adapts(name)
        if not (lora.adapts(name) or full) or (tie is not None and name == tie.layers[1]):
            continue
        if full:
            base_state, adapters = _layer_tensors(spec, checkpoint, i, name, seed, lora=lora)
        else:  # the adapters alone: no need to rebuild the frozen base
            base_state, adapters = split_state(_layer_state(checkpoint, i, name))
        saved = saved_adapter_names(spec, name, adapters)
        tensors.update(saved)
        targets += sorted({k.removeprefix("base_model.model.").split(".lora_")[0] for k in saved})
        if full:
            keys = owned_keys(spec, name)
            for _, path in layer_parts(spec, name):
                if path in keys.values():
                    raise ValueError(f"layer {name} trained in full holds {path}, a bare parameter, which PEFT's "
                                     f"modules_to_save cannot carry; export the whole model with merge=true")
                if any(k.startswith(path + ".") for k in keys.values()):
                    module = skeleton(spec.hf).get_submodule(path)
                    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # PEFT wraps modules only
                        whole += [f"{path}.{child}" for child, _ in module.named_children()]
                    else:
                        whole.append(path)
            tensors.update({f"base_model.model.{key}": base_state[local] for local, key in keys.items()})
    if not targets:
        raise ValueError(f"checkpoint {checkpoint} holds no adapter tensors: it is not a checkpoint of a "
                         f"train.lora run")
    config = peft_lora_config(lora, targets)
    config.modules_to_save = sorted(set(whole)) or None
    if tie is not None and is_trainable("llm.embed", trainable) and not lora.adapts("llm.embed"):
        config.ensure_weight_tying = True  # the trained embedding is the LM head too, as in training
    config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / ADAPTER_FILE),
              metadata={"format": "pt"})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return len(tensors), nbytes, 1, ()


def _write(spec: ModelSpec, checkpoint: Path, out: Path, *, index: dict[str, TensorRef], seed: int,
           tokenizer: str | Path | None, shard_bytes: int,
           lora: LoraSpec = NO_LORA) -> tuple[int, int, int, tuple[str, ...]]:
    """The export's files into `out` (an empty folder): (tensors, bytes, shards, copied keys)."""
    src = spec.hf
    tie = tied_embedding(spec)
    writer = _ShardWriter(out, shard_bytes)
    count = 0
    held = outer_folder(spec)
    prefix = held.prefix if held is not None else ""  # the model inside a larger folder (a full Qwen2.5-Omni's)

    def saved(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {prefix + k: v for k, v in _saved_names(src, tensors).items()}

    for i, name in enumerate(layer_names(spec)):
        if tie is not None and name == tie.layers[1]:
            continue  # the tied head is the embedding's weight, saved with llm.embed
        path = checkpoint / f"layer_{i:02d}-model_states.pt"
        state = _merge(_layer_tensors(spec, checkpoint, i, name, seed, lora=lora), lora, name)
        keys = owned_keys(spec, name)
        if set(state) != set(keys):
            extra = sorted(set(state) ^ set(keys))[:3]
            raise ValueError(f"{path} does not hold layer {name} of {src.architecture} (keys differ: {extra}); "
                             f"is it a checkpoint of this model?")
        tensors = {key: state[local].to(_dtype(src, key, index)) for local, key in keys.items()}
        writer.add(saved(tensors))
        count += len(tensors)
        del state, tensors
    copied = unowned_keys(spec)
    fresh: dict[str, torch.nn.Module] = {}
    for key in copied:
        if key in index:
            t = read_tensor(index[key])
        else:  # no source holds it (an inline preset): transformers' initialisation, seeded
            module_path, attr = key.rsplit(".", 1)
            if module_path not in fresh:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(layer_seed(seed, module_path))
                    fresh[module_path] = materialise(src, module_path)
            t = getattr(fresh[module_path], attr).detach().to(_dtype(src, key, index))
        writer.add(saved({key: t}))
        count += 1
    if held is not None:  # the rest of the folder (Omni's talker and token2wav), as the source holds it
        for key, file in sorted(stored_keys(held.folder).items()):
            if not key.startswith(prefix):
                writer.add({key: read_tensor(TensorRef(file=file, key=key, folder=str(held.folder)))})
                copied.append(key)
                count += 1
    shards = writer.finish()
    _copy_files(spec, out, tokenizer)
    return count, writer.total, shards, tuple(copied)


def save_layer_states(layers: list[torch.nn.Module], spec: ModelSpec, folder: str | Path) -> None:
    """Write layers' state dicts as DeepSpeed's pipeline checkpoint names them (one
    `layer_XX-model_states.pt` per layer index; none for a tied head, whose module is the
    embedding's). For single-process runs and tests; a pipeline run writes these itself."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tie = tied_embedding(spec)
    for i, (name, layer) in enumerate(zip(layer_names(spec), layers)):
        if tie is not None and name == tie.layers[1]:
            continue
        torch.save(layer.state_dict(), folder / f"layer_{i:02d}-model_states.pt")
