"""Tiny Hugging Face checkpoints written by transformers itself, and the comparison helpers the
model/hf tests share.

Every checkpoint has its norm weights and biases moved away from their initial values, so a
tensor that is not loaded shows up as a difference.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    CLIPVisionConfig,
    Gemma3ForConditionalGeneration,
    InternVLForConditionalGeneration,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    MistralConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    SiglipVisionConfig,
    WhisperFeatureExtractor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from mmpipe.model.geometry import image_tokens
from mmpipe.model.hf.demo import perturb
from mmpipe.model.hf.media import preprocess_audio, preprocess_images
from mmpipe.model.hf.skeleton import owned_keys
from mmpipe.model.layers import run_layers, token_loss
from mmpipe.runtime.batch import collate_hf

CLASSES = {"llava_clip_llama": LlavaForConditionalGeneration, "llava_siglip_qwen2": LlavaForConditionalGeneration,
           "qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_audio": Qwen2AudioForConditionalGeneration,
           "llava_next": LlavaNextForConditionalGeneration, "llava_onevision": LlavaOnevisionForConditionalGeneration,
           "qwen3_vl": Qwen3VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
           "qwen2_5_omni": Qwen2_5OmniThinkerForConditionalGeneration, "internvl": InternVLForConditionalGeneration,
           "internvl_qwen3": InternVLForConditionalGeneration, "gemma3": Gemma3ForConditionalGeneration}
"""The transformers class of each checkpoint fixture (tests/unit/model/conftest.py)."""
VOCAB, IMAGE, AUDIO, VSTART, VEND, VIDEO = 300, 290, 291, 292, 293, 294
ASTART, AEND = 295, 296  # Qwen2.5-Omni's audio bos / eos
TEXT = (10, 280)


def _llm(kind: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(extra)
    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind](**common)


def write_llava(root: Path, *, vision: str, llm: str, layer: int, select: str, seed: int, tie: bool = False,
                image_size: int = 28, patch: int = 7, **llm_extra) -> Path:
    torch.manual_seed(seed)
    v = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             image_size=image_size, patch_size=patch)
    vc = CLIPVisionConfig(**v) if vision == "clip" else SiglipVisionConfig(**v)
    cfg = LlavaConfig(vision_config=vc, text_config=_llm(llm, tie_word_embeddings=tie, **llm_extra),
                      image_token_id=IMAGE, vision_feature_layer=layer, vision_feature_select_strategy=select,
                      projector_hidden_act="gelu")
    model = LlavaForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / f"llava-{vision}-{llm}"
    model.save_pretrained(folder)
    if vision == "clip":
        CLIPImageProcessorPil(size={"shortest_edge": image_size},
                              crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    else:
        SiglipImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""LLaVA-NeXT's five grids (1x2, 2x1, 2x2, 1x3, 3x1 tiles) at a 28-px tile."""
ONEVISION_PINPOINTS = [[28 * i, 28 * j] for i in range(1, 4) for j in range(1, 4)]
"""OneVision's grids up to 3x3 tiles at a 28-px tile; with anyres_max_4, grids of more than
4.84 tiles' worth of unpadded features are shrunk."""


def write_llava_next(root: Path, *, seed: int) -> Path:
    """CLIP (28-px tiles of 7-px patches: 16 features + the class token; feature layer -2,
    `default`) + Mistral, the five NeXT grids."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor

    torch.manual_seed(seed)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                          image_size=28, patch_size=7)
    cfg = LlavaNextConfig(vision_config=vc, text_config=_llm("mistral", rms_norm_eps=1e-5), image_token_id=IMAGE,
                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                          image_grid_pinpoints=NEXT_PINPOINTS)
    model = LlavaNextForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "llava-next"
    model.save_pretrained(folder)
    LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                            image_grid_pinpoints=NEXT_PINPOINTS).save_pretrained(folder)
    return folder


def write_llava_onevision(root: Path, *, seed: int) -> Path:
    """SigLIP (28-px tiles of 7-px patches: 16 features; last layer, `full`) + Qwen2, grids up to
    3x3 tiles, anyres_max_4."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor

    torch.manual_seed(seed)
    vc = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                            image_size=28, patch_size=7, vision_use_head=False)
    cfg = LlavaOnevisionConfig(vision_config=vc, text_config=_llm("qwen2", hidden_size=48, intermediate_size=96),
                               image_token_id=IMAGE, video_token_id=VIDEO, vision_feature_layer=-1,
                               vision_feature_select_strategy="full", image_grid_pinpoints=ONEVISION_PINPOINTS,
                               vision_aspect_ratio="anyres_max_4")
    model = LlavaOnevisionForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "llava-onevision"
    model.save_pretrained(folder)
    LlavaOnevisionImageProcessor(size={"height": 28, "width": 28},
                                 image_grid_pinpoints=ONEVISION_PINPOINTS).save_pretrained(folder)
    return folder


