"""Answer text from generated ids: WordPiece splits at punctuation are rejoined, BPE output is left exact."""

from __future__ import annotations

import pytest

from rag.generation.detokenize import decode_answer, is_wordpiece


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.mark.parametrize("text, want", [
    ("28.088", "28.088"), ("(209)", "(209)"), ("1,234 and 5", "1,234 and 5"), ("in 1776", "in 1776"),
    ("Fe", "fe"), ("iron. then 5", "iron. then 5"),
])
def test_wordpiece_numbers_and_brackets_rejoined(minilm_tokenizer, text, want):
    ids = minilm_tokenizer(text)["input_ids"]
    assert decode_answer(minilm_tokenizer, ids) == want


def test_plain_decode_splits_numbers(minilm_tokenizer):
    ids = minilm_tokenizer("28.088 (209)")["input_ids"]
    assert minilm_tokenizer.decode(ids, skip_special_tokens=True) != "28.088 (209)"  # the defect decode_answer fixes


def test_bpe_tokenizer_untouched(bpe_tokenizer):
    assert is_wordpiece(bpe_tokenizer) is False
    ids = bpe_tokenizer(" 28. 088 ( x )")["input_ids"]
    assert decode_answer(bpe_tokenizer, ids) == bpe_tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_restore_case_takes_the_passages_casing(minilm_tokenizer, bpe_tokenizer):
    from rag.generation.detokenize import lowercases, restore_case

    assert lowercases(minilm_tokenizer) and not lowercases(bpe_tokenizer)
    passages = ["Iron / Symbol: Fe. Atomic number: 26.", "Fermium / Symbol: Fm."]
    assert restore_case("fe", passages) == "Fe"
    assert restore_case("fm", passages[::-1]) == "Fm"
    assert restore_case("f", passages) == "f"  # not a whole word anywhere: unchanged
    assert restore_case("28.088", passages) == "28.088"
