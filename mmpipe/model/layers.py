"""Pipeline layers of the multimodal model, built from transformers' own modules.

Each layer takes the carrier tuple (see carrier.py) and returns it with its slot replaced, so
DeepSpeed can cut the model between any two layers. Encoders work on all images (or clips)
of a micro-batch packed into one sequence with a per-image (per-clip) attention mask, so
images of different sizes need no padding and text-only micro-batches run no encoder work.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.siglip.configuration_siglip import SiglipVisionConfig
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer, SiglipVisionEmbeddings
from transformers.models.whisper.configuration_whisper import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import NAME as SEGMENT_ATTENTION
from mmpipe.model.attention import Segments, segments
from mmpipe.model.spec import AudioSpec, LLMSpec, ModelSpec, VisionSpec, layer_names

_ATTN = SEGMENT_ATTENTION


class PipeLayer(nn.Module):
    """Base: a named layer that maps the carrier tuple to the carrier tuple."""

    name: str = ""

    def forward(self, carrier: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        slots = list(carrier)
        self.step(slots)
        return C.pack(slots)

    def step(self, slots: list[torch.Tensor]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def projector(dims: tuple[int, ...]) -> nn.Sequential:
    """Linear layers through `dims` with GELU between them (LLaVA-style MLP projector)."""
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        if i:
            mods.append(nn.GELU())
        mods.append(nn.Linear(dims[i], dims[i + 1]))
    return nn.Sequential(*mods)


# ----------------------------------------------------------------------------- vision


def siglip_config(v: VisionSpec) -> SiglipVisionConfig:
    cfg = SiglipVisionConfig(
        hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.blocks,
        num_attention_heads=v.heads, num_channels=v.channels, patch_size=v.patch,
        image_size=v.patch * 8,  # an 8x8 grid of learned positions, interpolated per image
        attention_dropout=0.0,
    )
    cfg._attn_implementation = _ATTN
    return cfg


class VisionEmbed(PipeLayer):
    """Patch embedding + interpolated positions of every image and video, packed as [1, P, Dv].

    An image patch goes through SigLIP's Conv2d patch embedding. A video is cut into temporal
    patches of T sampled frames (model.vision.video.temporal_patch, an odd count padded with the
    last frame by the data layer); the T frames of one patch position go through a Conv3d over
    (T, p, p), as Qwen2-VL embeds its temporal patches (mmpipe's tiny rule, docs/data.md). Every
    temporal patch gets the image's interpolated 2-D positions and attends on its own (the
    carried layout): temporal order reaches the LLM through the token order.
    """

    def __init__(self, v: VisionSpec):
        super().__init__()
        self.embed = SiglipVisionEmbeddings(siglip_config(v))
        self.patch = v.patch
        self.channels = v.channels
        self.hidden = v.hidden
        self.temporal = v.video.temporal_patch if v.video is not None else 0
        if v.video is not None:
            t = self.temporal
            self.video_patch = nn.Conv3d(v.channels, v.hidden, kernel_size=(t, v.patch, v.patch),
                                         stride=(t, v.patch, v.patch))
        # pixel normalisation as SigLIP's processor: (x / 255 - 0.5) / 0.5
        self.register_buffer("scale", torch.tensor(2.0 / 255.0), persistent=False)

    def step(self, slots: list[torch.Tensor]) -> None:
        pixels, grid = slots[C.IMAGE], slots[C.IMAGE_GRID]
        w = self.embed.patch_embedding.weight
        x = pixels.to(w.dtype) * self.scale.to(w.dtype) - 1.0
        rows = layout.host_list(grid)
        carried = layout.read(slots[C.LAYOUT]).image.lengths
        if list(carried) != layout.image_segments(rows):
            raise ValueError(f"the micro-batch's layout has image segments {list(carried)} but its image grids "
                             f"{rows} make {layout.image_segments(rows)}; collate it with mmpipe.runtime.batch.collate")
        n_vid = C.videos_in(slots)
        n_img = len(rows) - n_vid
        at = sum(t * gh * gw for t, gh, gw in rows[:n_img])
        patches = self.embed.patch_embedding(x[:at]).flatten(1)  # [P_images, Dv]
        if n_vid:
            if not self.temporal:
                raise ValueError("the micro-batch holds videos but model.vision.video is not set")
            p, t = self.patch, self.temporal
            clips = x[at:].reshape(-1, t, self.channels, p, p).transpose(1, 2)  # [temporal patches, C, T, p, p]
            patches = torch.cat([patches, self.video_patch(clips).flatten(1)])
        elif self.temporal:  # a zero gradient for the video weights on a micro-batch without video, as
            # every other parameter of the stage gets one (some optimizer wrappers expect a gradient)
            patches = patches + 0 * sum(q.sum() for q in self.video_patch.parameters())
        pos = [self._positions(int(gh), int(gw)).repeat(int(t), 1) for t, gh, gw in rows]
        if pos:
            patches = patches + torch.cat(pos)
        slots[C.IMAGE] = patches[None]

    def _positions(self, gh: int, gw: int) -> torch.Tensor:
        table = self.embed.position_embedding.weight
        side = int(table.shape[0] ** 0.5)
        grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = nn.functional.interpolate(grid, size=(gh, gw), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(gh * gw, -1)


class VisionBlock(PipeLayer):
    def __init__(self, v: VisionSpec):
        super().__init__()
        self.block = SiglipEncoderLayer(siglip_config(v))

    def step(self, slots: list[torch.Tensor]) -> None:
        encoder_block_step(self.block, slots, C.IMAGE, "image", self.dtype)


class VisionProj(PipeLayer):
    """Final norm, merge x merge patch merge, MLP projector into the LLM width."""

    def __init__(self, v: VisionSpec):
        super().__init__()
        self.norm = nn.LayerNorm(v.hidden, eps=1e-6)
        self.merge = v.merge
        self.mlp = projector((v.proj_in, *v.proj))
        self.proj_in = v.proj_in

    def step(self, slots: list[torch.Tensor]) -> None:
        h = self.norm(C.from_wire(slots[C.IMAGE], self.dtype)[0])
        m = self.merge
        merged = []
        start = 0
        for t, gh, gw in layout.host_list(slots[C.IMAGE_GRID]):  # an image is one temporal patch
            n = t * gh * gw
            x = h[start:start + n].reshape(t, gh // m, m, gw // m, m, -1).permute(0, 1, 3, 2, 4, 5)
            merged.append(x.reshape(t * (gh // m) * (gw // m), -1))
            start += n
        # without images or videos h is [0, Dv]: reshaped, not new zeros, it stays in the graph, so a
        # tower cut before this layer gets the (empty) gradient DeepSpeed sends back for its states
        x = torch.cat(merged) if merged else h.reshape(0, self.proj_in)
        slots[C.IMAGE] = self.mlp(x)


# ----------------------------------------------------------------------------- audio


def whisper_config(a: AudioSpec) -> WhisperConfig:
    cfg = WhisperConfig(
        d_model=a.hidden, encoder_layers=a.blocks, encoder_attention_heads=a.heads,
        encoder_ffn_dim=a.mlp, num_mel_bins=a.mel_bins, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_source_positions=_audio_positions(a),
    )
    cfg._attn_implementation = _ATTN
    return cfg


def _audio_positions(a: AudioSpec) -> int:
    frames = int(round(a.max_seconds * a.frames_per_s))
    return -(-frames // a.conv_stride)


class AudioEmbed(PipeLayer):
    """Whisper's conv front (k3, then k3 stride 2, GELU) + learned positions, per clip."""

    def __init__(self, a: AudioSpec):
        super().__init__()
        self.conv1 = nn.Conv1d(a.mel_bins, a.hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(a.hidden, a.hidden, kernel_size=3, stride=a.conv_stride, padding=1)
        self.positions = nn.Embedding(_audio_positions(a), a.hidden)
        self.hidden = a.hidden

    def step(self, slots: list[torch.Tensor]) -> None:
        mels = C.from_wire(slots[C.AUDIO], self.dtype)
        carried = layout.read(slots[C.LAYOUT]).audio.lengths
        out = []
        for i, frames in enumerate(layout.host_list(slots[C.AUDIO_FRAMES])):
            x = nn.functional.gelu(self.conv1(mels[i:i + 1, :, :frames]))
            x = nn.functional.gelu(self.conv2(x))[0].transpose(0, 1)  # [positions, D]
            if i >= len(carried) or carried[i] != x.shape[0]:
                raise ValueError(f"audio clip {i} has {x.shape[0]} encoder positions but the micro-batch's layout "
                                 f"says {carried[i] if i < len(carried) else 'none'}; collate it with "
                                 f"audio_stride=model.audio.conv_stride ({self.conv2.stride[0]})")
            out.append(x + self.positions.weight[: x.shape[0]])
        w = self.conv1.weight
        h = torch.cat(out) if out else w.new_zeros(0, self.hidden) + 0 * w.sum()
        slots[C.AUDIO] = h[None]


class AudioBlock(PipeLayer):
    def __init__(self, a: AudioSpec):
        super().__init__()
        self.block = WhisperEncoderLayer(whisper_config(a))

    def step(self, slots: list[torch.Tensor]) -> None:
        encoder_block_step(self.block, slots, C.AUDIO, "audio", self.dtype)


class AudioProj(PipeLayer):
    """Final norm, average pooling by `pool` per clip, projector into the LLM width."""

    def __init__(self, a: AudioSpec):
        super().__init__()
        self.norm = nn.LayerNorm(a.hidden)
        self.pool = nn.AvgPool1d(a.pool, stride=a.pool, ceil_mode=True)
        self.mlp = projector((a.hidden, *a.proj))
        self.hidden = a.hidden

    def step(self, slots: list[torch.Tensor]) -> None:
        h = self.norm(C.from_wire(slots[C.AUDIO], self.dtype)[0])
        positions = list(layout.read(slots[C.LAYOUT]).audio.lengths)
        pooled = [self.pool(x.T[None])[0].T for x in torch.split(h, positions)] if positions else []
        x = torch.cat(pooled) if pooled else h  # [0, Da], in the graph (VisionProj says why)
        slots[C.AUDIO] = self.mlp(x)


# ----------------------------------------------------------------------------- llm


def llama_config(l: LLMSpec) -> LlamaConfig:
    cfg = LlamaConfig(
        vocab_size=l.vocab, hidden_size=l.hidden, intermediate_size=l.mlp,
        num_hidden_layers=l.blocks, num_attention_heads=l.heads, num_key_value_heads=l.kv_heads,
        max_position_embeddings=l.max_seq_len, rms_norm_eps=1e-6, attention_dropout=l.attention_dropout,
    )
    cfg._attn_implementation = _ATTN
    return cfg


class LLMEmbed(PipeLayer):
    """Token embedding; image, video and audio embeddings replace their placeholder positions.

    The IMAGE slot holds the images' embeddings, then the videos' (model/carrier.py): the first
    go to the image tokens in order, the rest to the video tokens in order."""

    def __init__(self, l: LLMSpec, image_token: int, audio_token: int, video_token: int = -1):
        super().__init__()
        self.embed = nn.Embedding(l.vocab, l.hidden)
        self.image_token = image_token
        self.audio_token = audio_token
        self.video_token = video_token

    def step(self, slots: list[torch.Tensor]) -> None:
        ids = slots[C.INPUT_IDS]
        h = self.embed(ids)
        for slot, tokens in ((C.IMAGE, (self.image_token, self.video_token)), (C.AUDIO, (self.audio_token,))):
            emb = slots[slot]
            if emb.numel() == 0 and not emb.is_floating_point():
                continue  # the model has no such encoder, or it is frozen and absent
            emb = C.from_wire(emb, h.dtype)
            where = [(ids == token).nonzero(as_tuple=True) for token in tokens if token >= 0]
            counts = [w[0].numel() for w in where]
            if sum(counts) != emb.shape[0]:
                raise ValueError(
                    f"{' + '.join(map(str, counts))} placeholder tokens for {emb.shape[0]} encoder embeddings "
                    f"(slot {slot}); the sample's media and its text disagree"
                )
            start = 0
            for w, n in zip(where, counts):
                h = h.index_put(w, emb[start:start + n])
                start += n
            if emb.requires_grad and emb.numel() == 0:
                h = h + 0 * emb.sum()  # keep an empty activation in the graph so it gets a grad
            slots[slot] = C.empty(ids)
        slots[C.IMAGE_GRID] = C.empty(ids)
        slots[C.AUDIO_FRAMES] = C.empty(ids)
        slots[C.VIDEOS] = C.empty(ids)
        slots[C.HIDDEN] = h


def encoder_block_step(block: nn.Module, slots: list[torch.Tensor], slot: int, stream: str,
                       dtype: torch.dtype) -> None:
    """One encoder block over a micro-batch's packed images (`slot` C.IMAGE, `stream` "image")
    or clips (C.AUDIO, "audio"): [1, positions, D], attention inside each image or clip (the
    carried layout). A micro-batch without any passes through."""
    h = C.from_wire(slots[slot], dtype)
    if h.shape[1] == 0:
        slots[slot] = h
        return
    with segments(Segments(stream=getattr(layout.read(slots[C.LAYOUT]), stream), causal=False)):
        slots[slot] = block(h, None)


def llm_segments(slots: list[torch.Tensor], dtype: torch.dtype) -> Segments:
    """Attention of the LLM row(s): per sample in a packed row (the carried layout), or a dense
    block-diagonal causal mask over padded rows (padding paid for)."""
    seg_ids = slots[C.SEGMENT_IDS]
    if seg_ids.shape[0] == 1:
        return Segments(stream=layout.read(slots[C.LAYOUT]).llm, causal=True)
    return Segments(stream=None, causal=True, mask=C.causal_segment_mask(seg_ids, dtype))


class LLMBlock(PipeLayer):
    def __init__(self, l: LLMSpec, index: int):
        super().__init__()
        cfg = llama_config(l)
        self.block = LlamaDecoderLayer(cfg, layer_idx=index)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.HIDDEN], self.dtype)
        pos = slots[C.POSITION_IDS]
        with segments(llm_segments(slots, h.dtype)):
            out = self.block(h, attention_mask=None, position_ids=pos,
                             position_embeddings=self.rotary(h, pos))
        slots[C.HIDDEN] = out[0] if isinstance(out, tuple) else out