def write_internvl(root: Path, *, seed: int, llm: str = "qwen2", tie: bool = False) -> Path:
    """InternViT (28-px tiles of 7-px patches, 2 layers, biased q/k/v, layer norms; 2x2 pixel shuffle:
    4 tokens a tile) + Qwen2 (InternVL 3) or Qwen3 with q/k norms (InternVL 3.5, whose tower is then
    InternViT-6B's kind: RMS norms, q/k norms, a final layer norm as use_mean_pooling=False has it),
    1..6 tiles and the thumbnail; the class token and position table (drawn as zeros) perturbed too."""
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLVisionConfig, Qwen3Config

    from mmpipe.model.hf.families.internvl import perturb_tower

    torch.manual_seed(seed)
    vc = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=7, attention_bias=True,
                              **(dict(norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False)
                                 if llm == "qwen3" else {}))
    if llm == "qwen3":
        text = Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, tie_word_embeddings=tie)
    else:
        text = _llm("qwen2", hidden_size=48, intermediate_size=96, tie_word_embeddings=tie)
    cfg = InternVLConfig(vision_config=vc, text_config=text, image_token_id=IMAGE, image_seq_length=4,
                         downsample_ratio=0.5, tie_word_embeddings=tie)
    model = InternVLForConditionalGeneration(cfg)
    perturb(model, seed)
    perturb_tower(model, seed)
    folder = root / f"internvl-{llm}"
    model.save_pretrained(folder)
    GotOcr2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=True, min_patches=1,
                          max_patches=6).save_pretrained(folder)
    return folder


GEMMA3_WINDOW = 8
"""The Gemma 3 case's sliding window: shorter than its samples and than an image's 16 tokens."""


def write_gemma3(root: Path, *, seed: int) -> Path:
    """SigLIP (56-px images of 7-px patches, 2 layers; its pooling head left out, as Gemma 3's) pooled 2x2
    into 16 tokens an image + a Gemma 3 decoder of 4 layers (sliding, full, sliding, full; an 8-token
    window; a local rope base of 100 and a linearly scaled global one; q/k norms; query_pre_attn_scalar
    12, not head_dim), tied embeddings. Every RMSNorm (Gemma's x * (1 + w), drawn as zeros) and the
    projector's matrix (drawn as zeros) moved off their initial values."""
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3TextConfig

    from mmpipe.model.hf.families.gemma3 import perturb_projector

    torch.manual_seed(seed)
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
    vc = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=56, patch_size=7, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vc, mm_tokens_per_image=16, image_token_id=IMAGE,
                       boi_token_id=VSTART, eoi_token_id=VEND)
    model = Gemma3ForConditionalGeneration(cfg)
    perturb(model, seed)
    perturb_projector(model, seed)
    folder = root / "gemma3"
    model.save_pretrained(folder)
    Gemma3ImageProcessor(size={"height": 56, "width": 56}, image_mean=[0.5] * 3,
                         image_std=[0.5] * 3).save_pretrained(folder)
    return folder


def qwen2_vl_config() -> Qwen2VLConfig:
    return Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)


