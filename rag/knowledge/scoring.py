"""Retrieval with gradients: questions -> ``Retrieved`` passages + ``(B, K)`` differentiable document scores.

Data flow of :meth:`RetrievalScorer.score` (B questions, K passages each)::

    questions ──tokenize once──► query encoder ──► q (B, D)        (with gradients unless frozen)
    q.detach() ──► index search (no grad) ──► rows (B, K), stored doc_embeds (B, K, D), passages
    doc_scores = q · doc_embeds (B, K)                             (the ONLY gradient path into the retriever, RAG §2.2)

``train_doc_encoder`` re-embeds the K retrieved passages *with gradients* by the current document
encoder (REALM / REPLUG-style, ``doc_scores = q · d_fresh``); ``rerank_candidates=L`` searches L
passages in the (stale) index, re-embeds them and keeps the best K (REPLUG §4.4). BM25 retrieval
(RAG Table 6) uses the BM25 scores as retrieval logits, without gradient.

RAG uses it through :class:`~rag.models.rag.model.RagModel`; REPLUG LSR (a loss over these ``(B, K)``
scores) and In-Context RALM (retrieval every stride) reuse it with their own readers.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union

import torch

from rag.knowledge.bm25 import BM25Retriever
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.hybrid import HybridRetriever
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.refresh import load_document_encoder
from rag.knowledge.rerank import Rerank
from rag.knowledge.retriever import DenseRetriever, check_compatible
from rag.knowledge.retriever_kinds import RETRIEVAL_KINDS, retriever_for_kind
from rag.knowledge.types import Retrieved, Retriever
from rag.utils.errors import ConfigError, KnowledgeBaseError

__all__ = ["ScoringSettings", "RetrievalScorer"]


class ScoringSettings(Protocol):
    """The options :class:`RetrievalScorer` reads at every call (:class:`~rag.models.rag.config.RagModelConfig` is one)."""

    retrieval: str
    """``"dense"`` (MIPS, trainable query encoder), ``"bm25"`` (BM25 scores as logits) or ``"hybrid"`` (the two rankings
    fused, the fused passages scored by q · d)."""
    max_question_length: int
    """Most query-encoder tokens per question."""
    freeze_query_encoder: bool
    """No gradient into the query encoder."""
    train_doc_encoder: bool
    """Re-embed the retrieved passages with gradients through the document encoder."""
    rerank_candidates: Optional[int]
    """Search this many candidates and keep the best K by fresh score (None: no re-ranking)."""

    @property
    def uses_doc_encoder(self) -> bool: ...


class RetrievalScorer:
    """Top-k passages and their ``(B, K)`` retrieval logits for B questions, differentiable into the encoders.

    Holds references (not copies) to the query encoder, the retriever and the optional document
    encoder; the modules themselves belong to the model that owns them (their parameters stay under
    that model's names). `settings` is read at every call, so a model's config changes take effect.

    Args:
        question_encoder: a :class:`~rag.knowledge.encoders.TextEncoder` whose dimension matches the knowledge base.
        retriever: a :class:`~rag.knowledge.retriever.DenseRetriever`, a :class:`~rag.knowledge.bm25.BM25Retriever`,
            or a ``KnowledgeBase`` (wrapped in the retriever ``settings.retrieval`` names).
        settings: :class:`ScoringSettings`.
        doc_encoder: the document encoder that ``train_doc_encoder`` trains and ``rerank_candidates``
            re-embeds with; None: loaded from the knowledge base's manifest when the settings need one.

    Raises:
        ConfigError: the retriever does not fit ``settings.retrieval``, or the document encoder's
            dimension differs from the query encoder's.
        KnowledgeBaseError: dimension mismatch, or BM25 asked of a knowledge base without a BM25 index.
    """

    def __init__(self, question_encoder: "TextEncoder", retriever: Union[Retriever, "KnowledgeBase"], settings: ScoringSettings,
                 doc_encoder: Optional["TextEncoder"] = None):
        self.question_encoder = question_encoder
        self.settings = settings
        if isinstance(retriever, KnowledgeBase):
            retriever = retriever_for_kind(settings.retrieval, retriever, question_encoder, settings=settings)
        if settings.retrieval == "hybrid":
            if not isinstance(retriever, HybridRetriever):
                raise ConfigError(f"config.retrieval='hybrid' needs a HybridRetriever or a KnowledgeBase, got "
                                  f"{type(retriever).__name__}")
            if retriever.query_encoder is not question_encoder:  # fuse with the model's own (trainable) encoder's ranking
                space = retriever.space
                retriever = HybridRetriever.from_knowledge_base(retriever.knowledge_base, question_encoder, **retriever.options,
                                                                allow_encoder_change=retriever.allow_encoder_change)
                retriever.dense.space = space
        elif settings.retrieval == "bm25":
            if not isinstance(retriever, BM25Retriever):
                raise ConfigError(f"config.retrieval='bm25' needs a BM25Retriever (or a KnowledgeBase built with bm25=True), got "
                                  f"{type(retriever).__name__}")
        else:
            if not isinstance(retriever, DenseRetriever):
                raise ConfigError(f"config.retrieval='dense' needs a DenseRetriever or a KnowledgeBase, got "
                                  f"{type(retriever).__name__}")
            check_compatible(retriever.knowledge_base, question_encoder.dim, None)
            if retriever.query_encoder is not question_encoder:
                # Retrieve with the model's own (trainable) encoder, keeping the retriever's embedding space.
                space = retriever.space
                retriever = DenseRetriever(retriever.knowledge_base, question_encoder,
                                           allow_encoder_change=retriever.allow_encoder_change)
                retriever.space = space
        self.retriever: Retriever = retriever
        self.rerank: Optional[Rerank] = None  # --rerank K --reranker DIR: the top K rescored, the best k kept (use_rerank)
        self._other_kinds: dict = {}  # retrievers of other kinds asked for per call, over the knowledge base served now
        self.doc_encoder = self._resolve_doc_encoder(doc_encoder)

    def _resolve_doc_encoder(self, doc_encoder: Optional["TextEncoder"]) -> Optional["TextEncoder"]:
        """The document encoder (or None): given, or loaded from the knowledge base's manifest when the
        settings re-embed passages; frozen and in eval mode unless ``train_doc_encoder``."""
        if doc_encoder is None and self.settings.uses_doc_encoder:
            doc_encoder = load_document_encoder(self.retriever.knowledge_base)
        if doc_encoder is None:
            return None
        if not isinstance(doc_encoder, TextEncoder):
            raise ConfigError(f"doc_encoder must be a rag.knowledge.encoders.TextEncoder, got {type(doc_encoder).__name__}")
        if doc_encoder.dim != self.question_encoder.dim:
            raise ConfigError(
                f"the document encoder {doc_encoder.name_or_path!r} outputs dim={doc_encoder.dim} but the query encoder "
                f"outputs dim={self.question_encoder.dim}; pair encoders of the same dimension"
            )
        if not self.settings.train_doc_encoder:
            doc_encoder.requires_grad_(False)
            doc_encoder.eval()
        return doc_encoder

    @property
    def query_encoder_frozen(self) -> bool:
        """True when the query encoder receives no gradients (RAG-Frozen or RAG-BM25)."""
        return self.settings.freeze_query_encoder or self.settings.retrieval == "bm25"

    @property
    def knowledge_base(self) -> Optional["KnowledgeBase"]:
        """The knowledge base the retriever currently reads (None for a BM25 retriever over bare passages)."""
        return getattr(self.retriever, "knowledge_base", None)

    def tokenize_questions(self, questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Query-encoder inputs ``(B, Lq)`` on the encoder's device (tokenize once; reuse for the hf question round trip)."""
        tok = self.question_encoder.tokenizer
        batch = tok(list(questions), padding=True, truncation=True, max_length=self.settings.max_question_length,
                    return_tensors="pt")
        device = self.question_encoder.device
        return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def retriever_of_kind(self, kind: Optional[str]) -> Retriever:
        """The retriever of `kind` (``dense`` | ``bm25`` | ``hybrid``; None: the configured one) over the knowledge base
        served now: the model's own, or one built for it on first use (rebuilt after a knowledge-base swap)."""
        if kind is None or kind == self.settings.retrieval:
            return self.retriever
        if kind not in RETRIEVAL_KINDS:
            raise ConfigError(f"retrieval={kind!r} (--retrieval); choose one of {RETRIEVAL_KINDS}")
        kb = self.knowledge_base
        found = self._other_kinds.get(kind)
        if found is None or found.knowledge_base is not kb:
            if kb is None:
                raise ConfigError(f"retrieval={kind!r}: this model's retriever has no knowledge base to build it over")
            found = retriever_for_kind(kind, kb, self.question_encoder, settings=self.settings,
                                       allow_encoder_change=bool(getattr(self.retriever, "allow_encoder_change", False)))
            self._other_kinds[kind] = found
        return found

    def use_rerank(self, rerank: Optional[Rerank]) -> None:
        """Rerank every later :meth:`score` with `rerank` (None: stop)."""
        self.rerank = rerank

    def score(self, questions: list[str], k: int, *, question_inputs: Optional[dict] = None,
              device: Optional[torch.device] = None, retrieval: Optional[str] = None) -> tuple[Retrieved, torch.Tensor]:
        """:meth:`scored`, or with :attr:`rerank` the best `k` of its top K by the cross-encoder, whose scores are then
        the ``(B, k)`` retrieval logits (no gradient into the retriever)."""
        if self.rerank is None:
            return self.scored(questions, k, question_inputs=question_inputs, device=device, retrieval=retrieval)
        kb = self.knowledge_base
        n = self.rerank.candidates_for(k, len(kb) if kb is not None else None)
        retrieved, doc_scores = self.scored(questions, n, question_inputs=question_inputs, device=device, retrieval=retrieval)
        kept = self.rerank.rerank(questions, retrieved, k)
        return kept, kept.scores.to(device=doc_scores.device, dtype=torch.float32)

    def scored(self, questions: list[str], k: int, *, question_inputs: Optional[dict] = None,
               device: Optional[torch.device] = None, retrieval: Optional[str] = None) -> tuple[Retrieved, torch.Tensor]:
        """The top-`k` passages of B `questions` and their ``(B, K)`` retrieval logits.

        Dense: ``doc_scores = q · doc_embeds`` (gradients into the query encoder when grad mode is on and
        it is not frozen; into the document encoder under ``train_doc_encoder``). Hybrid: the fused dense and BM25
        candidates, scored the same way (score fusion adds its BM25 part, without gradient). BM25: the BM25 scores as float32 on
        `device` (default CPU), no gradient. `question_inputs`: :meth:`tokenize_questions`'s output when the caller already has
        it. `retrieval`: another kind than the configured one for this call (None: the configured one).
        """
        kind = self.settings.retrieval if retrieval is None else retrieval
        retriever = self.retriever_of_kind(retrieval)
        if kind == "bm25":
            retrieved = retriever.retrieve(questions, k)
            return retrieved, retrieved.scores.to(device=device or "cpu", dtype=torch.float32)
        if question_inputs is None:
            question_inputs = self.tokenize_questions(questions)
        grad = torch.is_grad_enabled() and not self.query_encoder_frozen
        with torch.set_grad_enabled(grad):
            q = self.question_encoder(**question_inputs)  # (B, D)
        if retriever is not self.retriever:  # another kind for this call
            retrieved = retriever.search(questions, q.detach(), k) if kind == "hybrid" else retriever.search(q.detach(), k)
            doc_embeds = retrieved.doc_embeds.to(device=q.device, dtype=q.dtype)
        elif self.doc_encoder is not None and self.settings.uses_doc_encoder:
            n_search = k
            if self.settings.rerank_candidates is not None:  # dense only (the config refuses it for bm25 / hybrid)
                n_search = max(k, min(self.settings.rerank_candidates, len(self.retriever.knowledge_base)))
            retrieved = self.retriever.search(q.detach(), n_search)  # index search: no gradient
            retrieved, doc_embeds = self.fresh_doc_embeds(q, retrieved, k)  # (B, K, D) current doc encoder
        elif self.settings.retrieval == "hybrid":  # fused dense + BM25 candidates, scored by q · stored d
            retrieved = self.retriever.search(questions, q.detach(), k)
            doc_embeds = retrieved.doc_embeds.to(device=q.device, dtype=q.dtype)  # (B, K, D), frozen
        else:
            retrieved = self.retriever.search(q.detach(), k)  # index search: no gradient
            if retrieved.doc_embeds is None:
                raise KnowledgeBaseError("the dense retriever returned no doc_embeds; cannot compute differentiable doc scores")
            doc_embeds = retrieved.doc_embeds.to(device=q.device, dtype=q.dtype)  # (B, K, D), frozen
        # The only path by which gradients reach the query encoder (§2.2, p_η(z|x) ∝ exp(d(z)ᵀ q(x))).
        doc_scores = torch.bmm(q.unsqueeze(1), doc_embeds.transpose(1, 2)).squeeze(1)  # (B, K)
        if retrieved.prior_bias is not None:  # hybrid score fusion: + β · normalised BM25, no gradient
            doc_scores = doc_scores + retrieved.prior_bias.to(device=doc_scores.device, dtype=doc_scores.dtype)
        return retrieved, doc_scores

    def fresh_doc_embeds(self, q: torch.Tensor, retrieved: Retrieved, k: int) -> tuple[Retrieved, torch.Tensor]:
        """Re-embed the ``(B, L)`` retrieved passages with the current document encoder -> ``(B, L, D)``
        (with gradients under ``train_doc_encoder``), and keep the k best by ``q · d_fresh`` when L > k.

        Passages are encoded as DPR title/text pairs, exactly as :meth:`TextEncoder.encode_passages` built
        the index. Re-ranking scores all L candidates without gradients (eval mode, batched), then only the
        k kept passages are re-encoded with gradients, so memory grows with k, not L. Returns the Retrieved
        for the kept passages — its ``doc_embeds`` are the fresh vectors (detached), its ``scores`` the
        fresh scores when re-ranked (else the index's) — and the fresh ``(B, K, D)`` embeddings that
        doc_scores are computed from.
        """
        b, n = retrieved.rows.shape
        rows, scores, passages = retrieved.rows, retrieved.scores, retrieved.passages
        grad = torch.is_grad_enabled() and self.settings.train_doc_encoder
        d = None
        if n > k:  # stale-index re-ranking: the k best of L by fresh score
            cand = torch.from_numpy(self.doc_encoder.encode_passages([p for ps in passages for p in ps], show_progress=False))
            cand = cand.view(b, n, -1).to(device=q.device, dtype=q.dtype)  # (B, L, D), no gradient
            with torch.no_grad():
                fresh = torch.bmm(q.detach().unsqueeze(1), cand.transpose(1, 2)).squeeze(1)  # (B, L)
                top_scores, top = fresh.topk(k, dim=1)  # (B, K), best first
            top_cpu = top.cpu()
            rows = rows.gather(1, top_cpu)
            scores = top_scores.to("cpu", torch.float32)
            passages = [[passages[i][j] for j in top_cpu[i].tolist()] for i in range(b)]
            if not grad:
                d = cand.gather(1, top.unsqueeze(-1).expand(-1, -1, cand.shape[-1]))  # (B, K, D)
        if d is None:
            flat = [p for ps in passages for p in ps]
            with torch.set_grad_enabled(grad):
                batch = self.doc_encoder.tokenize([p.title for p in flat], [p.text for p in flat])
                d = self.doc_encoder(**batch).view(b, k, -1).to(device=q.device, dtype=q.dtype)  # (B, K, D)
        kept = Retrieved(rows=rows, scores=scores, passages=passages, doc_embeds=d.detach().to("cpu", torch.float32),
                         kb_version=retrieved.kb_version)
        return kept, d
