"""The templating interface, and mmpipe's own tiny template behind it.

A `Templater` turns a checked conversation into `input_ids` and `labels`, expanding each
media placeholder into as many image / audio token ids as the encoder hands the LLM for that
medium. Two implementations: `TinyTemplate` here (mmpipe's own tokenizer) and
`mmpipe.data.chat.ChatTemplate` (a Hugging Face checkpoint's tokenizer and chat template);
`mmpipe.data.chat.templater_for` picks one from the run's tokenizer setting.

The tiny template:

    <bos> <|user|> {human text} <|assistant|> {gpt text} <eos> <|user|> ... <eos>

Only answer tokens (each gpt text and its <eos>) carry labels; everything else is labelled
IGNORE (-100). Labels are aligned with `input_ids` (labels[i] is token i itself); the model
shifts them when it computes the next-token loss. Each `<image>` / `<audio>` / `<video>`
placeholder in a human turn is expanded in place into as many image / audio / video token ids as
the encoder hands the LLM for that medium (features.image_tokens / audio_tokens / video_tokens),
in order of appearance. Hence
`len(input_ids) == features(spec, meta).llm_len` and `meta.text_tokens` is the length with
the placeholders taken out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from mmpipe.data.skips import (
    BAD_CONVERSATION, EMPTY_ANSWER, NO_ANSWER, NO_ENCODER, PLACEHOLDER_MISMATCH, UNDECODABLE_IMAGE,
    UNDECODABLE_VIDEO, SampleError,
)
from mmpipe.data.tokenizer import AUDIO, IMAGE, VIDEO, Tokenizer
from mmpipe.model.spec import ModelSpec
from mmpipe.model.geometry import (
    SampleMeta, audio_tokens, interleaved_runs, sample_image_tokens, video_tokens, video_track,
)

IGNORE = -100
"""Label of a position that carries no loss."""

HUMAN, GPT, SYSTEM = "human", "gpt", "system"
PLACEHOLDER = re.compile(f"({re.escape(IMAGE)}|{re.escape(AUDIO)}|{re.escape(VIDEO)})")


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One turn of a conversation."""

    role: str
    """`human`, `gpt`, or `system` (first turn only, for templaters that have a system role)."""
    text: str
    """What was said; human text may hold `<image>` / `<audio>` / `<video>` placeholders."""


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


