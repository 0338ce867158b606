"""Retrieval ranking metrics as trec_eval defines them, and KILT's provenance R-precision.

Per query: a run ``{doc_id: score}`` and graded relevance judgements (qrels) ``{doc_id: grade}``; a document is
relevant when its grade is >= 1 (trec_eval's default relevance level), unjudged documents are not relevant.

* The run is ranked as trec_eval ranks it (:func:`trec_order`): score descending, ties broken by document id in
  *descending* string order (``comp_sim_docno`` in trec_eval's ``form_res_rels.c``: ``strcmp(docno2, docno1)``); the
  order the run was produced in does not matter.
* ``recall@k`` = relevant in the top k / relevant judged (trec_eval ``recall_k``); ``precision@k`` = relevant in the
  top k / k, also when fewer than k are retrieved (``P_k``); ``mrr@k`` = 1 / rank of the first relevant within the top
  k (``recip_rank`` of the run cut at k); ``ndcg@k`` with linear gain = grade and discount log2(rank + 1), over the
  ideal ordering of the qrels (``ndcg_cut_k``); ``map`` = average precision over the whole run (``map``).
  A query with no relevant document scores 0 on all of them.

KILT (Petroni et al. 2021, ``kilt/eval_retrieval.py``): a question's gold provenance is one list of page ids per gold
output; R-precision of a guess (the pages read, best first, duplicates dropped) is the best over gold outputs of
|guess[:R] ∩ gold| / R with R = len(gold); KILT-EM / KILT-F1 count an answer's EM / F1 only where R-precision is 1.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Mapping, Sequence

from rag.utils.errors import ConfigError

__all__ = ["trec_order", "query_metrics", "ranking_metrics", "metric_names", "ordered_metrics", "r_precision", "parse_ks"]


def trec_order(run: Mapping[str, float]) -> list[str]:
    """Document ids of `run` in trec_eval's order: score descending, then document id descending."""
    return [d for d, _ in sorted(run.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]


def parse_ks(text: str | Iterable[int], option: str = "--k") -> tuple[int, ...]:
    """Cut-offs as sorted distinct positive integers, from ``"1,5,10"`` or a sequence (a bad one is a ConfigError)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    ks = set()
    for item in items:
        try:
            k = int(str(item).strip())
        except ValueError:
            raise ConfigError(f"{option} {text!r}: {item!r} is not an integer; give comma-separated cut-offs "
                              f"such as 1,5,10,20") from None
        if k < 1:
            raise ConfigError(f"{option} {text!r}: cut-offs must be positive integers, got {k}")
        ks.add(k)
    if not ks:
        raise ConfigError(f"{option}: give at least one cut-off, e.g. 1,5,10,20")
    return tuple(sorted(ks))


def metric_names(ks: Sequence[int]) -> list[str]:
    """The names :func:`query_metrics` returns, in report order."""
    names = [f"{m}@{k}" for m in ("recall", "precision", "mrr", "ndcg") for k in ks]
    return names + ["map"]


FAMILIES = ("answer_recall", "recall", "precision", "mrr", "ndcg")


def ordered_metrics(names: Sequence[str]) -> list[str]:
    """Metric names in report order: answer metrics, then each retrieval family by cut-off, then MAP."""
    head = [n for n in ("em", "f1", "kilt_em", "kilt_f1", "rprec") if n in names]

    def key(n: str):
        m = re.fullmatch(r"(.+)@(\d+)", n)
        family = m.group(1) if m else n
        return (FAMILIES.index(family) if family in FAMILIES else len(FAMILIES), family, int(m.group(2)) if m else 0)

    return head + sorted((n for n in names if n not in head), key=key)


def query_metrics(ranked: Sequence[str], qrels: Mapping[str, int], ks: Sequence[int]) -> dict[str, float]:
    """Every metric of one query: `ranked` document ids best first (already in the order to score: see
    :func:`trec_order`), `qrels` ``{doc_id: grade}``, `ks` the cut-offs."""
    rels = [max(0, int(qrels.get(d, 0))) for d in ranked]
    n_rel = sum(1 for g in qrels.values() if g >= 1)
    ideal = sorted((g for g in qrels.values() if g >= 1), reverse=True)
    out: dict[str, float] = {}
    first = next((i for i, g in enumerate(rels) if g >= 1), None)
    for k in ks:
        hits = sum(1 for g in rels[:k] if g >= 1)
        out[f"recall@{k}"] = hits / n_rel if n_rel else 0.0
        out[f"precision@{k}"] = hits / k
        out[f"mrr@{k}"] = 1.0 / (first + 1) if first is not None and first < k else 0.0
        dcg = sum(g / math.log2(i + 2) for i, g in enumerate(rels[:k]) if g > 0)
        idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal[:k]))
        out[f"ndcg@{k}"] = dcg / idcg if idcg > 0 else 0.0
    seen, ap = 0, 0.0
    for i, g in enumerate(rels):
        if g >= 1:
            seen += 1
            ap += seen / (i + 1)
    out["map"] = ap / n_rel if n_rel else 0.0
    return {name: out[name] for name in metric_names(ks)}


def ranking_metrics(runs: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]],
                    ks: Sequence[int]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per-query metrics and their means over the queries of `runs` that have qrels (as pytrec_eval evaluates):
    ``({query_id: {metric: value}}, {metric: mean})``."""
    per = {q: query_metrics(trec_order(run), qrels[q], ks) for q, run in runs.items() if q in qrels}
    names = metric_names(ks)
    mean = {m: (sum(v[m] for v in per.values()) / len(per) if per else 0.0) for m in names}
    return per, mean


def r_precision(guess: Sequence[str], gold_sets: Sequence[Sequence[str]]) -> float:
    """KILT R-precision: `guess` the pages read best first, `gold_sets` one list of page ids per gold output
    (an output without provenance is an empty list and scores 0). 0 when there are no gold outputs."""
    unique = list(dict.fromkeys(str(g).strip() for g in guess))
    best = 0.0
    for gold in gold_sets:
        gold = list(dict.fromkeys(str(g).strip() for g in gold))
        if gold:
            best = max(best, sum(1 for g in unique[:len(gold)] if g in gold) / len(gold))
    return best
