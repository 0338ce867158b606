"""passage_focus: question — the generator reads each retrieved passage from the sentence its question names, in
training, decoding and the auxiliary passage loss alike, while provenance keeps the passage as stored."""

from __future__ import annotations

import pytest
import torch

from rag.generation.contexts import focus_on_question
from rag.knowledge.passages import Passage
from rag.models.rag.model import RagModel, RagModelConfig

QUESTION = "When was hydrogen discovered?"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("focus") / "gpt2")


@pytest.fixture(scope="module")
def kb_dir(build_hybrid_kb):
    return build_hybrid_kb(20, "focus_kb")  # BM25 finds the Hydrogen passage for QUESTION


@pytest.fixture(params=["seq2seq", "causal"])
def models(request, tiny_bart_dir, tiny_dpr_question_dir, kb_dir, gpt2_dir):
    """The same generator with and without passage focus."""
    def make(focus):
        cfg = RagModelConfig(n_docs=3, max_context_length=256, passage_focus=focus)
        if request.param == "causal":
            return RagModel.from_components(tiny_dpr_question_dir, gpt2_dir, kb_dir, cfg).eval()
        return RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb_dir, cfg).eval()

    plain = make("none")
    focused = make("question")
    focused.load_state_dict(plain.state_dict())
    return plain, focused


def test_the_generator_reads_the_focused_passage_and_provenance_keeps_the_stored_one(models):
    plain, focused = models
    a, b = plain.prepare_inputs([QUESTION], retrieval="bm25"), focused.prepare_inputs([QUESTION], retrieval="bm25")
    assert [p.text for p in a.retrieved.passages[0]] == [p.text for p in b.retrieved.passages[0]]
    moved = 0
    for p, s_plain, s_focus in zip(b.retrieved.passages[0], a.context_strings, b.context_strings):
        text = focus_on_question(p.text, QUESTION)
        moved += text != p.text
        assert text in s_focus and (text == p.text) == (s_plain == s_focus)
    assert b.retrieved.passages[0][0].title == "Hydrogen" and moved  # its "Discovered by ..." sentence, last, now first


def test_the_passage_loss_reads_the_focused_passage(models):
    plain, focused = models
    stored = Passage("elements/hydrogen", "Hydrogen", "Symbol: H. Atomic number: 1. Discovered by Henry Cavendish in 1776.")
    moved = Passage(stored.id, stored.title, focus_on_question(stored.text, QUESTION))
    assert moved.text.startswith("Discovered by")
    assert focused.reading_passages([QUESTION], [[stored]]) == [[moved]]
    assert plain.reading_passages([QUESTION], [[stored]]) == [[stored]]
    with torch.no_grad():
        torch.testing.assert_close(focused.generator_loss([QUESTION], ["1776"], [stored]),
                                   plain.generator_loss([QUESTION], ["1776"], [moved]))


def test_an_unknown_focus_is_refused_naming_the_field():
    from rag.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="passage_focus"):
        RagModelConfig(passage_focus="sentence")
