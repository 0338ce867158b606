"""`rag evaluate`: the results directory of a retriever alone and of a RAG pipeline, resuming a killed run without
computing a question twice, refusing other settings, --compare, and the CLI's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import rag
from rag.cli import main
from rag.demo.model import ensure_demo_kb_for_model
from rag.eval.compare import compare_runs
from rag.eval.runner import EvalResumeError, evaluate, read_records
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.pipeline.api import RagPipeline
from rag.utils.errors import RagError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"
ENCODER = {"name": "synthetic", "dim": 4, "fingerprint": "synthetic-4"}


@pytest.fixture(scope="module")
def beir_kb(tmp_path_factory):
    """The BEIR fixture's corpus, plus hydrogen and one document split in two chunks, as a knowledge base (retrieved with
    BM25)."""
    rows = [json.loads(line) for line in (FIXTURES / "beir" / "corpus.jsonl").read_text().splitlines()]
    ps = [Passage(r["_id"], r["title"], r["text"]) for r in rows]
    ps += [Passage("elements/neon-0", "Neon", "Symbol: Ne. Noble gas."), Passage("elements/neon-1", "Neon", "Atomic number: 10."),
           Passage("elements/hydrogen", "Hydrogen", "Symbol: H. Atomic number: 1.")]
    emb = np.random.default_rng(0).standard_normal((len(ps), 4)).astype(np.float32)
    return KnowledgeBase.from_embeddings(ps, emb, ENCODER, tmp_path_factory.mktemp("kb") / "kb", index="flat",
                                         show_progress=False)


def test_retriever_alone_on_beir(beir_kb, tmp_path):
    out = tmp_path / "run"
    summary = evaluate(None, FIXTURES / "beir", out, knowledge_base=beir_kb, retrieval="bm25", ks=(1, 2, 5), progress=False)
    recs = read_records(out)
    assert [r["id"] for r in recs] == ["q1", "q2"] and all(r["answer"] is None for r in recs)
    assert recs[1]["retrieved"][0]["id"] == "elements/oxygen" and recs[1]["scores"]["mrr@5"] == 1.0
    assert summary["metrics"]["ndcg@5"] == pytest.approx(np.mean([r["scores"]["ndcg@5"] for r in recs]))
    assert summary["provenance"]["gold_ids"] == 3 and summary["provenance"]["in_knowledge_base"] == 3
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert {p.name for p in (out / "plots").iterdir()} == {"recall_at_k.png", "score_histograms.png"}
    assert "| ndcg@5 |" in (out / "results.md").read_text()


def test_chunks_of_a_gold_document_count_as_it_and_unmatched_provenance_is_said(beir_kb, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "neon noble gas", "answers": ["Ne"], "passage_ids": ["elements/neon"]}) + "\n"
                    + json.dumps({"question": "argon", "answers": ["Ar"], "passage_ids": ["wiki/123"]}) + "\n")
    summary = evaluate(None, data, tmp_path / "run", knowledge_base=beir_kb, retrieval="bm25", ks=(1, 5), progress=False)
    recs = read_records(tmp_path / "run")
    assert recs[0]["scores"]["recall@1"] == 1.0 and recs[0]["scores"]["precision@5"] == 1 / 5  # two chunks, one document
    assert summary["provenance"]["in_knowledge_base"] == 1 and "1 of 2 gold provenance ids" in summary["provenance"]["note"]


@pytest.fixture(scope="module")
def tiny_pipeline(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir):
    from rag.models.rag.model import RagModel

    return RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2))


def test_pipeline_run_records_answers_with_provenance(tiny_pipeline, tmp_path):
    summary = evaluate(tiny_pipeline, FIXTURES / "kilt_nq.jsonl", tmp_path / "run", ks=(1, 3), max_new_tokens=3, progress=False)
    recs = read_records(tmp_path / "run")
    assert len(recs) == 3 and all(isinstance(r["answer"], str) and len(r["passages"]) == 2 for r in recs)
    assert all(p["posterior"] is not None and p["prior"] is not None for r in recs for p in r["passages"])
    assert {"em", "f1", "kilt_em", "kilt_f1", "rprec", "recall@3", "answer_recall@3"} <= set(summary["metrics"])
    assert all(r["scores"]["kilt_em"] <= r["scores"]["em"] for r in recs)
    assert summary["settings"]["options"] == {"max_new_tokens": 3}


def test_the_summary_counts_the_reader_prompts_cut_to_the_window(tiny_pipeline, tiny_dpr_question_dir, tiny_bart_dir,
                                                                 tiny_kb_dir, tmp_path):
    """summary.json's ``cut_prompts``: every (question, passage) prompt the reader built, and those longer than its
    window: none at the tiny model's 300 tokens, all of them at 8."""
    from rag.models.rag.model import RagModel

    kw = dict(ks=(1,), max_new_tokens=2, progress=False)
    whole = evaluate(tiny_pipeline, FIXTURES / "kilt_nq.jsonl", tmp_path / "a", **kw)["cut_prompts"]
    narrow = RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2,
                                                  max_context_length=8))
    cut = evaluate(narrow, FIXTURES / "kilt_nq.jsonl", tmp_path / "b", **kw)["cut_prompts"]
    assert whole["cut"] == 0 and whole["prompts"] >= 6 and whole["questions"] == 3 and whole["max_context_length"] == [300]
    assert cut["cut"] == cut["prompts"] == whole["prompts"] and cut["fraction"] == 1.0 and cut["max_context_length"] == [8]


