"""Reading practice in the forms of the training questions (``reading_practice.source: questions``, issue #31): on a
corpus whose passages hold many short entries, the reader practises finding the entry a question names among its
neighbours; a corpus where no form holds (the key only in titles, as in FOLDOC) gets the corpus practice unchanged."""

from __future__ import annotations

import random
import re

import pytest
import pytorch_lightning as pl

from rag.knowledge.passages import Passage
from rag.training.reading_practice import (
    QuestionForm,
    ReadingPracticeSettings,
    corpus_practice,
    find_question_forms,
    practice_pool,
    question_form_practice,
)


def _glossary(n_pages: int = 40, per_page: int = 6, seed: int = 0):
    """Pages of `per_page` acronym entries ("ABC: Alpha Beta Corp."), and "What does ABC stand for?" pairs."""
    rng = random.Random(seed)
    words = ["Alpha", "Beta", "Central", "Data", "Electric", "Federal", "General", "Hyper", "Internet", "Joint", "Kernel",
             "Logical", "Machine", "Network", "Open", "Parallel", "Query", "Remote", "System", "Terminal"]
    entries, seen = [], set()
    while len(entries) < n_pages * per_page:
        expansion = rng.sample(words, rng.randint(2, 4))
        key = "".join(w[0] for w in expansion) + rng.choice("XYZ")
        if key not in seen:
            seen.add(key)
            entries.append((key, " ".join(expansion)))
    entries.sort()
    passages = [Passage(f"p{i}", f"page {i}", " ".join(f"{k}: {e}." for k, e in entries[i * per_page:(i + 1) * per_page]))
                for i in range(n_pages)]
    pairs = [(f"What does {k} stand for?", e) for k, e in entries]
    return passages, pairs, entries


def test_the_form_of_the_questions_is_found_with_its_pattern():
    passages, pairs, entries = _glossary()
    forms = find_question_forms(passages, pairs[:100])
    assert forms, "no form found"
    (best, support), = forms.most_common(1)
    assert (best.prefix, best.suffix, best.key_first, best.middle) == ("What does ", " stand for?", True, ": ")
    assert support >= 50
    m = {(x.group("key"), x.group("answer")) for x in best.pattern().finditer(passages[3].text)}
    assert m <= set(entries) and len(m) >= 4  # it reads the page's own entries, nothing else


def test_practice_asks_about_renamed_entries_of_every_page():
    passages, pairs, entries = _glossary()
    examples = question_form_practice(passages, pairs[:100], 300, seed=1)
    assert examples == question_form_practice(passages, pairs[:100], 300, seed=1)  # seeded
    assert len(examples) >= 200  # of the 240 entries, those whose renamed key leaves the answer as it was
    keys = {k for k, _ in entries}
    pages = set()
    for e in examples:
        name = re.fullmatch(r"What does (\w+) stand for\?", e.question).group(1)
        assert name not in keys  # an invented name, never a real key: the answer cannot be recalled from it
        assert f"{name}: {e.answer}." in e.passage.text  # the entry it names holds the answer
        assert e.passage.text.count(name) == 1
        pages.add(e.passage.title)
    assert len(pages) > 30  # entries of pages no training question is about, too


def test_a_pattern_that_finds_other_spans_is_dropped():
    """FOLDOC-like definitions repeat the term after the answer ("An early system. PRINT I ran on ..."): "the answer,
    a space, the key" holds for the pairs one by one but, as a pattern, finds other spans: no form."""
    rng = random.Random(0)
    passages, pairs = [], []
    for i in range(60):
        term = f"Term{i}"
        answer = " ".join(rng.choice(["an", "early", "system", "for", "the", "IBM", "language", "used"]) for _ in range(5))
        answer = f"{answer.capitalize()} number {i}."
        passages.append(Passage(f"d{i}", term, f"{answer} {term} was written in 1960. It is old."))
        pairs.append((f"What is {term}?", answer))
    assert not find_question_forms(passages, pairs)


def test_without_a_form_the_pool_is_the_corpus_practice(tmp_path, caplog):
    class KB:
        def __init__(self, passages):
            self._passages = passages

        def all_passages(self):
            return self._passages

    titled = [Passage(f"d{i}", f"Term{i}", f"A thing described in sentence number {i}. More words follow here.")
              for i in range(20)]
    pairs = [(f"What is Term{i}?", f"A thing described in sentence number {i}.") for i in range(20)]
    settings = ReadingPracticeSettings(source="questions", pool=50)
    with caplog.at_level("WARNING"):
        pool = practice_pool(settings, KB(titled), pairs=pairs)
    assert pool == corpus_practice(titled, 50) and "no form of the training questions" in caplog.text
    glossary, glossary_pairs, _ = _glossary()
    pool = practice_pool(settings, KB(glossary), pairs=glossary_pairs)
    assert len(pool) == 50 and all(e.question.startswith("What does ") for e in pool)


def test_question_form_round_trip():
    form = QuestionForm("What does ", " stand for?", True, ": ", ". ", ". ")
    assert form.question("NCB") == "What does NCB stand for?"
    text = "NCB: National Computer Board. NCC: National Computing Centre. NCGA: National Computer Graphics Association."
    assert [(m.group("key"), m.group("answer")) for m in form.pattern().finditer(text)] == [
        ("NCB", "National Computer Board"), ("NCC", "National Computing Centre"),
        ("NCGA", "National Computer Graphics Association")]


def test_rag_module_builds_the_pool_from_the_training_pairs(make_module, make_data, trainer_kw, tmp_path, monkeypatch):
    """fit hands the datamodule's training pairs to the practice pool (the Elements demo has no entry-shaped form, so
    the pool is the corpus practice; what is checked is that the pairs arrive)."""
    import rag.training.modules as modules
    import rag.training.reading_practice as rp

    seen = {}
    real = rp.practice_pool

    def spy(settings, kb, tokenizer=None, pairs=()):
        seen["pairs"] = list(pairs)
        return real(settings, kb, tokenizer, pairs=pairs)

    monkeypatch.setattr(modules, "practice_pool", spy)  # the name RagModule calls
    module = make_module(reading_practice={"source": "questions", "per_step": 1, "pool": 10})
    data = make_data()
    pl.Trainer(max_steps=1, limit_val_batches=0, **trainer_kw).fit(module, datamodule=data)
    # the pool of 10, less the examples whose answer the model's window cannot hold (fit_to_window)
    assert seen["pairs"] and seen["pairs"][0][0].endswith("?") and 0 < len(module._practice) <= 10


@pytest.mark.parametrize("source", ["corpus", "questions", "elements"])
def test_every_source_is_accepted(source):
    assert ReadingPracticeSettings(source=source).source == source
