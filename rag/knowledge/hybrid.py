"""Hybrid retrieval: the dense (MIPS) and BM25 rankings of one knowledge base, fused.

Dense retrievers find paraphrases and miss exact tokens; BM25 finds exact tokens and misses paraphrases. On the
Elements demo a frozen MiniLM rarely finds the element of "which element is number 8?" (a bare number), which BM25
finds from the passage's "Atomic number: 8." Two fusions (``RagModelConfig.hybrid_fusion``):

``score`` (the default): the candidates are the union of the dense and the BM25 top K; each is scored ::

    s(z) = q · d(z) + β_q · bm25(z) / max_z' bm25(z')
    β_q = β · ν  when the query holds a numeral (a token with a digit: a number, a code such as 486SX), else β

(β = ``hybrid_bm25_weight``, in units of the dense score; ν = ``hybrid_numeral_weight``), with both parts computed
exactly for every candidate, and the top K by s are returned. The same s is the retrieval logit: the document prior is
softmax(s / τ), whose dense part carries the gradient into the query encoder (RAG §2.2) and whose BM25 part is a
per-passage bias without gradient (``Retrieved.prior_bias``). Dividing by the query's best BM25 score puts the sparse
part in [0, β_q] whatever the corpus. ν exists because a word-piece encoder barely tells numerals apart ("Commodore
1570" and "Commodore 1571" embed alike), so between passages that share a query's words the exact match of its number
or code must outweigh the dense difference; how β (with BM25's title weight, ``bm25.TITLE_WEIGHT``) and ν were chosen,
on development questions and on lookups of rare tokens, is in docs/benchmarks.md ("Hybrid retrieval"; the scripts
``benchmarks/hybrid_recall.py`` and ``benchmarks/rare_token_recall.py``).

``rrf``: reciprocal rank fusion (Cormack et al. 2009), which needs no score calibration ::

    rrf(d) = Σ_{ranking r ∈ {dense, BM25}} 1 / (k + rank_r(d))        (rank from 1; absent from a ranking: no term)

over the top K of each ranking, k = ``hybrid_rrf_k`` (60, the paper's constant); ties: dense first. ``Retrieved.scores``
holds the rrf scores and the prior over the fused passages is the dense score q · d alone, so a passage only BM25
found gets the prior its dense score gives it. That is why ``score`` was added: on the demo's held-out questions the
rrf prior kept favouring the dense neighbour of a bare number over the passage BM25 ranked first.

Either way ``doc_embeds`` holds the stored embeddings of the fused passages, and a model trains its query encoder
exactly as with dense retrieval.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np
import torch

from rag.knowledge.bm25 import BM25Retriever
from rag.knowledge.retriever import DenseRetriever
from rag.knowledge.types import Retrieved
from rag.utils.errors import ConfigError, KnowledgeBaseError
from rag.utils.validate import check_number, check_positive_int

__all__ = ["RRF_K", "BM25_WEIGHT", "NUMERAL_WEIGHT", "FUSIONS", "has_numeral", "reciprocal_rank_fusion", "score_fusion",
           "HybridRetriever"]

RRF_K = 60
"""The k of reciprocal rank fusion (Cormack, Clarke and Büttcher 2009)."""
BM25_WEIGHT = 1.0
"""β of score fusion: the weight of the query-normalised BM25 score, in units of the dense score."""
NUMERAL_WEIGHT = 4.0
"""ν of score fusion: the factor on β for a query with a numeral (a token holding a digit: a number, a code)."""
FUSIONS = ("score", "rrf")
_DIGIT = re.compile(r"\d")


def has_numeral(query: str) -> bool:
    """True when `query` holds a decimal digit, i.e. one of its BM25 tokens is a number or a code."""
    return _DIGIT.search(query) is not None


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


def score_fusion(dense: np.ndarray, sparse: np.ndarray, valid: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-`k` of C candidates per query by ``dense + sparse`` (both ``(B, C)`` float32; `valid` ``(B, C)`` bool
    masks padding): candidate indices ``(B, k)`` int64, best first (ties: the lower index, i.e. the dense ranking's
    order first), and their fused scores ``(B, k)``. Fewer than k valid candidates leave index -1 and score -inf."""
    fused = np.where(valid, dense + sparse, -np.inf).astype(np.float32)
    order = np.argsort(-fused, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(fused, order, axis=1)
    return np.where(np.isfinite(top), order, -1).astype(np.int64), top


class HybridRetriever:
    """Dense + BM25 over one knowledge base, fused (see the module docstring).

    Hot-swappable like the retrievers it combines (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`): both halves are
    prepared for the new knowledge base first, then one reference changes, so a call never mixes two versions.

    Args:
        dense: a :class:`~rag.knowledge.retriever.DenseRetriever` (its query encoder embeds the queries).
        bm25: a :class:`~rag.knowledge.bm25.BM25Retriever` over the same knowledge base.
        fusion: ``score`` (dense score + β · normalised BM25) or ``rrf`` (reciprocal rank fusion).
        rrf_k: the rrf constant.
        bm25_weight: β of score fusion.
        numeral_weight: ν of score fusion (1: a query with a numeral is fused like any other).
    """

    def __init__(self, dense, bm25, *, fusion: str = "score", rrf_k: int = RRF_K, bm25_weight: float = BM25_WEIGHT,
                 numeral_weight: float = NUMERAL_WEIGHT):
        if dense.knowledge_base is not bm25.knowledge_base:
            raise ConfigError("hybrid retrieval fuses two rankings of one knowledge base; the dense and BM25 retrievers "
                              "serve different ones")
        if fusion not in FUSIONS:
            raise ConfigError(f"hybrid_fusion={fusion!r}; choose one of {FUSIONS}")
        reciprocal_rank_fusion([np.zeros((0, 1), dtype=np.int64)], 1, rrf_k=rrf_k)  # checks rrf_k
        check_number(bm25_weight, "hybrid_bm25_weight (the BM25 part's weight; 1 for a cosine encoder)", low=0.0,
                     error=ConfigError)
        check_number(numeral_weight, "hybrid_numeral_weight (β's factor for a query with a number or code; 1: none)",
                     low=0.0, error=ConfigError)
        self.fusion, self.rrf_k, self.bm25_weight = fusion, rrf_k, float(bm25_weight)
        self.numeral_weight = float(numeral_weight)
        self._pair = (dense, bm25)

    @classmethod
    def from_knowledge_base(cls, kb, query_encoder, *, fusion: str = "score", rrf_k: int = RRF_K,
                            bm25_weight: float = BM25_WEIGHT, numeral_weight: float = NUMERAL_WEIGHT,
                            allow_encoder_change: bool = False) -> "HybridRetriever":
        """Over `kb`'s FAISS index (queries embedded by `query_encoder`) and its stored BM25 index."""
        if kb.bm25 is None:
            raise KnowledgeBaseError(f"{kb.path}: has no BM25 index, which hybrid retrieval fuses with the dense ranking; "
                                     "rebuild it with `rag index build --bm25`, or use retrieval dense")
        return cls(DenseRetriever(kb, query_encoder, allow_encoder_change=allow_encoder_change),
                   BM25Retriever(kb.bm25, kb.get_passages, knowledge_base=kb),
                   fusion=fusion, rrf_k=rrf_k, bm25_weight=bm25_weight, numeral_weight=numeral_weight)

    @classmethod
    def for_settings(cls, kb, query_encoder, settings=None, *, allow_encoder_change: bool = False) -> "HybridRetriever":
        """:meth:`from_knowledge_base` with the fusion options of `settings` (a RagModelConfig; None: the defaults)."""
        return cls.from_knowledge_base(kb, query_encoder, allow_encoder_change=allow_encoder_change,
                                       fusion=getattr(settings, "hybrid_fusion", "score"),
                                       rrf_k=getattr(settings, "hybrid_rrf_k", RRF_K),
                                       bm25_weight=getattr(settings, "hybrid_bm25_weight", BM25_WEIGHT),
                                       numeral_weight=getattr(settings, "hybrid_numeral_weight", NUMERAL_WEIGHT))

    @property
    def options(self) -> dict:
        """The fusion options, as :meth:`from_knowledge_base` takes them."""
        return {"fusion": self.fusion, "rrf_k": self.rrf_k, "bm25_weight": self.bm25_weight,
                "numeral_weight": self.numeral_weight}

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
        dense, bm25 = self._pair
        new_dense = DenseRetriever(kb, dense.query_encoder, allow_encoder_change=dense.allow_encoder_change)
        new_dense.space = dense.space
        new_dense.set_knowledge_base(kb, allow_encoder_change=allow_encoder_change)  # checks the embedding space
        source = bm25.prepare_knowledge_base(kb)
        return (new_dense, BM25Retriever(source.index, source.lookup, knowledge_base=kb))

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
        queries = list(queries)
        q = query_embeds.detach().float().cpu()
        _, dense_rows = kb.search(q, k)
        dense_rows = np.asarray(dense_rows)
        if self.fusion == "rrf":
            _, bm25_rows = bm25.index.search(queries, k)
            rows, scores = reciprocal_rank_fusion([dense_rows, np.asarray(bm25_rows)], k, rrf_k=self.rrf_k)
            rows_t = torch.from_numpy(rows)
            return Retrieved(rows=rows_t, scores=torch.from_numpy(scores), passages=kb.get_passages(rows),
                             doc_embeds=kb.get_embeddings(rows_t), kb_version=kb.served_version)
        # score fusion over both top-k lists, (B, 2k) candidates, dense first; a BM25 row the dense list holds is masked
        bm25_scores, bm25_rows, dense_bm25 = bm25.index.search_and_score(queries, k, dense_rows)  # one BM25 pass
        cand = np.concatenate([dense_rows, bm25_rows], axis=1)
        valid = cand >= 0
        valid[:, k:] &= ~(bm25_rows[:, :, None] == dense_rows[:, None, :]).any(-1)
        embeds = kb.get_embeddings(torch.from_numpy(np.where(valid, cand, 0))).float()  # (B, 2k, D)
        dense_s = torch.bmm(embeds, q.unsqueeze(-1)).squeeze(-1).numpy()  # (B, 2k) q · d, exact for every candidate
        top_bm25 = np.maximum(bm25_scores[:, :1], 1e-12)  # the query's best BM25 score (0: no known term -> no bias)
        beta = self.bm25_weight * np.array([[self.numeral_weight if has_numeral(t) else 1.0] for t in queries], dtype=np.float32)
        sparse = beta * np.concatenate([dense_bm25, bm25_scores], axis=1) / top_bm25  # (B, 2k) in [0, β · factor]
        pick, scores = score_fusion(dense_s, sparse, valid, k)
        pick = np.maximum(pick, 0)
        rows = np.take_along_axis(cand, pick, axis=1)
        rows_t = torch.from_numpy(rows)
        return Retrieved(rows=rows_t, scores=torch.from_numpy(scores), passages=kb.get_passages(rows),
                         doc_embeds=torch.from_numpy(np.take_along_axis(embeds.numpy(), pick[..., None], axis=1)),
                         kb_version=kb.served_version,
                         prior_bias=torch.from_numpy(np.take_along_axis(sparse, pick, axis=1).astype(np.float32)))

    @torch.no_grad()
    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k fused passages for B query strings (embedded by the dense retriever's query encoder)."""
        q = self.query_encoder.encode(list(queries), show_progress=False)
        return self.search(list(queries), torch.from_numpy(q), k)

