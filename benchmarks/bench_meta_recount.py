"""What recounting text tokens costs metadata-only reading (iter_meta), in samples/s of one worker.

    python benchmarks/bench_meta_recount.py [--path data/shards/train-{000000..000007}.tar]
        [--samples 2000] [--repeat 3]

Stored meta.text_tokens is used when the shards were counted by the run's templater; under any
other tokenizer iter_meta counts each conversation again (mmpipe.data.records.hint_applies).
Modes, over the same samples, best of --repeat passes:

- stored: iter_meta without a templater (today's planning path, nothing tokenized);
- tiny, hint used: the project tokenizer the shards were made with (the stored count is used);
- tiny, recount: the same tokenizer under another fingerprint, so every sample is counted;
- hf, recount: a small Hugging Face tokenizer with a ChatML chat template (built here, trained
  on the shards' text; nothing downloaded): one render and one tokenization per sample;
- tiny, records / hf, records: SampleStream.records() (for hf the full label convention: one
  render and tokenization per answer plus one; both with the media header checks), for scale.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmpipe.data.chat import templater_for  # noqa: E402
from mmpipe.data.reader import SampleStream, iter_meta  # noqa: E402
from mmpipe.data.shards import resolve_urls  # noqa: E402
from mmpipe.data.template import PLACEHOLDER, TinyTemplate  # noqa: E402
from mmpipe.data.tokenizer import load_tokenizer  # noqa: E402
from mmpipe.model.group import model_from_group  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
TEMPLATE = (
    "{% set n = namespace(audio=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'audio' %}"
    "{% set n.audio = n.audio + 1 %}Audio {{ n.audio }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def texts(path: str) -> list[str]:
    out = []
    for shard in resolve_urls(path, root=ROOT):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".json"):
                    for t in json.loads(tar.extractfile(m).read())["conversations"]:
                        out += [p for p in PLACEHOLDER.split(t["value"]) if p and not PLACEHOLDER.fullmatch(p)]
    return out


def hf_checkpoint(folder: Path, corpus: list[str]) -> None:
    """A byte-level BPE with Qwen2's special tokens and a ChatML template, as save_pretrained writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  extra_special_tokens={"image_token": "<|image_pad|>", "audio_token": "<|AUDIO|>"})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)


class Foreign:
    """The project tokenizer as a templater the shards do not name (not a TinyTemplate, so even
    their fingerprint-less meta does not count as its own): every count is redone."""

    system = False

    def __init__(self, tiny: TinyTemplate) -> None:
        self.tiny = tiny
        self.fingerprint = "foreign"

    def text_tokens(self, turns):
        return self.tiny.text_tokens(turns)


def rate(make, n: int, repeat: int) -> tuple[int, float]:
    best = float("inf")
    count = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        count = sum(1 for _ in itertools.islice(make(), n))
        best = min(best, time.perf_counter() - t0)
    return count, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=str(ROOT / "data/shards/train-{000000..000007}.tar"))
    ap.add_argument("--tokenizer", default=str(ROOT / "data/tokenizer.json"))
    ap.add_argument("--model", default="tiny", help="a conf/model preset")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    preset = ROOT / "conf" / "model" / f"{args.model}.yaml"
    spec = model_from_group(yaml.safe_load(preset.read_text())).spec
    tiny = TinyTemplate(load_tokenizer(args.tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        hf_checkpoint(Path(tmp), texts(args.path))
        hf = templater_for(tmp, spec)
        modes = {
            "stored": lambda: iter_meta(path=args.path, spec=spec, root=ROOT),
            "tiny, hint used": lambda: iter_meta(path=args.path, spec=spec, tokenizer=tiny, root=ROOT),
            "tiny, recount": lambda: iter_meta(path=args.path, spec=spec, tokenizer=Foreign(tiny), root=ROOT),
            "hf, recount": lambda: iter_meta(path=args.path, spec=spec, tokenizer=hf, root=ROOT),
            "tiny, records": lambda: SampleStream(path=args.path, tokenizer=tiny, spec=spec, epochs=1,
                                                  root=ROOT).records(),
            "hf, records": lambda: SampleStream(path=args.path, tokenizer=hf, spec=spec, epochs=1, root=ROOT).records(),
        }
        rows = [(name, *rate(make, args.samples, args.repeat)) for name, make in modes.items()]
    base = rows[0][1] / rows[0][2]
    print(f"{args.path}: first {rows[0][1]} samples, one worker, best of {args.repeat}")
    print(f"  {'mode':<16} {'samples':>7} {'seconds':>8} {'samples/s':>10} {'us/sample':>10} {'x stored':>9}")
    for name, n, s in rows:
        print(f"  {name:<16} {n:>7} {s:>8.3f} {n / s:>10.0f} {s / n * 1e6:>10.0f} {base / (n / s):>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
