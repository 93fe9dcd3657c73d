"""img2dataset shards (KEY.jpg + KEY.txt / KEY.json with a caption) read as caption conversations."""

from __future__ import annotations

import io

import pytest
import webdataset as wds
from PIL import Image

from mmpipe.data.options import CAPTION_PROMPT
from mmpipe.data.reader import iter_meta
from mmpipe.data.skips import SkipCounter
from mmpipe.data.template import IGNORE, text_tokens

from .helpers import js, png, stream

PROMPT = CAPTION_PROMPT.replace("<image>", "")


def image(fmt: str, h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (20, 120, 220)).save(buf, format=fmt)
    return buf.getvalue()


def download_json(key: str, caption: str | None, h: int, w: int) -> dict:
    """What img2dataset writes into KEY.json (no conversations)."""
    return {"url": f"https://example.com/{key}.jpg", "key": key, "status": "success", "error_message": None,
            "width": w, "height": h, "original_width": 2 * w, "original_height": 2 * h,
            **({"caption": caption} if caption is not None else {})}


@pytest.fixture
def img2dataset(tmp_path, mini_tok) -> str:
    """Two shards as img2dataset writes them, written with webdataset's TarWriter; one sample
    has no caption, and one sample in mmpipe's own format shares the second shard."""
    with wds.TarWriter(str(tmp_path / "i-0.tar")) as tw:
        tw.write({"__key__": "000000000", "jpg": image("JPEG", 48, 64), "txt": "a blue square",
                  "json": download_json("000000000", "a blue square", 48, 64)})
        tw.write({"__key__": "000000001", "png": image("PNG", 32, 32),
                  "json": download_json("000000001", "a blue tile", 32, 32)})
        tw.write({"__key__": "000000002", "jpg": image("JPEG", 16, 16), "json": download_json("000000002", None, 16, 16)})
    with wds.TarWriter(str(tmp_path / "i-1.tar")) as tw:
        tw.write({"__key__": "000000003", "webp": image("WEBP", 40, 24), "txt": "blue",
                  "json": download_json("000000003", "blue", 40, 24)})
        conv = [{"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "red"}]
        _, doc = js("own", conv[0]["value"], "red", meta={"text_tokens": text_tokens(conv, mini_tok),
                                                          "images": [[30, 40]]})
        tw.write({"__key__": "own", "json": doc, "0.png": png()})
    return str(tmp_path / "i-{0..1}.tar")


def test_img2dataset_samples_become_one_image_caption_conversations(img2dataset, mini_tok, tiny_spec) -> None:
    s = stream(img2dataset, mini_tok, tiny_spec, epochs=1)
    recs = {r.key: r for r in s.records()}
    assert list(recs) == ["000000000", "000000001", "000000003", "own"]
    assert s.skips.as_dict() == {"no answer": 1} and "sample 000000002: no answer: an image without a caption" \
        in s.skips.examples[0]
    captions = {"000000000": "a blue square", "000000001": "a blue tile", "000000003": "blue"}
    sizes = {"000000000": (48, 64), "000000001": (32, 32), "000000003": (40, 24)}
    for key, caption in captions.items():
        r = recs[key]
        assert r.meta.images == (sizes[key],) and r.meta.audio_seconds == ()
        text = mini_tok.decode([t for t in r.input_ids if t != mini_tok.image_id])
        assert text == f"<bos><|user|>{PROMPT}<|assistant|>{caption}<eos>"
        assert mini_tok.decode([t for t in r.labels if t != IGNORE]) == f"{caption}<eos>"
        assert r.input_ids.count(mini_tok.image_id) > 0
    own = recs["own"]  # mmpipe's own samples pass unchanged
    assert mini_tok.decode([t for t in own.labels if t != IGNORE]) == "red<eos>" and own.meta.images == ((30, 40),)
    samples = {x.key: x for x in stream(img2dataset, mini_tok, tiny_spec, epochs=1)}
    assert samples["000000003"].images[0].shape[2] == 3 and samples["000000003"].meta.images == ((40, 24),)


def test_metadata_only_reading_probes_the_image_and_needs_the_tokenizer(img2dataset, mini_tok, tiny_spec) -> None:
    recs = [(r.key, r.meta) for r in stream(img2dataset, mini_tok, tiny_spec, epochs=1).records()]
    skips = SkipCounter()
    assert list(iter_meta(path=img2dataset, spec=tiny_spec, tokenizer=mini_tok, skips=skips)) == recs
    assert skips.as_dict() == {"no answer": 1}
    skips = SkipCounter()
    assert [k for k, _ in iter_meta(path=img2dataset, skips=skips)] == ["own"]
    assert skips.as_dict() == {"missing meta": 3, "no answer": 1}
    assert "needs the tokenizer" in " ".join(skips.examples)


def test_the_caption_prompt_is_a_data_option(img2dataset, mini_tok, tiny_spec) -> None:
    s = stream(img2dataset, mini_tok, tiny_spec, epochs=1, caption_prompt="What is in <image> here?")
    first = next(s.records())
    text = mini_tok.decode([t for t in first.input_ids if t != mini_tok.image_id])
    assert text == "<bos><|user|>What is in  here?<|assistant|>a blue square<eos>"
    with pytest.raises(ValueError, match=r"data.caption_prompt='Describe it.' must hold exactly one <image>"):
        stream(img2dataset, mini_tok, tiny_spec, caption_prompt="Describe it.")


def test_a_caption_json_of_img2dataset_is_not_mistaken_for_a_conversation(tmp_path, mini_tok, tiny_spec) -> None:
    with wds.TarWriter(str(tmp_path / "c-0.tar")) as tw:
        tw.write({"__key__": "k", "jpg": image("JPEG", 16, 16), "json": {"caption": "  "}})
    s = stream(str(tmp_path / "c-0.tar"), mini_tok, tiny_spec, epochs=1)
    with pytest.raises(ValueError, match="no usable sample in shard.*1 empty answer"):
        list(s.records())
