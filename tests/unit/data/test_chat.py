"""A checkpoint's chat template: the label convention, media expanded as each model's own
processor expands them, the whitespace rule, and the one-line errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from mmpipe.data.chat import ChatTemplate, checkpoint_folder, templater_for
from mmpipe.data.template import IGNORE, parse_conversation, template_sample
from mmpipe.model.geometry import SampleMeta


def human(text: str) -> dict[str, str]:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict[str, str]:
    return {"from": "gpt", "value": text}


def text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


IMG, AUD = {"type": "image"}, {"type": "audio"}

# family -> (folder, spec, LLaVA conversation, the chat messages written out by hand, image counts, audio counts)
CASES = {
    "llava": ("llava", "llava", [
        human("<image>\nWhat shape is in the image?"), gpt("a red triangle"), human("And the colour?"), gpt("red")], [
        {"role": "user", "content": [IMG, text("What shape is in the image?")]},
        {"role": "assistant", "content": [text("a red triangle")]},
        {"role": "user", "content": [text("And the colour?")]},
        {"role": "assistant", "content": [text("red")]}], [4], []),
    "llava-system": ("llava", "llava", [
        {"from": "system", "value": "Answer briefly."}, human("Compare the two pictures.\n<image>\n<image>"),
        gpt("a red triangle"), human("And the colour?"), gpt("red")], [
        {"role": "system", "content": [text("Answer briefly.")]},
        {"role": "user", "content": [text("Compare the two pictures."), IMG, IMG]},
        {"role": "assistant", "content": [text("a red triangle")]},
        {"role": "user", "content": [text("And the colour?")]},
        {"role": "assistant", "content": [text("red")]}], [4, 4], []),
    "qwen2-vl": ("qwen2-vl", "qwen2-vl", [
        {"from": "system", "value": "Answer briefly."}, human("Image 1: <image>\nImage 2: <image>\nCompare them."),
        gpt("a red triangle"), human("And the colour?"), gpt("red"), human("Thanks.")], [
        {"role": "system", "content": [text("Answer briefly.")]},
        {"role": "user", "content": [text("Image 1: "), IMG, text("\nImage 2: "), IMG, text("\nCompare them.")]},
        {"role": "assistant", "content": [text("a red triangle")]},
        {"role": "user", "content": [text("And the colour?")]},
        {"role": "assistant", "content": [text("red")]},
        {"role": "user", "content": [text("Thanks.")]}], [4, 12], []),
    "qwen2-audio": ("qwen2-audio", "qwen2-audio", [
        human("<audio>\nWhat do you hear?"), gpt("a rising chirp"), human("<audio>\nAnd now?"), gpt("silence")], [
        {"role": "user", "content": [AUD, text("What do you hear?")]},
        {"role": "assistant", "content": [text("a rising chirp")]},
        {"role": "user", "content": [AUD, text("And now?")]},
        {"role": "assistant", "content": [text("silence")]}], [], [57, 1]),
    # a text LLM's string-only template: the media token is written into the text in place
    "composition": ("qwen2-text", "tiny", [
        human("<image>\n<audio>\nDescribe the picture and the sound."), gpt("a red triangle and a rising chirp")], [
        {"role": "user", "content": "<image>\n<audio>\nDescribe the picture and the sound."},
        {"role": "assistant", "content": "a red triangle and a rising chirp"}], [3], [7]),
}


def ids_of(enc) -> list[int]:
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def label_runs(labels: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, y in enumerate(labels):
        if y != IGNORE:
            if i == 0 or labels[i - 1] == IGNORE:
                runs.append([])
            runs[-1].append(y)
    return runs


def collapse(ids: list[int], media: set[int]) -> list[int]:
    """Each run of one media token back to a single token."""
    return [x for i, x in enumerate(ids) if x not in media or i == 0 or ids[i - 1] != x]


@pytest.fixture(scope="module")
def templaters(hf_dirs, hf_specs) -> dict[str, ChatTemplate]:
    return {case: ChatTemplate.from_checkpoint(hf_dirs[folder], hf_specs[spec])
            for case, (folder, spec, *_) in CASES.items()}


@pytest.fixture(scope="module")
def hf_tok(hf_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(d), local_files_only=True) for name, d in hf_dirs.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_labels_are_what_each_answer_adds_to_the_prompt_before_it(case, templaters, hf_tok) -> None:
    folder, _, conv, msgs, img, aud = CASES[case]
    tpl, tok = templaters[case], hf_tok[folder]
    t = tpl.template(parse_conversation(conv, system=True), image_tokens=img, audio_tokens=aud)
    # the convention computed independently: render through answer k minus the prompt before it
    expected = []
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            before = ids_of(tok.apply_chat_template(msgs[:j], add_generation_prompt=True))
            through = ids_of(tok.apply_chat_template(msgs[:j + 1]))
            assert through[:len(before)] == before
            expected.append(through[len(before):])
    assert label_runs(t.labels) == expected
    assert all(y in (IGNORE, x) for x, y in zip(t.input_ids, t.labels))
    media = {i for i in (tpl.image_id, tpl.audio_id) if i is not None}
    lead = [tok.bos_token_id] if folder == "llava" else []  # LLaVA's tokenizer adds <s>, as its processor does
    assert collapse(t.input_ids, media) == lead + ids_of(tok.apply_chat_template(msgs))
    if img:
        assert t.input_ids.count(tpl.image_id) == sum(img)
    if aud:
        assert t.input_ids.count(tpl.audio_id) == sum(aud)
    assert len(t.input_ids) == t.text_tokens + sum(img) + sum(aud)
    assert tpl.text_tokens(parse_conversation(conv, system=True)) == t.text_tokens


def test_the_end_of_turn_token_is_labelled_where_the_template_emits_one(templaters, hf_tok) -> None:
    conv = CASES["qwen2-vl"][2]
    t = templaters["qwen2-vl"].template(parse_conversation(conv, system=True), image_tokens=[4, 12])
    tok = hf_tok["qwen2-vl"]
    assert [tok.decode(r) for r in label_runs(t.labels)] == ["a red triangle<|im_end|>\n", "red<|im_end|>\n"]
    t = templaters["llava"].template(parse_conversation(CASES["llava"][2]), image_tokens=[4])
    runs = label_runs(t.labels)
    assert [r[-1] for r in runs] == [hf_tok["llava"].eos_token_id] * 2
    assert [hf_tok["llava"].decode(r[:-1]).strip() for r in runs] == ["a red triangle", "red"]


def test_llava_expansion_is_llava_processors(hf_dirs, hf_specs, templaters, hf_tok) -> None:
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = hf_tok["llava"]
    proc = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28},
                                                                crop_size={"height": 28, "width": 28}),
                          tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, chat_template=tok.chat_template)
    _, _, conv, msgs, _, _ = CASES["llava-system"]
    images = [Image.new("RGB", (40, 30), (200, 0, 0)), Image.new("RGB", (20, 50), (0, 0, 200))]
    it = iter(images)
    with_pixels = [{**m, "content": [{"type": "image", "image": next(it)} if c["type"] == "image" else c
                                     for c in m["content"]]} for m in msgs]
    want = ids_of(proc.apply_chat_template(with_pixels, tokenize=True, return_dict=True)["input_ids"][0])
    meta = SampleMeta(text_tokens=0, images=tuple((im.height, im.width) for im in images))
    got = template_sample(parse_conversation(conv, system=True), templaters["llava-system"], hf_specs["llava"], meta)
    assert got.input_ids == want
    assert want.count(templaters["llava"].image_id) == 8


def test_qwen2_audio_expansion_is_qwen2_audio_processors(templaters, hf_specs, hf_tok) -> None:
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    tok = hf_tok["qwen2-audio"]
    proc = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok,
                               chat_template=tok.chat_template)
    _, _, conv, msgs, _, _ = CASES["qwen2-audio"]
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (16000 * 2 + 4321, 777)]  # odd frame counts
    prompt = proc.apply_chat_template(msgs, tokenize=False)
    want = ids_of(proc(text=prompt, audio=clips, sampling_rate=16000)["input_ids"][0])
    meta = SampleMeta(text_tokens=0, audio_seconds=tuple(len(c) / 16000 for c in clips))
    got = template_sample(parse_conversation(conv), templaters["qwen2-audio"], hf_specs["qwen2-audio"], meta)
    assert got.input_ids == want
    assert [want.count(templaters["qwen2-audio"].audio_id)] == [sum(CASES["qwen2-audio"][5])]


def test_qwen2_vl_expansion_follows_the_image_grid_rule(templaters, hf_specs, hf_tok) -> None:
    # Qwen2VLProcessor needs torchvision (not installed): its rule is applied by hand here,
    # <|image_pad|> x (grid_t * grid_h * grid_w / merge^2) in the rendered text, on the grid
    # that transformers' PIL image processor computes.
    from transformers import Qwen2VLImageProcessorPil

    tok = hf_tok["qwen2-vl"]
    ip = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                                  temporal_patch_size=2)
    images = [Image.new("RGB", (100, 37)), Image.new("RGB", (300, 200))]
    counts = [int(np.prod(g)) // 4 for g in ip(images=images)["image_grid_thw"]]
    _, _, conv, msgs, _, _ = CASES["qwen2-vl"]
    pieces = tok.apply_chat_template(msgs, tokenize=False).split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    want = ids_of(tok(expanded))
    meta = SampleMeta(text_tokens=0, images=tuple((im.height, im.width) for im in images))
    got = template_sample(parse_conversation(conv, system=True), templaters["qwen2-vl"], hf_specs["qwen2-vl"], meta)
    assert got.input_ids == want
    assert counts == CASES["qwen2-vl"][4] == [4, 12]


@pytest.mark.parametrize("said, items", [
    ("<image>\nWhat is it?", [IMG, text("What is it?")]),
    ("What is it?\n<image>", [text("What is it?"), IMG]),
    ("  <image>\n <image>\n\nCompare them. ", [IMG, IMG, text("Compare them. ")]),
    ("Image 1: <image>\nImage 2: <image>\nWhich?",
     [text("Image 1: "), IMG, text("\nImage 2: "), IMG, text("\nWhich?")]),
    ("Is <image> red?", [text("Is "), IMG, text(" red?")]),
])
def test_whitespace_next_to_a_placeholder(said, items, templaters) -> None:
    got = templaters["llava"].messages(parse_conversation([human(said), gpt("x")]))[0]["content"]
    assert [{k: v for k, v in it.items() if k in ("type", "text")} for it in got] == items
    # a string-content template gets the text verbatim, the media token in place
    got = templaters["composition"].messages(parse_conversation([human(said), gpt("x")]))[0]["content"]
    assert got == said


def test_a_tokenizer_merging_across_the_prompt_boundary_labels_by_characters(hf_dirs, hf_specs, hf_tok,
                                                                             caplog) -> None:
    tok = hf_tok["llava-space"]
    with caplog.at_level(logging.WARNING, logger="mmpipe.data.chat"):
        tpl = ChatTemplate.from_checkpoint(hf_dirs["llava-space"], hf_specs["llava"])
    assert "labelled by character offsets" in caplog.text and str(hf_dirs["llava-space"]) in caplog.text
    _, _, conv, msgs, img, _ = CASES["llava"]
    before = ids_of(tok.apply_chat_template(msgs[:1], add_generation_prompt=True))
    through = ids_of(tok.apply_chat_template(msgs[:2]))
    assert through[:len(before)] != before  # "ASSISTANT: " + "a" tokenizes as "ASSISTANT:" "▁a"
    t = tpl.template(parse_conversation(conv), image_tokens=img)
    full = tok.apply_chat_template(msgs, tokenize=False)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    for j in (1, 3):
        lo = len(tok.apply_chat_template(msgs[:j], add_generation_prompt=True, tokenize=False))
        hi = len(tok.apply_chat_template(msgs[:j + 1], tokenize=False))
        spans.append([x for x, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if a < hi and b > lo])
    assert label_runs(t.labels) == spans
    assert [tok.decode(r).strip() for r in spans] == ["a red triangle</s>", "red</s>"]


@pytest.mark.parametrize("folder, why", [("qwen2-rerender", "differently once later turns follow"),
                                         ("qwen2-genprompt", "with its generation prompt")])
def test_a_template_that_breaks_the_convention_is_refused_naming_the_checkpoint(hf_dirs, hf_specs, folder,
                                                                                 why) -> None:
    with pytest.raises(ValueError) as err:
        ChatTemplate.from_checkpoint(hf_dirs[folder], hf_specs["text"])
    msg = str(err.value)
    assert "\n" not in msg and str(hf_dirs[folder]) in msg and "label convention" in msg and why in msg


def test_a_checkpoint_without_a_chat_template_is_a_one_line_error(hf_dirs, hf_specs) -> None:
    with pytest.raises(ValueError) as err:
        templater_for(hf_dirs["qwen2-nochat"], hf_specs["text"])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"data.tokenizer={str(hf_dirs['qwen2-nochat'])!r}: the checkpoint has no chat template")
    assert "chat_template.jinja" in msg


def test_a_model_encoder_without_its_token_is_a_one_line_error(hf_dirs, hf_specs) -> None:
    with pytest.raises(ValueError, match=r"has an audio encoder but the checkpoint has no audio token") as err:
        templater_for(hf_dirs["qwen2-vl"], hf_specs["qwen2-audio"], key="model.hf")
    assert str(err.value).startswith("model.hf=") and "\n" not in str(err.value)


def test_a_media_token_written_in_the_text_is_a_placeholder_mismatch(templaters) -> None:
    from mmpipe.data.skips import SampleError

    turns = parse_conversation([human("<image>\nWhat is <|image_pad|>?"), gpt("x")])
    with pytest.raises(SampleError) as err:
        templaters["qwen2-vl"].template(turns, image_tokens=[4])
    assert err.value.reason == "placeholder mismatch" and "2 <|image_pad|> token(s) for 1 image(s)" in str(err.value)


def test_templater_for_picks_by_path(mini_data, hf_dirs, hf_specs, tiny_spec) -> None:
    from mmpipe.data.template import TinyTemplate

    assert isinstance(templater_for(mini_data / "tokenizer.json", tiny_spec), TinyTemplate)
    omni = templater_for(hf_dirs["qwen2-omni"], hf_specs["tiny"])
    assert isinstance(omni, ChatTemplate)
    from mmpipe.data.tokenizer import check_vocab

    with pytest.raises(ValueError, match=rf"the tokenizer \({hf_dirs['qwen2-omni']}\) has {omni.vocab_size} entries"):
        check_vocab(omni, 100)
    with pytest.raises(FileNotFoundError, match=r"^data.tokenizer='nope': no such file or folder"):
        templater_for("nope", tiny_spec)


def test_a_medium_the_template_ignores_gets_its_token_in_the_text(hf_dirs, hf_specs, hf_tok) -> None:
    tpl = templater_for(hf_dirs["qwen2-vl+audio"], hf_specs["qwen2-vl+audio"])
    assert tpl.media["image"].placed and not tpl.media["audio"].placed
    turns = parse_conversation([human("<image>\n<audio>\nDescribe the picture and the sound."), gpt("red")])
    assert tpl.messages(turns)[0]["content"] == [IMG | {"image": None},
                                                 text("<audio>\nDescribe the picture and the sound.")]
    t = tpl.template(turns, image_tokens=[4], audio_tokens=[9])
    assert t.input_ids.count(tpl.image_id) == 4 and t.input_ids.count(tpl.audio_id) == 9
    rendered = hf_tok["qwen2-vl+audio"].decode(collapse(t.input_ids, {tpl.image_id, tpl.audio_id}))
    assert "<|vision_end|><audio>\nDescribe the picture" in rendered


def test_a_template_without_an_end_of_turn_token_is_warned_about(hf_dirs, hf_specs, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mmpipe.data.chat"):
        ChatTemplate.from_checkpoint(hf_dirs["llava-noeos"], hf_specs["llava"])
    assert "not taught to stop" in caplog.text and str(hf_dirs["llava-noeos"]) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmpipe.data.chat"):
        ChatTemplate.from_checkpoint(hf_dirs["llava"], hf_specs["llava"])
    assert "not taught to stop" not in caplog.text


def test_the_model_sides_specs_and_the_templater_agree(tmp_path, hf_dirs, hf_tok, hf_specs, small_llava) -> None:
    """A checkpoint folder's spec (mmpipe.model.hf) and its templater make records whose image
    tokens are the geometry's; a composition's image token id comes from its model config."""
    import io
    import json

    from transformers import LlavaConfig

    from mmpipe.data.reader import SampleStream
    from mmpipe.data.synth import write_shard
    from mmpipe.model.geometry import features
    from mmpipe.model.hf.arch import spec_from_config, spec_from_folder
    from mmpipe.model.spec import ModelSpec

    spec = spec_from_folder(hf_dirs["llava"])
    assert checkpoint_folder(spec) == hf_dirs["llava"] and checkpoint_folder(hf_specs["llava"]) is None
    tpl = templater_for(checkpoint_folder(spec), spec)
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 0, 0)).save(buf, format="PNG")
    conv = [human("<image>\nWhat shape is in the image?"), gpt("a red triangle")]
    write_shard(tmp_path / "l-0.tar", [("k.json", json.dumps({"conversations": conv}).encode()),
                                       ("k.0.png", buf.getvalue())])
    rec = next(SampleStream(path=str(tmp_path / "l-0.tar"), tokenizer=tpl, spec=spec, epochs=1).records())
    assert rec.input_ids.count(tpl.image_id) == sum(features(spec, rec.meta).image_tokens) == 4
    assert rec.llm_len == features(spec, rec.meta).llm_len

    llm = hf_tok["qwen2-llm"]
    image = llm.convert_tokens_to_ids("<image>")
    composed = spec_from_config(LlavaConfig(vision_config=small_llava["vision"], image_token_id=image,
                                            text_config=dict(small_llava["llm"], vocab_size=len(llm))),
                                name="compose-test", image_processor={"image_processor_type": "CLIPImageProcessor",
                                                                      **small_llava["processor"]},
                                weights=(("vision", str(tmp_path)), ("llm", str(hf_dirs["qwen2-llm"]))))
    assert checkpoint_folder(composed) == hf_dirs["qwen2-llm"]
    tpl = templater_for(checkpoint_folder(composed), composed)
    assert tpl.image_id == image and not tpl.media["image"].placed
    t = template_sample(parse_conversation(conv), tpl, composed, SampleMeta(text_tokens=0, images=((30, 40),)))
    assert llm.decode(collapse(t.input_ids, {image})).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nWhat shape")
    with pytest.raises(ValueError, match="has an image encoder but the checkpoint has no image token"):
        templater_for(hf_dirs["qwen2-llm"], ModelSpec(name="no-id", llm=composed.llm, vision=composed.vision))