class LLMNorm(PipeLayer):
    def __init__(self, l: LLMSpec):
        super().__init__()
        self.norm = LlamaRMSNorm(l.hidden, eps=1e-6)

    def step(self, slots: list[torch.Tensor]) -> None:
        slots[C.HIDDEN] = self.norm(C.from_wire(slots[C.HIDDEN], self.dtype))


class LLMHead(nn.Module):
    """The LM head: returns logits [B, T, V]; the loss is computed from them by token_loss."""

    def __init__(self, l: LLMSpec):
        super().__init__()
        self.head = nn.Linear(l.hidden, l.vocab, bias=False)

    def forward(self, carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.head(C.from_wire(carrier[C.HIDDEN], self.head.weight.dtype))


def token_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropies of a micro-batch, times the step's scale.

    `labels` = (targets [B, T] already shifted, -100 where no label; scale [1] =
    accumulation steps * dp / label tokens of the whole step), so that DeepSpeed's mean over
    micro-batches and replicas is the exact mean over every label token of the step.
    """
    targets, scale = labels
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
        reduction="sum",
    )
    return loss * scale.reshape(())


# ----------------------------------------------------------------------------- assembly


def layer_seed(seed: int, name: str) -> int:
    """Each layer's initial weights depend on the run seed and its name only, so a layer is
    the same whichever stage (and process) builds it."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def build_layer(spec: ModelSpec, name: str, *, seed: int, image_token: int, audio_token: int,
                video_token: int = -1) -> nn.Module:
    """Build one named pipeline layer of mmpipe's own model with deterministic initial weights
    (a Hugging Face model's layers are mmpipe.model.hf.build_layer's)."""
    comp, kind, *rest = name.split(".")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, name))
        layer = _construct(spec, comp, kind, rest, image_token, audio_token, video_token)
        _init_weights(layer)
    layer.name = name
    return layer


