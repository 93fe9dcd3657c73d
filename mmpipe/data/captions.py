"""img2dataset shards read as single-image caption conversations.

img2dataset (and the LAION / CC3M / DataComp shards made with it) writes each sample as
`KEY.jpg` (or `.png`, `.webp`), `KEY.txt` (the caption) and `KEY.json` (download metadata:
url, caption, sizes, ...; no `conversations`). The reader turns such a raw sample into the
sample format mmpipe.data.records expects before checking it:

    KEY.json  {"id": KEY, "conversations": [{"from": "human", "value": data.caption_prompt},
                                            {"from": "gpt", "value": caption}]}
    KEY.0.jpg the image

so the records code needs no second format. The caption is KEY.txt when present, else the
`caption` field of KEY.json. Samples in mmpipe's own format (a KEY.json with `conversations`,
media as KEY.0.png ...) pass through unchanged.

Such shards store no `meta`. Records probe the image header anyway; metadata-only reading
(`iter_meta`) reads the caption and the image too (images are small next to what decoding
costs, and only their header is parsed) and counts the text tokens with the tokenizer, so it
needs one.
"""

from __future__ import annotations

import json
from typing import Any

from mmpipe.data.media import probe_image
from mmpipe.data.skips import BAD_CONVERSATION, MISSING_META, NO_ANSWER, PLACEHOLDER_MISMATCH, SampleError
from mmpipe.data.template import GPT, HUMAN, Templater, as_templater, parse_conversation
from mmpipe.data.tokenizer import Tokenizer

CAPTION_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
"""Suffixes of an img2dataset image member (KEY.jpg, ...)."""
_META_SUFFIXES = frozenset(("json", "txt", *CAPTION_IMAGE_EXTS))


def metadata_member(name: str) -> bool:
    """The members metadata-only reading needs: KEY.json, and for caption samples KEY.txt and
    the image (mmpipe's own media members, KEY.0.png ..., are still skipped)."""
    if name.endswith(".json"):
        return True  # the common case first, without a regex (this runs for every member)
    base = name[name.rfind("/") + 1:]
    dot = base.find(".")
    return dot > 0 and base[dot + 1:].lower() in _META_SUFFIXES


def _caption_image(raw: dict[str, Any]) -> tuple[str, bytes] | None:
    """(suffix, bytes) of the caption sample's image, None when this is not a caption sample."""
    images = [ext for ext in CAPTION_IMAGE_EXTS if ext in raw]
    if not images:
        return None
    if "json" in raw:
        try:
            obj = json.loads(raw["json"])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None  # records reports the bad json
        if not isinstance(obj, dict) or "conversations" in obj:
            return None
    if len(images) > 1:
        raise SampleError(PLACEHOLDER_MISMATCH, f"a caption sample has {len(images)} images "
                          f"({', '.join('KEY.' + e for e in images)}); img2dataset writes one")
    return images[0], raw[images[0]]


def _caption(raw: dict[str, Any]) -> str:
    if "txt" in raw:
        try:
            return raw["txt"].decode("utf-8")
        except UnicodeDecodeError:
            raise SampleError(BAD_CONVERSATION, "KEY.txt (the caption) is not UTF-8 text") from None
    obj = json.loads(raw["json"]) if "json" in raw else {}
    caption = obj.get("caption")
    if not isinstance(caption, str):
        raise SampleError(NO_ANSWER, "an image without a caption: no KEY.txt and no 'caption' string in KEY.json")
    return caption


def as_conversation(raw: dict[str, Any], prompt: str, *, meta_with: Templater | Tokenizer | None = None,
                    need_meta: bool = False) -> dict[str, Any]:
    """`raw` itself, or for an img2dataset caption sample the same sample in mmpipe's format.

    With `need_meta` the new KEY.json also holds `meta` (image size from the header, text
    tokens counted with the templater `meta_with` and named by its fingerprint), as
    metadata-only reading expects.

    Raises:
        SampleError: no caption (`no answer`), a caption that is not UTF-8, two images, or
            (`need_meta` without a tokenizer) `missing meta`; a broken image header with
            `need_meta` (`undecodable image`).
    """
    found = _caption_image(raw)
    if found is None:
        return raw
    ext, image = found
    conversation = [{"from": HUMAN, "value": prompt}, {"from": GPT, "value": _caption(raw)}]
    doc: dict[str, Any] = {"id": str(raw.get("__key__", "")), "conversations": conversation}
    if need_meta:
        if meta_with is None:
            raise SampleError(MISSING_META, "an img2dataset caption sample stores no meta; metadata-only "
                              "reading needs the tokenizer to count its text tokens (iter_meta(tokenizer=...))")
        h, w = probe_image(image)
        tpl = as_templater(meta_with)
        doc["meta"] = {"text_tokens": tpl.text_tokens(parse_conversation(conversation)), "tokenizer": tpl.fingerprint,
                       "images": [[h, w]], "audio_seconds": []}
    out = {k: v for k, v in raw.items() if k.startswith("__")}
    out["json"] = json.dumps(doc).encode()
    out[f"0.{ext}"] = image
    return out
