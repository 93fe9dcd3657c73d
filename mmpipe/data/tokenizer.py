"""The project's own small tokenizer: byte-level BPE trained on the synthetic corpus.

Nothing is fetched from a hub: `python -m mmpipe.data.synth` trains it from the conversations
it generates and writes `data/tokenizer.json`; training and runs load that file. Digits are
always split one per token, so numbers never become vocabulary entries and counting or
arithmetic answers are spelled digit by digit (learnable by a tiny model). Byte-level BPE
decodes every encoded string back exactly, whitespace and newlines included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
IMAGE, AUDIO, VIDEO = "<image>", "<audio>", "<video>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, USER, ASSISTANT, IMAGE, AUDIO, VIDEO)
"""Special tokens, in id order: `<pad>` is id 0."""

DEFAULT_VOCAB = 1024
"""Target vocabulary of a trained tokenizer (specials and 256 byte symbols included)."""


class Tokenizer:
    """A thin typed wrapper over a `tokenizers.Tokenizer` with the project's special ids."""

    __slots__ = ("_tok", "pad_id", "bos_id", "eos_id", "user_id", "assistant_id",
                 "image_id", "audio_id", "video_id", "path", "_fingerprint")

    def __init__(self, tok: _HFTokenizer, *, path: Path | None = None) -> None:
        self._tok = tok
        self.path = path
        ids: dict[str, int] = {}
        for name in SPECIAL_TOKENS:
            tid = tok.token_to_id(name)
            if tid is None:
                where = f" {path}" if path else ""
                raise ValueError(
                    f"tokenizer{where} lacks the special token {name!r}; "
                    f"rebuild it with `python -m mmpipe.data.synth --out data/`"
                )
            ids[name] = tid
        if ids[PAD] != 0:
            raise ValueError(f"tokenizer {path or ''}: {PAD} has id {ids[PAD]}, expected 0")
        self.pad_id = ids[PAD]
        self.bos_id = ids[BOS]
        self.eos_id = ids[EOS]
        self.user_id = ids[USER]
        self.assistant_id = ids[ASSISTANT]
        self.image_id = ids[IMAGE]
        self.audio_id = ids[AUDIO]
        self.video_id = ids[VIDEO]
        self._fingerprint: str | None = None

    @property
    def vocab_size(self) -> int:
        """Entries of the vocabulary, special tokens included (ids are 0..vocab_size-1)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_id, self.bos_id, self.eos_id, self.user_id,
                          self.assistant_id, self.image_id, self.audio_id, self.video_id))

    @property
    def fingerprint(self) -> str:
        """A content hash of the tokenizer (its JSON form), the same wherever it is loaded from."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; no <bos>/<eos> is added (the chat template adds them)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of token ids; special tokens are written out unless `skip_special`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    def to_str(self) -> str:
        """The tokenizer as `tokenizer.json` text (deterministic for the same training data)."""
        return self._tok.to_str(pretty=True)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_str() + "\n")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={str(self.path) if self.path else None!r})"


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (deterministic for the same texts in order).

    Args:
        texts: the corpus, e.g. every turn of every synthetic conversation.
        vocab_size: upper bound on the vocabulary, specials and 256 byte symbols included.
    Returns:
        The trained tokenizer; `<pad>` is id 0 and the specials follow in SPECIAL_TOKENS order.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size={vocab_size} cannot hold the {len(SPECIAL_TOKENS)} special tokens and "
            f"256 byte symbols; use at least {len(SPECIAL_TOKENS) + 256}"
        )
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (data.tokenizer); a missing or foreign file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"data.tokenizer={str(path)!r}: no such file; generate it (and the shards) with "
            f"`python -m mmpipe.data.synth --out data/`"
        )
    try:
        tok = _HFTokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises its own exception type
        raise ValueError(f"data.tokenizer={str(path)!r} is not a tokenizers JSON file ({err})") from None
    return Tokenizer(tok, path=path)


class Vocabulary(Protocol):
    """What check_vocab reads: a Tokenizer, or any Templater (mmpipe.data.template)."""

    vocab_size: int
    path: Path | None


def check_vocab(tok: Vocabulary, vocab: int) -> None:
    """Raise if the tokenizer (or a templater's) has more entries than the model's embedding has rows."""
    if tok.vocab_size > vocab:
        where = f" ({tok.path})" if tok.path else ""
        raise ValueError(
            f"the tokenizer{where} has {tok.vocab_size} entries but model.llm.vocab={vocab}; "
            f"raise model.llm.vocab to at least {tok.vocab_size} or use a smaller tokenizer"
        )
