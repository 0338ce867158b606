"""Retrieval types shared by every retriever and reader: the ``Retrieved`` result and the ``Retriever`` / ``Reranker`` protocols.

A retriever maps B queries to their top-k passages (:class:`Retrieved`); a reranker reorders (and
cuts) what a retriever returned. RagModel, the pipeline, the training modules and the decoder-only
readers depend on these protocols, not on a concrete retriever, so dense, BM25 and future rerankers
plug in alike. This module imports nothing else from ``rag.knowledge`` except the passage type, so it
sits below every retriever and knowledge-base module in the import graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from rag.knowledge.passages import Passage

__all__ = ["Retrieved", "Retriever", "Reranker"]


@dataclass
class Retrieved:
    """The top-k passages for a batch of B queries.

    Attributes:
        rows: ``(B, K)`` int64 row numbers of the passages in their knowledge base.
        scores: ``(B, K)`` float32 retrieval scores, best first (inner products for
            dense retrieval, BM25 scores for sparse).
        passages: B lists of K :class:`Passage`, aligned with `rows`.
        doc_embeds: ``(B, K, D)`` float32 stored embeddings of the passages (dense
            retrieval only, else None).
        kb_version: version id of the knowledge base that answered.
        prior_bias: ``(B, K)`` float32 added to ``q · d`` to make the retrieval logits, or None (hybrid score fusion:
            the weighted, normalised BM25 score of each passage; it carries no gradient).
    """

    rows: torch.Tensor
    scores: torch.Tensor
    passages: list[list[Passage]]
    doc_embeds: Optional[torch.Tensor]
    kb_version: str
    prior_bias: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def k(self) -> int:
        return int(self.rows.shape[1])


@runtime_checkable
class Retriever(Protocol):
    """Anything that returns the top-k passages of a knowledge base for B query strings
    (:class:`~rag.knowledge.retriever.DenseRetriever`, :class:`~rag.knowledge.bm25.BM25Retriever`)."""

    @property
    def kb_version(self) -> str:
        """Version id of the knowledge base serving now."""
        ...

    @property
    def knowledge_base(self):
        """The :class:`~rag.knowledge.knowledge_base.KnowledgeBase` serving now (None over bare passages)."""
        ...

    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k passages for B queries: ``rows`` / ``scores`` ``(B, k)``, B lists of k passages."""
        ...


@runtime_checkable
class Reranker(Protocol):
    """Reorders retrieved passages and keeps the best `k` of them (embedding, LM or trained reranker)."""

    def rerank(self, queries: Sequence[str], retrieved: Retrieved, k: int) -> Retrieved:
        """The best ``k <= retrieved.k`` of ``retrieved``'s passages for each of the B `queries`, best first."""
        ...