def write_qwen2_vl(root: Path, *, seed: int) -> Path:
    """Its folder has an image processor file only: the video processor falls back to it (every
    frame, the image's pixel bounds), as transformers' own loading does."""
    torch.manual_seed(seed)
    cfg = qwen2_vl_config()
    model = Qwen2VLForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "qwen2-vl"
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 12).save_pretrained(folder)
    return folder


def write_qwen3_vl(root: Path, *, seed: int) -> Path:
    """3 tower blocks with DeepStack features from blocks 0 and 2 (added after decoder layers 0 and
    1 of 3), a 3 x 3 learned position table resampled to every grid, 16-px patches (images of 4
    to 12 tokens), and a Qwen3 decoder with head_dim 16 and unequal interleaved M-RoPE sections."""
    torch.manual_seed(seed)
    cfg = Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=9,
                           deepstack_visual_indexes=[0, 2]),
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 1e4,
                                          "mrope_interleaved": True}),
        image_token_id=IMAGE, video_token_id=294, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    model = Qwen3VLForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "qwen3-vl"
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 12,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return folder


QWEN25_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
"""A 3-block Qwen2.5-VL tower: windows of 4x4 patches (56 px), block 1 attends over each image."""
QWEN25_TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                   rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4})


def write_qwen2_5_vl(root: Path, *, seed: int) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(vision_config=QWEN25_VISION, text_config=QWEN25_TEXT, image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "qwen2.5-vl"
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 12).save_pretrained(folder)
    return folder


def omni_thinker_config(**extra):
    """A Qwen2.5-Omni thinker: the Qwen2.5-VL tower above, a 2-block audio tower over 16 mel bins
    attending within chunks of 8 positions (16 frames), the M-RoPE decoder."""
    from transformers import Qwen2_5OmniThinkerConfig

    return Qwen2_5OmniThinkerConfig(
        vision_config=QWEN25_VISION, text_config=QWEN25_TEXT,
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=100, n_window=8, output_dim=48),
        image_token_index=IMAGE, audio_token_index=AUDIO, video_token_index=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND, **extra)


def write_qwen2_5_omni(root: Path, *, seed: int, full: bool = False) -> Path:
    """A Qwen2.5-Omni thinker folder, or (`full`) a whole Qwen2.5-Omni with a tiny talker and
    token2wav (`thinker.*`, `talker.*`, `token2wav.*` tensors), as the Hub folder is."""
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    torch.manual_seed(seed)
    if full:
        talker = dict(vocab_size=64, embedding_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
        token2wav = dict(dit_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                         emb_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 32],
                                         enc_attention_channels=8, enc_se_channels=8, num_embeds=64, mel_dim=16,
                                         look_ahead_layers=[0], look_backward_layers=[0]),
                         bigvgan_config=dict(mel_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2],
                                             upsample_kernel_sizes=[4, 4]))
        model = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(
            thinker_config=omni_thinker_config().to_dict(), talker_config=talker, token2wav_config=token2wav))
    else:
        model = Qwen2_5OmniThinkerForConditionalGeneration(omni_thinker_config())
    perturb(model, seed)
    folder = root / ("qwen2.5-omni-full" if full else "qwen2.5-omni")
    model.save_pretrained(folder)
    # one flat preprocessor_config.json holding both processors' keys, as the Hub folder has it
    merged = {**Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 12).to_dict(),
              **WhisperFeatureExtractor(feature_size=16, chunk_length=4).to_dict()}
    merged["image_processor_type"] = "Qwen2VLImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(merged, indent=1))
    return folder


def write_qwen2_audio(root: Path, *, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=200),
        text_config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        audio_token_id=AUDIO)
    model = Qwen2AudioForConditionalGeneration(cfg)
    perturb(model, seed)
    folder = root / "qwen2-audio"
    model.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=16, chunk_length=4).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    key: str
    input_ids: list[int]
    labels: list[int]
    images: list = field(default_factory=list)
    audio: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    """(uint8 frames [n, H, W, 3], VideoMeta) per clip: the frames its video processor takes; a
    third item, the clip's audio track at 16 kHz, for Qwen2.5-Omni's use_audio_in_video."""