def parse_conversation(obj: Any, *, system: bool = False) -> list[Turn]:
    """Check a LLaVA `conversations` list ([{"from": "human"|"gpt", "value": str}, ...]).

    With `system=True` a first turn `{"from": "system", ...}` is accepted too.

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
        if role == SYSTEM and system and i == 0:
            if PLACEHOLDER.search(t["value"]):
                raise SampleError(PLACEHOLDER_MISMATCH, "turn 0 ('system') holds a media placeholder")
        elif role == SYSTEM and system:
            raise SampleError(BAD_CONVERSATION, f"turn {i} has from='system'; only the first turn may")
        elif role not in (HUMAN, GPT):
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


def count_videos(turns: Sequence[Turn]) -> int:
    """`<video>` placeholders over the human turns."""
    return sum(t.text.count(VIDEO) for t in turns if t.role == HUMAN)


def check_media_counts(turns: Sequence[Turn], image_tokens: Sequence[int], audio_tokens: Sequence[int],
                       video_tokens: Sequence[int] = ()) -> None:
    """Raise `placeholder mismatch` unless there is one count per placeholder of each kind."""
    n_img, n_aud = count_placeholders(turns)
    n_vid = count_videos(turns)
    if n_img != len(image_tokens) or n_aud != len(audio_tokens) or n_vid != len(video_tokens):
        vid = bool(n_vid or video_tokens)  # videos named only where there are some
        raise SampleError(
            PLACEHOLDER_MISMATCH,
            f"the text has {n_img} {IMAGE}{',' if vid else ''} and {n_aud} {AUDIO}"
            f"{f' and {n_vid} {VIDEO}' if vid else ''} placeholders but the sample has {len(image_tokens)} image(s)"
            f"{',' if vid else ''} and {len(audio_tokens)} audio clip(s){f' and {len(video_tokens)} video(s)' if vid else ''}",
        )


def apply_template(
    turns: Sequence[Turn],
    tok: Tokenizer,
    *,
    image_tokens: Sequence[int] = (),
    audio_tokens: Sequence[int] = (),
    video_tokens: Sequence[int] = (),
) -> Templated:
    """Template a checked conversation, expanding placeholder k of a kind into its count.

    Args:
        turns: from parse_conversation.
        tok: the tokenizer.
        image_tokens: LLM tokens of each image, in order (0 drops the placeholder).
        audio_tokens: LLM tokens of each audio clip, in order.
        video_tokens: LLM tokens of each video, in order.
    Raises:
        SampleError: `placeholder mismatch` when the placeholders and media differ in number.
    """
    check_media_counts(turns, image_tokens, audio_tokens, video_tokens)
    if any(t.role == SYSTEM for t in turns):
        raise SampleError(BAD_CONVERSATION, "the conversation has a 'system' turn; mmpipe's tiny template has no "
                                            "system role (a checkpoint's chat template may have one)")
    ids: list[int] = [tok.bos_id]
    labels: list[int] = [IGNORE]
    media = 0
    next_img = iter(image_tokens)
    next_aud = iter(audio_tokens)
    next_vid = iter(video_tokens)
    for t in turns:
        if t.role == HUMAN:
            ids.append(tok.user_id)
            for piece in PLACEHOLDER.split(t.text):
                if piece == IMAGE:
                    n, tid = next(next_img), tok.image_id
                elif piece == AUDIO:
                    n, tid = next(next_aud), tok.audio_id
                elif piece == VIDEO:
                    n, tid = next(next_vid), tok.video_id
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
    return TinyTemplate(tok).text_tokens(parse_conversation(conversations))


class Templater(Protocol):
    """A tokenizer with its chat template: what the records, the reader and the model need.

    `TinyTemplate` (mmpipe's tokenizer) and `mmpipe.data.chat.ChatTemplate` (a Hugging Face
    checkpoint's) implement it.
    """

    path: Path | None
    """Where it was loaded from (named in errors)."""
    fingerprint: str
    """Content hash of everything that decides text_tokens (tokenizer and template); shards
    record it beside meta.text_tokens."""
    system: bool
    """Whether a leading `system` turn is accepted."""
    pad_id: int
    """Id of padding positions."""
    image_id: int | None
    """Id of the image token (None: no image token)."""
    audio_id: int | None
    """Id of the audio token (None: no audio token)."""
    video_id: int | None
    """Id of the video token (None: no video token)."""
    vocab_size: int
    """Entries of the vocabulary (the LLM embedding needs at least this many rows)."""

    def template(self, turns: Sequence[Turn], *, image_tokens: Sequence[int] = (),
                 audio_tokens: Sequence[int] = (), video_tokens: Sequence[int] = ()) -> Templated:
        """input_ids and labels; placeholder k of a kind expands into image_tokens[k] /
        audio_tokens[k] / video_tokens[k] ids. A video_tokens entry may instead be the runs of an
        interleaved clip (Qwen2.5-Omni's use_audio_in_video: ((`video`, n), (`audio`, m), ...),
        geometry.interleaved_runs), which a templater that supports it expands into <audio_bos>,
        the runs and <audio_eos>. Raises SampleError (the caller adds shard and key)."""
        ...

    def text_tokens(self, turns: Sequence[Turn]) -> int:
        """template(...).text_tokens, for planning: no labels are computed."""
        ...


class TinyTemplate:
    """mmpipe's own tokenizer and the tiny template above, as a Templater."""

    __slots__ = ("tok",)
    system = False

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    @property
    def path(self) -> Path | None:
        return self.tok.path

    @property
    def fingerprint(self) -> str:
        return f"tiny:{self.tok.fingerprint}"

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    @property
    def image_id(self) -> int:
        return self.tok.image_id

    @property
    def audio_id(self) -> int:
        return self.tok.audio_id

    @property
    def video_id(self) -> int:
        return self.tok.video_id

    @property
    def vocab_size(self) -> int:
        return self.tok.vocab_size

    def template(self, turns: Sequence[Turn], *, image_tokens: Sequence[int] = (),
                 audio_tokens: Sequence[int] = (), video_tokens: Sequence[int] = ()) -> Templated:
        return apply_template(turns, self.tok, image_tokens=image_tokens, audio_tokens=audio_tokens,
                              video_tokens=video_tokens)

    def text_tokens(self, turns: Sequence[Turn]) -> int:
        n_img, n_aud = count_placeholders(turns)
        return apply_template(turns, self.tok, image_tokens=[0] * n_img, audio_tokens=[0] * n_aud,
                              video_tokens=[0] * count_videos(turns)).text_tokens

    def __repr__(self) -> str:
        return f"TinyTemplate({self.tok!r})"


def as_templater(tok: Templater | Tokenizer) -> Templater:
    """A Templater; mmpipe's Tokenizer stands for its tiny template."""
    return TinyTemplate(tok) if isinstance(tok, Tokenizer) else tok


def media_tokens(spec: ModelSpec, meta: SampleMeta) -> tuple[list[int], list[int], list]:
    """LLM tokens of each image, each clip and each video of a sample under a model (the geometry
    rules); a video whose audio track is interleaved (Qwen2.5-Omni's use_audio_in_video) gives its
    runs (geometry.interleaved_runs) instead of a count.

    Raises:
        SampleError: `no encoder` when the sample has a medium the model cannot encode;
            `undecodable image` for an image the model's resize rule refuses (Qwen2-VL's: an
            aspect ratio over 200); `undecodable video` for a clip the frame rule refuses (too
            short for one temporal patch, a frame size the resize refuses).
    """
    if meta.images and spec.vision is None:
        raise SampleError(NO_ENCODER, f"the sample has images but model {spec.name} has no vision encoder")
    if meta.audio_seconds and spec.audio is None:
        raise SampleError(NO_ENCODER, f"the sample has audio but model {spec.name} has no audio encoder")
    if meta.videos and (spec.vision is None or spec.vision.video is None):
        raise SampleError(NO_ENCODER, f"the sample has videos but model {spec.name} takes no video")
    try:
        img = list(sample_image_tokens(spec.vision, meta.images)) if spec.vision else []
    except ValueError as err:
        raise SampleError(UNDECODABLE_IMAGE, f"the model's image processor refuses it ({err})") from None
    aud = [audio_tokens(spec.audio, s) for s in meta.audio_seconds] if spec.audio else []
    try:
        vid = [interleaved_runs(spec, m) if video_track(spec.vision, m) else video_tokens(spec.vision, m)
               for m in meta.videos]
    except ValueError as err:
        raise SampleError(UNDECODABLE_VIDEO, f"the model's video rule refuses it ({err})") from None
    return img, aud, vid


def template_sample(turns: Sequence[Turn], tok: Templater | Tokenizer, spec: ModelSpec,
                    meta: SampleMeta) -> Templated:
    """Template a conversation for a model: placeholders expand by the geometry rules.

    `meta` gives the true media sizes (images as (height, width) before resizing, clip
    durations); its text_tokens is not read.
    """
    img, aud, vid = media_tokens(spec, meta)
    return as_templater(tok).template(turns, image_tokens=img, audio_tokens=aud, video_tokens=vid)
