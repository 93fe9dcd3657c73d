"""Architecture figures of a multimodal LLM, and its flat list of pipeline layers.

Pure values only: the planner reads these specs to cost a 7B preset without building
weights, and the runtime builds the tiny CPU model from the same spec. The layer grammar is
`<component>.<kind>[.<index>]` (see shared/spec/PLANNING.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

COMPONENTS = ("vision", "audio", "llm")


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    """A ViT-style image encoder (CLIP / SigLIP / Qwen2-VL)."""

    blocks: int
    """Transformer blocks in the encoder."""
    hidden: int
    """Hidden width of the encoder."""
    mlp: int
    """MLP inner width of each block."""
    heads: int
    """Attention heads."""
    patch: int
    """Square patch side in pixels."""
    resize: str = "fixed"
    """`fixed`: every image resized to image_size x image_size; `native`: aspect kept,
    both sides rounded to multiples of patch*merge, area clamped to [min_pixels, max_pixels]."""
    image_size: int = 336
    """Side of a `fixed` resize."""
    min_pixels: int = 4 * 28 * 28
    """Smallest area of a `native` resize."""
    max_pixels: int = 1280 * 28 * 28
    """Largest area of a `native` resize."""
    merge: int = 1
    """Spatial merge: merge x merge neighbouring patches become one LLM token."""
    cls_token: bool = False
    """A class token adds one encoder position (not passed to the LLM)."""
    proj: tuple[int, ...] = ()
    """Projector output widths; its input width is hidden * merge**2; the last must equal
    the LLM hidden size."""
    channels: int = 3
    """Image channels."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "patch", "merge", "channels")
        if self.resize not in ("fixed", "native"):
            raise ValueError(f"model.vision.resize={self.resize!r} is unknown; use fixed or native")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.vision.hidden={self.hidden} is not divisible by model.vision.heads={self.heads}"
            )
        if not self.proj:
            raise ValueError("model.vision.proj is empty; give the projector widths, e.g. [4096, 4096]")

    @property
    def proj_in(self) -> int:
        return self.hidden * self.merge * self.merge


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioSpec:
    """A Whisper-style audio encoder over log-mel features."""

    blocks: int
    """Transformer blocks in the encoder."""
    hidden: int
    """Hidden width of the encoder."""
    mlp: int
    """MLP inner width of each block."""
    heads: int
    """Attention heads."""
    mel_bins: int = 128
    """Log-mel channels of the input features."""
    sample_rate: int = 16000
    """Waveform sample rate the features are computed at."""
    frames_per_s: int = 100
    """Mel frames per second (hop = sample_rate / frames_per_s)."""
    conv_stride: int = 2
    """The conv front divides frames by this: positions/s = frames_per_s / conv_stride."""
    pool: int = 2
    """Average pooling of encoder positions before the projector."""
    max_seconds: float = 30.0
    """Clips are cut at this length."""
    proj: tuple[int, ...] = ()
    """Projector output widths; input width is hidden; the last must equal the LLM hidden."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "mel_bins", "sample_rate",
                  "frames_per_s", "conv_stride", "pool")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.audio.hidden={self.hidden} is not divisible by model.audio.heads={self.heads}"
            )
        if not self.proj:
            raise ValueError("model.audio.proj is empty; give the projector widths, e.g. [4096]")
        if self.max_seconds <= 0:
            raise ValueError(f"model.audio.max_seconds={self.max_seconds} must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class LLMSpec:
    """A Llama / Qwen2-style decoder (SwiGLU MLP, RMSNorm, rotary positions, GQA)."""

    blocks: int
    """Decoder blocks."""
    hidden: int
    """Hidden width."""
    mlp: int
    """SwiGLU inner width."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when < heads)."""
    vocab: int
    """Vocabulary size (embedding rows and LM head outputs)."""
    max_seq_len: int = 4096
    """Longest sequence a sample may have."""
    tie_embeddings: bool = False
    """Tie the LM head to the input embedding (never across pipeline stages here)."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.llm.hidden={self.hidden} is not divisible by model.llm.heads={self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model.llm.kv_heads={self.kv_heads} does not divide model.llm.heads={self.heads}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A whole multimodal model: optional encoders and a decoder LLM."""

    name: str
    """Preset name, e.g. `tiny` or `qwen2-vl-7b`."""
    llm: LLMSpec
    """The decoder."""
    vision: VisionSpec | None = None
    """Image encoder, or None for a model without one."""
    audio: AudioSpec | None = None
    """Audio encoder, or None."""

    def __post_init__(self) -> None:
        for comp, enc in (("vision", self.vision), ("audio", self.audio)):
            if enc is not None and enc.proj[-1] != self.llm.hidden:
                raise ValueError(
                    f"model.{comp}.proj ends in {enc.proj[-1]} but model.llm.hidden={self.llm.hidden}; "
                    f"the projector must output the LLM width"
                )

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(c for c in COMPONENTS if c == "llm" or getattr(self, c) is not None)


def layer_names(spec: ModelSpec) -> list[str]:
    """The ordered pipeline layers of a model: encoders (vision, audio), then the LLM."""
    names: list[str] = []
    for comp, enc in (("vision", spec.vision), ("audio", spec.audio)):
        if enc is None:
            continue
        names.append(f"{comp}.embed")
        names.extend(f"{comp}.block.{i}" for i in range(enc.blocks))
        names.append(f"{comp}.proj")
    names.append("llm.embed")
    names.extend(f"llm.block.{i}" for i in range(spec.llm.blocks))
    names += ["llm.norm", "llm.head"]
    return names


def is_trainable(layer: str, trainable: tuple[str, ...]) -> bool:
    """Whether a layer trains under component prefixes such as ("vision.proj", "llm") or ("all",)."""
    if "all" in trainable:
        return True
    return any(layer == p or layer.startswith(p + ".") for p in trainable)


TRAINABLE_PREFIXES = ("all", "vision", "vision.proj", "audio", "audio.proj", "llm")


def spec_from_dict(cfg: Mapping[str, Any]) -> ModelSpec:
    """Build a ModelSpec from a plain mapping (a resolved `model` config group).

    Unknown keys are an error naming the key, so a typo never goes unnoticed.
    """
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    if not name:
        raise ValueError("model.name is missing; every model preset names itself")
    parts: dict[str, Any] = {}
    for comp, cls in (("vision", VisionSpec), ("audio", AudioSpec), ("llm", LLMSpec)):
        sub = cfg.pop(comp, None)
        if sub is None:
            if comp == "llm":
                raise ValueError("model.llm is missing; a model needs a decoder LLM")
            continue
        parts[comp] = _dataclass_from(cls, f"model.{comp}", sub)
    if cfg:
        key = sorted(cfg)[0]
        raise ValueError(f"model.{key} is not a model setting; known: name, vision, audio, llm")
    return ModelSpec(name=str(name), **parts)


def _dataclass_from(cls: type, prefix: str, values: Mapping[str, Any]) -> Any:
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    kwargs: dict[str, Any] = {}
    for key, value in dict(values).items():
        if key not in known:
            raise ValueError(f"{prefix}.{key} is not a setting; known: {', '.join(sorted(known))}")
        if key == "proj":
            value = tuple(int(v) for v in value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{prefix}: {err}") from None


def _positive(obj: object, *fields: str) -> None:
    comp = type(obj).__name__.removesuffix("Spec").lower()
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"model.{comp}.{f}={v!r} must be a positive integer")