def _construct(spec: ModelSpec, comp: str, kind: str, rest: list[str], image_token: int,
               audio_token: int, video_token: int) -> nn.Module:
    if comp == "vision" and spec.vision is not None:
        v = spec.vision
        return {"embed": lambda: VisionEmbed(v), "block": lambda: VisionBlock(v),
                "proj": lambda: VisionProj(v)}[kind]()
    if comp == "audio" and spec.audio is not None:
        a = spec.audio
        return {"embed": lambda: AudioEmbed(a), "block": lambda: AudioBlock(a),
                "proj": lambda: AudioProj(a)}[kind]()
    if comp == "llm":
        l = spec.llm
        return {"embed": lambda: LLMEmbed(l, image_token, audio_token, video_token),
                "block": lambda: LLMBlock(l, int(rest[0])), "norm": lambda: LLMNorm(l),
                "head": lambda: LLMHead(l)}[kind]()
    raise ValueError(f"layer {comp}.{kind} does not exist in model {spec.name}")


def _init_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)


def build_layers(spec: ModelSpec, *, seed: int, image_token: int, audio_token: int,
                 video_token: int = -1) -> list[nn.Module]:
    """All pipeline layers in order (for single-process reference runs and tests)."""
    return [build_layer(spec, n, seed=seed, image_token=image_token, audio_token=audio_token, video_token=video_token)
            for n in layer_names(spec)]


def run_layers(layers: list[nn.Module], carrier: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Forward through layers in one process: the reference the pipeline must equal."""
    x: object = carrier
    for layer in layers:
        x = layer(x)
    assert isinstance(x, torch.Tensor)
    return x
