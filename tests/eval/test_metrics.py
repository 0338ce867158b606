"""EM / F1 / recall@k on hand-worked cases, and agreement with torchmetrics' SQuAD normalisation."""

from __future__ import annotations

import pytest
import torch

from rag.eval.metrics import (
    ExactMatch,
    RetrievalRecall,
    TokenF1,
    exact_match,
    gold_in_answer,
    has_answer,
    normalize_answer,
    token_f1,
)
from rag.knowledge.passages import Passage
from rag.utils.errors import RagError


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The Eiffel Tower", "eiffel tower"),  # article + case
        ("  an   apple, a day!  ", "apple day"),  # articles, punctuation, whitespace
        ("Theatre", "theatre"),  # 'the' inside a word is kept
        ("U.S.A.", "usa"),  # punctuation removed, not replaced
        ("A", ""),
        ("1.0079", "10079"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalisation_matches_torchmetrics_squad():
    squad = pytest.importorskip("torchmetrics.functional.text.squad")
    cases = ["The  Beatles!", "an A-team", "Ünïcödé — dash", "Theory of the 'thing'", "", "a an the", "$1,000.00"]
    for c in cases:
        assert normalize_answer(c) == squad._normalize_text(c)


def test_exact_match_multiple_gold():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match("Paris.", ["paris"]) == 1.0


def test_token_f1_hand_cases():
    # pred tokens {eiffel, tower, paris}, gold {eiffel, tower}: P=2/3, R=1, F1=0.8
    assert token_f1("the Eiffel Tower, Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    # best over gold answers
    assert token_f1("blue whale", ["whale", "blue whale"]) == pytest.approx(1.0)
    assert token_f1("cat", ["dog"]) == 0.0
    # SQuAD v1.1: both sides normalising to nothing scores 0 (v2.0 / torchmetrics would give 1)
    assert token_f1("the", ["a"]) == 0.0
    # repeated tokens count with multiplicity: common = min counts
    assert token_f1("new new york", ["new york"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_single_string_gold_rejected():
    with pytest.raises(RagError, match="wrap it in a list"):
        exact_match("x", "x")


def test_metric_classes_accumulate_and_reset():
    em, f1 = ExactMatch(), TokenF1()
    em.update(["Paris", "Rome"], [["paris"], ["Milan", "Turin"]])
    em.update(["an Iron"], [["iron", "Fe"]])
    assert em.compute().item() == pytest.approx(2 / 3)
    f1.update(["the Eiffel Tower, Paris", "cat"], [["Eiffel Tower"], ["dog"]])
    assert f1.compute().item() == pytest.approx(0.4)
    em.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert em.compute().item() == 0.0
    with pytest.raises(RagError, match="2 predictions but 1"):
        em.update(["a", "b"], [["a"]])


def test_gold_in_answer_is_a_whole_token_span_of_the_normalised_answer():
    assert gold_in_answer("It was discovered by Priestley in 1774.", ["1774"]) == 1.0
    assert gold_in_answer("The Priestley", ["priestley"]) == 1.0  # SQuAD normalisation on both sides
    assert gold_in_answer("in 1774", ["17"]) == 0.0  # inside a token: no match
    assert gold_in_answer("high temperature welding", ["welding", "breathing"]) == 1.0  # any gold answer
    assert gold_in_answer("W.H. Wollaston", ["Priestley"]) == 0.0
    assert gold_in_answer("anything", ["the"]) == 0.0  # a gold answer that normalises to nothing matches nothing
    assert gold_in_answer("Cuprum", ["cuprum"]) == exact_match("Cuprum", ["cuprum"]) == 1.0
    with pytest.raises(RagError):
        gold_in_answer("x", "x")


def test_has_answer_token_boundaries():
    p = Passage("x", "Iron", "Symbol: Fe. Atomic number: 26. Atomic weight: 55.847.")
    assert has_answer(p, ["fe"])
    assert has_answer(p, ["55.847"])
    assert has_answer(p, ["iron"])  # title counts
    assert not has_answer(p, ["2"])  # '2' only occurs inside '26'
    assert not has_answer(p, ["Fermium"])
    assert has_answer("Crème brûlée is French", ["creme brulee"]) is False  # accents differ after NFD: kept as-is
    assert has_answer("Crème brûlée is French", ["Crème Brûlée"])


def test_retrieval_recall_at_k():
    r = RetrievalRecall(ks=(1, 2, 3))
    passages = [
        ["answer is Fe here", "nothing", "nothing"],  # hit at rank 1
        ["nothing", "nothing", "gold 26"],  # hit at rank 3
        ["nothing", "nothing", "nothing"],  # miss
        ["nothing", "Paris"],  # hit at rank 2, short list
    ]
    golds = [["Fe"], ["26"], ["Rome"], ["paris"]]
    r.update(passages, golds)
    out = r.compute()
    assert set(out) == {"recall@1", "recall@2", "recall@3"}
    assert out["recall@1"].item() == pytest.approx(1 / 4)
    assert out["recall@2"].item() == pytest.approx(2 / 4)
    assert out["recall@3"].item() == pytest.approx(3 / 4)
    with pytest.raises(RagError, match="must be a positive integer"):
        RetrievalRecall(ks=(0,))


def test_metric_state_is_summable():
    """Sum-reduced states: merging two metrics' states equals one metric over both batches."""
    a, b, both = ExactMatch(), ExactMatch(), ExactMatch()
    a.update(["x"], [["x"]])
    b.update(["y", "z"], [["q"], ["z"]])
    both.update(["x", "y", "z"], [["x"], ["q"], ["z"]])
    merged = (a.total + b.total) / (a.count + b.count)
    assert merged.float().item() == pytest.approx(both.compute().item())
    assert isinstance(both.compute(), torch.Tensor)


def test_bleu1_and_rouge_l_are_torchmetrics_as_a_user_calls_it():
    """Bleu1 / RougeL take the QA metrics' (predictions, lists of gold answers) and give exactly torchmetrics' numbers."""
    from torchmetrics.text import BLEUScore, ROUGEScore

    from rag.eval.metrics import GENERATION_METRICS, Bleu1, RougeL

    preds = ["the cat sat on the mat", "a quick brown fox", "who wrote hamlet", ""]
    golds = [["the cat is on the mat", "there is a cat"], ["the quick brown fox jumps"], ["which playwright wrote hamlet"],
             ["x y"]]
    for ours, ref in ((Bleu1(), BLEUScore(n_gram=1)), (RougeL(), ROUGEScore(rouge_keys="rougeL", accumulate="best"))):
        ours.update(preds[:2], golds[:2])
        ours.update(preds[2:], golds[2:])  # accumulates over batches
        ref.update(preds, golds)
        expected = ref.compute()
        expected = expected["rougeL_fmeasure"] if isinstance(expected, dict) else expected
        assert torch.isclose(ours.compute(), expected), type(ours).__name__
        assert 0 < float(expected) < 1
    assert set(GENERATION_METRICS) == {"bleu1", "rougeL"}
    with pytest.raises(RagError):
        Bleu1().update(["a"], [["a"], ["b"]])
