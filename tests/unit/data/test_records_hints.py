"""Shards are not tied to one tokenizer: meta.text_tokens is a hint of the templater that
counted it (meta.tokenizer), checked and used only under that templater, counted again under
any other."""

from __future__ import annotations

import json
import pickle

import pytest
from PIL import Image

from mmpipe.data.chat import templater_for
from mmpipe.data.convert import convert
from mmpipe.data.reader import SampleStream, iter_meta
from mmpipe.data.synth import write_shard
from mmpipe.data.template import parse_conversation, template_sample
from mmpipe.model.geometry import features

CONV = [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "gpt", "value": "4"}]


@pytest.fixture(scope="module")
def omni(hf_dirs, hf_specs):
    return templater_for(hf_dirs["qwen2-omni"], hf_specs["tiny"])


def test_shards_made_with_the_project_tokenizer_train_a_checkpoint_tokenizer(mini_path, omni, hf_specs) -> None:
    spec = hf_specs["tiny"]
    stream = SampleStream(path=mini_path, tokenizer=omni, spec=spec, epochs=1)
    recs = list(stream.records())
    assert len(recs) == 40 and stream.skips.total == 0
    recounted = 0
    for r in recs:
        obj = json.loads(r.raw["json"])
        turns = parse_conversation(obj["conversations"])
        t = template_sample(turns, omni, spec, r.meta)
        assert (r.input_ids, r.labels) == (t.input_ids, t.labels)
        assert r.meta.text_tokens == t.text_tokens == omni.text_tokens(turns)
        assert r.llm_len == features(spec, r.meta).llm_len
        recounted += r.meta.text_tokens != obj["meta"]["text_tokens"]
    assert recounted >= 35  # the stored counts are the tiny tokenizer's
    # planning from the .json members alone gives the counts training will see
    assert [m for _, m in iter_meta(path=mini_path, spec=spec, tokenizer=omni)] == [r.meta for r in recs]
    sample = stream.decode(next(r for r in recs if r.meta.images and r.meta.audio_seconds))
    assert sample.input_ids.count(omni.image_id) == sum(features(spec, sample.meta).image_tokens)
    assert len(sample.images) == len(sample.meta.images) and len(sample.audio) == len(sample.meta.audio_seconds)


def _shard(tmp_path, metas: dict[str, dict]) -> str:
    members = [(f"{k}.json", json.dumps({"id": k, "conversations": CONV, "meta": m}).encode())
               for k, m in metas.items()]
    write_shard(tmp_path / "h-0.tar", members)
    return str(tmp_path / "h-0.tar")


def test_a_stored_count_is_checked_and_used_only_under_the_templater_that_counted_it(tmp_path, omni, hf_specs,
                                                                                     mini_tok) -> None:
    spec = hf_specs["tiny"]
    right = omni.text_tokens(parse_conversation(CONV))
    path = _shard(tmp_path, {
        "mine-wrong": {"text_tokens": right + 5, "tokenizer": omni.fingerprint},
        "mine-right": {"text_tokens": right, "tokenizer": omni.fingerprint},
        "other": {"text_tokens": right + 5, "tokenizer": "chat:0123456789abcdef"},
        "legacy": {"text_tokens": right + 5},  # before fingerprints: counted by an mmpipe tokenizer
    })
    stream = SampleStream(path=path, tokenizer=omni, spec=spec, epochs=1)
    got = {r.key: r.meta.text_tokens for r in stream.records()}
    assert got == {"mine-right": right, "other": right, "legacy": right}
    assert stream.skips.as_dict() == {"meta mismatch": 1}
    assert f"mine-wrong: meta mismatch: text_tokens {right + 5} stored, {right} with this tokenizer" in \
        stream.skips.examples[0]
    # metadata-only reading trusts a hint of its own templater, counts every other one
    metas = dict(iter_meta(path=path, spec=spec, tokenizer=omni))
    assert {k: m.text_tokens for k, m in metas.items()} == {"mine-wrong": right + 5, "mine-right": right,
                                                           "other": right, "legacy": right}
    # under the project tokenizer the legacy count is its own again, and checked as before
    tiny = mini_tok.fingerprint
    path = _shard(tmp_path, {"legacy": {"text_tokens": 999},
                             "chat": {"text_tokens": 999, "tokenizer": omni.fingerprint},
                             "tiny": {"text_tokens": 999, "tokenizer": f"tiny:{tiny}"}})
    stream = SampleStream(path=path, tokenizer=mini_tok, spec=spec, epochs=1)
    assert [r.key for r in stream.records()] == ["chat"]
    assert stream.skips.as_dict() == {"meta mismatch": 2}


