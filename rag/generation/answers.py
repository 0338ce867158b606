"""What the Python API returns: answers with provenance (``Answer``, ``PassageProvenance``, ``SegmentProvenance``,
``Citation``) and retrievals (``Retrieval``).

Every answer names the knowledge-base version that answered and the passages it read, with their prior
p(z|x) and posterior p(z|x,y) (RAG) or the generated-token span each passage was in context for (In-Context
RALM ``segments``); the readers of :mod:`rag.pipeline.readers` build them, :mod:`rag.pipeline.api` returns them.

Citations (:func:`cite`, ``Answer.citations``, ``Answer.cited_text``) are drawn from those probabilities. For one
distribution w over the K passages read, the *covering set* is the passages taken by descending w until their sum
reaches ``mass`` (default :data:`CITE_MASS` = 0.9), leaving out any below ``min_weight`` (:data:`CITE_MIN_WEIGHT` =
0.1) except the first, so an answer read from passages always cites at least its top one. The distribution is:

* RAG-Token with per-token posteriors: each generated token's p(z | x, y_<t, y_t); a passage is cited when it is in
  the covering set of some token, and the citations are numbered by the first token that cites them (ties: the
  higher sequence posterior first), i.e. in the order the reader used them;
* RAG-Sequence (and RAG-Token without token posteriors): the answer's posterior p(z|x,y), numbered by rank;
* In-Context RALM: the passage in context for each stride segment, numbered by the first segment it was read for;
* REPLUG (no posterior): the ensemble weights p(z|x) in its place, numbered by rank.

Each passage is cited once. ``cited_text`` is the answer followed by its markers in number order: ``"Au [1][2]"``.
"""

from __future__ import annotations

import math
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


CITE_MASS = 0.9
"""Probability mass the cited passages of one distribution cover (see the module docstring)."""
CITE_MIN_WEIGHT = 0.1
"""A passage below this probability is not cited for that distribution, unless it is the top one."""
_SUM_SLACK = 1e-9  # rounding of a sum of K <= 10^4 float64 probabilities stays far below it (0.6 + 0.3 < 0.9 in floats)


@dataclass
class Citation:
    """One passage an answer cites: ``[number]`` in ``Answer.cited_text``."""

    number: int
    """1-based, in the order the reader used the passages (see the module docstring)."""
    passage: int
    """Index of the passage in ``Answer.passages``."""
    id: str
    title: str
    weight: float
    """The probability the passage was cited by: its posterior p(z|x,y) (RAG), its prior (REPLUG: no posterior), or 1
    (In-Context RALM: in context)."""
    first_token: Optional[int] = None
    """RAG-Token and In-Context RALM: the first generated token (index into ``Answer.tokens``) it is cited for."""


def covering(weights: Sequence[float], mass: float = CITE_MASS, min_weight: float = CITE_MIN_WEIGHT) -> list[int]:
    """Indices of the covering set of `weights` (K probabilities), highest first: taken by descending weight until
    they sum to at least `mass`, those below `min_weight` left out except the first. NaN weights are never cited."""
    order = sorted((i for i, w in enumerate(weights) if w is not None and not math.isnan(w)), key=lambda i: -weights[i])
    out: list[int] = []
    total = 0.0
    for i in order:
        if total >= mass - _SUM_SLACK:
            break
        if out and weights[i] < min_weight:
            break  # sorted: every later one is smaller still
        out.append(i)
        total += weights[i]
    return out


def cite(answer: "Answer", *, mass: float = CITE_MASS, min_weight: float = CITE_MIN_WEIGHT) -> list[Citation]:
    """`answer`'s citations, numbered from 1 in the order the reader used the passages (rules: the module docstring)."""
    if not 0.0 < mass <= 1.0 or not 0.0 <= min_weight <= 1.0:
        raise RagError(f"citations need 0 < mass <= 1 and 0 <= min_weight <= 1, got mass={mass}, min_weight={min_weight}")
    passages = answer.passages
    if not passages:
        return []
    first: dict[int, int] = {}  # passage index -> first token citing it
    if answer.segments:
        where = {(p.id, p.title): i for i, p in enumerate(passages)}
        for s in sorted(answer.segments, key=lambda s: s.start):
            i = where.get((s.passage_id, s.title))
            if i is not None:
                first.setdefault(i, s.start)
        order = sorted(first, key=lambda i: first[i])
        return [Citation(n, i, passages[i].id, passages[i].title, 1.0, first[i]) for n, i in enumerate(order, 1)]
    seq = [p.posterior if p.posterior is not None else p.prior for p in passages]
    grid = answer.token_doc_posterior
    if grid and all(len(row) == len(passages) for row in grid):
        for t, row in enumerate(grid):
            for i in covering(row, mass, min_weight):
                first.setdefault(i, t)
        order = sorted(first, key=lambda i: (first[i], -_finite(seq[i])))
        return [Citation(n, i, passages[i].id, passages[i].title, float(seq[i]), first[i]) for n, i in enumerate(order, 1)]
    return [Citation(n, i, passages[i].id, passages[i].title, float(seq[i]))
            for n, i in enumerate(covering(seq, mass, min_weight), 1)]


def _finite(w) -> float:
    return -1.0 if w is None or math.isnan(w) else float(w)


def cited_text(text: str, citations: Sequence[Citation]) -> str:
    """`text` followed by one ``[n]`` marker per citation, in number order (`text` alone when there is none)."""
    if not citations:
        return text
    return f"{text.rstrip()} " + "".join(f"[{c.number}]" for c in sorted(citations, key=lambda c: c.number))


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

    @property
    def citations(self) -> list[Citation]:
        """The passages the answer cites, numbered in the order the reader used them (:func:`cite`, default rule)."""
        return cite(self)

    @property
    def cited_text(self) -> str:
        """The answer with ``[n]`` markers for its citations (:func:`cited_text`)."""
        return cited_text(self.text, self.citations)

    def to_dict(self) -> dict:
        """Every field, plus ``citations`` (list of :class:`Citation` dicts) and ``cited_text``."""
        cites = self.citations
        return {**asdict(self), "citations": [asdict(c) for c in cites], "cited_text": cited_text(self.text, cites)}


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
