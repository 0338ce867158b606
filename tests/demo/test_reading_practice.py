"""Reading practice: randomised facts in training passages, answerable only by reading the passage."""

from __future__ import annotations

import pytest

from rag.demo import load_demo_corpus, load_demo_qa
from rag.demo.reading_practice import FIELDS, ReadingPractice


@pytest.fixture(scope="module")
def train_passages():
    train = {x["element"] for x in load_demo_qa("train")}
    return [p for p in load_demo_corpus() if p.title in train]


def test_answers_are_in_the_synthetic_passage_and_facts_are_random(train_passages):
    examples = ReadingPractice(train_passages, ["Marble", "Lantern"], seed=3).examples(300)
    real = {p.text for p in load_demo_corpus()}
    for ex in examples:
        assert ex.answer in ex.passage.text or ex.answer == ex.passage.title
        assert FIELDS.match(ex.passage.text) and ex.passage.text not in real
        assert ex.passage.title.lower() in ex.question or ex.answer == ex.passage.title
    kinds = {ex.question.split(" ")[0:3][-1] for ex in examples}
    assert len(kinds) >= 3  # several question templates
    assert len({ex.answer for ex in examples}) > 200  # answers vary: memorising them cannot help


def test_deterministic_per_seed_and_only_given_passages(train_passages):
    a = ReadingPractice(train_passages, seed=1).examples(50)
    b = ReadingPractice(train_passages, seed=1).examples(50)
    assert a == b
    assert a != ReadingPractice(train_passages, seed=2).examples(50)
    practice = ReadingPractice(train_passages, seed=1)
    assert {p.id for p in practice.base} <= {p.id for p in train_passages}  # held-out elements never used
    for ex in practice.examples(50):  # each example is one base passage's text with new facts
        body = set(FIELDS.sub("", ex.passage.text).split())
        best = max(len(body & set(p.text.split())) / len(body) for p in practice.base)
        assert best > 0.6


def test_rejects_passages_without_the_fields():
    from rag.knowledge.passages import Passage

    with pytest.raises(ValueError, match="Symbol"):
        ReadingPractice([Passage("x", "X", "no fields here")])
