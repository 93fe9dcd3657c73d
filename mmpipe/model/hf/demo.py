"""Tiny Hugging Face checkpoint folders as a user has them (`mmpipe demo-checkpoints OUT`): the
model (random weights, saved by transformers' save_pretrained, every norm weight and bias moved
off its initial value so a tensor that is not loaded shows), a tokenizer trained here on the
shipped shards' conversations with a chat template in its family's format (our own wording), and
the processor config, all in one folder. Nothing is downloaded.

    folders = write_all(tmp)   # {"llava", "qwen2-vl", "qwen2-audio", "qwen3-vl", "compose-vision", "compose-llm",
                               #  "compose-projector", "llava-next", "llava-onevision", "qwen2.5-vl", "qwen2.5-omni"}

The test suite trains and compares these; a user tries the real-model path on CPU with them:

    mmpipe demo-checkpoints /tmp/ckpt     # then: mmpipe train model=hf model.path=/tmp/ckpt/llava
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch

from mmpipe.paths import PACKAGE_ROOT

SHARDS = PACKAGE_ROOT / "data" / "shards"  # the shipped shards (package data)

LLAVA_TEMPLATE = (  # LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT: answer</s>"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ ' ' }}"
    "{% elif m['role'] == 'user' %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{{ ' ' }}"
    "{% else %}ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _chatml(items: str) -> str:
    """Qwen's ChatML with its default system message; `items` renders one content item."""
    return (
        "{% set audio_count = namespace(value=0) %}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}" + items + "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


_TEXT = "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
QWEN2_VL_TEMPLATE = _chatml("{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                            "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>" + _TEXT)
QWEN3_VL_TEMPLATE = (  # Qwen3-VL's ChatML: no default system message; an image item becomes its three markers
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>" + _TEXT + "{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN2_AUDIO_TEMPLATE = _chatml("{% if content['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
                               "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" + _TEXT)
NEXT_TEMPLATE = (  # LLaVA-NeXT on Mistral: "[INST] <image>\n... [/INST] answer</s>", a message's images first
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ '\n\n' }}"
    "{% elif m['role'] == 'user' %}[INST] {% for c in m['content'] if c['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %} [/INST]"
    "{% else %} {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}")
ONEVISION_TEMPLATE = (  # LLaVA-OneVision's ChatML (no default system message), a message's images, then videos first
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] if c['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'video' %}<video>\n{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OMNI_TEMPLATE = _chatml(  # Qwen2.5-Omni's markers around each image, clip and video
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>" + _TEXT)
TEXT_TEMPLATE = (  # a text LLM's ChatML: string content only
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
OMNI_SPECIALS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                 "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                 "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
"""The named tokens Qwen2.5-Omni's tokenizer (and its processor) has."""


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every norm weight and bias (every 1-D parameter) off its initial value, so a tensor
    that is not loaded, or loaded into the wrong place, changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def corpus() -> list[str]:
    """Every turn of the shipped shards' conversations, and the chat templates' own words."""
    texts = ["USER: ASSISTANT:", "You are a helpful assistant.", "system user assistant Audio 1: 2: 3:"]
    shards = sorted(SHARDS.glob("train-*.tar"))
    if not shards:
        raise FileNotFoundError(f"no shipped shards in {SHARDS}")  # the tokenizers would be trained on nothing
    for shard in shards:
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".json"):
                    texts += [t["value"] for t in json.loads(tar.extractfile(m).read())["conversations"]]
    return texts


def llama_tokenizer(texts: list[str], vocab: int = 600):
    """A SentencePiece-style BPE (Metaspace) with Llama's specials; it puts <s> before every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<image>"], show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", t.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})


def qwen_tokenizer(texts: list[str], extra: tuple[str, ...] = (), named: dict[str, str] | None = None,
                   vocab: int = 700):
    """A byte-level BPE with Qwen's specials (pad <|endoftext|>, end of turn <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=QWEN_SPECIALS + list(extra), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   **({"extra_special_tokens": named} if named else {}))


def _save(model, tok, template: str, folder: Path, seed: int) -> Path:
    perturb(model, seed)
    model.save_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return folder


def _llm(kind: str, tok, **extra):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=len(tok) + 5, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    common.update(extra)
    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind](**common)


CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
            patch_size=7)
"""A CLIP tower on 28-px images: 16 patches and the class token; with feature layer -2, 2 blocks run."""


def write_llava(root: Path, texts: list[str]) -> Path:
    """CLIP (feature layer -2, `default`) + Llama (rope theta 5e5), LLaVA-1.5's template."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(41)
    tok = llama_tokenizer(texts)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP),
                      text_config=_llm("llama", tok, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                       bos_token_id=tok.bos_token_id),
                      image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    folder = _save(LlavaForConditionalGeneration(cfg), tok, LLAVA_TEMPLATE, root / "llava", 41)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    return folder


NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""LLaVA-NeXT's five grids (1x2, 2x1, 2x2, 1x3, 3x1 tiles), at a 28-px tile."""
ONEVISION_PINPOINTS = [[28 * i, 28 * j] for i in range(1, 4) for j in range(1, 4)]
"""OneVision's grids, to 3x3 tiles of 28 px; with anyres_max_4 the unpadded features of a grid
larger than 4.84 tiles' worth are shrunk (the shipped images, 16 to 200 px, get all cases)."""


def write_llava_next(root: Path, texts: list[str]) -> Path:
    """CLIP (28-px tiles of 7-px patches, feature layer -2, `default`) + Mistral, the five NeXT grids,
    Mistral's [INST] template; the processor (LlavaNextProcessor) saved whole."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    torch.manual_seed(47)
    tok = llama_tokenizer(texts + ["[INST] [/INST]"])
    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**CLIP),
                          text_config=_llm("mistral", tok, bos_token_id=tok.bos_token_id, sliding_window=None),
                          image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                          vision_feature_select_strategy="default", image_grid_pinpoints=NEXT_PINPOINTS)
    folder = _save(LlavaNextForConditionalGeneration(cfg), tok, NEXT_TEMPLATE, root / "llava-next", 47)
    image = LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=NEXT_PINPOINTS)
    LlavaNextProcessor(image_processor=image, tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=NEXT_TEMPLATE).save_pretrained(folder)
    return folder


def write_llava_onevision(root: Path, texts: list[str]) -> Path:
    """SigLIP (28-px tiles of 7-px patches, last layer, `full`) + Qwen2, grids to 3x3 tiles,
    anyres_max_4, OneVision's ChatML; the processor (LlavaOnevisionProcessor) saved whole."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        SiglipVisionConfig,
    )

    torch.manual_seed(48)
    tok = qwen_tokenizer(texts, extra=("<image>", "<video>"),
                         named={"image_token": "<image>", "video_token": "<video>"})
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**CLIP, vision_use_head=False),
        text_config=_llm("qwen2", tok, hidden_size=48, intermediate_size=96),
        image_token_id=tok.convert_tokens_to_ids("<image>"), video_token_id=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_aspect_ratio="anyres_max_4")
    folder = _save(LlavaOnevisionForConditionalGeneration(cfg), tok, ONEVISION_TEMPLATE, root / "llava-onevision", 48)
    side = {"height": 28, "width": 28}
    LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=side, image_grid_pinpoints=ONEVISION_PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size=side), tokenizer=tok, num_image_tokens=16,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_4",
        chat_template=ONEVISION_TEMPLATE).save_pretrained(folder)
    return folder


