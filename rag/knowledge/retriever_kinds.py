"""Retrievers by kind (``bm25`` | ``dense`` | ``hybrid``) over one knowledge base, swappable as one reference, pinned per call.

The decoder-only readers choose the retrieval per call (``retrieval="bm25"`` or ``"dense"``), and In-Context
RALM retrieves many times in one generation (every ``s`` tokens). :class:`KnowledgeBaseRetrievers` holds the
serving knowledge base with its retrievers in one immutable :class:`ServedRetrievers`; a call reads it once
(:meth:`KnowledgeBaseRetrievers.pin`) and every retrieval of that call comes from that one version, while a hot
swap (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`, through ``prepare_knowledge_base`` /
``set_knowledge_base``) replaces the reference for later calls.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from rag.knowledge.bm25 import BM25Index, BM25Retriever
from rag.knowledge.hybrid import HybridRetriever
from rag.knowledge.rerank import Rerank, RerankingRetriever
from rag.knowledge.retriever import DenseRetriever, check_compatible, default_query_encoder
from rag.knowledge.types import Retrieved
from rag.utils.errors import ConfigError, KnowledgeBaseError

__all__ = ["RETRIEVAL_KINDS", "retriever_for_kind", "ServedRetrievers", "KnowledgeBaseRetrievers"]

RETRIEVAL_KINDS = ("bm25", "dense", "hybrid")


def retriever_for_kind(kind: str, kb, query_encoder=None, *, settings=None, allow_encoder_change: bool = False,
                       build_missing: bool = False, rerank: Optional[Rerank] = None, **bm25_build):
    """The one factory of retrievers over the open knowledge base `kb`, by `kind` (``--retrieval``); each reports
    ``kb.served_version`` with every result.

    ``bm25`` uses its stored BM25 index (``rag index build --bm25``; with `build_missing`, one built in memory now and on
    later swaps, keywords `bm25_build` as :meth:`~rag.knowledge.bm25.BM25Index.build`); ``dense`` its FAISS index with
    `query_encoder` (None: the encoder its manifest names, :func:`~rag.knowledge.retriever.default_query_encoder`;
    dimension checked now); ``hybrid`` both, fused as `settings` (a RagModelConfig; None: the defaults) says.
    `rerank` (``--rerank K --reranker DIR``): that retriever's top K reranked by the stage's cross-encoder
    (:class:`~rag.knowledge.rerank.RerankingRetriever`); None: not reranked.

    Raises:
        KnowledgeBaseError: BM25 or hybrid over a knowledge base without a BM25 index; a dimension mismatch.
        ConfigError: an unknown `kind`.
    """
    retriever = _retriever_for_kind(kind, kb, query_encoder, settings=settings, allow_encoder_change=allow_encoder_change,
                                    build_missing=build_missing, **bm25_build)
    return retriever if rerank is None else RerankingRetriever(retriever, rerank.cross_encoder, rerank.candidates)


def _retriever_for_kind(kind: str, kb, query_encoder, *, settings, allow_encoder_change: bool, build_missing: bool,
                        **bm25_build):
    if kind == "bm25":
        if kb.bm25 is None and not build_missing:
            raise KnowledgeBaseError(f"--kb {kb.path}: has no BM25 index, which --retrieval bm25 (retrieval='bm25') needs; "
                                     "rebuild it with `rag index build --bm25`, or use --retrieval dense")
        index = kb.bm25 if kb.bm25 is not None else BM25Index.build(kb.all_passages(), **bm25_build)
        return BM25Retriever(index, kb.get_passages, knowledge_base=kb, build_missing=build_missing)
    if kind in ("dense", "hybrid"):
        encoder = query_encoder if query_encoder is not None else default_query_encoder(kb)
        if kind == "hybrid":  # both rankings fused (rag.knowledge.hybrid)
            return HybridRetriever.for_settings(kb, encoder, settings, allow_encoder_change=allow_encoder_change)
        return DenseRetriever(kb, encoder, allow_encoder_change=allow_encoder_change)
    raise ConfigError(f"retrieval={kind!r} (--retrieval); choose one of {RETRIEVAL_KINDS}")


class ServedRetrievers:
    """One knowledge-base version and its retrievers, built on first use (thread-safe). Never re-pointed: a call that
    holds it retrieves from this version only."""

    def __init__(self, kb, owner: "KnowledgeBaseRetrievers", built: Optional[dict] = None):
        self.knowledge_base = kb
        self._owner = owner
        self._built: dict = dict(built or {})
        self._lock = threading.Lock()

    @property
    def kb_version(self) -> str:
        return self.knowledge_base.served_version

    def retriever(self, kind: Optional[str] = None):
        """The retriever of `kind` (None: the owner's default) over this version."""
        kind = self._owner.default if kind is None else kind
        if kind not in RETRIEVAL_KINDS:
            raise ConfigError(f"retrieval={kind!r} (--retrieval); choose one of {RETRIEVAL_KINDS}")
        with self._lock:
            if kind not in self._built:
                self._built[kind] = retriever_for_kind(kind, self.knowledge_base,
                                                       self._owner.query_encoder_for(self.knowledge_base)
                                                       if kind != "bm25" else None, rerank=self._owner.rerank)
            return self._built[kind]


class KnowledgeBaseRetrievers:
    """The knowledge base a decoder-only reader serves from, with a BM25 and a dense retriever over it.

    Satisfies the :class:`~rag.knowledge.types.Retriever` protocol with the default kind, and the
    :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` protocol (``knowledge_base``, ``prepare_knowledge_base``,
    ``set_knowledge_base``): a swap is validated for every kind this object has served (a dense query encoder's
    dimension and document-encoder identity; a BM25 index when BM25 has served), then one reference changes.

    Args:
        kb: the open :class:`~rag.knowledge.knowledge_base.KnowledgeBase`.
        default: the kind used when a call names none; None: ``bm25`` when `kb` has a BM25 index, else ``dense``.
        rerank: the rerank stage every retriever of every kind applies (:meth:`use_rerank`); None: none.
    """

    def __init__(self, kb, default: Optional[str] = None, rerank: Optional[Rerank] = None):
        if default is None:
            default = "bm25" if kb.bm25 is not None else "dense"
        if default not in RETRIEVAL_KINDS:
            raise ConfigError(f"retrieval={default!r} (--retrieval); choose one of {RETRIEVAL_KINDS}")
        self.default = default
        self.rerank = rerank
        self.query_encoder = None  # loaded on first dense retrieval
        self.space: Optional[str] = None  # the document-encoder fingerprint the query encoder was paired with
        self._encoder_lock = threading.Lock()
        self._served = ServedRetrievers(kb, self)
        if default == "bm25":
            self._served.retriever("bm25")  # a missing BM25 index is an error now, not at the first request

    # ------------------------------------------------------------------ state
    def use_rerank(self, rerank: Optional[Rerank]) -> None:
        """Rerank every later retrieval with `rerank` (None: stop): the serving version's retrievers are made anew."""
        self.rerank = rerank
        self._served = ServedRetrievers(self._served.knowledge_base, self)

    def pin(self) -> ServedRetrievers:
        """The version serving now, with its retrievers: read once per call."""
        return self._served

    @property
    def knowledge_base(self):
        return self._served.knowledge_base

    @property
    def kb_version(self) -> str:
        return self._served.kb_version

    def query_encoder_for(self, kb):
        """The dense query encoder (loaded from `kb`'s manifest on first use, then kept across swaps)."""
        with self._encoder_lock:
            if self.query_encoder is None:
                self.query_encoder = default_query_encoder(kb)
                self.space = kb.encoder.get("fingerprint")
            return self.query_encoder

    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k passages with the default kind (the :class:`~rag.knowledge.types.Retriever` protocol)."""
        return self.pin().retriever().retrieve(queries, k)

    # ------------------------------------------------------------------ hot swap
    def prepare_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None) -> ServedRetrievers:
        """`kb` with its retrievers for every kind served so far, built and checked off the swap lock.

        Raises:
            KnowledgeBaseError: `kb` lacks a BM25 index while BM25 has served, or its embeddings do not fit the
                dense query encoder (dimension, or document encoder unless `allow_encoder_change`).
        """
        current = self._served
        built = {}
        for kind in sorted(current._built):
            if kind != "bm25":
                check_compatible(kb, self.query_encoder.dim, self.space, allow_encoder_change=bool(allow_encoder_change))
            built[kind] = retriever_for_kind(kind, kb, self.query_encoder if kind != "bm25" else None, rerank=self.rerank)
        return ServedRetrievers(kb, self, built)

    def set_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None,
                           prepared: Optional[ServedRetrievers] = None) -> None:
        """Serve from `kb` from now on (one reference assignment); `prepared`: :meth:`prepare_knowledge_base`'s result."""
        served = prepared if prepared is not None else self.prepare_knowledge_base(kb, allow_encoder_change=allow_encoder_change)
        if served.knowledge_base is not kb:
            raise ConfigError("set_knowledge_base: `prepared` was made for another knowledge base; prepare this one")
        self._served = served
