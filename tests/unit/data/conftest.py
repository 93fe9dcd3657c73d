"""Fixtures for the data tests: the tiny model spec, a small generated shard set, a local HTTP server."""

from __future__ import annotations

import http.server
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from mmpipe.paths import CONF_DIR
from mmpipe.data.synth import SynthConfig, generate
from mmpipe.data.tokenizer import Tokenizer, load_tokenizer
from mmpipe.model.spec import ModelSpec, spec_from_dict
from mmpipe.model.hf.demo import LLAVA_TEMPLATE  # one copy of LLaVA-1.5's template


@dataclass(frozen=True)
class Web:
    root: Path
    """The served folder."""
    url: str
    """http://127.0.0.1:PORT (no trailing slash)."""


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return spec_from_dict(yaml.safe_load((CONF_DIR / "model/tiny.yaml").read_text()))


@pytest.fixture(scope="session")
def mini_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 synthetic samples in 4 shards (every task kind appears), and a video mix of 14 samples
    (6 clips) in 2 shards (shards/video-00000{0,1}.tar)."""
    out = tmp_path_factory.mktemp("mini")
    generate(SynthConfig(out=out, samples=40, shards=4, seed=3, video_samples=14, video_shards=2))
    return out


@pytest.fixture(scope="session")
def mini_tok(mini_data: Path) -> Tokenizer:
    return load_tokenizer(mini_data / "tokenizer.json")


@pytest.fixture(scope="session")
def mini_path(mini_data: Path) -> str:
    return str(mini_data / "shards" / "train-{000000..000003}.tar")


@pytest.fixture(scope="session")
def web(mini_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    """An HTTP server on 127.0.0.1 (a thread) serving a folder that holds the mini shards under
    shards/; tests may write more files into `web.root`. `/cut/NAME` announces NAME's full
    length but sends only half of it, then closes the connection."""
    root = tmp_path_factory.mktemp("www")
    shutil.copytree(mini_data / "shards", root / "shards")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):
            super().__init__(*args, directory=str(root), **kw)

        def do_GET(self):
            if not self.path.startswith("/cut/"):
                return super().do_GET()
            data = (root / self.path[5:]).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Web(root=root, url=f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


@pytest.fixture
def deadline():
    """Fail a test that reads over the network if it has not finished in 60 s (instead of hanging)."""
    def expired(*_):
        raise TimeoutError("the test took more than 60 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------- Hugging Face checkpoints
# Tiny tokenizers trained here, with each family's special tokens and a chat template written in
# that family's format (our own wording), saved with save_pretrained: nothing is downloaded.

HF_CORPUS = ["What shape is in the image?", "a red triangle", "What do you hear?", "a rising chirp",
             "And the colour?", "red", "Answer briefly.", "You are a helpful assistant.", "USER:", "ASSISTANT:",
             "Compare the two pictures.", "Describe the picture and the sound.", "system user assistant Audio",
             "mmpipe probe question", "mmpipe probe answer", "\n"] * 20
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]

# The generation prompt ends in a space that the answer's first word absorbs when tokenized.
LLAVA_SPACE_TEMPLATE = LLAVA_TEMPLATE.replace("{% if add_generation_prompt %}ASSISTANT:{% endif %}",
                                              "{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def chatml(items: str) -> str:
    """A ChatML template with Qwen's default system message; `items` renders one content item."""
    return (
        "{% set image_count = namespace(value=0) %}{% set audio_count = namespace(value=0) %}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}" + items + "{% endfor %}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


VL_ITEM = "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_ITEM = ("{% if content['type'] == 'audio' or 'audio' in content %}"
              "{% set audio_count.value = audio_count.value + 1 %}"
              "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n")
TEXT_ITEM = "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
QWEN2_VL_TEMPLATE = chatml(VL_ITEM + TEXT_ITEM)
QWEN2_AUDIO_TEMPLATE = chatml(AUDIO_ITEM + TEXT_ITEM)
OMNI_TEMPLATE = chatml(VL_ITEM + AUDIO_ITEM.replace("{% if", "{% elif", 1) + TEXT_ITEM)
# A text LLM's template: string content only (a composition adds encoders to such a model).
QWEN2_TEXT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Drops the content of every answer but the last, as templates that strip reasoning do.
RERENDER_TEMPLATE = QWEN2_TEXT_TEMPLATE.replace(
    "{{ message['content'] }}<|im_end|>",
    "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}<|im_end|>")


SMALL_CLIP = {"model_type": "clip_vision_model", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 1, "image_size": 28, "patch_size": 14}
SMALL_LLM = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}
SMALL_CLIP_PROCESSOR = {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}