def test_a_killed_run_resumes_without_computing_twice(tiny_pipeline, tmp_path, monkeypatch):
    out, asked = tmp_path / "run", []
    real = RagPipeline.generate

    def generate(self, questions, **kw):
        if len(asked) == 1:
            raise KeyboardInterrupt  # killed during the second batch
        asked.append(list(questions))
        return real(self, questions, **kw)

    monkeypatch.setattr(RagPipeline, "generate", generate)
    kw = dict(batch_size=2, ks=(1,), max_new_tokens=2, progress=False)
    with pytest.raises(KeyboardInterrupt):
        evaluate(tiny_pipeline, "demo:test", out, limit=5, **kw)
    assert [r["id"] for r in read_records(out)] == ["0", "1"] and not (out / "summary.json").exists()
    with open(out / "records.jsonl", "a") as f:
        f.write('{"id": "2", "question": "cut by the ki')  # a line the kill cut short
    asked.clear()
    monkeypatch.setattr(RagPipeline, "generate", lambda self, q, **k: (asked.append(list(q)), real(self, q, **k))[1])
    summary = evaluate(tiny_pipeline, "demo:test", out, limit=5, **kw)
    assert [len(b) for b in asked] == [2, 1]  # questions 2-4 only
    assert [r["id"] for r in read_records(out)] == ["0", "1", "2", "3", "4"] and summary["questions"] == 5
    with pytest.raises(EvalResumeError, match=r"made with other settings \(limit: 5, now 4; also .*choose another --out"):
        evaluate(tiny_pipeline, "demo:test", out, limit=4, **kw)


