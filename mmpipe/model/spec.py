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
FRAME_SAMPLING = ("all", "fps", "count")
"""How a video's frames are picked (VideoSpec.sample)."""
FRAME_INDICES = ("qwen2_vl", "uniform")
"""Whose frame-index rule `sample: fps / count` follows (VideoSpec.indices)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoSpec:
    """How a vision encoder takes a video: which frames it samples, the size they are resized to,
    and how many frames make one temporal patch. The figures of transformers' Qwen2-VL video
    processor (`Qwen2VLVideoProcessor`: do_sample_frames, fps, num_frames, min/max_frames, size,
    cap_pixels_per_frame, max_video_tokens), so that `mmpipe.model.geometry` gives the frames,
    patches and tokens that processor gives; mmpipe's tiny model uses the same rule with its own
    figures (conf/model/tiny.yaml). LLaVA-OneVision (`LlavaOnevisionVideoProcessor` and the
    model's get_video_features) adds the last three fields: its frame-index rule, its per-frame
    pooling and its one newline per video."""

    sample: str = "all"
    """`all`: every frame of the clip (Qwen2-VL's do_sample_frames=false, its default); `fps`: about
    `fps` frames per second of the clip, clamped to [min_frames, max_frames]; `count`: `frames`
    frames, evenly spread."""
    fps: float = 2.0
    """Frames per second sampled (`sample: fps`)."""
    frames: int = 0
    """Frames sampled (`sample: count`), rounded to a multiple of temporal_patch."""
    min_frames: int = 4
    """Fewest frames `sample: fps` takes (never more than the clip has)."""
    max_frames: int = 768
    """Most frames `sample: fps` takes."""
    temporal_patch: int = 2
    """Consecutive sampled frames that make one temporal patch; an odd count is padded by
    repeating the last frame."""
    min_pixels: int = 0
    """Smallest frame area after resizing (`smart` resize); 0: the image's min_pixels."""
    max_pixels: int = 0
    """Largest frame area after resizing (`smart` resize); 0: the image's max_pixels."""
    cap_pixels: bool = False
    """Qwen2-VL's cap_pixels_per_frame: each frame's max_pixels is also bounded by an even share of
    max_tokens tokens' worth of pixels over the clip's frames."""
    max_tokens: int = 128000
    """The token budget of `cap_pixels` (Qwen2-VL's max_video_tokens)."""
    indices: str = "qwen2_vl"
    """`qwen2_vl`: Qwen2-VL's sample_frames (min/max_frames, whole temporal patches); `uniform`:
    transformers' default sampler (BaseVideoProcessor.sample_frames, LLaVA-OneVision's): `fps`
    takes max(1, int(frames / native fps * fps)) frames, `count` takes `frames`, no clamp, at
    indices arange(n) * frames // n."""
    pool: int = 0
    """Per-frame pooling of the projected features to ceil(rows / pool) x ceil(cols / pool)
    (LLaVA-OneVision's bilinear apply_pooling: 2); 0: none."""
    newline: bool = False
    """One learned newline token after each video's features (LLaVA-OneVision's image_newline)."""
    grid_seconds: float = 0.0
    """Seconds one temporal patch spans in the 3-D positions when the model's processor fixes it
    (Qwen2.5-Omni's video_second_per_grid: temporal_patch / its call's fps, 2.0 by default); 0: the
    clip's own, temporal_patch / its sampled frame rate (Qwen2.5-VL's second_per_grid_ts)."""
    audio_in_video: bool = False
    """Qwen2.5-Omni's use_audio_in_video: a clip's audio track goes through the audio tower and its
    tokens are interleaved with the frames' in chunks of chunk_seconds (model.use_audio_in_video)."""
    positions_per_second: float = 25.0
    """Temporal position ids per second of video, which the chunks of `audio_in_video` are cut by
    (the Omni processor's position_id_per_seconds)."""
    chunk_seconds: float = 2.0
    """Seconds of video and audio per interleaved chunk (the Omni processor's seconds_per_chunk)."""

    def __post_init__(self) -> None:
        if self.sample not in FRAME_SAMPLING:
            raise ValueError(f"model.vision.video.sample={self.sample!r} is unknown; use all, fps or count")
        if self.indices not in FRAME_INDICES:
            raise ValueError(f"model.vision.video.indices={self.indices!r} is unknown; use qwen2_vl or uniform")
        for name in ("temporal_patch", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model.vision.video.{name}={v!r} must be a positive integer")
        for name in ("frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "pool"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"model.vision.video.{name}={v!r} must be a non-negative integer")
        if self.sample == "fps" and not self.fps > 0:
            raise ValueError(f"model.vision.video.fps={self.fps!r} must be > 0 with sample=fps")
        if self.sample == "count" and self.frames < 1:
            raise ValueError(f"model.vision.video.frames={self.frames!r} must be >= 1 with sample=count")
        if not self.grid_seconds >= 0 or not self.positions_per_second > 0 or not self.chunk_seconds > 0:
            raise ValueError(f"model.vision.video: grid_seconds={self.grid_seconds!r} must be >= 0, "
                             f"positions_per_second={self.positions_per_second!r} and "
                             f"chunk_seconds={self.chunk_seconds!r} > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    """A ViT-style image encoder (CLIP / SigLIP / Qwen2-VL / Qwen3-VL)."""

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
    to 0 before the area clamp, and an aspect ratio over 200 is refused); `anyres`: LLaVA-NeXT /
    OneVision tiles: the image at image_size x image_size plus a grid of image_size tiles of the
    `grid_pinpoints` resolution that fits it best, each tile a tower pass (model/geometry.py);
    `tiles`: InternVL's dynamic tiles (transformers' GotOcr2ImageProcessor with crop_to_patches):
    the image resized to the grid of min_tiles..max_tiles image_size tiles whose aspect is
    closest to its own, plus a thumbnail of the whole image when the grid has more than one
    tile, each tile a tower pass whose patches (less the class token) merge x merge into LLM
    tokens (InternVL's pixel shuffle)."""
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
    video: VideoSpec | None = None
    """How the encoder takes video (frames, their size, temporal patches); None: no video."""
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    """`anyres`: the (height, width) resolutions a tile grid may take (`image_grid_pinpoints`),
    each side a multiple of image_size."""
    anyres_max: int = 0
    """`anyres`: OneVision's `anyres_max_N` (`vision_aspect_ratio`): an unpadded feature map of
    more than 1.1^2 x N tiles' worth of features is shrunk (bilinear) to about N tiles' worth;
    0: never (LLaVA-NeXT)."""
    anyres_single: bool = False
    """`anyres`: only a sample's lone image is tiled; every image of a sample with several is one
    tile, padded to a square (OneVision's multi-image rule, transformers' `batch_num_images`)."""
    min_tiles: int = 1
    """`tiles`: fewest tiles of a grid (the image processor's min_patches)."""
    max_tiles: int = 12
    """`tiles`: most tiles of a grid, the thumbnail not counted (the image processor's max_patches)."""
    image_markers: int = 0
    """Text tokens the model's processor puts around each image's tokens (InternVL's `<img>` and
    `</img>`: 2; Gemma 3's "\\n\\n", <start_of_image>, <end_of_image>, "\\n\\n": 4), which the
    templater adds and the planner counts as text; 0: none."""
    pooled: bool = False
    """The merge x merge patches are averaged into one token (Gemma 3's average pool) rather than
    concatenated: the projector's input width is `hidden`, not hidden * merge**2."""
    image_blocks: bool = False
    """The LLM attends bidirectionally inside each image's run of tokens (Gemma 3; attention.Segments.
    blocks): flash-attn cannot run it, `train.attention=auto` picks FlexAttention on CUDA."""

    deepstack: tuple[int, ...] = ()
    """Qwen3-VL's DeepStack: the encoder blocks (0-based, rising) whose outputs, each through its
    own merger (as wide as the projector), are added to the LLM hidden states at the image
    tokens after decoder blocks 0, 1, ... in that order. Empty: none."""
    position_table: int = 0
    """Entries of a learned position table interpolated to each image's grid (Qwen3-VL's
    `num_position_embeddings`); 0: none beyond what `fixed` towers hold."""
    window: int = 0
    """Side in pixels of the attention windows of windowed blocks (Qwen2.5-VL's `window_size`):
    the patches of each window attend to each other only; 0: every block attends over the whole
    image."""
    full_blocks: tuple[int, ...] = ()
    """With `window`, the blocks that still attend over the whole image (Qwen2.5-VL's
    `fullatt_block_indexes`); every other block is windowed."""
    mlp_gated: bool = False
    """The block MLP is gated (SwiGLU: gate, up and down matrices, as Qwen2.5-VL's), not two
    matrices."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "patch", "merge", "channels", "temporal_patch")
        if list(self.deepstack) != sorted(set(self.deepstack)) or any(
                not isinstance(i, int) or not 0 <= i < self.blocks for i in self.deepstack):
            raise ValueError(f"model.vision.deepstack={list(self.deepstack)} must be rising block indexes in "
                             f"0..{self.blocks - 1}")
        if self.resize not in ("fixed", "native", "smart", "anyres", "tiles"):
            raise ValueError(f"model.vision.resize={self.resize!r} is unknown; use fixed, native, smart, anyres or "
                             f"tiles")
        if self.resize == "anyres":
            _check_anyres(self)
        if self.resize == "tiles":
            _check_tiles(self)
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
        if self.window and (not isinstance(self.window, int) or self.window < self.patch * self.merge):
            raise ValueError(f"model.vision.window={self.window!r} must be 0 (no windowed blocks) or at least "
                             f"patch * merge = {self.patch * self.merge} pixels")
        bad = [b for b in self.full_blocks if not isinstance(b, int) or not 0 <= b < self.blocks]
        if bad:
            raise ValueError(f"model.vision.full_blocks={list(self.full_blocks)} names block {bad[0]!r}, but the "
                             f"encoder has blocks 0..{self.blocks - 1}")

    @property
    def proj_in(self) -> int:
        return self.hidden if self.pooled else self.hidden * self.merge * self.merge

    def windowed(self, block: int) -> bool:
        """Whether block `block` attends within windows (not over the whole image)."""
        return bool(self.window) and block not in self.full_blocks


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
    window: int = 0
    """Encoder positions per attention chunk (Qwen2.5-Omni's `n_window`): a clip is cut into
    chunks of window * conv_stride mel frames, each convolved and attended on its own; 0: a clip
    attends as a whole."""

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
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"model.audio.window={self.window!r} must be 0 (whole clips) or a positive number of "
                             f"encoder positions per chunk")


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
    attention_dropout: float = 0.0
    """Dropout on the attention weights while training (transformers' LlamaConfig.attention_dropout)
    of mmpipe's own decoder; off in evaluation. A Hugging Face checkpoint's comes from its config.json."""

    def __post_init__(self) -> None:
        _positive(self, "blocks", "hidden", "mlp", "heads", "kv_heads", "vocab", "max_seq_len")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"model.llm.attention_dropout={self.attention_dropout!r} must be in [0, 1)")
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
    video_processor: str = field(default="", repr=False)
    """The video processor's configuration as JSON (empty: the model takes no video)."""


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
        if self.vision is not None and len(self.vision.deepstack) > self.llm.blocks:
            raise ValueError(f"model.vision.deepstack has {len(self.vision.deepstack)} features but the LLM has "
                             f"{self.llm.blocks} blocks to add them to; give at most {self.llm.blocks}")

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


def image_blocks(spec: ModelSpec) -> bool:
    """Whether the spec's LLM attends bidirectionally inside each image (VisionSpec.image_blocks)."""
    return spec.vision is not None and spec.vision.image_blocks


def is_trainable(layer: str, trainable: tuple[str, ...]) -> bool:
    """Whether a layer trains under component prefixes such as ("vision.proj", "llm") or ("all",)."""
    if "all" in trainable:
        return True
    return any(layer == p or layer.startswith(p + ".") for p in trainable)


TRAINABLE_PREFIXES = ("all", "vision", "vision.proj", "audio", "audio.proj", "llm")

LORA_PARTS = ("llm", "vision", "audio")
"""Components train.lora.parts may name (a component's projector belongs to it: `vision.proj`)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""train.lora.target_modules' default: the attention and MLP projections of every supported decoder."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """Low-rank adapters (LoRA, through the `peft` library) on the Linear layers of some components.

    An adapted layer keeps its base weights frozen and trains `lora_A` [r, in] and `lora_B`
    [out, r]; its output is `base(x) + (alpha / r) * B(A(dropout(x)))`, PEFT's LoraLayer. A module
    is adapted when its component is in `parts` and its name matches `target_modules` by PEFT's
    rule for a list (the name, or the name's tail after a dot), the name being the module's path
    in the transformers model (`model.language_model.layers.3.self_attn.q_proj`; in mmpipe's own
    model the layer's name and the module's path in it: `llm.block.3.block.self_attn.q_proj`)."""

    r: int = 0
    """Adapter rank (0: no adapters; the run trains train.trainable in full)."""
    alpha: float = 16.0
    """Scale numerator: adapters add (alpha / r) * B A x (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input in training (PEFT's lora_dropout)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Module names to adapt, as PEFT's LoraConfig takes a list (Linear layers only); [all-linear]:
    every Linear of the parts but the LM head, as PEFT's `all-linear`."""
    parts: tuple[str, ...] = ("llm",)
    """Components whose matching modules get adapters: llm, vision, audio."""

    @property
    def active(self) -> bool:
        return self.r > 0

    def adapts(self, layer: str) -> bool:
        """Whether a pipeline layer's base weights are frozen under adapters (its component is in parts)."""
        return self.active and layer.split(".")[0] in self.parts

    def check_parts(self, model: ModelSpec) -> None:
        """ValueError naming a part in `parts` that the model lacks (no adapters: nothing to check)."""
        names = layer_names(model)
        have = [c for c in COMPONENTS if any(n.startswith(c + ".") for n in names)]
        for part in self.parts if self.active else ():
            if part not in have:
                raise ValueError(f"train.lora.parts names {part!r}, which model {model.name} does not have; use "
                                 f"{' or '.join(have)}")

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 0:
            raise ValueError(f"train.lora.r={self.r!r} must be a non-negative integer (0: no adapters; "
                             f"8 or 16 are usual)")
        if not self.alpha > 0:
            raise ValueError(f"train.lora.alpha={self.alpha!r} must be > 0 (adapters add alpha / r times B A x)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"train.lora.dropout={self.dropout!r} must be in [0, 1)")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"train.lora.target_modules={list(self.target_modules)!r} must be a non-empty list of "
                             f"module names such as [q_proj,v_proj]")
        if not self.parts:
            raise ValueError(f"train.lora.parts=[] adapts nothing; use some of {', '.join(LORA_PARTS)}")
        for p in self.parts:
            if p not in LORA_PARTS:
                raise ValueError(f"train.lora.parts entry {p!r} is unknown; use {', '.join(LORA_PARTS)}")


NO_LORA = LoraSpec()
"""Full training: no adapters."""


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
        if key in ("proj", "deepstack", "full_blocks"):
            value = tuple(int(v) for v in value)
        if key == "video" and value is not None:
            value = _dataclass_from(VideoSpec, f"{prefix}.video", value)
        if key == "grid_pinpoints":
            value = tuple(tuple(int(x) for x in pin) for pin in value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{prefix}: {err}") from None


def _check_tiles(v: VisionSpec) -> None:
    """A dynamic-tile tower (InternVL): a tile grid bound, and whole merge units of whole patches."""
    if v.image_markers not in (0, 2):
        raise ValueError(f"model.vision.image_markers={v.image_markers!r} must be 0 or 2 (a start and an end token)")
    if not (isinstance(v.min_tiles, int) and isinstance(v.max_tiles, int) and 1 <= v.min_tiles <= v.max_tiles):
        raise ValueError(f"model.vision.min_tiles={v.min_tiles!r} and max_tiles={v.max_tiles!r} must be integers "
                         f"with 1 <= min_tiles <= max_tiles")
    side = v.image_size // v.patch
    if v.image_size % v.patch or side % v.merge or v.select != "patches":
        raise ValueError(f"model.vision: a tiles tower needs whole patches (image_size={v.image_size}, "
                         f"patch={v.patch}) whose {side} a side merge={v.merge} divides, and select=patches")


def _check_anyres(v: VisionSpec) -> None:
    """An any-resolution tower: a grid of whole tiles and one feature per patch of a tile (what
    LLaVA-NeXT's feature packing reshapes; a tile's last pixels may fall outside its patches, as
    SigLIP's 27 patches of 14 px do in a 384-px tile)."""
    if not v.grid_pinpoints:
        raise ValueError("model.vision.grid_pinpoints is empty; an anyres tower needs its (height, width) grids, "
                         "e.g. [[672, 672], [336, 1008]]")
    for pin in v.grid_pinpoints:
        if len(pin) != 2 or any(not isinstance(x, int) or x <= 0 or x % v.image_size for x in pin):
            raise ValueError(f"model.vision.grid_pinpoints holds {list(pin)}; each must be [height, width] in "
                             f"multiples of the tile side model.vision.image_size={v.image_size}")
    if v.merge != 1 or v.select not in ("default", "full") or (v.select == "default") != v.cls_token:
        raise ValueError(f"model.vision: an anyres tower needs one feature per patch of a tile: select=default "
                         f"with a class token, or select=full without one (got select={v.select}, "
                         f"cls_token={v.cls_token}, merge={v.merge})")
    if v.anyres_max < 0:
        raise ValueError(f"model.vision.anyres_max={v.anyres_max} must be >= 0 (0: no downsampling)")


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


def lora_identity(lora: LoraSpec) -> dict[str, Any] | None:
    """What a checkpoint records of its adapters (None: none), which a resumed run must share."""
    if not lora.active:
        return None
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "parts": list(lora.parts)}


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
