"""The project tokenizer: exact round trips, fixed special ids, and the vocab check."""

from __future__ import annotations

import pytest

from mmpipe.paths import PACKAGE_ROOT
from mmpipe.data.tokenizer import SPECIAL_TOKENS, build_tokenizer, check_vocab, load_tokenizer

CORPUS = ["What shape is in the image?", "a red triangle on a white background",
          "Count from 7 to 12.", "7 8 9 10 11 12", "Repeat these words: apple river stone"] * 20


def test_round_trip_is_exact_including_digits_newlines_and_unseen_text() -> None:
    tok = build_tokenizer(CORPUS)
    for text in ["What shape is in the image?", "Count from 98 to 102.\n98 99 100 101 102",
                 "  two  spaces\tand a tab", "unseen: Zürich ☃ 12+30=42"]:
        assert tok.decode(tok.encode(text)) == text


def test_special_ids_are_fixed_and_placeholders_are_single_tokens() -> None:
    tok = build_tokenizer(CORPUS)
    assert tok.pad_id == 0
    ids = [tok.pad_id, tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id, tok.image_id, tok.audio_id,
           tok.video_id]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode("<image>") == [tok.image_id]
    assert tok.encode("<audio>") == [tok.audio_id]
    assert tok.encode("<video>") == [tok.video_id]
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<bos><eos>"
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id], skip_special=True) == "hi"


def test_digits_are_one_token_each() -> None:
    tok = build_tokenizer(CORPUS)
    assert len(tok.encode("1234567")) == 7


def test_training_is_deterministic() -> None:
    assert build_tokenizer(CORPUS).to_str() == build_tokenizer(CORPUS).to_str()


def test_save_and_load(tmp_path) -> None:
    tok = build_tokenizer(CORPUS)
    tok.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert back.vocab_size == tok.vocab_size
    assert back.encode("a red triangle") == tok.encode("a red triangle")


def test_missing_file_names_the_key_and_the_fix(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer=.*nope.json.*mmpipe.data.synth"):
        load_tokenizer(tmp_path / "nope.json")


def test_not_a_tokenizer_file(tmp_path) -> None:
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")


def test_vocab_larger_than_the_model_is_an_error() -> None:
    tok = build_tokenizer(CORPUS)
    check_vocab(tok, tok.vocab_size)  # equal fits
    with pytest.raises(ValueError, match=rf"{tok.vocab_size} entries but model.llm.vocab=100"):
        check_vocab(tok, 100)


def test_shipped_tokenizer_fits_the_tiny_model(tiny_spec) -> None:
    tok = load_tokenizer(PACKAGE_ROOT / "data" / "tokenizer.json")
    check_vocab(tok, tiny_spec.llm.vocab)
    assert tok.vocab_size < tiny_spec.llm.vocab
