"""Small builders shared by the data tests: media bytes, sample JSON, streams and their keys."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
from PIL import Image

from mmpipe.data.reader import SampleStream, iter_meta


def png(h: int = 30, w: int = 40) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float = 0.5) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(1)
        wf.setframerate(8000)
        wf.writeframes(np.full(int(seconds * 8000), 128, np.uint8).tobytes())
    return buf.getvalue()


def js(key: str, human: str, answer: str, **extra) -> tuple[str, bytes]:
    """The KEY.json member of a one-round conversation (extra fields such as meta= added)."""
    obj = {"id": key, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": answer}], **extra}
    return f"{key}.json", json.dumps(obj).encode()


def stream(path, tok, spec, **kw) -> SampleStream:
    return SampleStream(path=path, tokenizer=tok, spec=spec, **kw)


def keys(items) -> list[str]:
    return [s.key for s in items]


def all_keys(path: str) -> list[str]:
    """Every sample key of a shard list, in stream order (one pass)."""
    return [k for k, _ in iter_meta(path=path)]
