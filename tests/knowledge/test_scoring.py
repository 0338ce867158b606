"""RetrievalScorer on its own (no RagModel): the retrieval-with-gradients seam REPLUG LSR and In-Context RALM reuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.scoring import RetrievalScorer
from rag.utils.errors import ConfigError


@dataclass
class Settings:
    """A reader's own options: anything with the ScoringSettings fields will do."""

    retrieval: str = "dense"
    max_question_length: int = 32
    freeze_query_encoder: bool = False
    train_doc_encoder: bool = False
    rerank_candidates: Optional[int] = None

    @property
    def uses_doc_encoder(self) -> bool:
        return self.train_doc_encoder or self.rerank_candidates is not None


@pytest.fixture(scope="module")
def setup(tiny_bert_dir, demo_passages, tmp_path_factory):
    from rag.knowledge.encoders import TextEncoder

    enc = TextEncoder(tiny_bert_dir, pooling="mean")
    kb = KnowledgeBase.build(demo_passages[:20], enc, tmp_path_factory.mktemp("scoring") / "kb", index="flat",
                             show_progress=False)
    return enc, kb


QUESTIONS = ["what is the symbol of gold?", "which element is a noble gas?"]


def test_scores_are_query_dot_stored_embeddings_and_carry_gradient(setup):
    enc, kb = setup
    scorer = RetrievalScorer(enc, kb, Settings())
    retrieved, scores = scorer.score(QUESTIONS, 3)
    assert retrieved.rows.shape == scores.shape == (2, 3) and retrieved.kb_version == kb.version
    q = enc(**scorer.tokenize_questions(QUESTIONS))
    torch.testing.assert_close(scores, torch.einsum("bd,bkd->bk", q, retrieved.doc_embeds))
    torch.testing.assert_close(scores.detach(), retrieved.scores, atol=1e-4, rtol=1e-4)  # the index agrees
    scores.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())
    enc.zero_grad()


def test_frozen_query_encoder_gets_no_gradient(setup):
    enc, kb = setup
    _, scores = RetrievalScorer(enc, kb, Settings(freeze_query_encoder=True)).score(QUESTIONS, 2)
    assert not scores.requires_grad


def test_reranking_keeps_the_best_by_fresh_score(setup, tiny_bert_dir):
    from rag.knowledge.encoders import TextEncoder

    enc, kb = setup
    doc_encoder = TextEncoder(tiny_bert_dir, pooling="mean")  # a fresh copy: the scorer freezes it
    scorer = RetrievalScorer(enc, kb, Settings(rerank_candidates=8), doc_encoder=doc_encoder)
    with torch.no_grad():
        retrieved, scores = scorer.score(QUESTIONS, 3)
        wide, wide_scores = RetrievalScorer(enc, kb, Settings()).score(QUESTIONS, 8)
    # the document encoder has the index's weights here, so re-ranking 8 keeps the index's top 3
    torch.testing.assert_close(scores, wide_scores[:, :3], atol=1e-4, rtol=1e-4)
    # same rows, except where two candidates tie within float noise (a random tiny encoder makes near-ties, and
    # re-embedding vs the index's stored vectors may order them either way depending on the kernel's rounding)
    wide_score_of = {(b, int(r)): float(s) for b in range(len(QUESTIONS)) for r, s in zip(wide.rows[b], wide_scores[b])}
    for b in range(len(QUESTIONS)):
        for k in range(3):
            got, want = int(retrieved.rows[b, k]), int(wide.rows[b, k])
            assert got == want or abs(wide_score_of[(b, got)] - wide_score_of[(b, want)]) < 1e-4, (b, k, got, want)


def test_settings_are_read_at_every_call_and_bad_retrievers_refused(setup):
    enc, kb = setup
    settings = Settings()
    scorer = RetrievalScorer(enc, kb, settings)
    settings.freeze_query_encoder = True
    assert scorer.query_encoder_frozen
    with pytest.raises(ConfigError, match="needs a DenseRetriever"):
        RetrievalScorer(enc, object(), Settings())
