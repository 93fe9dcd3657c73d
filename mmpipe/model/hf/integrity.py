"""A checkpoint's weight files checked before launch: readable, whole, complete, and shaped as its
config says. Only headers are read (no tensor data), so a 7B checkpoint is checked in well under
a second, instead of every rank failing on it minutes after launch.

- every file `model.safetensors.index.json` lists exists, and holds the tensors it lists;
- a safetensors file is an 8-byte little-endian header length, a JSON header giving each
  tensor's dtype, shape and byte range, then the data: the ranges must be consistent with the
  dtypes and shapes and cover the data exactly up to the end of the file (a file cut short by an
  interrupted copy or download fails here; the safetensors library refuses it only when a rank
  opens it, with "incomplete metadata, file not fully covered");
- every tensor the model loads has the shape the model built from config.json has (the
  meta-device skeleton's state_dict).

The header is parsed by hand because the safetensors library's only reader, safe_open, refuses
such a file with its own message and without saying which bytes are missing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from mmpipe.model.spec import HFSource

PART_KEYS = {"model": "model.path", "vision": "model.vision.path", "audio": "model.audio.path",
             "llm": "model.llm.path", "projector": "model.projector.path"}
"""A weight source's part (HFSource.weights) -> the key the user set its folder with."""
INDEX = "model.safetensors.index.json"
_HEADER_LIMIT = 100 * 2**20
"""The safetensors format's own cap on the header length (100 MB)."""
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) of a safetensors file, after checking that its byte ranges
    cover the file exactly. Raises ValueError (what is wrong, without the key) or OSError."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} holds {size} bytes, not a safetensors file (cut short?)")
        n = int.from_bytes(head, "little")
        if n > min(_HEADER_LIMIT, size - 8):
            raise ValueError(f"{path.name} is not a safetensors file or is cut short: its first 8 bytes announce a "
                             f"{n}-byte header, the file holds {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path.name}: its header is not valid JSON (not a safetensors file, or "
                             f"damaged)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: its header is not a JSON object (not a safetensors file)")
    header.pop("__metadata__", None)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    try:
        for name, info in header.items():
            dtype, shape, (start, stop) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            width = _DTYPE_BYTES.get(dtype)
            if width is not None and stop - start != math.prod(shape) * width:
                raise ValueError(f"{path.name}: tensor {name} spans {stop - start} bytes but is {dtype} of shape "
                                 f"{shape} ({math.prod(shape) * width} bytes); the file is damaged")
            out[name] = (dtype, shape)
            end = max(end, int(stop))
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ValueError) and str(err).startswith(path.name):
            raise
        raise ValueError(f"{path.name}: its header does not describe tensors ({err}); the file is damaged") from None
    want = 8 + n + end
    if want > size:
        raise ValueError(f"{path.name} is cut short: its header describes {want} bytes, the file holds {size} "
                         f"({want - size} missing); copy or download it again")
    if want < size:
        raise ValueError(f"{path.name} has {size - want} bytes after its last tensor (its header describes {want}); "
                         f"the file is damaged: copy or download it again")
    return out


def _folder_headers(folder: Path, key: str) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Stored tensor name -> (file, dtype, shape) of a checkpoint folder, every file checked."""
    where = f"{key}={folder}"
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            listed = {str(k): str(v) for k, v in weight_map.items()}
        except OSError as err:
            raise ValueError(f"{where}: cannot read {INDEX} ({err.strerror or err}); make it readable") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{where}: {INDEX} is not valid JSON with a weight_map; restore it or re-save the "
                             f"model with save_pretrained") from None
        files = sorted(set(listed.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ValueError(f"{where}: {len(missing)} of the {len(files)} files its {INDEX} lists "
                             f"{'is' if len(missing) == 1 else 'are'} missing ({shown}); copy or download "
                             f"the whole checkpoint")
    else:
        try:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        except OSError as err:
            raise ValueError(f"{where}: cannot list the folder ({err.strerror or err}); make it readable") from None
        listed = {}
        if not files:
            raise ValueError(f"{where} holds no .safetensors weights (only safetensors checkpoints load; "
                             f"re-save the model with save_pretrained(safe_serialization=True))")
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for name in files:
        path = folder / name
        try:
            header = read_header(path)
        except OSError as err:
            raise ValueError(f"{where}: cannot read {name} ({err.strerror or err}); make it readable by "
                             f"this user") from None
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        out.update({k: (path, dtype, shape) for k, (dtype, shape) in header.items()})
    absent = sorted(k for k, f in listed.items() if k not in out or out[k][0].name != f)
    if absent:
        raise ValueError(f"{where}: {INDEX} lists {len(absent)} tensor(s) that its files do not hold (first: "
                         f"{absent[0]} in {listed[absent[0]]}); copy or download the whole checkpoint")
    return out


def check_weights(src: HFSource) -> None:
    """Every weight folder of `src` is readable and whole, and every tensor the model loads from
    it has the shape config.json gives. Reads headers only.

    Raises:
        ValueError: one line naming the key, the folder, the file and the fix.
    """
    from mmpipe.model.hf.skeleton import skeleton
    from mmpipe.model.hf.weights import checkpoint_index

    headers: dict[str, dict[str, tuple[Path, str, tuple[int, ...]]]] = {}
    for part, folder in src.weights:
        key = PART_KEYS.get(part, f"model.{part}.path")
        if not os.access(folder, os.R_OK | os.X_OK) or not Path(folder).is_dir():
            raise ValueError(f"{key}={folder}: the folder cannot be read by this user (or is gone); fix its "
                             f"permissions")
        headers[folder] = _folder_headers(Path(folder), key)
    wanted = skeleton(src).state_dict()
    keys = {folder: PART_KEYS.get(part, f"model.{part}.path") for part, folder in src.weights}
    for model_key, ref in checkpoint_index(src).items():
        _, _, shape = headers[ref.folder][ref.key]
        need = tuple(wanted[model_key].shape)
        if shape != need:
            raise ValueError(f"{keys[ref.folder]}={ref.folder}: {Path(ref.file).name} holds {ref.key} of shape "
                             f"{shape}, but the model its config.json describes needs {need} ({model_key}); the "
                             f"weights and config.json are of different models: use the config they were saved with")
