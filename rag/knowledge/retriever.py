"""One retrieval interface for dense and sparse retrievers.

A retriever maps a batch of B queries to the top-k passages of a knowledge base.
Dense retrieval also returns the stored embeddings of the retrieved passages so
that RAG can recompute ``doc_scores = q · doc_embeds`` in torch: the only path by
which gradients reach the query encoder (Lewis et al. 2020, §2.2/§2.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rag.knowledge.passages import Passage


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
    """

    rows: torch.Tensor
    scores: torch.Tensor
    passages: list[list[Passage]]
    doc_embeds: Optional[torch.Tensor]
    kb_version: str

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def k(self) -> int:
        return int(self.rows.shape[1])