def _llava_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.train_from_iterator(HF_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<image>"], show_progress=False))
    # A Llama tokenizer puts <s> in front of every text it encodes with special tokens.
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", t.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def _qwen_tokenizer(extra: tuple[str, ...] = (), named: dict[str, str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(HF_CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=QWEN_SPECIALS + list(extra), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   **({"extra_special_tokens": named} if named else {}))


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoint folders (tokenizer, chat template, config.json) by family name."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, Qwen2AudioConfig, Qwen2VLConfig

    root = tmp_path_factory.mktemp("hf")
    out: dict[str, Path] = {}

    def save(name: str, tok, template: str | None, config=None) -> None:
        tok.chat_template = template
        tok.save_pretrained(root / name)
        if config is not None:
            config.save_pretrained(root / name)
        out[name] = root / name

    llava = _llava_tokenizer()
    image = llava.convert_tokens_to_ids("<image>")
    save("llava", llava, LLAVA_TEMPLATE, LlavaConfig(
        image_token_index=image, vision_config=SMALL_CLIP, text_config=dict(SMALL_LLM, vocab_size=len(llava))))
    CLIPImageProcessorPil(**SMALL_CLIP_PROCESSOR).save_pretrained(root / "llava")
    save("llava-space", llava, LLAVA_SPACE_TEMPLATE, LlavaConfig(image_token_index=image))
    save("llava-noeos", llava, LLAVA_TEMPLATE.replace("</s>{% endif %}", "{{ ' ' }}{% endif %}"),
         LlavaConfig(image_token_index=image))
    qwen = _qwen_tokenizer()
    ids = {t: qwen.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    save("qwen2-vl", qwen, QWEN2_VL_TEMPLATE, Qwen2VLConfig(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"]))
    save("qwen2-audio", qwen, QWEN2_AUDIO_TEMPLATE, Qwen2AudioConfig(audio_token_index=ids["<|AUDIO|>"]))
    save("qwen2-nochat", qwen, None)
    save("qwen2-rerender", qwen, RERENDER_TEMPLATE)
    # A generation prompt that is not how the template starts an answer.
    gen = "{% if add_generation_prompt %}<|im_start|>assistant\n"
    save("qwen2-genprompt", qwen, QWEN2_TEXT_TEMPLATE.replace(gen, gen + "\n"))
    # No config.json: the media tokens are the tokenizer's own image_token / audio_token.
    omni = _qwen_tokenizer(named={"image_token": "<|image_pad|>", "audio_token": "<|AUDIO|>"})
    save("qwen2-omni", omni, OMNI_TEMPLATE)
    # A text LLM whose tokenizer got <image> / <audio> added for a composition with encoders.
    text = _qwen_tokenizer(extra=("<image>", "<audio>"), named={"image_token": "<image>", "audio_token": "<audio>"})
    save("qwen2-text", text, QWEN2_TEXT_TEMPLATE)
    # Qwen2-VL's template (it ignores audio items) with <audio> added for a composition with an audio encoder.
    vl_audio = _qwen_tokenizer(extra=("<audio>",), named={"audio_token": "<audio>"})
    save("qwen2-vl+audio", vl_audio, QWEN2_VL_TEMPLATE, Qwen2VLConfig(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"]))
    # A text LLM's tokenizer with <image> added for a composition: the id is only in the model config.
    save("qwen2-llm", _qwen_tokenizer(extra=("<image>",)), QWEN2_TEXT_TEMPLATE)
    return out


@pytest.fixture(scope="session")
def small_llava() -> dict[str, dict]:
    """Configs of a small LLaVA: vision tower, LLM, image processor (4 image tokens)."""
    return {"vision": SMALL_CLIP, "llm": SMALL_LLM, "processor": SMALL_CLIP_PROCESSOR}


@pytest.fixture(scope="session")
def hf_specs(tiny_spec: ModelSpec) -> dict[str, ModelSpec]:
    """Model specs whose geometry matches each family's processor (small images and LLMs)."""
    from dataclasses import replace

    from mmpipe.model.spec import AudioSpec, LLMSpec, VisionSpec

    llm = LLMSpec(blocks=1, hidden=16, mlp=32, heads=2, kv_heads=1, vocab=512, max_seq_len=4096)
    enc = dict(blocks=1, hidden=8, mlp=16, heads=1)
    clip = VisionSpec(**enc, patch=14, image_size=28, cls_token=True, select="default", proj=(16,))
    qwen_vl = VisionSpec(**enc, patch=14, merge=2, resize="smart", min_pixels=56 * 56, max_pixels=28 * 28 * 16,
                         temporal_patch=2, proj=(16,))
    whisper = AudioSpec(**enc, mel_bins=128, sample_rate=16000, frames_per_s=100, conv_stride=2, pool=2,
                        pool_ceil=False, max_seconds=30.0, proj=(16,))
    return {"llava": ModelSpec(name="llava-test", llm=llm, vision=clip),
            "qwen2-vl": ModelSpec(name="qwen2-vl-test", llm=llm, vision=qwen_vl),
            "qwen2-audio": ModelSpec(name="qwen2-audio-test", llm=llm, audio=whisper),
            "text": ModelSpec(name="text-test", llm=llm),
            "qwen2-vl+audio": ModelSpec(name="qwen2-vl-audio-test", llm=llm, vision=qwen_vl, audio=whisper),
            "tiny": replace(tiny_spec, llm=replace(tiny_spec.llm, max_seq_len=8192))}
