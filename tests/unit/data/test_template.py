"""The chat template: which tokens carry loss, and placeholder expansion by the features rules."""

from __future__ import annotations

import pytest

from mmpipe.data.skips import SampleError
from mmpipe.data.template import IGNORE, apply_template, parse_conversation, template_sample, text_tokens
from mmpipe.data.tokenizer import build_tokenizer
from mmpipe.model.geometry import SampleMeta, audio_tokens, features, image_tokens

CORPUS = ["What shape is in the image?", "a red triangle", "What do you hear?", "a rising chirp",
          "And the colour?", "red"] * 10


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS)


def conv(*turns: str) -> list[dict[str, str]]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]


def test_only_the_answer_and_its_eos_are_labelled(tok) -> None:
    t = apply_template(parse_conversation(conv("What shape is in the image?", "a red triangle")), tok)
    answer = tok.encode("a red triangle") + [tok.eos_id]
    assert t.input_ids == ([tok.bos_id, tok.user_id] + tok.encode("What shape is in the image?")
                           + [tok.assistant_id] + answer)
    assert [x for x in t.labels if x != IGNORE] == answer
    assert t.labels[-len(answer):] == answer
    assert all(x == IGNORE for x in t.labels[:-len(answer)])
    assert tok.decode([x for x in t.labels if x != IGNORE]) == "a red triangle<eos>"


def test_multi_turn_labels_every_answer_and_no_question(tok) -> None:
    t = apply_template(parse_conversation(conv("What shape is in the image?", "a red triangle",
                                               "And the colour?", "red")), tok)
    labelled = tok.decode([x for x in t.labels if x != IGNORE])
    assert labelled == "a red triangle<eos>red<eos>"
    assert t.input_ids.count(tok.user_id) == 2 and t.input_ids.count(tok.eos_id) == 2


def test_placeholders_expand_to_the_features_token_counts(tok, tiny_spec) -> None:
    meta = SampleMeta(text_tokens=0, images=((200, 50), (16, 16)), audio_seconds=(2.5,))
    turns = parse_conversation(conv("<image>\n<audio>\nWhat shape is in the image?\n<image>", "a red triangle"))
    t = template_sample(turns, tok, tiny_spec, meta)
    n_img = [image_tokens(tiny_spec.vision, h, w) for h, w in meta.images]
    n_aud = audio_tokens(tiny_spec.audio, 2.5)
    assert t.input_ids.count(tok.image_id) == sum(n_img)
    assert t.input_ids.count(tok.audio_id) == n_aud
    # the first image's run comes first, then the audio run, then the second image's run
    runs: list[list[int]] = []
    for prev, x in zip([None] + t.input_ids, t.input_ids):
        if x in (tok.image_id, tok.audio_id):
            if x != prev:
                runs.append([x, 0])
            runs[-1][1] += 1
    assert runs == [[tok.image_id, n_img[0]], [tok.audio_id, n_aud], [tok.image_id, n_img[1]]]
    assert all(t.labels[i] == IGNORE for i, x in enumerate(t.input_ids) if x in (tok.image_id, tok.audio_id))
    full = SampleMeta(text_tokens=t.text_tokens, images=meta.images, audio_seconds=meta.audio_seconds)
    assert len(t.input_ids) == features(tiny_spec, full).llm_len
    assert t.text_tokens == text_tokens(conv("<image>\n<audio>\nWhat shape is in the image?\n<image>",
                                             "a red triangle"), tok)


@pytest.mark.parametrize("turns, reason", [
    (conv("What shape is in the image?"), "no answer"),
    (conv("What shape is in the image?", "   "), "empty answer"),
    (conv("What shape?", "a <image>"), "placeholder mismatch"),
    ([{"from": "system", "value": "x"}], "bad conversation"),
    ("not a list", "bad conversation"),
])
def test_unusable_conversations_name_their_reason(turns, reason) -> None:
    with pytest.raises(SampleError) as err:
        parse_conversation(turns)
    assert err.value.reason == reason


def test_placeholder_count_must_equal_media_count(tok, tiny_spec) -> None:
    turns = parse_conversation(conv("<image>\n<image>\nWhat shape is in the image?", "a red triangle"))
    with pytest.raises(SampleError, match=r"2 <image> and 0 <audio> placeholders but the sample has 1 image") as err:
        template_sample(turns, tok, tiny_spec, SampleMeta(text_tokens=0, images=((32, 32),)))
    assert err.value.reason == "placeholder mismatch"
