"""A Hugging Face checkpoint's own tokenizer and chat template, as a Templater; and
`templater_for`, which picks the run's templater (this one or mmpipe's tiny template).

    templater = templater_for("ckpt/llava-1.5-7b-hf", spec)   # or "data/tokenizer.json"
    t = templater.template(turns, image_tokens=[576], audio_tokens=[])   # Templated

**Messages.** LLaVA turns become chat messages: `human` -> `user`, `gpt` -> `assistant`, a
leading `system` -> `system`. When the template reads structured content (probed once), every
message is a list of items: `{"type": "text", "text": ...}`, and `{"type": "image", "image":
None}` / `{"type": "audio", "audio": None}` / `{"type": "video", "video": None}` at the position
of each `<image>` / `<audio>` / `<video>` placeholder, so that the template emits its own markers
(LLaVA `<image>\\n`, Qwen2-VL `<|vision_start|><|image_pad|><|vision_end|>` and
`<|vision_start|><|video_pad|><|vision_end|>`, Qwen2-Audio `Audio 1: <|audio_bos|><|AUDIO|>
<|audio_eos|>\\n`). A template that reads only string content (a text LLM's), or that emits
nothing for a medium's items, gets that medium's token written into the text in place instead.

**Whitespace next to a placeholder.** Whitespace between a placeholder and the start or the
end of its turn is dropped (also between placeholders there): the template supplies its own
separator, so `"<image>\\nWhat is it?"` gives LLaVA's `<image>\\nWhat is it?` once, not with
a doubled newline, and Qwen2-VL's `...<|vision_end|>What is it?` as its own processor
examples have it. Text around a placeholder inside a turn is kept verbatim, and so is all text
of a medium written into the text in place.

**Labels** (the convention of docs/data.md): the conversation is rendered with the template;
answer k's label tokens are the tokens that the render through answer k adds after the render
of the turns before it with `add_generation_prompt=True` (its end-of-turn token included where
the template emits one); every other position is IGNORE. The three renders are tokenized and
must extend one another token by token. Where a tokenizer merges tokens across such a boundary
(e.g. a generation prompt ending in a space that the answer's first word absorbs), that
answer's labels fall back to the tokens of the full render that hold at least one character
of the answer's part of the render (the character rule of transformers' assistant masks); this
is logged once. A template whose earlier turns render differently once later turns follow (the
string renders do not extend one another) cannot follow the convention: an error naming the
checkpoint when the templater is made, or a `bad conversation` skip when only some
conversations do it.

**Media tokens.** The image / audio token id is the model config's (`image_token_id` /
`image_token_index`, `audio_token_id` / `audio_token_index`: the spec's `hf.config` when the
model has one, else the folder's config.json), else the tokenizer's `image_token` /
`audio_token`. After tokenization each occurrence (one per item, in order) is repeated as many
times as the encoder gives that medium tokens, which is the text a model's own processor
tokenizes (LlavaProcessor, Qwen2VLProcessor, Qwen2AudioProcessor repeat the same token in the
rendered string). Like the processors, the tokenizer's leading special tokens (a Llama `<s>`)
are added unless the render starts with the bos token already.

`text_tokens` = the templated length without the media tokens (markers such as
`<|vision_start|>` are text tokens).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mmpipe.data.skips import BAD_CONVERSATION, EMPTY_ANSWER, NO_ENCODER, PLACEHOLDER_MISMATCH, SampleError
from mmpipe.data.template import (
    GPT, HUMAN, IGNORE, PLACEHOLDER, SYSTEM, Templated, Templater, TinyTemplate, Turn, check_media_counts,
)
from mmpipe.data.tokenizer import AUDIO, IMAGE, VIDEO, load_tokenizer
from mmpipe.model.spec import ModelSpec

log = logging.getLogger(__name__)

ROLES = {HUMAN: "user", GPT: "assistant", SYSTEM: "system"}
"""LLaVA turn -> chat message role."""
KINDS = {IMAGE: "image", AUDIO: "audio", VIDEO: "video"}
"""LLaVA placeholder -> content item type."""
CONFIG_IDS = {"image": ("image_token_id", "image_token_index"), "audio": ("audio_token_id", "audio_token_index"),
              "video": ("video_token_id", "video_token_index")}
"""Checkpoint config attributes that give a medium's token id, in order of preference."""
RULES_VERSION = "chat-1"
"""Part of the fingerprint: bump when the message or whitespace rules change the counts."""
_PROBE_Q, _PROBE_A = "mmpipe probe question", "mmpipe probe answer"


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaToken:
    """How one medium appears in the token stream."""

    kind: str
    """`image` or `audio` (the content item type)."""
    id: int
    """The token id whose positions the encoder's outputs replace."""
    text: str
    """The token written as text."""
    placed: bool
    """True: the template emits the token (and its markers) for a content item; False: the
    token is written into the message text in place of the placeholder."""


