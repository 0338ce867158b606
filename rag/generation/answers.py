"""What the Python API returns: answers with provenance (``Answer``, ``PassageProvenance``, ``SegmentProvenance``) and
retrievals (``Retrieval``).

Every answer names the knowledge-base version that answered and the passages it read, with their prior
p(z|x) and posterior p(z|x,y) (RAG) or the generated-token span each passage was in context for (In-Context
RALM ``segments``); the readers of :mod:`rag.pipeline.readers` build them, :mod:`rag.pipeline.api` returns them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from rag.utils.errors import RagError
from rag.utils.validate import check_positive_int


@dataclass
class SegmentProvenance:
    """The document in context while generated tokens ``[start, end)`` were produced (In-Context RALM provenance)."""

    start: int
    """First generated token of the segment (0-based, counting the answer's generated tokens)."""
    end: int
    """One past its last generated token."""
    passage_id: str
    title: str
    score: float
    """Retrieval score of the passage for `query` (BM25 score or q · d)."""
    kb_version: str
    """Version of the knowledge base the passage came from."""
    query: str
    """The retrieval query: the last ``ℓ`` tokens of prompt + generated text before the segment."""


@dataclass
class PassageProvenance:
    """One retrieved passage and how much the answer relied on it."""

    id: str
    title: str
    text: str
    score: float
    """Retrieval score (q · d for dense retrieval, BM25 score for sparse)."""
    prior: float
    """p(z|x): softmax of the scores over the K retrieved passages."""
    posterior: Optional[float] = None
    """p(z|x,y) for the generated answer y (None when only retrieving)."""


@dataclass
class Answer:
    """A generated answer with its provenance."""

    question: str
    text: str
    score: float
    """log p(y|x) under the model's marginalization (and decoding approximation)."""
    kb_version: str
    """Version id of the knowledge base every passage below came from; ``"<id>+unverified"`` when that
    knowledge base was opened without checking every file's SHA-256 (``verify="size"``/``"none"``)."""
    passages: list[PassageProvenance]
    tokens: Optional[list[str]] = None
    """The answer's tokens (generator vocabulary), aligned with `token_doc_posterior`."""
    token_doc_posterior: Optional[list[list[float]]] = None
    """(T, K) p(z | x, y_<t, y_t) ∝ p(z|x) p(y_t|x,z,y_<t) per generated token (RAG-Token only)."""
    token_ids: Optional[list[int]] = None
    """The generated ids as transformers' ``generate`` returns them: the decoder start token first, through the
    first EOS (padding dropped), for token-for-token comparisons."""
    segments: Optional[list[SegmentProvenance]] = None
    """In-Context RALM only: per stride segment, the generated-token span ``[start, end)`` (indices into `tokens`) and
    the passage in context for it (id, title, retrieval score, query, knowledge-base version). `passages` then lists
    each passage read once (prior 1: one document per segment; no posterior)."""
    nli_entailment: Optional[list[dict[str, float]]] = None
    """RetRobust back-off only (``generate(..., nli=...)``): per checked step (one for a single-hop answer, one per
    intermediate question-answer pair for a multi-step one), the NLI model's class probabilities (``entailment``,
    ``neutral``, ``contradiction``) for premise = the retrieved evidence, hypothesis = the question + retrieval answer."""
    answered_with: Optional[str] = None
    """RetRobust back-off only: ``"retrieval"`` (every step entailed at the threshold: the retrieval answer, with its
    passages) or ``"no_retrieval"`` (the reader's answer without retrieval: no passages)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Retrieval:
    """The top-k passages retrieved for one question, and the knowledge base they came from."""

    question: str
    kb_version: str
    """Version id of the knowledge base every passage below came from (``+unverified`` as in :class:`Answer`)."""
    passages: list[PassageProvenance]
    """Best first; `posterior` is None (nothing was generated)."""

    def to_dict(self) -> dict:
        return asdict(self)


def check_k(k, name: str, kb) -> int:
    """`k` (option `name`) as a positive integer no larger than the knowledge base `kb`."""
    check_positive_int(k, name)
    n = len(kb)
    if k > n:
        raise RagError(f"{name}={k} exceeds the {n} passages of knowledge base {kb.path}; use {name} <= {n}")
    return k


def retrievals(questions: Sequence[str], kb_version: str, passages, scores: torch.Tensor, *,
               temperature: float = 1.0) -> list[Retrieval]:
    """One :class:`Retrieval` per question: its passages with their scores ``(B, K)`` and priors
    (softmax over K of ``scores / temperature``, the reader's retrieval temperature)."""
    prior = torch.softmax(scores.float() / temperature, dim=1)
    return [
        Retrieval(q, kb_version,
                  [PassageProvenance(p.id, p.title, p.text, float(s), float(pr)) for p, s, pr in zip(ps, srow, prow)])
        for q, ps, srow, prow in zip(questions, passages, scores.tolist(), prior.tolist())
    ]


def through_eos(ids: list[int], eos: Optional[int]) -> list[int]:
    """`ids` (decoder start first) up to and including the first EOS after the start token."""
    if eos is not None and eos in ids[1:]:
        return ids[:ids.index(eos, 1) + 1]
    return ids
