"""The chat template: a LLaVA-style conversation becomes `input_ids` and `labels`.

    <bos> <|user|> {human text} <|assistant|> {gpt text} <eos> <|user|> ... <eos>

Only answer tokens (each gpt text and its <eos>) carry labels; everything else is labelled
IGNORE (-100). Labels are aligned with `input_ids` (labels[i] is token i itself); the model
shifts them when it computes the next-token loss. Each `<image>` / `<audio>` placeholder in a
human turn is expanded into as many image / audio token ids as the encoder hands the LLM for
that medium (features.image_tokens / audio_tokens), in order of appearance. Hence
`len(input_ids) == features(spec, meta).llm_len` and `meta.text_tokens` is the length with
the placeholders taken out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from mmpipe.data.skips import (
    BAD_CONVERSATION, EMPTY_ANSWER, NO_ANSWER, PLACEHOLDER_MISMATCH, NO_ENCODER, SampleError,
)
from mmpipe.data.tokenizer import AUDIO, IMAGE, Tokenizer
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import SampleMeta, audio_tokens, image_tokens

IGNORE = -100
"""Label of a position that carries no loss."""

HUMAN, GPT = "human", "gpt"
PLACEHOLDER = re.compile(f"({re.escape(IMAGE)}|{re.escape(AUDIO)})")


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One turn of a conversation."""

    role: str
    """`human` or `gpt`."""
    text: str
    """What was said; human text may hold `<image>` / `<audio>` placeholders."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Templated:
    """A conversation after the template."""

    input_ids: list[int]
    """Token ids, placeholders expanded."""
    labels: list[int]
    """Same length as input_ids: the id on answer tokens, IGNORE elsewhere."""
    text_tokens: int
    """Length without the expanded media tokens (SampleMeta.text_tokens)."""

    @property
    def answer_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


def parse_conversation(obj: Any) -> list[Turn]:
    """Check a LLaVA `conversations` list ([{"from": "human"|"gpt", "value": str}, ...]).

    Raises:
        SampleError: reason `bad conversation`, `no answer` or `empty answer`, or
            `placeholder mismatch` for a placeholder inside an answer.
    """
    if not isinstance(obj, list) or not obj:
        raise SampleError(BAD_CONVERSATION, f"conversations must be a non-empty list, got {obj!r:.80}")
    turns: list[Turn] = []
    for i, t in enumerate(obj):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise SampleError(BAD_CONVERSATION, f"turn {i} must be {{'from': ..., 'value': str}}, got {t!r:.80}")
        role = t.get("from")
        if role not in (HUMAN, GPT):
            raise SampleError(BAD_CONVERSATION, f"turn {i} has from={role!r}; use 'human' or 'gpt'")
        turns.append(Turn(role=role, text=t["value"]))
    answers = [t for t in turns if t.role == GPT]
    if not answers:
        raise SampleError(NO_ANSWER, "the conversation has no 'gpt' turn to learn from")
    for i, t in enumerate(turns):
        if t.role == GPT and not t.text.strip():
            raise SampleError(EMPTY_ANSWER, f"turn {i} ('gpt') is empty")
        if t.role == GPT and PLACEHOLDER.search(t.text):
            raise SampleError(PLACEHOLDER_MISMATCH, f"turn {i} ('gpt') holds a media placeholder")
    return turns


def count_placeholders(turns: Sequence[Turn]) -> tuple[int, int]:
    """(`<image>` count, `<audio>` count) over the human turns."""
    n_img = n_aud = 0
    for t in turns:
        if t.role == HUMAN:
            for m in PLACEHOLDER.findall(t.text):
                n_img += m == IMAGE
                n_aud += m == AUDIO
    return n_img, n_aud


def apply_template(
    turns: Sequence[Turn],
    tok: Tokenizer,
    *,
    image_tokens: Sequence[int] = (),
    audio_tokens: Sequence[int] = (),
) -> Templated:
    """Template a checked conversation, expanding placeholder k of a kind into its count.

    Args:
        turns: from parse_conversation.
        tok: the tokenizer.
        image_tokens: LLM tokens of each image, in order (0 drops the placeholder).
        audio_tokens: LLM tokens of each audio clip, in order.
    Raises:
        SampleError: `placeholder mismatch` when the placeholders and media differ in number.
    """
    n_img, n_aud = count_placeholders(turns)
    if n_img != len(image_tokens) or n_aud != len(audio_tokens):
        raise SampleError(
            PLACEHOLDER_MISMATCH,
            f"the text has {n_img} {IMAGE} and {n_aud} {AUDIO} placeholders but the sample has "
            f"{len(image_tokens)} image(s) and {len(audio_tokens)} audio clip(s)",
        )
    ids: list[int] = [tok.bos_id]
    labels: list[int] = [IGNORE]
    media = 0
    next_img = iter(image_tokens)
    next_aud = iter(audio_tokens)
    for t in turns:
        if t.role == HUMAN:
            ids.append(tok.user_id)
            for piece in PLACEHOLDER.split(t.text):
                if piece == IMAGE:
                    n, tid = next(next_img), tok.image_id
                elif piece == AUDIO:
                    n, tid = next(next_aud), tok.audio_id
                else:
                    n, tid = 0, 0
                    ids.extend(tok.encode(piece) if piece else ())
                ids.extend([tid] * n)
                media += n
            labels.extend([IGNORE] * (len(ids) - len(labels)))
        else:
            ids.append(tok.assistant_id)
            labels.append(IGNORE)
            answer = tok.encode(t.text) + [tok.eos_id]
            ids.extend(answer)
            labels.extend(answer)
    return Templated(input_ids=ids, labels=labels, text_tokens=len(ids) - media)


def text_tokens(conversations: Any, tok: Tokenizer) -> int:
    """SampleMeta.text_tokens of a raw conversation: its templated length without media."""
    turns = parse_conversation(conversations)
    n_img, n_aud = count_placeholders(turns)
    return apply_template(turns, tok, image_tokens=[0] * n_img, audio_tokens=[0] * n_aud).text_tokens


def template_sample(turns: Sequence[Turn], tok: Tokenizer, spec: ModelSpec, meta: SampleMeta) -> Templated:
    """Template a conversation for a model: placeholders expand by the features rules.

    `meta` gives the true media sizes (images as (height, width) before resizing, clip
    durations); its text_tokens is not read.
    """
    if meta.images and spec.vision is None:
        raise SampleError(NO_ENCODER, f"the sample has images but model {spec.name} has no vision encoder")
    if meta.audio_seconds and spec.audio is None:
        raise SampleError(NO_ENCODER, f"the sample has audio but model {spec.name} has no audio encoder")
    img = [image_tokens(spec.vision, h, w) for h, w in meta.images] if spec.vision else []
    aud = [audio_tokens(spec.audio, s) for s in meta.audio_seconds] if spec.audio else []
    return apply_template(turns, tok, image_tokens=img, audio_tokens=aud)
