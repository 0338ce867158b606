"""Faithfulness (rag.eval.faithfulness, ``rag evaluate --faithfulness``): which passages an answer is judged against
(the top-posterior one, the cited ones, any read), the hand-labelled calibration set and its agreement numbers, and
the scores a run records and sums up. NLI models: the tests' tiny BERT classifiers, planted to say one class whatever
the input, and a lexical judge (entailed when the answer is in the premise) where the passage must matter."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rag.cli import main
from rag.demo import load_demo_corpus
from rag.eval.faithfulness import LABELS_PATH, FaithfulnessError, FaithfulnessJudge, calibrate, cohen_kappa, read_labels
from rag.eval.runner import EvalResumeError, evaluate, read_records
from rag.generation.answers import Answer, PassageProvenance
from rag.pipeline.api import RagPipeline
from rag.retrobust.nli import NLIScorer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"


class Lexical:
    """An NLI scorer's interface: P(entailment) 1 when the hypothesis's last word occurs in the premise, else 0."""

    name = "lexical"

    def entailment_probs(self, premises, hypotheses):
        last = [h.rstrip(".").split()[-1].lower() for h in hypotheses]
        return torch.tensor([float(w in p.lower()) for p, w in zip(premises, last)])


def _answer(text, posts, texts, question="which element has the symbol Fe?"):
    ps = [PassageProvenance(f"p{i}", f"T{i}", t, 0.0, 1 / len(posts), po) for i, (t, po) in enumerate(zip(texts, posts))]
    return Answer(question, text, -1.0, "v1", ps)


def test_the_top_the_cited_and_any_passage_are_judged_apart():
    judge = FaithfulnessJudge(Lexical())
    texts = ["Symbol: Fe. Iron.", "Symbol: Cu.", "Symbol: Ag. Silver."]
    # top passage (0.7) supports; cited (0.7, 0.2) support; any supports
    # top passage does not support, a cited one does; only an uncited one does; none does
    answers = [_answer("Iron", [0.7, 0.2, 0.1], texts), _answer("Iron", [0.3, 0.6, 0.1], texts),
               _answer("Silver", [0.05, 0.9, 0.05], texts), _answer("Gold", [0.5, 0.3, 0.2], texts),
               _answer("", [0.5, 0.3, 0.2], texts), Answer("q?", "Iron", -1.0, "v1", [])]
    got = [v.scores() for v in judge.judge(answers)]
    assert [(s["supported_top"], s["supported_cited"], s["supported_any"]) for s in got] == [
        (1, 1, 1), (0, 1, 1), (0, 0, 1), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    v = judge.judge(answers[:2])
    assert v[0].entailment == [1.0, 0.0, 0.0] and v[0].top == 0 and v[1].top == 1 and v[1].cited == [1, 0]


def test_cohen_kappa_is_sklearns():
    sklearn = pytest.importorskip("sklearn.metrics")
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.random() < 0.5 for _ in range(40)]
        b = [x if rng.random() < 0.7 else not x for x in a]
        assert cohen_kappa(a, b) == pytest.approx(sklearn.cohen_kappa_score(a, b), abs=1e-12)
    assert cohen_kappa([True] * 4, [True] * 4) == 1.0


def test_the_bundled_labels_are_forty_balanced_pairs_over_demo_passages():
    rows = read_labels()
    ids = {p.id for p in load_demo_corpus()}
    assert len(rows) == 40 and sum(r.supported for r in rows) == 20 and all(r.passage_id in ids for r in rows)
    assert len({(r.passage_id, r.question, r.answer) for r in rows}) == 40


def test_calibration_reports_accuracy_and_kappa(nli_dirs):
    rows = read_labels()
    always = calibrate(FaithfulnessJudge.open(nli_dirs["yes"]), rows)
    assert always["accuracy"] == 0.5 and always["kappa"] == 0.0 and always["confusion"]["not_supported->supported"] == 20
    lexical = calibrate(FaithfulnessJudge(Lexical()), rows)
    said = [p >= 0.5 for p in lexical["entailment"]]
    assert lexical["accuracy"] == sum(s == r.supported for s, r in zip(said, rows)) / 40
    assert lexical["kappa"] == pytest.approx(cohen_kappa([r.supported for r in rows], said))
    assert 0.5 < lexical["accuracy"] < 1.0  # the passage matters to it, and the labels are not all lexical


@pytest.mark.parametrize("line, message", [
    ('{"passage_id": "elements/argon", "question": "q", "answer": "a"}', "field 'label' missing"),
    ('{"passage_id": "elements/argon", "question": "q", "answer": "a", "label": "yes"}', "label 'yes'"),
    ('{"passage_id": "wiki/1", "question": "q", "answer": "a", "label": "supported"}', "not a demo Elements passage"),
    ('[1]', "expected a JSON object"),
    ('{"passage_id": ', "labels.jsonl:2"),
])
def test_bad_label_files_are_one_line_naming_the_line(tmp_path, line, message):
    path = tmp_path / "labels.jsonl"
    path.write_text(LABELS_PATH.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(FaithfulnessError, match=message) as e:
        read_labels(path)
    assert "\n" not in str(e.value) and f"{path}:2" in str(e.value)


@pytest.fixture(scope="module")
def tiny_pipeline(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir):
    from rag.models.rag.model import RagModel

    return RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2))


def test_a_run_records_the_verdicts_and_sums_them_up(tiny_pipeline, nli_dirs, tmp_path):
    out = tmp_path / "run"
    judge = FaithfulnessJudge(NLIScorer.from_pretrained(nli_dirs["yes"]))
    summary = evaluate(tiny_pipeline, FIXTURES / "kilt_nq.jsonl", out, ks=(1,), max_new_tokens=3, min_new_tokens=1,
                       faithfulness=judge, progress=False)
    recs = read_records(out)
    for r in recs:
        f = r["faithfulness"]
        assert len(f["entailment"]) == len(r["passages"]) == 2 and all(p > 0.99 for p in f["entailment"])
        assert f["cited"] == [c["passage"] for c in r["citations"]] and r["cited_text"].endswith("]")
        assert r["scores"]["supported_top"] == r["scores"]["supported_any"] == 1.0
    for name in ("supported_top", "supported_cited", "supported_any"):
        assert summary["metrics"][name] == sum(r["scores"][name] for r in recs) / len(recs)
    assert summary["settings"]["faithfulness"] == {"model": judge.name, "threshold": 0.5}
    assert "Faithfulness: NLI model" in (out / "results.md").read_text()
    with pytest.raises(EvalResumeError, match="faithfulness"):  # the same directory with another judge: refused
        evaluate(tiny_pipeline, FIXTURES / "kilt_nq.jsonl", out, ks=(1,), max_new_tokens=3, min_new_tokens=1,
                 faithfulness=FaithfulnessJudge(NLIScorer.from_pretrained(nli_dirs["no"])), progress=False)
    plain = evaluate(tiny_pipeline, FIXTURES / "kilt_nq.jsonl", tmp_path / "plain", ks=(1,), max_new_tokens=3,
                     min_new_tokens=1, progress=False)
    assert "faithfulness" not in plain["settings"] and "supported_top" not in plain["metrics"]


def test_cli_faithfulness_and_calibration(tiny_pipeline, nli_dirs, tmp_path, capsys):
    assert main(["evaluate", "--faithfulness", nli_dirs["no"], "--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "on 40 hand-labelled pairs" in out and "accuracy 0.500, Cohen's kappa 0.000" in out
    assert main(["evaluate", "--faithfulness", nli_dirs["yes"], "--calibrate", str(LABELS_PATH), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == 40
    assert main(["evaluate", "--calibrate"]) == 2
    assert "--faithfulness" in capsys.readouterr().err
    assert main(["evaluate", "--kb", str(tmp_path / "kb"), "--data", "demo:test", "--out", str(tmp_path / "o"),
                 "--faithfulness", nli_dirs["yes"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "give a model (--model)" in err and not (tmp_path / "o").exists()
    assert main(["evaluate", "--faithfulness", nli_dirs["yes"], "--faithfulness-threshold", "2", "--calibrate"]) == 2
    assert "--faithfulness-threshold" in capsys.readouterr().err