def random_image(rng: np.random.Generator, h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def text(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(*TEXT, n)]


def sample(key: str, pieces: list, images=(), audio=(), videos=()) -> Sample:
    """Tokens from pieces (lists of ids); labels on every text token after the first piece."""
    ids, labels = [], []
    for i, piece in enumerate(pieces):
        ids += piece
        labels += [t if i > 0 and t not in (IMAGE, AUDIO, VSTART, VEND, VIDEO) else -100 for t in piece]
    return Sample(key=key, input_ids=ids, labels=labels, images=list(images), audio=list(audio), videos=list(videos))


# ----------------------------------------------------------------------------- comparison


def our_loss_and_grads(layers, mb) -> float:
    for layer in layers:
        layer.zero_grad()
    loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
    loss.backward()
    return loss.item()


def grad_differences(spec, layers, hf_model) -> tuple[float, int]:
    """Largest |our grad - transformers' grad| over every parameter, relative to the largest
    transformers grad of that tensor (at least 1e-4: a key bias has a zero gradient in exact
    arithmetic, so both sides hold only rounding noise), and how many tensors were compared."""
    worst, count = 0.0, 0
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    for layer in layers:
        name = getattr(layer, "name", "")
        mine = dict(layer.named_parameters())
        for local, key in owned_keys(spec, name).items():
            if local not in mine:
                continue
            ours, theirs = mine[local].grad, params[key].grad
            if theirs is None:
                assert ours is None or float(ours.abs().max()) == 0.0, f"{key} got a gradient it should not"
                continue
            assert ours is not None, f"{key}: no gradient in the pipeline layer {name}"
            scale = max(float(theirs.abs().max()), 1e-4)
            diff = float((ours - theirs).abs().max()) / scale
            if diff > worst:
                worst, where = diff, key
            count += 1
    if worst > 1e-4:
        print(f"worst gradient: {where}")
    return worst, count


# ----------------------------------------------------------------------------- unimodal checkpoints


def write_unimodal(root: Path, kind: str, *, seed: int) -> Path:
    """A CLIP vision model, a full CLIP model, a SigLIP vision model, a Llama / Qwen2 causal LM
    or a Whisper model, with the processor files a user's folder would hold."""
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPVisionModel,
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        SiglipVisionModel,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(seed)
    v = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
             patch_size=7)
    folder = root / kind
    if kind == "clip-vision":
        model = CLIPVisionModel(CLIPVisionConfig(**v))
    elif kind == "clip":
        model = CLIPModel(CLIPConfig(vision_config=v, text_config=dict(hidden_size=16, intermediate_size=32,
                                                                        num_hidden_layers=1, num_attention_heads=2)))
    elif kind == "siglip-vision":
        model = SiglipVisionModel(SiglipVisionConfig(**v))
    elif kind == "llama":
        model = LlamaForCausalLM(_llm("llama", rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                      rms_norm_eps=1e-5))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(_llm("qwen2", hidden_size=48, intermediate_size=96))
    elif kind == "whisper":
        model = WhisperForConditionalGeneration(WhisperConfig(
            vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
            max_source_positions=200, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1))
    else:
        raise KeyError(kind)
    perturb(model, seed)
    model.save_pretrained(folder)
    if kind in ("clip-vision", "clip"):
        CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    elif kind == "siglip-vision":
        SiglipImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(folder)
    elif kind == "whisper":
        WhisperFeatureExtractor(feature_size=16, chunk_length=4).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- parity runs


LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # fp32, relative to the largest gradient of each tensor


def padded(samples, key):
    t = max(len(getattr(s, key)) for s in samples)
    fill = 0 if key == "input_ids" else -100
    return torch.tensor([getattr(s, key) + [fill] * (t - len(getattr(s, key))) for s in samples])


def mask(samples):
    t = max(len(s.input_ids) for s in samples)
    return torch.tensor([[1] * len(s.input_ids) + [0] * (t - len(s.input_ids)) for s in samples])


