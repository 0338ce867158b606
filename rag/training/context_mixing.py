"""RetRobust training contexts (Yoran et al. 2024, §2.2): each training question is paired with its top-1, a
low-ranked, or a random retrieved passage, so the reader learns to use relevant context and ignore irrelevant context.

:class:`ContextMixing` is the typed option (``data.context_mixing`` of :class:`~rag.training.data.QADataModule`,
readable by LightningCLI). :func:`sample_context_choices` is the pure sampler over retrieved row numbers;
:func:`retrieve_rows` fills those rows from a knowledge base. The chosen passage reaches the batch as
``batch["contexts"]`` (one :class:`~rag.knowledge.passages.Passage` per question) and ``batch["context_kinds"]``
(``"top1" | "low" | "random"``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from rag.demo.kb import resolve_knowledge_base
from rag.knowledge.retriever import DenseRetriever, default_query_encoder
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number

KINDS = ("top1", "low", "random")

__all__ = ["KINDS", "ContextMixing", "ContextChoice", "sample_context_choices", "retrieve_rows", "open_knowledge_base"]


@dataclass
class ContextMixing:
    """How training contexts are drawn (paper: 1/3 each).

    Args:
        knowledge_base: knowledge-base directory to retrieve from, or ``"demo"`` (the bundled Elements KB).
        top_k: K, how many passages are retrieved per question.
        low_rank_start: first (0-based) rank of the "low-ranked" pool; default ``top_k // 2`` (ranks K/2..K-1).
        p_top1: probability of the top-1 passage.
        p_low: probability of a passage drawn uniformly from ranks ``low_rank_start..top_k-1``.
        p_random: probability of a random passage: the top-1 of another question, never one of this question's
            own top-K passages.
        seed: seed of the draws (the same seed gives the same contexts).
        query_encoder: query encoder name (default: the one the knowledge base records).
    """

    knowledge_base: str = "demo"
    top_k: int = 10
    low_rank_start: Optional[int] = None
    p_top1: float = 1 / 3
    p_low: float = 1 / 3
    p_random: float = 1 / 3
    seed: int = 0
    query_encoder: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "data.context_mixing") -> None:
        """Raise :class:`ConfigError` naming the option when K, the low-rank start or the probabilities are invalid."""
        check_number(self.top_k, f"{prefix}.top_k (top-1 plus a low-ranked pool)", integer=True, low=2, error=ConfigError)
        start = self.low_start
        if not 1 <= start < self.top_k:
            raise ConfigError(f"{prefix}.low_rank_start={self.low_rank_start!r}: must be in [1, top_k-1] = [1, {self.top_k - 1}] "
                              f"(0-based rank; default top_k // 2)")
        probs = self.probabilities
        for name, p in zip(("p_top1", "p_low", "p_random"), probs):
            if not isinstance(p, (int, float)) or math.isnan(p) or p < 0:
                raise ConfigError(f"{prefix}.{name}={p!r}: a probability must be a number >= 0")
        if abs(sum(probs) - 1.0) > 1e-6:
            raise ConfigError(f"{prefix}.p_top1 + p_low + p_random = {sum(probs):.6g} ({probs[0]:g} + {probs[1]:g} + "
                              f"{probs[2]:g}); "
                              f"they must sum to 1, e.g. 0.3333 each (the paper's mix)")

    @property
    def low_start(self) -> int:
        return self.top_k // 2 if self.low_rank_start is None else self.low_rank_start

    @property
    def probabilities(self) -> tuple[float, float, float]:
        return (self.p_top1, self.p_low, self.p_random)


@dataclass(frozen=True)
class ContextChoice:
    """The context drawn for one question: its `kind` and the knowledge-base `row` of the passage."""

    kind: str
    row: int


def sample_context_choices(top_rows: Sequence[Sequence[int]], mixing: ContextMixing) -> list[ContextChoice]:
    """One :class:`ContextChoice` per question from its retrieved rows `top_rows` ``(N, K)``, best first.

    A *random* context is the top-1 row of another question that is not among this question's own K rows; when no
    other question qualifies, :class:`RagError` says so (too few distinct questions for random contexts).
    """
    rng = random.Random(mixing.seed)
    rows = [list(r) for r in top_rows]
    for i, r in enumerate(rows):
        if len(r) < mixing.top_k:
            raise RagError(f"question {i} has {len(r)} retrieved passages; context mixing needs top_k={mixing.top_k}")
    tops = [r[0] for r in rows]
    out = []
    for i, r in enumerate(rows):
        kind = rng.choices(KINDS, weights=mixing.probabilities)[0]
        if kind == "top1":
            row = r[0]
        elif kind == "low":
            row = r[rng.randrange(mixing.low_start, mixing.top_k)]
        else:
            own = set(r[: mixing.top_k])
            row = None
            for _ in range(64):  # rejection sampling first: cheap and uniform
                j = rng.randrange(len(rows))
                if j != i and tops[j] not in own:
                    row = tops[j]
                    break
            if row is None:
                candidates = sorted({t for j, t in enumerate(tops) if j != i and t not in own})
                if not candidates:
                    raise RagError(f"no random context for question {i}: every other question's top-1 passage is among its own "
                                   f"top-{mixing.top_k}; use more training questions, a smaller top_k, or p_random=0")
                row = rng.choice(candidates)
        out.append(ContextChoice(kind, int(row)))
    return out


open_knowledge_base = resolve_knowledge_base
"""``"demo"`` -> the bundled demo knowledge base (built on first use); else a knowledge-base directory (the one
resolver, :func:`rag.demo.kb.resolve_knowledge_base`)."""


def retrieve_rows(kb, questions: Sequence[str], k: int, query_encoder: Optional[str] = None) -> list[list[int]]:
    """Top-`k` knowledge-base rows ``(N, k)`` of each question by dense retrieval (the KB's query encoder)."""
    if k > len(kb):
        raise ConfigError(f"data.context_mixing.top_k={k} exceeds the {len(kb)} passages of knowledge base {kb.path}")
    retriever = DenseRetriever(kb, default_query_encoder(kb, query_encoder))
    return retriever.retrieve(list(questions), k).rows.tolist()