def test_compare_two_runs(beir_kb, tmp_path):
    data = FIXTURES / "own.jsonl"
    a = tmp_path / "a"
    b = tmp_path / "b"
    evaluate(None, data, a, knowledge_base=beir_kb, retrieval="bm25", ks=(1, 5), progress=False)
    evaluate(None, data, b, knowledge_base=beir_kb, retrieval="bm25", ks=(1, 5), progress=False)
    recs = read_records(b)
    recs[0]["scores"]["answer_recall@1"] = 1.0 - recs[0]["scores"]["answer_recall@1"]  # B differs on one question
    (b / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = compare_runs(a, b, resamples=200)
    ra = read_records(a)
    m = c["metrics"]["answer_recall@1"]
    assert m["delta"] == pytest.approx(np.mean([y["scores"]["answer_recall@1"] - x["scores"]["answer_recall@1"]
                                                for x, y in zip(ra, recs)]))
    assert m["low"] <= m["delta"] <= m["high"] and m["better"] + m["worse"] == 1
    assert c["metrics"]["recall@5"]["delta"] == 0.0 and c["metrics"]["recall@5"]["low"] == 0.0
    assert c["paired_questions"] == 3 and set(c["by_category"]) == {"symbol", "atomic_number", "discoverer"}
    flipped = c["flipped"]
    assert flipped["metric"] == "answer_recall@1" and sum(flipped["counts"].values()) == 1
    assert [f["id"] for f in flipped["a_wrong_b_right"] + flipped["a_right_b_wrong"]] == [recs[0]["id"]]
    recs[1]["question"] = "another question"
    (b / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(RagError,
                       match=r"question 'helium-number' is .* but 'another question' in .*not over the same evaluation set"):
        compare_runs(a, b)


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    root = tmp_path / "beir"
    root.mkdir()
    for name in ("corpus.jsonl", "queries.jsonl"):
        (root / name).write_text((FIXTURES / "beir" / name).read_text())
    (root / "qrels").mkdir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq7\td\t1\n")
    assert main(["evaluate", "--kb", str(tmp_path / "nokb"), "--data", str(root), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "test.tsv:2: query id 'q7' is not in" in err
    assert not (tmp_path / "o").exists()
    assert main(["evaluate", "--compare", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["evaluate", "--data", "demo:test"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_model_end_to_end_and_compare(tmp_path, capsys):
    """The bundled demo model over demo:test (first 3 questions), then compared with its retriever alone."""
    run, retr = tmp_path / "demo", tmp_path / "retriever"
    assert main(["evaluate", "--model", "demo", "--data", "demo:test", "--limit", "3", "--out", str(run), "--quiet"]) == 0
    assert "| em |" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["questions"] == 3 and 0 <= summary["metrics"]["em"] <= 1
    assert {p.name for p in (run / "plots").iterdir()} == {"recall_at_k.png", "by_category.png", "score_histograms.png"}
    kb = str(ensure_demo_kb_for_model().path)
    assert main(["evaluate", "--kb", kb, "--data", "demo:test", "--limit", "3", "--out", str(retr), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--compare", str(retr), str(run), "--resamples", "100"]) == 0
    out = capsys.readouterr().out
    assert "3 paired questions" in out and "answer_recall@5" in out and "95% interval" in out


@pytest.mark.parametrize("name", ["kilt_nq.jsonl", "dpr_nq-test.qa.csv", "dpr_trivia-dev.json", "hotpot_dev_distractor.json",
                                  "own.jsonl", "beir"])
def test_every_format_round_trips_through_evaluate(beir_kb, tmp_path, name):
    summary = evaluate(None, FIXTURES / name, tmp_path / "run", knowledge_base=beir_kb, retrieval="bm25", ks=(1, 3),
                       progress=False)
    recs = read_records(tmp_path / "run")
    assert summary["complete"] and summary["questions"] == len(recs) >= 2
    if name != "dpr_nq-test.qa.csv":  # every other format names gold provenance, all of it in this knowledge base
        assert summary["provenance"]["in_knowledge_base"] == summary["provenance"]["gold_ids"] > 0
        assert "recall@3" in summary["metrics"]
    if name == "hotpot_dev_distractor.json":  # supporting facts name pages by title
        assert recs[0]["scores"]["recall@3"] == 1.0 and set(summary["by_category"]) == {"comparison", "bridge"}


def test_cli_retriever_alone_json_and_the_python_name(beir_kb, tmp_path, capsys):
    assert rag.evaluate is evaluate
    argv = ["evaluate", "--kb", str(beir_kb.path), "--data", str(FIXTURES / "beir"), "--retrieval", "bm25", "--k", "1,3",
            "--out", str(tmp_path / "run"), "--json", "--quiet"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["questions"] == 2 and summary["settings"]["options"] == {"retrieval": "bm25"}
    assert "ndcg@3" in summary["metrics"]
    assert main(argv) == 0  # a complete directory: the same summary, nothing run again
    assert json.loads(capsys.readouterr().out) == summary
    assert main(argv[:-4] + ["--k", "1", "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert "made with other settings (ks: [1, 3], now [1])" in capsys.readouterr().err