def test_convert_names_the_templater_that_counted(tmp_path, omni, hf_specs, mini_tok) -> None:
    Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / "a.png")
    items = [{"id": "t", "conversations": CONV},
             {"id": "i", "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                                            {"from": "gpt", "value": "red"}]},
             {"id": "s", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hi"}]}]
    (tmp_path / "in.json").write_text(json.dumps(items))
    for tpl, fingerprint in ((omni, omni.fingerprint), (mini_tok, f"tiny:{mini_tok.fingerprint}")):
        out = tmp_path / fingerprint[:4]
        r = convert(json_path=tmp_path / "in.json", out=out, tokenizer=tpl, spec=hf_specs["tiny"], progress=False)
        assert r.index["tokenizer"]["fingerprint"] == fingerprint
        # a system turn is the chat template's; mmpipe's tiny template has none
        assert r.skipped_ids == ({} if tpl is omni else {"bad conversation": ["s"]})
        stream = SampleStream(path=r.path, tokenizer=tpl, spec=hf_specs["tiny"], epochs=1, on_error="raise")
        for rec in stream.records():
            obj = json.loads(rec.raw["json"])
            assert obj["meta"]["tokenizer"] == fingerprint
            assert obj["meta"]["text_tokens"] == rec.meta.text_tokens


def test_fingerprints_name_the_tokenizer_and_template_not_the_folder(tmp_path, hf_dirs, hf_specs, omni) -> None:
    import shutil

    shutil.copytree(hf_dirs["qwen2-omni"], tmp_path / "copy")
    assert templater_for(tmp_path / "copy", hf_specs["tiny"]).fingerprint == omni.fingerprint
    template = (tmp_path / "copy" / "chat_template.jinja").read_text()
    (tmp_path / "copy" / "chat_template.jinja").write_text(template.replace("helpful", "useful"))
    assert templater_for(tmp_path / "copy", hf_specs["tiny"]).fingerprint != omni.fingerprint
    # workers of a DataLoader may receive the templater pickled
    turns = parse_conversation(CONV)
    assert pickle.loads(pickle.dumps(omni)).template(turns) == omni.template(turns)


def test_a_system_turn_is_the_chat_templates_and_a_skip_under_the_tiny_one(tmp_path, omni, hf_specs, mini_tok) -> None:
    conv = [{"from": "system", "value": "Answer briefly."}] + CONV
    write_shard(tmp_path / "s-0.tar", [("k.json", json.dumps({"id": "k", "conversations": conv}).encode()),
                                       ("z.json", json.dumps({"id": "z", "conversations": CONV}).encode())])
    stream = SampleStream(path=str(tmp_path / "s-0.tar"), tokenizer=omni, spec=hf_specs["tiny"], epochs=1)
    rec = next(stream.records())
    assert omni.tokenizer.decode(rec.input_ids).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    stream = SampleStream(path=str(tmp_path / "s-0.tar"), tokenizer=mini_tok, spec=hf_specs["tiny"], epochs=1)
    assert [r.key for r in stream.records()] == ["z"] and stream.skips.as_dict() == {"bad conversation": 1}
    assert "from='system'" in stream.skips.examples[0]


def test_img2dataset_captions_are_counted_by_the_run_templater(tmp_path, omni, hf_specs) -> None:
    import io

    import webdataset as wds

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (20, 120, 220)).save(buf, format="JPEG")
    with wds.TarWriter(str(tmp_path / "c-0.tar")) as tw:
        tw.write({"__key__": "k", "jpg": buf.getvalue(), "txt": "a blue square", "json": {"caption": "a blue square"}})
    path, spec = str(tmp_path / "c-0.tar"), hf_specs["tiny"]
    rec = next(SampleStream(path=path, tokenizer=omni, spec=spec, epochs=1).records())
    assert omni.tokenizer.decode(rec.labels[-4:]).endswith("<|im_end|>\n")
    assert [m for _, m in iter_meta(path=path, spec=spec, tokenizer=omni)] == [rec.meta]
