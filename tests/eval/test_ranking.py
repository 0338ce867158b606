"""Ranking metrics equal to trec_eval's (through pytrec_eval, what BEIR reports with), and answer / KILT metrics equal
to the SQuAD v1.1 and KILT evaluation scripts (transcribed in reference_evaluators.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import reference_evaluators as ref

from rag.eval.benchmarks import read_eval_set
from rag.eval.metrics import exact_match, normalize_answer, token_f1
from rag.eval.ranking import parse_ks, query_metrics, r_precision, ranking_metrics, trec_order
from rag.utils.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"
KS = (1, 2, 3, 5, 10)


def _random_world(seed: int, n_queries: int = 40):
    """Runs with many tied scores (scores drawn from few values, as BM25's are), graded qrels 0-3 including judged
    non-relevant documents, queries with no relevant document, and run documents nobody judged."""
    rng = random.Random(seed)
    docs = [f"d{i:02d}" for i in range(30)]
    runs, qrels = {}, {}
    for q in range(n_queries):
        qid = f"q{q}"
        judged = rng.sample(docs, rng.randint(1, 8))
        qrels[qid] = {d: rng.choice([0, 0, 1, 1, 2, 3]) for d in judged}
        retrieved = rng.sample(docs, rng.randint(1, 15))
        runs[qid] = {d: float(rng.choice([0.5, 1.0, 1.5, 2.0, 2.25, 3.0])) for d in retrieved}
    return runs, qrels


@pytest.fixture(scope="module")
def pytrec_eval():
    return pytest.importorskip("pytrec_eval",
                               reason="pytrec_eval not installed (pip install pytrec-eval-terrier): parity skipped")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranking_metrics_equal_pytrec_eval(pytrec_eval, seed):
    runs, qrels = _random_world(seed)
    measures = {"map", "recip_rank", *(f"{m}.{','.join(map(str, KS))}" for m in ("P", "recall", "ndcg_cut"))}
    theirs = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(runs)
    per, mean = ranking_metrics(runs, qrels, KS)
    assert set(per) == set(theirs)
    for q, t in theirs.items():
        ours = per[q]
        for k in KS:
            assert ours[f"precision@{k}"] == pytest.approx(t[f"P_{k}"], abs=1e-12), (q, k)
            assert ours[f"recall@{k}"] == pytest.approx(t[f"recall_{k}"], abs=1e-12), (q, k)
            assert ours[f"ndcg@{k}"] == pytest.approx(t[f"ndcg_cut_{k}"], abs=1e-12), (q, k)
        assert ours["map"] == pytest.approx(t["map"], abs=1e-12), q
        assert ours[f"mrr@{max(KS)}"] == pytest.approx(t["recip_rank"], abs=1e-12) or len(runs[q]) > max(KS), q
    assert mean["ndcg@10"] == pytest.approx(sum(t["ndcg_cut_10"] for t in theirs.values()) / len(theirs), abs=1e-12)


def test_mrr_at_k_equals_recip_rank_of_the_run_cut_at_k(pytrec_eval):
    runs, qrels = _random_world(3)
    for k in (1, 3, 5):
        cut = {q: {d: run[d] for d in trec_order(run)[:k]} for q, run in runs.items()}
        theirs = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
        per, _ = ranking_metrics(runs, qrels, (k,))
        for q in theirs:
            assert per[q][f"mrr@{k}"] == pytest.approx(theirs[q]["recip_rank"], abs=1e-12), (q, k)


def test_ties_break_by_docid_descending_as_trec_eval(pytrec_eval):
    """Two relevant-or-not documents at the same score: trec_eval ranks 'b' above 'a' whatever order the run lists."""
    qrels = {"q": {"a": 1}}
    for run in ({"a": 1.0, "b": 1.0}, {"b": 1.0, "a": 1.0}):
        theirs = pytrec_eval.RelevanceEvaluator(qrels, {"P.1", "recip_rank"}).evaluate({"q": run})["q"]
        assert theirs["P_1"] == 0.0 and theirs["recip_rank"] == 0.5
        assert trec_order(run) == ["b", "a"]
        assert query_metrics(trec_order(run), qrels["q"], (1,))["precision@1"] == 0.0


def test_graded_ndcg_by_hand():
    # ranking b (grade 2), a (grade 1): DCG = 2/log2(2) + 1/log2(3) = IDCG, so 1; reversed: (1 + 2/log2(3)) / IDCG
    assert query_metrics(["b", "a"], {"a": 1, "b": 2}, (2,))["ndcg@2"] == 1.0
    assert query_metrics(["a", "b"], {"a": 1, "b": 2},
                         (2,))["ndcg@2"] == pytest.approx((1 + 2 / 1.5849625007211563) / (2 + 1 / 1.5849625007211563))


def test_parse_ks():
    assert parse_ks("10,1,5,5") == (1, 5, 10)
    for bad in ("0", "a", ""):
        with pytest.raises(ConfigError, match="--k"):
            parse_ks(bad)


ANSWER_VECTORS = [
    ("The Eiffel Tower", ["eiffel tower"]), ("Paris, France.", ["Paris"]), ("an apple a day", ["apple day", "a"]),
    ("", ["the"]), ("the", ["a"]), ("Ar", ["AR", "argon"]), ("1,776", ["1776"]), ("Henry  Cavendish", ["Cavendish"]),
    ("naïve café", ["Naïve Café!"]), ("x y z", ["z y x", "x"]), ("United States of America", ["the United States"]),
]


@pytest.mark.parametrize("pred,golds", ANSWER_VECTORS)
def test_answer_metrics_equal_squad_v11(pred, golds):
    assert normalize_answer(pred) == ref.squad_normalize_answer(pred)
    assert exact_match(pred, golds) == float(ref.squad_metric_max_over_ground_truths(ref.squad_exact_match_score, pred, golds))
    assert token_f1(pred, golds) == ref.squad_metric_max_over_ground_truths(ref.squad_f1_score, pred, golds)


def _kilt_guess(qid, answer, pages):
    return {"id": qid, "output": [{"answer": answer, "provenance": [{"wikipedia_id": p} for p in pages]}]}


GUESSES = [("-1001", "Ar", ["elements/argon", "elements/helium"]), ("-1001", "Argon", ["elements/helium", "elements/argon"]),
           ("-1002", "He", ["elements/hydrogen", "elements/helium"]), ("-1002", "helium", ["elements/helium", "elements/helium"]),
           ("-1002", "Helium", ["elements/oxygen"]), ("-1003", "Joseph Priestley", ["elements/oxygen", "x"]),
           ("-1003", "Priestley", ["x", "elements/oxygen"])]


@pytest.mark.parametrize("qid,answer,pages", GUESSES)
def test_kilt_metrics_equal_the_kilt_scripts(qid, answer, pages):
    golds = {json.loads(line)["id"]: json.loads(line) for line in (FIXTURES / "kilt_nq.jsonl").read_text().splitlines()}
    gold = golds[qid]
    ours = {ex.id: ex for ex in read_eval_set(FIXTURES / "kilt_nq.jsonl")}[qid]
    assert set(ours.answers) == ref.kilt_get_gold_answers(gold)
    guess = _kilt_guess(qid, answer, pages)
    em, f1, kilt_em, kilt_f1 = ref.kilt_downstream(guess, gold)
    rprec = r_precision(pages, ours.evidence)
    assert rprec == ref.kilt_rprecision(guess, gold, ["wikipedia_id"])
    assert exact_match(answer, list(ours.answers)) == em and token_f1(answer, list(ours.answers)) == f1
    assert (exact_match(answer, list(ours.answers)) if rprec == 1 else 0) == kilt_em
    assert (token_f1(answer, list(ours.answers)) if rprec == 1 else 0) == kilt_f1
