"""Extractive decoding's constraint: the tokens it allows continue a word-aligned span of the passage, and only those."""

from __future__ import annotations

import re

import pytest
import torch

from rag.generation.spans import PassageSpans, TokenTexts
from rag.knowledge.bm25 import TOKEN_PATTERN

PASSAGE = ("Tellurium", "Symbol: Te. Atomic weight: 127.60. Discovered in 1782 by Franz Miller.")
BRACKETS = ("Americium", "Atomic weight: (243). Discovered in 1944.")


def word_span(text: str, texts) -> bool:
    """`text` starts at a word of one of `texts` and continues it exactly (it need not end at a word)."""
    return any(t.startswith(text, m.start()) for t in texts for m in re.finditer(TOKEN_PATTERN, t))


@pytest.fixture(scope="module")
def texts(bpe_tokenizer):
    return TokenTexts(bpe_tokenizer)


def allowed_after(texts, answer_ids: list[int], passages=(PASSAGE,), question=None) -> torch.Tensor:
    eos = texts.tokenizer.eos_token_id
    spans = PassageSpans(texts, list(passages), None if question is None else [question] * len(passages))
    fn = spans.constraint([range(len(passages))], eos)
    return fn(torch.tensor([answer_ids], dtype=torch.long).reshape(1, -1), len(texts.tokenizer))[0]


def test_token_texts_keep_the_leading_space(texts, bpe_tokenizer):
    [franz] = [i for i in bpe_tokenizer(" Franz", add_special_tokens=False)["input_ids"]][:1]
    assert any(t.startswith(" ") and franz in ids for t, ids in texts.by_text.items())


def test_every_allowed_token_continues_a_span_and_every_span_token_is_allowed(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    for answer in ("Franz Miller", "127.60", "Tellurium", "Te"):
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        for n in range(len(ids) + 1):
            mask = allowed_after(texts, ids[:n])
            assert mask[ids[n]] if n < len(ids) else mask[eos], (answer, n)  # the span's own tokenization is allowed
            for t in mask.nonzero().flatten().tolist():
                if t != eos:
                    assert word_span(tok.decode(ids[:n] + [t]).lstrip(), PASSAGE), (answer, n, tok.decode([t]))


def test_an_answer_ends_only_where_a_word_ends(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    assert not allowed_after(texts, [])[eos]  # an empty answer is no span
    ids = tok("127.60", add_special_tokens=False)["input_ids"]
    cut = [n for n in range(1, len(ids)) if tok.decode(ids[:n]) in ("127", "127.", "127.6")]
    assert cut and not any(allowed_after(texts, ids[:n])[eos] for n in cut)  # "127." is inside the number
    assert allowed_after(texts, ids)[eos]


def test_text_not_in_the_passage_is_banned(texts, bpe_tokenizer):
    tok = bpe_tokenizer
    for wrong in ("Oxygen", "Miller Franz", "1783"):  # another word; words out of order; a number the passage lacks
        ids = tok(wrong, add_special_tokens=False)["input_ids"]
        assert not all(allowed_after(texts, ids[:n])[ids[n]] for n in range(len(ids))), wrong


def test_a_row_without_passages_and_a_finished_row_are_unconstrained(texts, bpe_tokenizer):
    eos, vocab = bpe_tokenizer.eos_token_id, len(bpe_tokenizer)
    spans = PassageSpans(texts, [PASSAGE, None])
    fn = spans.constraint([(0,), (1,), (0,)], eos)
    mask = fn(torch.tensor([[5], [5], [eos]]), vocab)
    assert mask[1].all() and mask[2].all()


def test_a_span_may_take_the_brackets_around_a_word(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    ids = tok("(243)", add_special_tokens=False)["input_ids"]
    for n in range(len(ids)):
        assert allowed_after(texts, ids[:n], [BRACKETS])[ids[n]], n
    inner = [n for n in range(1, len(ids)) if tok.decode(ids[:n]) == "(243"]
    assert all(allowed_after(texts, ids[:n], [BRACKETS])[eos] for n in inner)  # "(243" ends where the word does
    assert allowed_after(texts, ids, [BRACKETS])[eos]


def test_an_answer_does_not_start_with_a_word_of_its_question(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    question = "Who discovered TELLURIUM, with Miller?"
    echo = tok("Tellurium", add_special_tokens=False)["input_ids"]
    def takes(ids, question=None):  # every token of `ids` allowed in turn, then EOS
        return all(allowed_after(texts, ids[:n], question=question)[ids[n] if n < len(ids) else eos] for n in range(len(ids) + 1))

    assert takes(echo) and not takes(echo, question)  # the title, a span without the question, is one no longer
    # a question word may follow the first word of the answer
    ids = tok("Franz Miller", add_special_tokens=False)["input_ids"]
    assert takes(ids, question)
    with pytest.raises(ValueError, match="one per context"):
        PassageSpans(texts, [PASSAGE, PASSAGE], ["only one question"])


def test_a_hyphenated_compound_is_one_word_to_end_at_and_may_start_with_a_question_word(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    passage = ("Isotopes", "Carbon-14 is used in radioactive dating. Chlorine is a greenish-yellow gas.")

    def takes(answer, question=None):
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        return all(allowed_after(texts, ids[:n], [passage], question)[ids[n] if n < len(ids) else eos]
                   for n in range(len(ids) + 1))

    assert takes("greenish-yellow") and not takes("greenish")  # no stop inside the compound
    question = "Which isotope of carbon is used to date things?"
    assert takes("Carbon-14", question)  # a question word may open a compound, held whole
    assert not takes("Carbon", question)  # but is no answer alone
    assert not takes("Carbon", None)  # "Carbon" stands only as the head of "Carbon-14" in this passage


def test_holds_says_whether_an_answer_is_a_span_the_search_could_give(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    spans = PassageSpans(texts, [PASSAGE, None], ["Who discovered tellurium?", "Who discovered tellurium?"])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert spans.holds(0, ids("Franz Miller") + [eos], skip=[eos])
    assert not spans.holds(0, ids("Franz Mil"), skip=[eos])  # ends inside a word
    assert not spans.holds(0, ids("Tellurium"))  # starts with a word of the question
    assert not spans.holds(0, ids("Priestley"))  # not in the passage
    assert spans.holds(1, ids("Priestley"))  # a context without passages holds every answer


def test_a_span_is_written_in_the_tokenizers_own_tokens(texts, bpe_tokenizer):
    tok, eos = bpe_tokenizer, bpe_tokenizer.eos_token_id
    for answer in ("Franz Miller", " Franz Miller"):  # with or without the space before it: both are training targets
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert all(allowed_after(texts, ids[:n])[ids[n] if n < len(ids) else eos] for n in range(len(ids) + 1)), answer
    # the same characters in another split: "Franz" one letter at a time
    letters = [texts.by_text[c][0] for c in "Franz"]
    assert letters != tok("Franz", add_special_tokens=False)["input_ids"]
    assert not all(allowed_after(texts, letters[:n])[letters[n]] for n in range(len(letters)))


def test_a_special_token_in_a_passage_is_never_part_of_an_answer(texts, bpe_tokenizer):
    tok = bpe_tokenizer
    passage = ("Notes", "Made by Franz <mask> Miller.")
    mask_id = tok.convert_tokens_to_ids("<mask>")
    ids = tok("Franz", add_special_tokens=False)["input_ids"]
    assert not allowed_after(texts, ids, [passage])[mask_id]
