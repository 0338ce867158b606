"""Hybrid retrieval: the dense (MIPS) and BM25 rankings of one knowledge base fused by reciprocal rank fusion.

Dense retrievers find paraphrases and miss exact tokens; BM25 finds exact tokens and misses paraphrases. On the
Elements demo a frozen MiniLM rarely finds the element of "which element is number 8?" (a bare number), which BM25
finds from the passage's "Atomic number: 8." Reciprocal rank fusion (Cormack et al. 2009) needs no score calibration
between the two: each passage scores ::

    rrf(d) = Σ_{ranking r ∈ {dense, BM25}} 1 / (k + rank_r(d))        (rank from 1; absent from a ranking: no term)

over the top K passages of each ranking (each retriever proposes as many passages as are asked for), with ``k = 60``
(the paper's constant; ``RagModelConfig.hybrid_rrf_k``): a passage in both proposals beats one in a single proposal, and
among the others the better-ranked goes first (ties: dense first). The top K by rrf are returned; ``Retrieved.scores``
holds the rrf scores and ``doc_embeds`` the stored embeddings of the fused passages. Fusing deeper rankings (the top
20 of each) was worse on the demo's questions: passages that both retrievers rank mediocre then outscore one that a
single retriever ranks first (``benchmarks/hybrid_recall.py``; docs/benchmarks.md has the numbers).

For training (:class:`~rag.knowledge.scoring.RetrievalScorer` with ``retrieval="hybrid"``), fusion chooses WHICH
passages are marginalised over, and the document prior over them is the dense score ``q · d`` of each fused passage
(softmax over them / τ), so the gradient reaches the query encoder exactly as for dense retrieval (RAG §2.2). A passage
only BM25 found gets the prior its dense score gives it; the reader's likelihood then raises that score when the
passage answers (the posterior p(z | x, y) moves towards it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from rag.knowledge.types import Retrieved
from rag.utils.errors import ConfigError
from rag.utils.validate import check_positive_int

__all__ = ["RRF_K", "reciprocal_rank_fusion", "HybridRetriever"]

RRF_K = 60
"""The k of reciprocal rank fusion (Cormack, Clarke and Büttcher 2009)."""


def reciprocal_rank_fusion(rankings: Sequence[np.ndarray], k: int, *, rrf_k: int = RRF_K) -> tuple[np.ndarray, np.ndarray]:
    """Fuse rankings of row ids, each ``(B, D_i)`` best first (-1: no passage), into the top-`k` rows ``(B, k)`` by
    Σ 1 / (rrf_k + rank) and their fused scores ``(B, k)`` float32. Ties keep the order of first appearance (the first
    ranking's order first). Rows that no ranking holds are -1 with score 0."""
    if not rankings:
        raise ConfigError("reciprocal_rank_fusion needs at least one ranking")
    check_positive_int(rrf_k, "hybrid_rrf_k (60 is the usual constant)", error=ConfigError)
    batch = rankings[0].shape[0]
    rows = np.full((batch, k), -1, dtype=np.int64)
    scores = np.zeros((batch, k), dtype=np.float32)
    for b in range(batch):
        fused: dict[int, float] = {}
        for ranking in rankings:
            for rank, row in enumerate(ranking[b].tolist(), start=1):
                if row >= 0:
                    fused[row] = fused.get(row, 0.0) + 1.0 / (rrf_k + rank)
        best = sorted(fused.items(), key=lambda item: -item[1])[:k]  # stable: first appearance wins ties
        for j, (row, score) in enumerate(best):
            rows[b, j], scores[b, j] = row, score
    return rows, scores


class HybridRetriever:
    """Dense + BM25 over one knowledge base, fused by reciprocal rank fusion (see the module docstring).

    Hot-swappable like the retrievers it combines (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`): both halves are
    prepared for the new knowledge base first, then one reference changes, so a call never mixes two versions.

    Args:
        dense: a :class:`~rag.knowledge.retriever.DenseRetriever` (its query encoder embeds the queries).
        bm25: a :class:`~rag.knowledge.bm25.BM25Retriever` over the same knowledge base.
        rrf_k: the fusion constant.
    """

    def __init__(self, dense, bm25, *, rrf_k: int = RRF_K):
        if dense.knowledge_base is not bm25.knowledge_base:
            raise ConfigError("hybrid retrieval fuses two rankings of one knowledge base; the dense and BM25 retrievers "
                              "serve different ones")
        reciprocal_rank_fusion([np.zeros((0, 1), dtype=np.int64)], 1, rrf_k=rrf_k)  # checks rrf_k
        self.rrf_k = rrf_k
        self._pair = (dense, bm25)

    @classmethod
    def from_knowledge_base(cls, kb, query_encoder, *, rrf_k: int = RRF_K, allow_encoder_change: bool = False) -> "HybridRetriever":
        """Over `kb`'s FAISS index (queries embedded by `query_encoder`) and its stored BM25 index."""
        from rag.knowledge.bm25 import BM25Retriever
        from rag.knowledge.retriever import DenseRetriever
        from rag.utils.errors import KnowledgeBaseError

        if kb.bm25 is None:
            raise KnowledgeBaseError(f"{kb.path}: has no BM25 index, which hybrid retrieval fuses with the dense ranking; "
                                     "rebuild it with `rag index build --bm25`, or use retrieval dense")
        return cls(DenseRetriever(kb, query_encoder, allow_encoder_change=allow_encoder_change),
                   BM25Retriever(kb.bm25, kb.get_passages, kb.served_version, knowledge_base=kb), rrf_k=rrf_k)

    @property
    def dense(self):
        return self._pair[0]

    @property
    def bm25(self):
        return self._pair[1]

    @property
    def query_encoder(self):
        return self._pair[0].query_encoder

    @property
    def knowledge_base(self):
        return self._pair[0].knowledge_base

    @property
    def kb_version(self) -> str:
        return self._pair[0].kb_version

    @property
    def space(self) -> Optional[str]:
        return self._pair[0].space

    @property
    def allow_encoder_change(self) -> bool:
        return self._pair[0].allow_encoder_change

    @allow_encoder_change.setter
    def allow_encoder_change(self, value: bool) -> None:
        self._pair[0].allow_encoder_change = value

    # ------------------------------------------------------------------ hot swap
    def prepare_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None):
        """New dense and BM25 retrievers for `kb`, checked (dimension, document encoder, BM25 index) before the swap."""
        from rag.knowledge.bm25 import BM25Retriever
        from rag.knowledge.retriever import DenseRetriever

        dense, bm25 = self._pair
        new_dense = DenseRetriever(kb, dense.query_encoder, allow_encoder_change=dense.allow_encoder_change)
        new_dense.space = dense.space
        new_dense.set_knowledge_base(kb, allow_encoder_change=allow_encoder_change)  # checks the embedding space
        source = bm25.prepare_knowledge_base(kb)
        return (new_dense, BM25Retriever(source.index, source.lookup, source.kb_version, knowledge_base=kb))

    def set_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None, prepared=None) -> None:
        """Serve from `kb` from now on (one reference assignment)."""
        pair = prepared if prepared is not None else self.prepare_knowledge_base(kb, allow_encoder_change=allow_encoder_change)
        if pair[0].knowledge_base is not kb:
            raise ConfigError("set_knowledge_base: `prepared` was made for another knowledge base; prepare this one")
        self._pair = pair

    # ------------------------------------------------------------------ retrieval
    def search(self, queries: Sequence[str], query_embeds: torch.Tensor, k: int) -> Retrieved:
        """The fused top-`k` for B `queries` whose dense vectors `query_embeds` ``(B, D)`` the caller computed (with
        gradients, detached here): rows, rrf scores, passages and stored ``doc_embeds`` ``(B, k, D)``."""
        dense, bm25 = self._pair
        kb = dense.knowledge_base
        n = len(kb)
        if k > n:
            raise ConfigError(f"k={k} exceeds the {n} passages of the knowledge base")
        _, dense_rows = kb.search(query_embeds.detach(), k)
        _, bm25_rows = bm25.index.search(list(queries), k)
        rows, scores = reciprocal_rank_fusion([np.asarray(dense_rows), np.asarray(bm25_rows)], k, rrf_k=self.rrf_k)
        rows_t = torch.from_numpy(rows)
        return Retrieved(rows=rows_t, scores=torch.from_numpy(scores), passages=kb.get_passages(rows),
                         doc_embeds=kb.get_embeddings(rows_t), kb_version=kb.served_version)

    @torch.no_grad()
    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k fused passages for B query strings (embedded by the dense retriever's query encoder)."""
        q = self.query_encoder.encode(list(queries), show_progress=False)
        return self.search(list(queries), torch.from_numpy(q), k)