def load_reference(cls, folder):
    """The transformers model, with the parameters its modules declare frozen kept frozen
    (from_pretrained in transformers 5.24 loses `requires_grad_(False)`, e.g. on Whisper's and
    Qwen2-Audio's position table; mmpipe keeps what the module declares)."""
    model = cls.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    with torch.device("meta"):
        fresh = cls(model.config)
    frozen = {n for n, p in fresh.named_parameters() if not p.requires_grad}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    return model


def compare(spec, layers, hf_model, hf_loss, samples, *, packings=(True, False)):
    """Our loss and gradients on the samples, packed into one row and padded, equal the
    transformers model's (one backward of `hf_loss`)."""
    from mmpipe.model.hf.video import preprocess_video

    hf_loss.backward()

    def video(f, m, *track):
        vid = preprocess_video(spec, f, m, tuple(range(len(f))))
        return replace(vid, audio=preprocess_audio(spec, track[0], 16000)) if track else vid

    ours = [Sample(s.key, s.input_ids, s.labels, preprocess_images(spec, s.images),
                   [preprocess_audio(spec, w, 16000) for w in s.audio], [video(*v) for v in s.videos])
            for s in samples]
    for packed in packings:
        mb = collate_hf(ours, spec=spec, packed=packed, pad_id=0)
        loss = our_loss_and_grads(layers, mb)
        assert loss == pytest.approx(hf_loss.item(), rel=LOSS_RTOL)
        worst, count = grad_differences(spec, layers, hf_model)
        assert count > 0
        assert worst < GRAD_RTOL, f"largest relative gradient difference {worst:.2e} (packed={packed})"
        print(f"\n{spec.name} packed={packed}: loss {loss:.6f} vs {hf_loss.item():.6f} (rel "
              f"{abs(loss - hf_loss.item()) / abs(hf_loss.item()):.1e}); max rel grad diff {worst:.1e} "
              f"over {count} tensors")


def llava_samples(spec, rng):
    n = image_tokens(spec.vision, 1, 1)
    imgs = [random_image(rng, 40, 60), random_image(rng, 28, 28), random_image(rng, 90, 33)]
    return [sample("a", [text(rng, 3), [IMAGE] * n, text(rng, 5), [IMAGE] * n, text(rng, 12)],
                     images=imgs[:2]),
            sample("b", [text(rng, 4), [IMAGE] * n, text(rng, 9)], images=imgs[2:])]


ANYRES_SIZES = [[(40, 60), (90, 33)], [(120, 200)], [(200, 31)], [], [(20, 50)]]
"""Images (height, width) of each sample of the any-resolution parity cases: two of different
aspects in one sample (OneVision: one tile each), a large one (OneVision shrinks its grid), a tall
narrow one (most of its grid unpadded away), a text-only sample and a small wide one (a 1x2 grid)."""


def anyres_samples(spec, rng):
    """Samples of ANYRES_SIZES with placeholders expanded by the geometry (the model itself refuses
    any other count) and their encoded images."""
    from mmpipe.model.geometry import sample_image_tokens

    out = []
    for k, sizes in enumerate(ANYRES_SIZES):
        counts = sample_image_tokens(spec.vision, tuple(sizes))
        pieces = [text(rng, 3)]
        for n in counts:
            pieces += [[IMAGE] * n, text(rng, int(rng.integers(2, 6)))]
        pieces.append(text(rng, 8))
        out.append(sample(f"s{k}", pieces, images=[random_image(rng, h, w) for h, w in sizes]))
    return out


def anyres_reference_inputs(folder, samples, *, nested: bool) -> dict:
    """pixel_values, image_sizes (and OneVision's batch_num_images) from the folder's own image
    processor as AutoImageProcessor loads it (its default backend), one conversation's images
    nested for OneVision as its processor nests them."""
    proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    pil = [[Image.open(io.BytesIO(b)).convert("RGB") for b in s.images] for s in samples]
    images = [p for p in pil if p] if nested else [img for p in pil for img in p]
    out = proc(images=images, return_tensors="pt")
    keys = ("pixel_values", "image_sizes") + (("batch_num_images",) if nested else ())
    return {k: out[k] for k in keys}


