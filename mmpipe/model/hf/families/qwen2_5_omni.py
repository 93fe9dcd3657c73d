"""Qwen2.5-Omni's thinker (`Qwen2_5OmniThinkerForConditionalGeneration`): its audio tower's figures
and pipeline layers, its 3-D positions, its processor's video call, and what a full Qwen2.5-Omni
folder (thinker, talker, token2wav) means to mmpipe (`Outer`, outer.py).

The audio tower (`Qwen2_5OmniAudioEncoder`) takes the valid mel frames of all clips, cuts each clip
into chunks of 2 * n_window frames (the last one shorter), runs the conv front on each chunk alone
(zeros past its end), adds sinusoidal positions restarting at every chunk, attends within each
chunk in every block, then averages pairs of positions per clip, normalises (`ln_post`) and
projects into the LLM. The layers run transformers' own chunking and index helpers on the carried
frames; the chunks' attention segments come with the micro-batch's layout (collate computes them,
`model/geometry.py: chunk_positions`). The vision tower is Qwen2.5-VL's (`qwen2_5_vl.py`); the decoder
is the M-RoPE decoder of `layers.HFLLMBlock`, its positions computed in collate:

a text, audio or marker token takes 1 + the largest position of the segment before it; an image
or video takes its grid offset by that, a video's temporal index being trunc(k x
video_second_per_grid x position_id_per_seconds); with use_audio_in_video, a clip that has an
audio track is <vision_bos><audio_bos> (one position for both), its video and audio positions from
the same start, laid out chunk by chunk as its tokens are, then <audio_eos><vision_eos> (one
position for both), exactly as that get_rope_index lays them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    chunk_and_pad_features,
    get_pool_indices,
    get_valid_indices,
)

from mmpipe.model import carrier as C
from mmpipe.model import layout
from mmpipe.model.attention import Segments, segments
from mmpipe.model.hf.arch import audio_feature_extractor
from mmpipe.model.hf.configs import hf_config
from mmpipe.model.hf.demo_kit import TEXT_ITEM, chatml, qwen_tokenizer, save
from mmpipe.model.hf.families import qwen2_5_vl, qwen2_vl
from mmpipe.model.hf.family import Demo, Family, Outer
from mmpipe.model.hf.layers import HFLayer, empty_like_output, use_varlen_attention
from mmpipe.model.hf.positions import clip_tokens, grid_indices
from mmpipe.model.hf.video import make_video_processor
from mmpipe.model.spec import AudioSpec, ModelSpec, VisionSpec

AUDIO_TOWER = "model.audio_tower"
DEFAULT_FPS = 2.0
"""The fps Qwen2_5OmniProcessor assumes when its call names none (hard-coded there too)."""
OUTER = Outer(model_type="qwen2_5_omni", part="thinker", title="full Qwen2.5-Omni",
              trains="audio and vision towers, LLM", rest="the talker and token2wav", files=("spk_dict.pt",))
"""A full Qwen2.5-Omni folder (`thinker.*`, `talker.*`, `token2wav.*` tensors; the talker's speaker
file)."""
SPECIALS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
"""The named tokens Qwen2.5-Omni's tokenizer (and its processor) has."""
TEMPLATE = chatml(  # Qwen2.5-Omni's markers around each image, clip and video
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>" + TEXT_ITEM)


# ----------------------------------------------------------------------------- audio tower


class OmniAudioEmbed(HFLayer):
    """Conv front per chunk and sinusoidal positions per chunk: features [clips, mel, F] (each
    clip's valid frames, zero-filled past them) -> states [A, D] over every chunk's positions."""

    def __init__(self, parts: dict[str, nn.Module], *, window: int):
        super().__init__(parts)
        self.window = window

    def step(self, slots: list[torch.Tensor]) -> None:
        feats = C.from_wire(slots[C.AUDIO], self.dtype)
        frames = slots[C.AUDIO_FRAMES]
        lengths = layout.host_list(frames)
        if not lengths:
            slots[C.AUDIO] = empty_like_output(feats, self, 0, self.conv2.out_channels)
            return
        x = torch.cat([feats[i, :, :n] for i, n in enumerate(lengths)], dim=1)  # [mel, all valid frames]
        padded, chunk_lengths = chunk_and_pad_features(x, frames, self.window)
        mask = (torch.arange(padded.shape[2], device=padded.device) < chunk_lengths[:, None])[:, None]
        h = F.gelu(self.conv1(padded)) * mask.to(padded.dtype)
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        h = h + self.positions.positional_embedding[:h.shape[1]].to(h.dtype)
        h = h.reshape(-1, h.shape[-1]).index_select(0, get_valid_indices(chunk_lengths))
        carried = layout.read(slots[C.LAYOUT]).audio
        if carried.total != h.shape[0]:
            raise ValueError(f"the audio tower made {h.shape[0]} positions of clips of {lengths} mel frames but the "
                             f"micro-batch's layout has {carried.total}; collate it with "
                             f"mmpipe.runtime.batch.collate_hf")
        slots[C.AUDIO] = h


class OmniAudioBlock(HFLayer):
    """One encoder block over all chunks' positions [A, D], attending within each chunk."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__(parts)
        use_varlen_attention(self.block.self_attn)

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.AUDIO], self.dtype)
        if h.shape[0] == 0:
            slots[C.AUDIO] = h
            return
        chunks = layout.read(slots[C.LAYOUT]).audio
        with segments(Segments(stream=chunks, causal=False)):
            slots[C.AUDIO] = self.block(h, cu_seqlens=chunks.cu_seqlens, max_seqlen=chunks.max_len)[0]


class OmniAudioProj(HFLayer):
    """Average of position pairs per clip (the last odd one dropped), ln_post, linear into the LLM:
    [A, D] -> [tokens, D_llm]."""

    def step(self, slots: list[torch.Tensor]) -> None:
        h = C.from_wire(slots[C.AUDIO], self.dtype)
        frames = slots[C.AUDIO_FRAMES]
        if frames.numel():
            pairs = get_pool_indices(frames)
            h = (h[pairs] + h[pairs + 1]) / 2
        else:
            h = h[:0]
        slots[C.AUDIO] = self.proj(self.ln_post(h))


def tower_layer(spec: ModelSpec, name: str, parts: dict[str, nn.Module]) -> nn.Module:
    """The vision layers are Qwen2.5-VL's; `audio.<kind>[.<index>]` this tower's."""
    comp, kind = name.split(".")[:2]
    if comp == "vision":
        return qwen2_5_vl.vision_layer(spec, name, parts)
    if kind == "embed":
        return OmniAudioEmbed(parts, window=hf_config(spec.hf).audio_config.n_window)
    return {"block": OmniAudioBlock, "proj": OmniAudioProj}[kind](parts)


def layer_parts(config: PretrainedConfig, comp: str, kind: str, i: str) -> tuple[tuple[str, str], ...]:
    """Qwen2.5-VL's vision tower; the audio tower. `audio_bos_eos_token` is in no layer: the
    thinker's forward never reads it (export carries it)."""
    if comp == "vision":
        return qwen2_vl.tower_parts(kind, i)
    return {"embed": (("conv1", f"{AUDIO_TOWER}.conv1"), ("conv2", f"{AUDIO_TOWER}.conv2"),
                      ("positions", f"{AUDIO_TOWER}.positional_embedding")),
            "block": (("block", f"{AUDIO_TOWER}.layers.{i}"),),
            "proj": (("ln_post", f"{AUDIO_TOWER}.ln_post"), ("proj", f"{AUDIO_TOWER}.proj"))}[kind]


# ----------------------------------------------------------------------------- figures


def check(config: PretrainedConfig, what: str) -> None:
    """Qwen2.5-VL's windows; audio chunks the sinusoidal table can index."""
    qwen2_5_vl.check_windows(config, what)
    ac = config.audio_config
    if not 0 < ac.n_window <= ac.max_source_positions:
        raise ValueError(f"{what}.audio_config.n_window={ac.n_window} must be in 1..max_source_positions="
                         f"{ac.max_source_positions} (each chunk's positions index the sinusoidal table)")


def processor_call(proc: Any) -> dict[str, Any]:
    """The keyword arguments Qwen2_5OmniProcessor gives its video processor on every call beyond the
    video processor's own settings: its class-level `videos_kwargs` (its frame size bounds), plus,
    when the video processor samples by fps, that fps (what a user passes to the Omni processor so
    that its video_second_per_grid is the frames' real spacing)."""
    from transformers import Qwen2_5OmniProcessor

    call = copy.deepcopy(Qwen2_5OmniProcessor.videos_kwargs)
    if proc.do_sample_frames and proc.fps is not None and proc.num_frames is None:
        call["fps"] = float(proc.fps)
    return call


def vision(config: PretrainedConfig, ip: Mapping[str, Any], vp: Mapping[str, Any] | None, what: str,
           audio_in_video: bool) -> VisionSpec:
    """Qwen2.5-VL's tower; videos as Omni's processor calls its video processor, with the seconds
    per temporal patch and the position rate its positions take."""
    from transformers import Qwen2_5OmniProcessor as P

    proc = qwen2_vl.image_processor(config, ip, what)
    frames = make_video_processor(qwen2_vl.VIDEO_PROCESSOR, vp)
    call = processor_call(frames)
    video = qwen2_vl.video(config, frames, what, call=call, audio_in_video=audio_in_video,
                           timing=dict(grid_seconds=config.vision_config.temporal_patch_size
                                       / call.get("fps", DEFAULT_FPS),
                                       positions_per_second=float(P.position_id_per_seconds),
                                       chunk_seconds=float(P.seconds_per_chunk)))
    return qwen2_5_vl.windowed_vision(config, proc, video)


def audio(config: PretrainedConfig, fe_config: Mapping[str, Any], what: str) -> AudioSpec:
    """Whisper-style blocks attending within chunks of n_window positions (2 * n_window mel frames),
    pooled by 2 per clip, ln_post, linear into the LLM. The feature extractor's length (its
    chunk_length) cuts clips; the chunks need no 30-s cap."""
    ac = config.audio_config
    fe = audio_feature_extractor(ac, fe_config, what)
    rate, hop = fe.sampling_rate, fe.hop_length
    return AudioSpec(blocks=ac.encoder_layers, hidden=ac.d_model, mlp=ac.encoder_ffn_dim,
                     heads=ac.encoder_attention_heads, mel_bins=ac.num_mel_bins, sample_rate=rate,
                     frames_per_s=rate // hop, conv_stride=2, pool=2, pool_ceil=False,
                     max_seconds=fe.n_samples / rate, proj=(ac.output_dim,), window=int(ac.n_window))


def default_feature_extractor(config: PretrainedConfig) -> dict[str, Any]:
    """Whisper's at 16 kHz; the chunked tower takes clips of any length, and the Hub preprocessor
    pads to 300 s."""
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config.audio_config.num_mel_bins,
            "chunk_length": 300, "sampling_rate": 16000, "hop_length": 160}


