"""Gold passages of training pairs: the knowledge-base passage that holds each answer, for a direct reading loss
(``RagModule(gold_passage=...)``): the generator is also trained on the question with that passage alone, so it learns
to read the right passage from the first step instead of only through the retrieval marginal.

Found two ways: the data names the passage (``data.passage_field``: every named id must be in the knowledge base), or
the answer occurs (after SQuAD normalisation, as a whole-word substring) in exactly one passage of the knowledge base.
"""

from __future__ import annotations

import logging
from typing import Literal, Optional, Sequence

from rag.eval.metrics import normalize_answer
from rag.knowledge.passages import Passage
from rag.utils.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["GoldPassageMode", "GoldPassages"]

GoldPassageMode = Literal["off", "auto", "named", "unique_answer"]


class GoldPassages:
    """Lookup of the gold passage of a training pair, by the pair's named passage id or by its answer.

    Args:
        passages: every passage of the knowledge base.
        answers: the training answers to look up by content (``unique_answer``); others are never found by content.
        mode: ``named`` (ids only), ``unique_answer`` (content only) or ``auto`` (ids when a batch has them, else content).
        min_answer_chars: shorter normalised answers ("1", "no") are never looked up by content: they occur everywhere.
    """

    def __init__(self, passages: Sequence[Passage], answers: Sequence[str], mode: GoldPassageMode = "auto",
                 min_answer_chars: int = 4) -> None:
        if mode not in ("auto", "named", "unique_answer"):
            raise ConfigError(f"model.gold_passage={mode!r}: choose off, auto, named or unique_answer")
        self.mode = mode
        self.by_id = {p.id: p for p in passages}
        self.by_answer: dict[str, Passage] = {}
        if mode == "named":
            return
        texts = [f" {normalize_answer(p.title + ' ' + p.text)} " for p in passages]
        wanted = {normalize_answer(a) for a in answers}
        for key in sorted(k for k in wanted if len(k) >= min_answer_chars):
            needle = f" {key} "
            hits = [i for i, t in enumerate(texts) if needle in t]
            if len(hits) == 1:
                self.by_answer[key] = passages[hits[0]]
        logger.info("gold passages: %d of %d distinct training answers occur in exactly one passage", len(self.by_answer),
                    len(wanted))

    def check_ids(self, ids: Sequence[Optional[str]], where: str = "data.passage_field") -> None:
        """ConfigError naming the first id that is not a passage of the knowledge base."""
        for pid in ids:
            if pid is not None and pid not in self.by_id:
                raise ConfigError(f"{where}: passage id {pid!r} is not in the knowledge base ({len(self.by_id)} passages); "
                                  "name passages by the ids `rag index search` prints, or unset data.passage_field")

    def lookup(self, answers: Sequence[str], ids: Optional[Sequence[Optional[str]]] = None) -> list[Optional[Passage]]:
        """The gold passage of each pair (None where there is none)."""
        if ids is not None and self.mode in ("auto", "named"):
            self.check_ids(ids)
            return [self.by_id.get(pid) if pid is not None else None for pid in ids]
        if self.mode == "named":
            return [None] * len(answers)
        return [self.by_answer.get(normalize_answer(a)) for a in answers]