QWEN25_WORDS = {"qwen2_5_vl": {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": VSTART,
                               "<|vision_end|>": VEND},
                "qwen2_5_omni": {"<|IMAGE|>": IMAGE, "<|AUDIO|>": AUDIO, "<|VIDEO|>": VIDEO, "<|vision_bos|>": VSTART,
                                 "<|vision_eos|>": VEND, "<|audio_bos|>": ASTART, "<|audio_eos|>": AEND}}
"""The placeholder and marker tokens of each class's processor, at this module's ids."""
QWEN25_NAMES = {"qwen2_5_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                               "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
                "qwen2_5_omni": {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                                 "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                                 "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}}
"""The same tokens as the tokenizer's named special tokens (the processors read them by name)."""


def qwen25_processor(folder, kind: str, video_processor=None):
    """transformers' own Qwen2_5_VLProcessor (`qwen2_5_vl`) or Qwen2_5OmniProcessor (`qwen2_5_omni`)
    around the folder's image processor, video processor and feature extractor as transformers
    loads them (folder None: their defaults, a 16-bin extractor; `video_processor` replaces the
    folder's), with a word-level tokenizer whose ids are this module's: `w<i>` is token i, the
    placeholders and markers are IMAGE, VIDEO, VSTART, ... (so its input_ids are the samples')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    words = QWEN25_WORDS[kind]
    vocab = {f"w{i}": i for i in range(VOCAB) if i not in words.values()} | words
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", extra_special_tokens=QWEN25_NAMES[kind])
    local = dict(local_files_only=True)
    image = AutoImageProcessor.from_pretrained(folder, **local) if folder else Qwen2VLImageProcessor()
    video = video_processor or (Qwen2VLVideoProcessor.from_pretrained(folder, **local) if folder
                                else Qwen2VLVideoProcessor())
    parts = dict(image_processor=image, video_processor=video, tokenizer=tok)
    if kind == "qwen2_5_vl":
        return Qwen2_5_VLProcessor(**parts)
    fe = (WhisperFeatureExtractor.from_pretrained(folder, **local) if folder
          else WhisperFeatureExtractor(feature_size=16, chunk_length=30))
    return Qwen2_5OmniProcessor(**parts, feature_extractor=fe)


def words(ids, kind: str) -> str:
    """Text that kind's qwen25_processor tokenizes into `ids`, before it expands placeholders."""
    names = {v: k for k, v in QWEN25_WORDS[kind].items()}
    return " ".join(names.get(i, f"w{i}") for i in ids)


def processed_images(folder, images: list[bytes]):
    """What the folder's own image processor (transformers' AutoImageProcessor, in the backend it
    picks by default: torchvision) makes of the images."""
    proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    return proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")


INTERNVL_SIZES = [[(40, 60), (90, 33)], [(120, 200)], [], [(20, 50), (28, 28), (31, 170)]]
"""Images (height, width) of each sample of the InternVL parity case: two of different grids in one
sample, a large one (a 2x3 grid and the thumbnail), a text-only sample, three in one sample (a 1x2
grid, a lone tile, a 1x6 strip)."""


def internvl_samples(spec, rng):
    """Samples of INTERNVL_SIZES, each image <img> (VSTART), its tiles' tokens by the geometry,
    </img> (VEND), as InternVLProcessor expands it."""
    from mmpipe.model.geometry import sample_image_tokens

    out = []
    for k, sizes in enumerate(INTERNVL_SIZES):
        pieces = [text(rng, 3)]
        for n in sample_image_tokens(spec.vision, tuple(sizes)):
            pieces += [[VSTART] + [IMAGE] * n + [VEND], text(rng, int(rng.integers(2, 6)))]
        pieces.append(text(rng, 8))
        out.append(sample(f"s{k}", pieces, images=[random_image(rng, h, w) for h, w in sizes]))
    return out


def internvl_pixels(folder, samples):
    """pixel_values of all samples' images as InternVLProcessor makes them: the folder's image
    processor (its default backend) with crop_to_patches=True, every image's tiles in order."""
    proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for s in samples for b in s.images]
    return proc(images=images, crop_to_patches=True, return_tensors="pt")