def write_qwen2_vl(root: Path, texts: list[str]) -> Path:
    """A 2-block Qwen2-VL tower (14-px patches, 2x2 merge, images and video frames of 4 to 16 tokens)
    + its M-RoPE decoder. Its video processor keeps transformers' default frame rule (every frame,
    do_sample_frames=false), so clips of an odd frame count are padded by the processor."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(42)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=len(tok) + 3, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = _save(Qwen2VLForConditionalGeneration(cfg), tok, QWEN2_VL_TEMPLATE, root / "qwen2-vl", 42)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
    Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
    return folder


def write_qwen3_vl(root: Path, texts: list[str]) -> Path:
    """A 3-block Qwen3-VL tower (16-px patches, 2x2 merge, images of 4 to 16 tokens, a 3 x 3 learned
    position table resampled to every grid, DeepStack features of blocks 0 and 2 added after
    decoder layers 0 and 1) + a 3-layer Qwen3 decoder (q/k norms, head_dim 16, interleaved M-RoPE
    with unequal sections)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(47)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=9,
                           deepstack_visual_indexes=[0, 2]),
        text_config=dict(vocab_size=len(tok) + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 1e4,
                                          "mrope_interleaved": True}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = _save(Qwen3VLForConditionalGeneration(cfg), tok, QWEN3_VL_TEMPLATE, root / "qwen3-vl", 47)
    Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32 * 4,
                          max_pixels=32 * 32 * 16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return folder