def templater_for(source: str | Path, spec: ModelSpec, *, key: str = "data.tokenizer") -> Templater:
    """The run's templater: mmpipe's `tokenizer.json` (a file) or a Hugging Face checkpoint
    folder (its tokenizer, chat template and config; see mmpipe.data.chat).

    Args:
        source: the file or folder.
        spec: the model (which media tokens the templater must have).
        key: the setting `source` came from, named in errors.
    Raises:
        FileNotFoundError / ValueError: one line naming `key`, the value and the fix.
    """
    path = Path(source)
    if path.is_dir():
        return ChatTemplate.from_checkpoint(path, spec, key=key)
    if not path.is_file():
        raise FileNotFoundError(
            f"{key}={str(path)!r}: no such file or folder; give mmpipe's tokenizer.json (made by "
            f"`python -m mmpipe.data.synth --out data/`) or a Hugging Face checkpoint folder")
    return TinyTemplate(load_tokenizer(path))


def checkpoint_folder(spec: ModelSpec) -> Path | None:
    """The folder whose tokenizer and chat template a Hugging Face model trains with: the
    checkpoint's (`model.path`), or a composition's LLM (`model.llm.path`); None for
    mmpipe's own models and configs without weights."""
    if spec.hf is None:
        return None
    parts = dict(spec.hf.weights)
    folder = parts.get("model") or parts.get("llm")
    return Path(folder) if folder else None


def no_template_error(folder: Path, key: str) -> ValueError:
    return ValueError(
        f"{key}={str(folder)!r}: the checkpoint has no chat template (no chat_template.jinja, no chat_template in "
        f"tokenizer_config.json or chat_template.json); add one: set tokenizer.chat_template to a Jinja template "
        f"and tokenizer.save_pretrained({str(folder)!r}) (it writes chat_template.jinja)")