GEMMA3_SIZES = [[(40, 60), (90, 33)], [(120, 200)], [], [(20, 50), (56, 56), (31, 170)]]
"""Images (height, width) of each sample of the Gemma 3 parity case: two in one sample, one, none,
three (every image resized to 56 px: one tower pass, 16 tokens)."""
NEWLINES = 11
"""The Gemma 3 case's "\\n\\n" text token around each image."""


def gemma3_samples(spec, rng):
    """Samples of GEMMA3_SIZES, each image "\\n\\n" <start_of_image> (VSTART), its tokens by the
    geometry, <end_of_image> (VEND) "\\n\\n", as Gemma3Processor expands <start_of_image>."""
    from mmpipe.model.geometry import sample_image_tokens

    out = []
    for k, sizes in enumerate(GEMMA3_SIZES):
        pieces = [text(rng, 3)]
        for n in sample_image_tokens(spec.vision, tuple(sizes)):
            pieces += [[NEWLINES, VSTART] + [IMAGE] * n + [VEND, NEWLINES], text(rng, int(rng.integers(2, 6)))]
        pieces.append(text(rng, 14))
        out.append(sample(f"s{k}", pieces, images=[random_image(rng, h, w) for h, w in sizes]))
    return out


# ----------------------------------------------------------------------------- OneVision video


ONEVISION_VIDEO = [  # per sample: images (height, width), then clips (frames, height, width)
    ([(40, 60)], [(5, 40, 56)]),  # an image alone (tiled) and a clip: videos do not count as images
    ([(90, 33), (20, 50)], [(3, 28, 28)]),  # two images (one tile each) and a clip
    ([], []),  # text only
    ([], [(7, 60, 30)]),  # a clip alone
    ([], [(4, 28, 84), (4, 50, 50)]),  # two clips
]
"""The LLaVA-OneVision video parity case: clips of 3 to 7 frames of several sizes (each frame
resized to one tile) beside tiled and untiled images and text."""


def onevision_video_samples(spec, rng):
    """Samples of ONEVISION_VIDEO: placeholders by the geometry (images first, then videos, as
    OneVision's template puts them), random frames, so that their order matters."""
    from mmpipe.model.geometry import VideoMeta, sample_image_tokens, video_tokens

    out = []
    for k, (sizes, clips) in enumerate(ONEVISION_VIDEO):
        pieces = [text(rng, 3)]
        for n in sample_image_tokens(spec.vision, tuple(sizes)):
            pieces += [[IMAGE] * n, text(rng, 2)]
        videos = []
        for n, h, w in clips:
            meta = VideoMeta(frames=n, fps=4.0, height=h, width=w)
            videos.append((rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8), meta))
            pieces += [[VIDEO] * video_tokens(spec.vision, meta), text(rng, 2)]
        pieces.append(text(rng, 9))
        out.append(sample(f"v{k}", pieces, images=[random_image(rng, h, w) for h, w in sizes], videos=videos))
    return out


def onevision_reference_loss(folder, hf_model, samples):
    """transformers' LLaVA-OneVision on each sample alone (its get_video_features batches only clips
    of one frame count), with the folder's image and video processors as AutoImageProcessor and
    AutoVideoProcessor load them; the samples' losses weighted by their label tokens: the mean over
    every label token, as one batch's loss is."""
    from transformers import AutoImageProcessor, AutoVideoProcessor

    images = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    videos = AutoVideoProcessor.from_pretrained(folder, local_files_only=True)
    total, count = 0.0, 0
    for s in samples:
        inputs = {}
        if s.images:
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in s.images]
            out = images(images=[pil], return_tensors="pt")
            inputs |= {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
        if s.videos:
            inputs["pixel_values_videos"] = videos(videos=[f for f, _ in s.videos], return_tensors="pt")[
                "pixel_values_videos"]
        labels = torch.tensor([s.labels])
        loss = hf_model(input_ids=torch.tensor([s.input_ids]), labels=labels, **inputs).loss
        n = int((labels[0, 1:] != -100).sum())
        total, count = total + loss * n, count + n
    return total / count