def write_qwen2_audio(root: Path, texts: list[str]) -> Path:
    """A 2-block Qwen2-Audio tower over 16 mel bins, clips cut at 4 s, + a Qwen2 decoder."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    torch.manual_seed(43)
    tok = qwen_tokenizer(texts)
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=200),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048),
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"))
    folder = _save(Qwen2AudioForConditionalGeneration(cfg), tok, QWEN2_AUDIO_TEMPLATE, root / "qwen2-audio", 43)
    WhisperFeatureExtractor(feature_size=16, chunk_length=4).save_pretrained(folder)
    return folder


QWEN25_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
"""A 3-block Qwen2.5-VL tower: windows of 4 x 4 patches (56 px), so the shipped images (16 to 140 px a
side, resized to 56 to 168) span up to nine; block 1 attends over each whole image, blocks 0 and 2 per
window."""


def _qwen25_text(tok, **extra):
    return dict(vocab_size=len(tok) + 3, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048,
                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}, **extra)


def _image_processor():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 36)


def write_qwen2_5_vl(root: Path, texts: list[str]) -> Path:
    """The Qwen2.5-VL tower above + its M-RoPE decoder (tokens_per_second 4: the shipped clips' frame
    pairs, every frame taken, are 2 to 4 temporal positions apart), ChatML with Qwen2-VL's image and
    video markers; the processor (image and video processors, tokenizer, template) saved by
    Qwen2_5_VLProcessor. Video frames of 4 to 16 tokens."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(47)
    tok = qwen_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2_5_VLConfig(vision_config=QWEN25_VISION, text_config=_qwen25_text(tok),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    folder = _save(Qwen2_5_VLForConditionalGeneration(cfg), tok, QWEN2_VL_TEMPLATE, root / "qwen2.5-vl", 47)
    Qwen2_5_VLProcessor(image_processor=_image_processor(), tokenizer=tok, chat_template=QWEN2_VL_TEMPLATE,
                        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
                        ).save_pretrained(folder)
    return folder


def write_qwen2_5_omni(root: Path, texts: list[str]) -> Path:
    """A Qwen2.5-Omni thinker: the Qwen2.5-VL tower above, a 2-block audio tower over 16 mel bins
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
                         named=OMNI_SPECIALS)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in OMNI_SPECIALS.items()}
    cfg = Qwen2_5OmniThinkerConfig(
        vision_config=QWEN25_VISION, text_config=_qwen25_text(tok),
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                          max_source_positions=100, n_window=25, output_dim=48),
        image_token_index=ids["image_token"], audio_token_index=ids["audio_token"],
        video_token_index=ids["video_token"], vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"])
    folder = _save(Qwen2_5OmniThinkerForConditionalGeneration(cfg), tok, OMNI_TEMPLATE, root / "qwen2.5-omni", 48)
    Qwen2_5OmniProcessor(image_processor=_image_processor(),
                         video_processor=Qwen2VLVideoProcessor(do_sample_frames=True, fps=2.0),
                         feature_extractor=WhisperFeatureExtractor(feature_size=16, chunk_length=8), tokenizer=tok,
                         chat_template=OMNI_TEMPLATE).save_pretrained(folder)
    return folder


def write_composition(root: Path, texts: list[str]) -> dict[str, Path]:
    """A CLIP vision model, a Qwen2 causal LM (tied embeddings, a string-content ChatML template,
    `<image>` added to its tokenizer), and a folder holding a projector for the two (a LLaVA
    checkpoint of the same widths): what `model=compose` joins."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        CLIPVisionModel,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(44)
    vision = root / "compose-vision"
    model = CLIPVisionModel(CLIPVisionConfig(**CLIP))
    perturb(model, 44)
    model.save_pretrained(vision)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(vision)
    tok = qwen_tokenizer(texts, extra=("<image>",), named={"image_token": "<image>"})
    llm_config = _llm("qwen2", tok, tie_word_embeddings=True)
    llm = _save(Qwen2ForCausalLM(llm_config), tok, TEXT_TEMPLATE, root / "compose-llm", 45)
    donor = LlavaForConditionalGeneration(LlavaConfig(vision_config=CLIPVisionConfig(**CLIP), text_config=llm_config,
                                                      image_token_id=tok.convert_tokens_to_ids("<image>")))
    perturb(donor, 46)
    projector = root / "compose-projector"
    donor.save_pretrained(projector)
    return {"compose-vision": vision, "compose-llm": llm, "compose-projector": projector}


MARKER = "mmpipe-demo-checkpoints.json"
"""Written at the top of the folder write_all fills: `mmpipe demo-checkpoints` may write there again."""


def write_all(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    folders = {"llava": write_llava(root, texts), "qwen2-vl": write_qwen2_vl(root, texts),
               "qwen2-audio": write_qwen2_audio(root, texts), **write_composition(root, texts),
               "llava-next": write_llava_next(root, texts),
               "llava-onevision": write_llava_onevision(root, texts),
               "qwen3-vl": write_qwen3_vl(root, texts),
               "qwen2.5-vl": write_qwen2_5_vl(root, texts), "qwen2.5-omni": write_qwen2_5_omni(root, texts)}
    (root / MARKER).write_text(json.dumps({name: folder.name for name, folder in folders.items()}, indent=1) + "\n")
    return folders


MODELS = ("llava", "qwen2-vl", "qwen2-audio", "compose", "llava-next", "llava-onevision", "qwen3-vl", "qwen2.5-vl",
          "qwen2.5-omni")
"""The models the folders of write_all make."""


def model_overrides(name: str, folders: dict[str, Path]) -> list[str]:
    """The `mmpipe train` overrides that select model `name` (one of MODELS) of write_all's folders."""
    if name == "compose":
        return ["model=compose", f"model.vision.path={folders['compose-vision']}",
                f"model.llm.path={folders['compose-llm']}", f"model.projector.path={folders['compose-projector']}"]
    return ["model=hf", f"model.path={folders[name]}"]
