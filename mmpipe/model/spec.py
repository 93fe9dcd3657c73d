"""Architecture figures of a multimodal LLM, and its flat list of pipeline layers.

Pure values only: the planner reads these specs to cost a 7B preset without building
weights, and the runtime builds the tiny CPU model from the same spec. The layer grammar is
`<component>.<kind>[.<index>]` (docs/spec.md section 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    both sides rounded to multiples of patch*merge, area clamped to [min_pixels, max_pixels];
    `smart`: transformers' Qwen2-VL `smart_resize`, exactly (as `native`, but a side may round
    to 0 before the area clamp, and an aspect ratio over 200 is refused)."""
    image_size: int = 336
    """Side of a `fixed` resize."""
    min_pixels: int = 4 * 28 * 28
    """Smallest area of a `native` resize."""
    max_pixels: int = 1280 * 28 * 28
    """Largest area of a `native` resize."""
    merge: int = 1
    """Spatial merge: merge x merge neighbouring patches become one LLM token."""
    cls_token: bool = False
    """A class token adds one encoder position."""
    select: str = "patches"
    """Which encoder positions become LLM tokens (after the merge): `patches` (every patch,
    the class token dropped), or LLaVA's `vision_feature_select_strategy`: `default` (drops
    position 0, whatever it holds) or `full` (every position, the class token included)."""
    temporal_patch: int = 1
    """Frames per patch (Qwen2-VL: 2; a still image is repeated to fill them)."""
    proj: tuple[int, ...] = ()
    """Projector output widths; its input width is hidden * merge**2; the last must equal
    the LLM hidden size."""
    channels: int = 3
    """Image channels."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "patch", "merge", "channels", "temporal_patch")
        if self.resize not in ("fixed", "native", "smart"):
            raise ValueError(f"model.vision.resize={self.resize!r} is unknown; use fixed, native or smart")
        if self.select not in ("patches", "default", "full"):
            raise ValueError(f"model.vision.select={self.select!r} is unknown; use patches, default or full")
        if self.select != "patches" and self.merge != 1:
            raise ValueError(f"model.vision.select={self.select} needs model.vision.merge=1 (LLaVA-style "
                             f"towers do not merge patches); got merge={self.merge}")
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
    pool_ceil: bool = True
    """A last, partial pooling window still makes a token (ceil); false: it is dropped, as
    torch's AvgPool1d without ceil_mode does in Qwen2-Audio (floor)."""
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
    """The LM head is the input embedding (one weight; DeepSpeed's TiedLayerSpec keeps the
    copies equal when llm.embed and llm.head sit on different stages)."""

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
class HFSource:
    """Where a model made of Hugging Face transformers modules comes from (`mmpipe.model.hf`).

    Plain strings only, so a spec stays a hashable value the planner can carry around.
    """

    architecture: str
    """The transformers class the model is and exports as, e.g. `LlavaForConditionalGeneration`."""
    config: str = field(repr=False)
    """That class's configuration as JSON (what its config.json holds)."""
    weights: tuple[tuple[str, str], ...] = ()
    """(part, folder) to load weights from: `model` for a whole checkpoint; `vision`, `audio`,
    `llm`, `projector` for a composition; empty for a random initialisation."""
    image_processor: str = field(default="", repr=False)
    """The image processor's configuration as JSON (empty without a vision tower)."""
    feature_extractor: str = field(default="", repr=False)
    """The audio feature extractor's configuration as JSON (empty without an audio tower)."""


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
    hf: HFSource | None = None
    """The transformers source of a model built by `mmpipe.model.hf`; None for mmpipe's own
    tiny assembly (`mmpipe.model.layers`)."""

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


_SHAPING = {"vision": ("blocks", "hidden", "mlp", "heads", "patch", "image_size", "merge", "cls_token",
                       "temporal_patch", "proj", "channels"),
            "audio": ("blocks", "hidden", "mlp", "heads", "mel_bins", "conv_stride", "max_seconds", "proj"),
            "llm": ("blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "tie_embeddings")}
"""The figures of each component that shape its weights (image_size: fixed-size towers' position
table; max_seconds: the audio position table). Resizing, pixel limits and max_seq_len change what
the data becomes, not the tensors a checkpoint holds."""


def model_identity(spec: ModelSpec) -> dict[str, Any]:
    """What a checkpoint records of the model it holds, and a resumed run must share: the
    weight-shaping figures of each component (`llm.blocks`, ...), `vision` / `audio` absent
    when the model has none, and a Hugging Face model's class. The name is kept to be shown."""
    out: dict[str, Any] = {"name": spec.name, "class": spec.hf.architecture if spec.hf else "mmpipe"}
    for comp in COMPONENTS:
        part = getattr(spec, comp)
        out[comp] = None if part is None else {k: _plain(getattr(part, k)) for k in _SHAPING[comp]}
    return out


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def identity_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`what: X in the checkpoint, Y in this run` for each weight-shaping figure that differs."""
    out = []
    if saved.get("class") != now.get("class"):
        out.append(f"class: {saved.get('class')} in the checkpoint, {now.get('class')} in this run")
    for comp in COMPONENTS:
        a, b = saved.get(comp), now.get(comp)
        if (a is None) != (b is None):
            have, lack = ("the checkpoint", "this run") if a is not None else ("this run", "the checkpoint")
            out.append(f"{comp}: in {have}, not in {lack}")
        elif a is not None:
            out += [f"{comp}.{k}: {a.get(k)} in the checkpoint, {b[k]} in this run" for k in b if a.get(k) != b[k]]
    return out
