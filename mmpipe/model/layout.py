"""The segment layout of a micro-batch: which positions of each packed sequence belong together.

A micro-batch has three packed sequences ("streams"): the LLM row (its samples), all image
patches (their images) and all audio positions (their clips). Attention runs per segment, so
every attention layer needs the segment lengths: on the device as cumulative offsets
(`cu_seqlens`, what varlen kernels take) and on the host (the per-segment SDPA loop, the
longest segment). Collate computes them once (`encode`) and the carrier's LAYOUT slot carries
them through every stage; a stage reads the slot to the host once per micro-batch (`read`), not
once per layer, so a GPU waits for one small copy per stage instead of one per layer.

`read` and `per_batch` remember what they derived from a carrier tensor for as long as they
hold that tensor: every layer of a stage passes the same slot tensors on (DeepSpeed's recompute
passes detached views of the same storage), so the key is the storage, and holding the tensor
keeps that storage from being reused for another micro-batch while the entry lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmpipe.model.geometry import chunk_positions

STREAMS = ("llm", "image", "audio")
"""The packed sequences of a micro-batch, in the order the LAYOUT slot stores them."""


def encode(llm: Sequence[int], image: Sequence[int], audio: Sequence[int]) -> torch.Tensor:
    """int32 [3 + (a + 1) + (b + 1) + (c + 1)]: the segment counts (a, b, c) of the LLM row,
    the images and the clips, then each stream's cu_seqlens (0, l0, l0 + l1, ...).

    The LLM stream of a padded micro-batch (several rows) holds each row's valid length."""
    out = [len(llm), len(image), len(audio)]
    for lengths in (llm, image, audio):
        total = 0
        out.append(0)
        for n in lengths:
            if n < 0:
                raise ValueError(f"segment length {n} is negative")
            total += n
            out.append(total)
    if out[-1] >= 2 ** 31:
        raise ValueError(f"{out[-1]} positions in one stream overflow int32 cu_seqlens")
    return torch.tensor(out, dtype=torch.int32)


def image_segments(grid: Sequence[Sequence[int]]) -> list[int]:
    """Attention segments of images from their patch grids: [rows, cols] -> rows * cols;
    Qwen2-VL's [t, h, w] -> t segments of h * w (each temporal frame attends on its own, as
    transformers' get_vision_cu_seqlens cuts them)."""
    out: list[int] = []
    for g in grid:
        if len(g) == 3:
            out += [int(g[1]) * int(g[2])] * int(g[0])
        else:
            out.append(int(g[0]) * int(g[1]))
    return out


def audio_segments(frames: Sequence[int], conv_stride: int, window: int = 0) -> list[int]:
    """Attention segments of clips with `frames` valid mel frames: a clip's encoder positions,
    ceil(frames / stride) (Whisper's and Qwen2-Audio's (L - 1) // 2 + 1 for their stride 2, and
    mmpipe's tiny model's conv front for any stride); with a `window` (Qwen2.5-Omni's n_window),
    each chunk's positions, clip after clip (model/geometry.py: chunk_positions)."""
    return [n for f in frames for n in chunk_positions(int(f), window=window, conv_stride=conv_stride)]


@dataclass(frozen=True, slots=True)
class Stream:
    """The segments of one packed sequence of the current micro-batch."""

    lengths: tuple[int, ...]
    """Segment lengths, in order (host)."""
    cu_seqlens: torch.Tensor
    """[len(lengths) + 1] int32 cumulative offsets, on the carrier's device."""
    derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Tensors a kernel builds from this stream once per micro-batch (document ids, block
    masks), by the kernel's own key."""

    @property
    def total(self) -> int:
        """Positions in the stream."""
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        """The longest segment (varlen kernels size their grid by it)."""
        return max(self.lengths, default=0)

    def document_ids(self) -> torch.Tensor:
        """[total] int32: the segment index of every position, built on the device from
        cu_seqlens (no host round trip), once per micro-batch."""
        ids = self.derived.get("document_ids")
        if ids is None:
            pos = torch.arange(self.total, device=self.cu_seqlens.device, dtype=torch.int32)
            ids = torch.searchsorted(self.cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32)
            self.derived["document_ids"] = ids
        return ids


@dataclass(frozen=True, slots=True)
class Layout:
    """The segments of every stream of a micro-batch."""

    llm: Stream
    """Samples of the packed LLM row (or the valid length of each padded row)."""
    image: Stream
    """Images (Qwen2-VL: temporal frames) over all patches."""
    audio: Stream
    """Clips (Qwen2.5-Omni: each clip's chunks) over all audio-encoder positions."""


class _PerBatch:
    """Values derived from carrier tensors, kept (with the tensor) for the last `size` ones."""

    def __init__(self, size: int = 64):
        self.size = size
        self.items: OrderedDict[tuple, tuple[torch.Tensor, Any]] = OrderedDict()

    def get(self, t: torch.Tensor, what: Any, make: Callable[[torch.Tensor], Any]) -> Any:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
               t.dtype, t.device, what)
        hit = self.items.get(key)
        if hit is not None:
            self.items.move_to_end(key)
            return hit[1]
        value = make(t)
        self.items[key] = (t, value)
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_PER_BATCH = _PerBatch()


def per_batch(t: torch.Tensor, what: Any, make: Callable[[torch.Tensor], Any]) -> Any:
    """`make(t)`, computed once per micro-batch and stage: later calls with the same carrier
    tensor (or a detached view of it) and the same `what` get the first result."""
    return _PER_BATCH.get(t, what, make)


def host_list(t: torch.Tensor) -> list:
    """`t.tolist()`, copied to the host once per micro-batch and stage."""
    return per_batch(t, "host_list", lambda x: x.tolist())


def read(slot: torch.Tensor) -> Layout:
    """The Layout of the LAYOUT slot, with one device-to-host copy per micro-batch and stage."""
    return per_batch(slot, "layout", _decode)


def _decode(slot: torch.Tensor) -> Layout:
    if slot.dim() != 1 or slot.dtype != torch.int32 or slot.numel() < 6:
        raise ValueError(f"the carrier's LAYOUT slot is {tuple(slot.shape)} {slot.dtype}, not the int32 "
                         f"vector mmpipe.model.layout.encode makes; build micro-batches with "
                         f"mmpipe.runtime.batch.collate / collate_hf")
    values = slot.tolist()  # the one host copy of this micro-batch on this stage
    counts = values[:3]
    if min(counts) < 0 or 3 + sum(counts) + 3 != len(values):
        raise ValueError(f"the carrier's LAYOUT slot holds {len(values)} values but its header {counts} "
                         f"needs {3 + sum(counts) + 3}")
    streams, at = [], 3
    for n in counts:
        cu = values[at:at + n + 1]
        lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
        if cu[0] != 0 or any(n < 0 for n in lengths):
            raise ValueError(f"the carrier's LAYOUT slot has cu_seqlens {cu} that do not start at 0 and rise")
        streams.append(Stream(lengths=lengths, cu_seqlens=slot[at:at + n + 1]))
        at += n + 1
    return Layout(llm=streams[0], image=streams[1], audio=streams[2])