# ----------------------------------------------------------------------------- positions


def chunk_runs(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of ascending `values`, as transformers' Omni `get_chunked_index`
    cuts them: a chunk ends at the first value reaching the next multiple of per_chunk (one
    multiple per value)."""
    out, start, chunk = [], 0, 1
    for i, x in enumerate(values.tolist()):
        if x >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(values)))
    return out


def omni_positions(input_ids: Sequence[int], *, tokens: dict[str, int], merge: int,
                   image_grids: Sequence[Sequence[int]], videos: Sequence[tuple[Sequence[int], float, int]],
                   per_second: float, chunk_seconds: float) -> np.ndarray:
    """Qwen2.5-Omni's thinker positions [3, n] (see the module docstring).

    Args:
        tokens: the config's ids: `image`, `video`, `audio`, `vision_bos`, `audio_bos`.
        videos: per video, (grid, video_second_per_grid, audio tokens of its interleaved track or 0).
        per_second: the config's position_id_per_seconds; chunk_seconds: its seconds_per_chunk.
    """
    ids = list(input_ids)
    image, video, audio, vbos, abos = (tokens[k] for k in ("image", "video", "audio", "vision_bos", "audio_bos"))
    imgs, vids = iter(image_grids), iter(videos)
    parts: list[np.ndarray] = []
    last = -1  # the largest position of the segment before (what the next segment counts on from)
    i = 0

    def visual(grid: Sequence[int], seconds: float | None, start: int) -> np.ndarray:
        t, h, w = (int(x) for x in grid)
        if seconds is None:  # an image: (arange(1) * 1 * per_second).long() = 0
            t_index = np.zeros(t, dtype=np.int64)
        else:  # (arange(t) * float32 seconds) * per_second, in float32, then truncated
            t_index = ((np.arange(t, dtype=np.float32) * np.float32(seconds)).astype(np.float32)
                       * np.float32(per_second)).astype(np.int64)
        return grid_indices(t_index, h, w, merge) + start

    def take(block: np.ndarray, what: str) -> None:
        nonlocal i, last
        n = block.shape[1]
        if i + n > len(ids):
            raise ValueError(f"an {what} of {n} tokens runs past the end of the sample ({len(ids) - i} tokens left)")
        parts.append(block)
        last = int(block.max()) if n else last
        i += n

    while i < len(ids):
        x = ids[i]
        if x == vbos and i + 1 < len(ids) and ids[i + 1] == abos:  # a clip with its audio track interleaved
            grid, seconds, track = next(vids, ((0, 0, 0), 0.0, 0))
            if not track:
                raise ValueError("<vision_bos><audio_bos> opens a clip whose audio track is not interleaved; "
                                 "make the sample with model.use_audio_in_video and that clip's track")
            p = last + 1
            parts.append(np.full((3, 2), p, dtype=np.int64))  # both openers take one position
            i += 2
            base = p + 1
            vpos = visual(grid, seconds, base)
            apos = np.broadcast_to(np.arange(track, dtype=np.int64) + base, (3, track))
            per_chunk = int(per_second * chunk_seconds)
            vchunks = chunk_runs(vpos[0] - base, per_chunk)
            achunks = chunk_runs(apos[0] - base, per_chunk)
            for j in range(max(len(vchunks), len(achunks))):
                if j < len(vchunks):
                    take(vpos[:, vchunks[j][0]:vchunks[j][1]], "interleaved clip")
                if j < len(achunks):
                    take(apos[:, achunks[j][0]:achunks[j][1]], "interleaved clip")
            e = last + 1
            closers = min(2, len(ids) - i)  # <audio_eos><vision_eos>: one position for both
            parts.append(np.full((3, closers), e, dtype=np.int64))
            last, i = e, i + closers
        elif x == image:
            take(visual(next(imgs, (0, 0, 0)), None, last + 1), "image")
        elif x == video:
            grid, seconds, track = next(vids, ((0, 0, 0), 0.0, 0))
            if track:
                raise ValueError("a clip whose audio track is interleaved must open with <vision_bos><audio_bos>")
            take(visual(grid, seconds, last + 1), "video")
        else:  # text, markers and audio tokens: one position each, counting on
            j = i
            while j < len(ids) and ids[j] not in (image, video) and not (ids[j] == vbos and j + 1 < len(ids)
                                                                             and ids[j + 1] == abos):
                j += 1
            parts.append(np.broadcast_to(np.arange(last + 1, last + 1 + j - i, dtype=np.int64), (3, j - i)))
            last, i = last + j - i, j
    for rest, what in ((imgs, "images"), (vids, "videos")):
        if next(rest, None) is not None:
            raise ValueError(f"more {what} than the sample's tokens hold")
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)


def positions(spec: ModelSpec, input_ids: Sequence[int], images: Sequence[Any], videos: Sequence[Any]) -> np.ndarray:
    """The sample's positions by `omni_positions`, with the config's tokens and rates."""
    config = hf_config(spec.hf)
    tokens = dict(image=config.image_token_id, video=config.video_token_id, audio=config.audio_token_id,
                  vision_bos=config.vision_start_token_id, audio_bos=config.audio_start_token_id)
    vids = [(v.grid, v.second_per_grid, clip_tokens(spec, v.audio.frames) if v.audio is not None else 0)
            for v in videos]
    return omni_positions(input_ids, tokens=tokens, merge=spec.vision.merge, image_grids=[img.grid for img in images],
                          videos=vids, per_second=config.position_id_per_seconds,
                          chunk_seconds=config.seconds_per_chunk)


# ----------------------------------------------------------------------------- demo checkpoint


def write_demo(root: Path, texts: list[str]) -> Path:
    """A Qwen2.5-Omni thinker: the demo Qwen2.5-VL tower, a 2-block audio tower over 16 mel bins
    attending within chunks of 25 positions (0.5 s: the shipped clips of 0.3 to 5.4 s span 1 to 11),
    clips cut at 8 s, the M-RoPE decoder; Omni's markers in ChatML; the processor saved by
    Qwen2_5OmniProcessor (image, video and feature extractor, tokenizer, template). Its video
    processor samples 2 frames a second (at least 4), which its processor resizes to 128 to 768
    x 28^2 pixels whatever the file says."""
    from transformers import (
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    torch.manual_seed(48)
    tok = qwen_tokenizer(texts, extra=("<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>"),
                         named=SPECIALS)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in SPECIALS.items()}
    cfg = Qwen2_5OmniThinkerConfig(
        vision_config=qwen2_5_vl.DEMO_VISION, text_config=qwen2_5_vl.demo_text(tok),
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=100, n_window=25, output_dim=48),
        image_token_index=ids["image_token"], audio_token_index=ids["audio_token"],
        video_token_index=ids["video_token"], vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"])
    folder = save(Qwen2_5OmniThinkerForConditionalGeneration(cfg), tok, TEMPLATE, root / "qwen2.5-omni", 48)
    Qwen2_5OmniProcessor(image_processor=qwen2_5_vl.demo_image_processor(),
                         video_processor=Qwen2VLVideoProcessor(do_sample_frames=True, fps=2.0),
                         feature_extractor=WhisperFeatureExtractor(feature_size=16, chunk_length=8), tokenizer=tok,
                         chat_template=TEMPLATE).save_pretrained(folder)
    return folder


FAMILY = Family(
    model_type="qwen2_5_omni_thinker", architecture="Qwen2_5OmniThinkerForConditionalGeneration",
    title="Qwen2.5-Omni", text_types=("qwen2_5_omni_text",), towers={"vision": qwen2_vl.TOWER, "audio": AUDIO_TOWER},
    check=check, vision=vision, audio=audio, image_processors=(qwen2_vl.IMAGE_PROCESSOR,),
    default_image_processor=qwen2_vl.default_image_processor, default_feature_extractor=default_feature_extractor,
    video_processor=qwen2_vl.VIDEO_PROCESSOR, processor_settings=None, layer_parts=layer_parts,
    tower_layer=tower_layer, llm_block=None, positions=positions, audio_in_video=True, outer=OUTER,
    demo=Demo(name="qwen2.5-omni", write=write_demo))