class ChatTemplate:
    """A checkpoint's tokenizer and chat template (a Templater; see the module docstring)."""

    system = True

    def __init__(self, tokenizer: Any, *, path: Path, chat_template: str, list_content: bool,
                 media: Sequence[MediaToken], pad_id: int, lead: Sequence[int],
                 track: tuple[int, int] | None = None, wrap: tuple[int, int] | None = None,
                 boi: tuple[str, str] | None = None) -> None:
        """Use from_checkpoint, which probes the template for `list_content` and `media`; `track`:
        the <audio_bos> / <audio_eos> ids around an interleaved clip (Qwen2.5-Omni's
        use_audio_in_video); `wrap`: the ids the model's processor puts around each image's tokens
        (InternVL's <img> / </img>: model.vision.image_markers); `boi`: (the text the template writes
        for an image, what the model's processor writes in its place around one image token) (Gemma 3's
        <start_of_image> -> "\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\n": the text is
        tokenized as Gemma3Processor tokenizes it, and its 4 text tokens around the image token are
        counted as model.vision.image_markers, not as text_tokens)."""
        self.tokenizer = tokenizer
        self.path = path
        self.chat_template = chat_template
        self.list_content = list_content
        self.media = {m.kind: m for m in media}
        self.pad_id = pad_id
        self.lead = tuple(lead)
        self.track = track
        self.wrap = wrap
        self.boi = boi
        self.inline_markers = 4 if boi is not None else 0
        self.bos = tokenizer.bos_token
        self.fallbacks = 0
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_checkpoint(cls, folder: Path, spec: ModelSpec, *, key: str = "data.tokenizer") -> ChatTemplate:
        """Load and probe a checkpoint folder (tokenizer files, chat template, config.json).

        Raises:
            ValueError: one line naming `key` and the folder: no tokenizer, no chat template,
                no token for a medium the model encodes, or a template that breaks the label
                convention.
        """
        from transformers import AutoTokenizer

        where = f"{key}={str(folder)!r}"
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:  # missing files, unknown or broken formats
            raise ValueError(f"{where}: no Hugging Face tokenizer loads from this folder "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
        template = tok.chat_template
        if isinstance(template, dict):  # several named templates: the default one is the chat's
            template = template.get("default")
        legacy = folder / "chat_template.json"  # a processor's file: the tokenizer does not read it
        if template is None and legacy.is_file():
            try:
                template = json.loads(legacy.read_text()).get("chat_template")
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"{where}: {legacy} is not a JSON object with a chat_template") from None
        if not template:
            raise no_template_error(folder, key)
        config = _model_config(spec, folder, where)
        ids: dict[str, int] = {}
        video = spec.vision.video if spec.vision is not None else None
        for kind, names in CONFIG_IDS.items():
            if kind == "video" and video is None:
                continue  # a model that takes no video needs no video token (Qwen2-VL configs always name one)
            tid = next((config[n] for n in names if isinstance(config.get(n), int)), None)
            if tid is None and getattr(tok, f"{kind}_token", None):
                tid = tok.convert_tokens_to_ids(getattr(tok, f"{kind}_token"))
            if tid is not None:
                ids[kind] = _check_token(tok, int(tid), kind, where)
        # (a model that takes video with a tokenizer without a video token skips video samples as
        # `no encoder`, mmpipe's tiny model with a text LLM's tokenizer for one)
        for kind, enc in (("image", spec.vision), ("audio", spec.audio)):
            if enc is not None and kind not in ids:
                raise ValueError(
                    f"{where}: model {spec.name} has an {kind} encoder but the "
                    f"checkpoint has no {kind} token (the model config has no {CONFIG_IDS[kind][0]} or "
                    f"{CONFIG_IDS[kind][1]}, the tokenizer no {kind}_token); add the token to the tokenizer "
                    f"as a special token and its id to the config")
        wrap = None
        if spec.vision is not None and spec.vision.image_markers == 2:  # InternVLProcessor's <img> ... </img>
            names = [getattr(tok, n, None) for n in ("start_image_token", "end_image_token")]
            if not all(names):
                raise ValueError(f"{where}: the model's processor puts a start and an end token around each image's "
                                 f"tokens but the tokenizer names no start_image_token / end_image_token; add them "
                                 f"(tokenizer_config.json's extra_special_tokens, as the checkpoint's processor reads)")
            wrap = tuple(_check_token(tok, tok.convert_tokens_to_ids(t), k, where)
                         for t, k in zip(names, ("image start", "image end")))
            context = getattr(tok, "context_image_token", None)  # the token InternVLProcessor repeats
            if context and tok.convert_tokens_to_ids(context) != ids.get("image"):
                want = tok.convert_tokens_to_ids(context)
                raise ValueError(f"{where}: the model config's image_token_id={ids.get('image')} "
                                 f"({tok.convert_ids_to_tokens(ids['image']) if 'image' in ids else None!r}) is not "
                                 f"the tokenizer's context_image_token {context!r} ({want}), the token the model's "
                                 f"processor repeats for an image's features; set image_token_id to {want}")
        boi = None
        if spec.vision is not None and spec.vision.image_markers == 4:  # Gemma3Processor's text around an image
            names = [getattr(tok, n, None) for n in ("boi_token", "eoi_token")]
            if not all(names) or "image" not in ids:
                raise ValueError(f"{where}: the model's processor writes <start_of_image> and <end_of_image> "
                                 f"around each image's tokens but the tokenizer names no boi_token / eoi_token; add "
                                 f"them (tokenizer_config.json's extra_special_tokens, as Gemma 3's tokenizer has)")
            for t, k in zip(names, ("image start", "image end")):
                _check_token(tok, tok.convert_tokens_to_ids(t), k, where)
            image = tok.convert_ids_to_tokens(ids["image"])
            boi = (names[0], f"\n\n{names[0]}{image}{names[1]}\n\n")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        plain = tok("a", add_special_tokens=False)["input_ids"]
        full = tok("a", add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        probe = cls(tok, path=folder, chat_template=template, list_content=True, media=[], pad_id=pad or 0,
                    lead=full[:at], wrap=wrap, boi=boi)
        list_content = probe._probe_content(where)
        media = [MediaToken(kind=k, id=tid, text=boi[0] if boi and k == "image" else tok.convert_ids_to_tokens(tid),
                            placed=list_content and probe._probe_placed(k, tid, where)) for k, tid in ids.items()]
        track = None
        if video is not None and video.audio_in_video:  # the processor's markers around a clip and its track
            bos, eos = config.get("audio_start_token_id"), config.get("audio_end_token_id")
            if not isinstance(bos, int) or not isinstance(eos, int):
                raise ValueError(f"{where}: model.use_audio_in_video needs the config's audio_start_token_id and "
                                 f"audio_end_token_id (Qwen2.5-Omni's <|audio_bos|> / <|audio_eos|>)")
            track = (_check_token(tok, bos, "audio start", where), _check_token(tok, eos, "audio end", where))
        out = cls(tok, path=folder, chat_template=template, list_content=list_content, media=media,
                  pad_id=pad or 0, lead=full[:at], track=track, wrap=wrap, boi=boi)
        out._probe_convention(where)
        return out

    def _probe_content(self, where: str) -> bool:
        """Whether the template reads list content (else string content)."""
        failed = ""
        for list_content in (True, False):
            q, a = ([{"type": "text", "text": t}] if list_content else t for t in (_PROBE_Q, _PROBE_A))
            try:
                out = self._render([[{"role": "user", "content": q}, {"role": "assistant", "content": a}]],
                                   gen=False)[0]
            except SampleError as err:
                failed = f" ({err.detail})"
                continue
            if _PROBE_Q in out and _PROBE_A in out and "'type'" not in out:
                return list_content
        raise ValueError(f"{where}: the chat template renders neither list nor string content of a user and an "
                         f"assistant message{failed}")

    def _probe_placed(self, kind: str, tid: int, where: str) -> bool:
        """Whether the template emits the medium's token for a content item (exactly once)."""
        msgs = [{"role": "user", "content": [{"type": kind, kind: None}, {"type": "text", "text": _PROBE_Q}]},
                {"role": "assistant", "content": [{"type": "text", "text": _PROBE_A}]}]
        try:
            out = self._render([msgs], gen=False)[0]
        except SampleError as err:
            raise ValueError(f"{where}: the chat template fails on a message with an {kind} item "
                             f"({err.detail})") from None
        n = self._encode([out])[0].count(tid)
        if n > 1:
            raise ValueError(f"{where}: the chat template emits {n} {kind} tokens for one {kind} item; "
                             f"mmpipe expands one token per item")
        return n == 1

    def _probe_convention(self, where: str) -> None:
        first = "".join(f"{p}\n" for p, k in KINDS.items() if k in self.media) + _PROBE_Q
        turns = [Turn(role=HUMAN, text=first), Turn(role=GPT, text=_PROBE_A),
                 Turn(role=HUMAN, text=_PROBE_Q), Turn(role=GPT, text=_PROBE_A)]
        try:
            t = self.template(turns, image_tokens=[2] * ("image" in self.media),
                              audio_tokens=[2] * ("audio" in self.media), video_tokens=[2] * ("video" in self.media))
        except SampleError as err:
            raise ValueError(f"{where}: the chat template cannot follow mmpipe's label convention on a two-round "
                             f"probe conversation: {err.detail}") from None
        specials = set(self.tokenizer.all_special_ids)
        if not any(y in specials for y in t.labels):
            log.warning("%s: the chat template ends answers with no special token, so no end-of-turn token is "
                        "labelled and the model is not taught to stop (docs/data.md)", where)

    @property
    def fingerprint(self) -> str:
        """Hash of the vocabulary, the template and the rules that decide text_tokens."""
        if self._fingerprint is None:
            self._fingerprint = self._digest()
        return self._fingerprint

    def _digest(self) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(self.tokenizer.get_vocab(), sort_keys=True)
        rules = {"rules": RULES_VERSION, "list": self.list_content, "lead": list(self.lead),
                 "placed": sorted(k for k, m in self.media.items() if m.placed), "template": self.chat_template,
                 **({"wrap": list(self.wrap)} if self.wrap else {}), **({"boi": list(self.boi)} if self.boi else {})}
        digest = hashlib.sha256(vocab.encode())
        digest.update(json.dumps(rules, sort_keys=True).encode())
        return f"chat:{digest.hexdigest()[:16]}"

    # ------------------------------------------------------------------ the Templater interface

    @property
    def image_id(self) -> int | None:
        return self.media["image"].id if "image" in self.media else None

    @property
    def audio_id(self) -> int | None:
        return self.media["audio"].id if "audio" in self.media else None

    @property
    def video_id(self) -> int | None:
        return self.media["video"].id if "video" in self.media else None

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def messages(self, turns: Sequence[Turn]) -> list[dict[str, Any]]:
        """The chat messages of a conversation (placeholders as items or token text)."""
        out = []
        for t in turns:
            if t.role == HUMAN:
                content = self._human_content(t.text)
            else:
                content = [{"type": "text", "text": t.text}] if self.list_content else t.text
            out.append({"role": ROLES[t.role], "content": content})
        return out

    def template(self, turns: Sequence[Turn], *, image_tokens: Sequence[int] = (),
                 audio_tokens: Sequence[int] = (), video_tokens: Sequence[int] = ()) -> Templated:
        """input_ids and labels by the label convention; media tokens expanded to the counts."""
        check_media_counts(turns, image_tokens, audio_tokens, video_tokens)
        msgs = self.messages(turns)
        answers = [j for j, t in enumerate(turns) if t.role == GPT]
        inner = [j for j in answers if j + 1 < len(msgs)]  # answers whose render is not the whole one
        prompts = self._render([msgs[:j] for j in answers], gen=True)
        renders = self._render([msgs[:j + 1] for j in inner] + [msgs], gen=False)
        full = renders[-1]
        through = dict(zip(inner, renders))
        ids = self._encode(prompts + renders)
        p_ids, t_ids, full_ids = ids[:len(answers)], dict(zip(inner, ids[len(answers):])), ids[-1]
        lead = self._lead(full)
        labels = [IGNORE] * (len(lead) + len(full_ids))
        offsets = None
        for k, j in enumerate(answers):
            p, t = prompts[k], through.get(j, full)
            if not t.startswith(p):
                raise SampleError(BAD_CONVERSATION, f"the chat template of {self.path} does not start answer turn {j} "
                                  f"with its generation prompt; mmpipe's label convention needs each render to "
                                  f"extend the one before (docs/data.md)")
            if not full.startswith(t):
                raise SampleError(BAD_CONVERSATION, f"the chat template of {self.path} renders the conversation up to "
                                  f"turn {j} differently once later turns follow; mmpipe's label convention needs "
                                  f"each render to extend the one before (docs/data.md)")
            pi, ti = p_ids[k], t_ids.get(j, full_ids)
            if ti[:len(pi)] == pi and full_ids[:len(ti)] == ti:
                span = range(len(pi), len(ti))
            else:  # the tokenizer merged across a boundary: label by characters
                offsets = offsets or self.tokenizer(self._inline(full), add_special_tokens=False,
                                                    return_offsets_mapping=True)["offset_mapping"]
                span = [i for i, (a, b) in enumerate(offsets) if a < len(self._inline(t)) and b > len(self._inline(p))]
                self._note_fallback(j)
            if not span:
                raise SampleError(EMPTY_ANSWER, f"turn {j}: the chat template of {self.path} renders no tokens "
                                                f"for this answer")
            for i in span:
                labels[len(lead) + i] = full_ids[i]
        return self._expand(list(lead) + full_ids, labels,
                            {"image": image_tokens, "audio": audio_tokens, "video": video_tokens})

    def text_tokens(self, turns: Sequence[Turn]) -> int:
        """template(...).text_tokens from one render (no labels, no prefix checks)."""
        msgs = self.messages(turns)
        full = self._render([msgs], gen=False)[0]
        ids = self._encode([full])[0]
        n_media = sum(ids.count(m.id) for m in self.media.values())
        placeholders = sum(len(PLACEHOLDER.findall(t.text)) for t in turns if t.role == HUMAN)
        if n_media != placeholders:
            raise SampleError(PLACEHOLDER_MISMATCH, f"the rendered conversation holds {n_media} media tokens for "
                                                    f"{placeholders} placeholders (a media token in the text itself?)")
        return len(self._lead(full)) + len(ids) - n_media - self.inline_markers * ids.count(self.image_id or -1)

    def __repr__(self) -> str:
        return f"ChatTemplate(path={str(self.path)!r}, fingerprint={self.fingerprint!r})"

    # ------------------------------------------------------------------ helpers

    def _human_content(self, text: str) -> Any:
        items: list[dict[str, Any]] = []
        for n, piece in enumerate(PLACEHOLDER.split(text)):
            kind = KINDS[piece] if n % 2 else None  # split() puts the placeholders at odd positions
            if kind is not None and kind not in self.media:
                raise SampleError(NO_ENCODER, f"the sample has an {kind} but {self.path} has no {kind} token")
            if kind is not None and self.media[kind].placed:
                items.append({"type": kind, kind: None})
                continue
            piece = self.media[kind].text if kind is not None else piece
            if items and items[-1]["type"] == "text":
                items[-1]["text"] += piece
            else:
                items.append({"type": "text", "text": piece})
        if not self.list_content:  # then no medium is placed: one text
            return "".join(it["text"] for it in items)
        _strip_edges(items)
        _strip_edges(items[::-1], end=True)
        return [it for it in items if it["type"] != "text" or it["text"]]

    def _render(self, convs: list[list[dict[str, Any]]], *, gen: bool) -> list[str]:
        from jinja2 import TemplateError

        try:
            out = self.tokenizer.apply_chat_template(convs, chat_template=self.chat_template, tokenize=False,
                                                     add_generation_prompt=gen)
        except (TemplateError, TypeError) as err:  # raise_exception() in a template; content of a type it
            # does not handle (jinja raises TypeError, e.g. adding a list to a string)
            raise SampleError(BAD_CONVERSATION, f"the chat template of {self.path} rejects it ({err})") from None
        return [out] if isinstance(out, str) else list(out)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        texts = [self._inline(t) for t in texts]
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _inline(self, text: str) -> str:
        """A render as the model's processor tokenizes it: Gemma 3's image text in place of each
        <start_of_image> (`boi`); unchanged for every other model."""
        return text.replace(self.boi[0], self.boi[1]) if self.boi is not None else text

    def _lead(self, render: str) -> tuple[int, ...]:
        # The processors tokenize with the tokenizer's special tokens unless the render starts
        # with bos (ProcessorMixin.apply_chat_template); only leading ones keep the prefixes.
        return () if self.bos and render.startswith(self.bos) else self.lead

    def _note_fallback(self, turn: int) -> None:
        if not self.fallbacks:
            log.warning("%s: the tokenizer merges tokens across an answer boundary (turn %d); such answers are "
                        "labelled by character offsets (docs/data.md)", self.path, turn)
        self.fallbacks += 1

    def _expand(self, ids: list[int], labels: list[int], counts: dict[str, Sequence[int]]) -> Templated:
        by_id = {m.id: m for m in self.media.values()}
        seen = {kind: 0 for kind in counts}
        out_ids: list[int] = []
        out_labels: list[int] = []
        for x, y in zip(ids, labels):
            m = by_id.get(x)
            if m is None:
                out_ids.append(x)
                out_labels.append(y)
                continue
            if y != IGNORE:
                raise SampleError(PLACEHOLDER_MISMATCH, f"an answer holds the {m.kind} token {m.text!r}")
            k = seen[m.kind]
            seen[m.kind] += 1
            if k >= len(counts[m.kind]):
                break
            expanded = self._media_ids(x, counts[m.kind][k])
            out_ids.extend(expanded)
            out_labels.extend([IGNORE] * len(expanded))
        for kind, n in seen.items():
            if n != len(counts[kind]):
                token = self.media[kind].text if kind in self.media else kind
                raise SampleError(PLACEHOLDER_MISMATCH, f"the rendered conversation holds {n} {token} token(s) for "
                                                        f"{len(counts[kind])} {kind}(s) (a media token in the text "
                                                        f"itself, or a template that drops media items?)")
        return Templated(input_ids=out_ids, labels=out_labels,
                         text_tokens=len(ids) - sum(seen.values()) - self.inline_markers * seen.get("image", 0))

    def _media_ids(self, token: int, count: Any) -> list[int]:
        """One placeholder's ids: `count` copies of its token (an image's between the `wrap` markers,
        as InternVLProcessor.replace_image_token puts them), or for the runs of an interleaved
        clip (geometry.interleaved_runs) <audio_bos>, each run's video or audio tokens, <audio_eos>:
        what Qwen2_5OmniProcessor.replace_video_with_audio_token puts in the clip's place."""
        if isinstance(count, int):
            if self.wrap is not None and "image" in self.media and token == self.media["image"].id:
                return [self.wrap[0], *[token] * count, self.wrap[1]]
            return [token] * count
        if self.track is None or "audio" not in self.media:
            raise SampleError(NO_ENCODER, f"{self.path} has no audio track markers (model.use_audio_in_video)")
        ids = {"video": token, "audio": self.media["audio"].id}
        return [self.track[0], *(ids[kind] for kind, n in count for _ in range(n)), self.track[1]]


def _strip_edges(items: list[dict[str, Any]], *, end: bool = False) -> None:
    """Drop whitespace before the first text after the placeholders that open a turn (or,
    with end=True on the reversed items, after the last text before those that close it)."""
    media = False
    for it in items:
        if it["type"] != "text":
            media = True
        elif not it["text"].strip():
            it["text"] = ""
        else:
            if media:
                it["text"] = it["text"].rstrip() if end else it["text"].lstrip()
            return


def _model_config(spec: ModelSpec, folder: Path, where: str) -> dict[str, Any]:
    """The model's config as its JSON fields: the spec's (a model built from transformers
    classes, compositions included), else the folder's config.json, else empty."""
    text, origin = (spec.hf.config, "model.config") if spec.hf is not None and spec.hf.config else (None, "")
    if text is None and (folder / "config.json").is_file():
        text, origin = (folder / "config.json").read_text(), str(folder / "config.json")
    if text is None:
        return {}
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: {origin} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {origin} must hold a JSON object")
    return cfg


def _check_token(tok: Any, tid: int, kind: str, where: str) -> int:
    text = tok.convert_ids_to_tokens(tid) if 0 <= tid < len(tok) else None
    if text is None or tok(text, add_special_tokens=False)["input_ids"] != [tid]:
        raise ValueError(f"{where}: the {kind} token id {tid} of the model config is not a single token of the "
                         f"tokenizer "
                         f"({text!r}); add it to the tokenizer as a special token")
    return tid
