"""What the families' demo checkpoint writers share (`mmpipe demo-checkpoints`, demo.py): the
corpus their tokenizers are trained on (the shipped shards' conversations), the tokenizers, Qwen's
ChatML, a tiny CLIP tower, and saving a model with every norm moved off its initial value. Each
family's own writer, template and figures are in its file (families/); nothing is downloaded."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch

from mmpipe.paths import PACKAGE_ROOT

SHARDS = PACKAGE_ROOT / "data" / "shards"  # the shipped shards (package data)


def chatml(items: str) -> str:
    """Qwen's ChatML with its default system message; `items` renders one content item."""
    return (
        "{% set audio_count = namespace(value=0) %}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}" + items + "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TEXT_ITEM = "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
TEXT_TEMPLATE = (  # a text LLM's ChatML: string content only
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]

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


GEMMA_NAMED = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
"""Gemma 3's named image tokens (Gemma3Processor reads the tokenizer's image_token, boi_token, eoi_token)."""


def gemma_tokenizer(texts: list[str], vocab: int = 600):
    """A SentencePiece-style BPE (Metaspace, newline runs kept whole) with Gemma 3's specials: <bos> before
    every text, <start_of_turn> / <end_of_turn>, and the named image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n+", behavior="isolated"),
                                               pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")])
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *GEMMA_NAMED.values()]
    t.train_from_iterator([*texts, *["\n\n"] * 500], trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                                          show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                     special_tokens=[("<bos>", t.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens=dict(GEMMA_NAMED))


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


def save(model, tok, template: str, folder: Path, seed: int) -> Path:
    perturb(model, seed)
    model.save_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return folder


def llm_config(kind: str, tok, **extra):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=len(tok) + 5, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    common.update(extra)
    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind](**common)


CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
            patch_size=7)
"""A CLIP tower on 28-px images: 16 patches and the class token; with feature layer -2, 2 blocks run."""
