"""Open-domain QA metrics as `torchmetrics.Metric` subclasses: exact match, token F1, retrieval recall@k; and, for
generation tasks (the paper's MS-MARCO answers and Jeopardy question generation), BLEU-1 and ROUGE-L straight from
torchmetrics (:class:`Bleu1`, :class:`RougeL`, :data:`GENERATION_METRICS`).

Answer normalisation follows the official SQuAD v1.1 evaluation script, which is
also what RAG (Lewis et al. 2020, §3.1 "Exact Match") and DPR report on NQ-open:
lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse
whitespace. torchmetrics' `SQuAD` metric uses the very same normalisation (a test
checks the two agree); it is not used directly because it takes SQuAD-format
dicts, returns one batch-averaged number, and scores F1 with the SQuAD *v2.0* rule
that two answers normalising to nothing match (F1 = 1), whereas v1.1 — the rule the
RAG/DPR numbers use — scores them 0. `token_f1` implements the v1.1 rule.

Every metric keeps `sum`/`count` states reduced with ``"sum"``, so it is correct
under DDP and accumulates across batches until :meth:`compute`.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Sequence, Union

import torch
from torchmetrics import Metric
from torchmetrics.text import BLEUScore, ROUGEScore

from rag.utils.errors import RagError
from rag.utils.validate import check_positive_int

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

PassageLike = Union[str, object]  # a str, or anything with `.title` and `.text` (rag Passage)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalisation: lower case, strip punctuation, articles, extra whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    """1.0 if `prediction` equals any gold answer after :func:`normalize_answer`, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _check_gold(gold)))


def token_f1(prediction: str, gold: Sequence[str]) -> float:
    """Best bag-of-tokens F1 between `prediction` and any gold answer (SQuAD v1.1 rule:
    no shared token, including both sides empty, scores 0)."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for g in _check_gold(gold):
        gold_tokens = normalize_answer(g).split()
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def gold_in_answer(prediction: str, gold: Sequence[str]) -> float:
    """1.0 if any gold answer, after :func:`normalize_answer`, is a whole-token span of the normalised `prediction`
    (the "answer contains the gold string" accuracy of free-form QA, e.g. ALCE's ``str_em`` on whole tokens: "1774" is
    found in "by Priestley in 1774", "17" is not), else 0.0. An empty gold answer matches nothing."""
    hay = f" {normalize_answer(prediction)} "
    return float(any(needle and f" {needle} " in hay for needle in (normalize_answer(g) for g in _check_gold(gold))))


def _normalize_for_search(text: str) -> str:
    """Lower case, NFD unicode, punctuation as token boundaries: the form in which
    :func:`has_answer` looks for an answer inside a passage."""
    text = unicodedata.normalize("NFD", text).lower()
    text = "".join(" " if ch in _PUNCT else ch for ch in text)
    return " ".join(text.split())


def has_answer(passage: PassageLike, answers: Sequence[str]) -> bool:
    """True if any answer occurs in the passage (title and text) as a whole-token span,
    ignoring case and punctuation — the "answer string in a retrieved passage" test
    used for retrieval recall in DPR/RAG."""
    text = passage if isinstance(passage, str) else f"{getattr(passage, 'title', '')} {getattr(passage, 'text', '')}"
    hay = f" {_normalize_for_search(text)} "
    for a in _check_gold(answers):
        needle = _normalize_for_search(a)
        if needle and f" {needle} " in hay:
            return True
    return False


def _check_gold(gold: Sequence[str]) -> Sequence[str]:
    if isinstance(gold, str):
        raise RagError("gold answers must be a list of strings per example, got a single string; wrap it in a list")
    return gold


def _check_batch(preds: Sequence, golds: Sequence, what: str) -> None:
    if isinstance(preds, str):
        raise RagError(f"{what}: predictions must be a list of strings (one per example), got a single string")
    if len(preds) != len(golds):
        raise RagError(f"{what}: {len(preds)} predictions but {len(golds)} gold answer lists; give one list per prediction")


class _MeanMetric(Metric):
    """Mean of a per-example score over everything seen since the last reset."""

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _score(self, prediction: str, gold: Sequence[str]) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, preds: Sequence[str], golds: Sequence[Sequence[str]]) -> None:
        """`preds`: B predicted strings; `golds`: B lists of acceptable answers."""
        _check_batch(preds, golds, type(self).__name__)
        self.total += sum(self._score(p, g) for p, g in zip(preds, golds))
        self.count += len(preds)

    def compute(self) -> torch.Tensor:
        """Mean score in [0, 1] (0 when nothing was seen)."""
        return (self.total / self.count.clamp(min=1)).float()


class ExactMatch(_MeanMetric):
    """Exact match (SQuAD-normalised) against any of several gold answers, averaged."""

    def _score(self, prediction: str, gold: Sequence[str]) -> float:
        return exact_match(prediction, gold)


class TokenF1(_MeanMetric):
    """Token-level F1 (SQuAD v1.1) against the best-matching gold answer, averaged."""

    def _score(self, prediction: str, gold: Sequence[str]) -> float:
        return token_f1(prediction, gold)


class RetrievalRecall(Metric):
    """Retrieval recall@k: the fraction of questions with an answer string in one of
    their top-k retrieved passages (see :func:`has_answer`), for several k at once.

    `compute()` returns ``{"recall@k": value}`` for each k in `ks`.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, ks: Sequence[int] = (1, 5), **kwargs) -> None:
        super().__init__(**kwargs)
        ks = tuple(ks)
        if not ks:
            raise RagError("recall ks must be positive integers, got none")
        for k in ks:
            check_positive_int(k, f"recall k (of {list(ks)})")
        self.ks = tuple(sorted(set(ks)))
        self.add_state("hits", default=torch.zeros(len(self.ks), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, passages: Sequence[Sequence[PassageLike]], golds: Sequence[Sequence[str]]) -> None:
        """`passages`: B ranked lists of retrieved passages (best first); `golds`: B answer lists.

        A list shorter than k counts what it has (a miss if the answer is not there).
        """
        _check_batch(passages, golds, "RetrievalRecall")
        hits = torch.zeros(len(self.ks), dtype=torch.long)
        for ranked, gold in zip(passages, golds):
            first = next((i for i, p in enumerate(ranked) if has_answer(p, gold)), None)
            if first is not None:
                hits += torch.tensor([int(first < k) for k in self.ks], dtype=torch.long)
        self.hits += hits.to(self.hits.device)
        self.count += len(passages)

    def compute(self) -> dict[str, torch.Tensor]:
        recall = self.hits.double() / self.count.clamp(min=1)
        return {f"recall@{k}": recall[i].float() for i, k in enumerate(self.ks)}


class Bleu1(BLEUScore):
    """Corpus BLEU-1 (unigram precision with brevity penalty) of the predictions against their gold answers: torchmetrics'
    ``BLEUScore(n_gram=1)``, whitespace tokens, several references per prediction (Lewis et al. 2020 report Q-BLEU-1 and
    BLEU-1 for Jeopardy question generation)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(n_gram=1, **kwargs)

    def update(self, preds: Sequence[str], golds: Sequence[Sequence[str]]) -> None:
        _check_batch(preds, golds, "Bleu1")
        super().update(list(preds), [list(_check_gold(g)) for g in golds])


class RougeL(ROUGEScore):
    """ROUGE-L F-measure against the best-matching gold answer, averaged: torchmetrics' ``ROUGEScore(rouge_keys="rougeL",
    accumulate="best")`` (Lewis et al. 2020 report ROUGE-L for MS-MARCO)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(rouge_keys="rougeL", accumulate="best", **kwargs)

    def update(self, preds: Sequence[str], golds: Sequence[Sequence[str]]) -> None:
        _check_batch(preds, golds, "RougeL")
        super().update(list(preds), [list(_check_gold(g)) for g in golds])

    def compute(self) -> torch.Tensor:
        return super().compute()["rougeL_fmeasure"]


GENERATION_METRICS = {"bleu1": Bleu1, "rougeL": RougeL}
"""Metrics a training module can add to EM and F1 by name (``model.evaluation.generation_metrics: [bleu1, rougeL]``)."""
