"""hotswap-eval: one model, every knowledge base x every question set.

An "oracle reader" pipeline answers each question with the text of the passage whose id is
the question, read from the knowledge base it is currently serving: with knowledge bases A
and B holding different answers under the same ids, the EM matrix must be exactly the
identity (matched 100%, mismatched 0%) — the §4.5 pattern — so the swapping and bookkeeping
are checked without a trained model. The CLI runs once end to end with a tiny random RAG model.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from rag.eval.hotswap_eval import HotswapEvalResult, evaluate_hotswap
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.knowledge.retriever import DenseRetriever
from rag.utils.errors import ConfigError, KnowledgeBaseError, RagError

N = 6
ENCODER = {"name": "synthetic", "dim": 4, "fingerprint": "synthetic-4"}


def _write_qa(path, answers):
    with open(path, "w", encoding="utf-8") as f:
        for i, a in enumerate(answers):
            f.write(json.dumps({"question": f"q{i}", "answers": [a, f"alias {a}"]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hotswap_eval")
    rng = np.random.default_rng(0)
    answers = {"A": [f"alpha {i}" for i in range(N)], "B": [f"beta {i}" for i in range(N)]}
    kbs = {}
    for tag, ans in answers.items():
        ps = [Passage(f"q{i}", f"title {i}", a) for i, a in enumerate(ans)]
        kbs[tag] = KnowledgeBase.from_embeddings(ps, rng.standard_normal((N, 4)).astype(np.float32), ENCODER,
                                                 root / f"kb_{tag}", index="flat", show_progress=False)
    KnowledgeBase.from_embeddings([Passage("x", "", "x")], np.ones((1, 8), np.float32),
                                  {"name": "other", "dim": 8, "fingerprint": "o"}, root / "kb_dim8",
                                  index="flat", show_progress=False)
    data = {tag: _write_qa(root / f"qa_{tag}.jsonl", ans) for tag, ans in answers.items()}
    return {"root": root, "kbs": kbs, "data": data}


class OraclePipeline:
    """Answers question "q<i>" with passage q<i>'s text from the knowledge base serving now (read once)."""

    def __init__(self, kb):
        self.model = types.SimpleNamespace(retriever=DenseRetriever(kb, types.SimpleNamespace(dim=4)))
        self.calls: list[dict] = []

    def generate(self, questions, **kw):
        self.calls.append(kw)
        kb = self.model.retriever.knowledge_base
        by_id = {p.id: p.text for p in kb.all_passages()}
        return [types.SimpleNamespace(text=by_id[q], kb_version=kb.version) for q in questions]


def test_matrix_is_identity_for_an_oracle_reader(world, tmp_path):
    kbs = world["kbs"]
    pipe = OraclePipeline(kbs["A"])
    original = pipe.model.retriever.knowledge_base
    res = evaluate_hotswap(pipe, [kbs["A"].path, kbs["B"].path], [world["data"]["A"], world["data"]["B"]],
                           batch_size=4, num_beams=2, max_new_tokens=5, show_progress=False)
    assert res.em == [[1.0, 0.0], [0.0, 1.0]]
    assert res.f1[0][0] == 1.0 and 0.0 < res.f1[0][1] < 1.0  # "alpha 3" vs "beta 3" share the token "3"
    assert res.matched() == 1.0 and res.mismatched() == 0.0
    assert res.kb_versions == [kbs["A"].version, kbs["B"].version]
    assert res.kb_labels == ["kb_A", "kb_B"] and res.data_labels == ["qa_A", "qa_B"] and res.n_questions == [N, N]
    assert pipe.model.retriever.knowledge_base is original  # swapped back at the end
    assert len(pipe.calls) == 2 * 2 * 2 and all(c["num_beams"] == 2 and c["max_new_tokens"] == 5 for c in pipe.calls)

    table = res.table()
    assert "100.0*" in table and "matched (*) 100.0   mismatched 0.0" in table
    d = res.to_dict()
    assert d["matched"]["em"] == 1.0 and d["mismatched"]["em"] == 0.0 and json.loads(json.dumps(d)) == d
    png = res.plot(tmp_path / "out" / "heat.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unpaired_lists_and_limit(world):
    kbs = world["kbs"]
    pipe = OraclePipeline(kbs["B"])
    res = evaluate_hotswap(pipe, [kbs["A"].path, kbs["B"].path, kbs["A"].path], [world["data"]["B"]], limit=2,
                           kb_labels=["a", "b", "a again"], show_progress=False)
    assert res.em == [[0.0], [1.0], [0.0]] and res.n_questions == [2]
    assert not res.paired and res.matched() is None and "matched" not in res.table()


def test_bad_knowledge_base_fails_before_any_generation(world, tmp_path):
    kbs = world["kbs"]
    pipe = OraclePipeline(kbs["A"])
    with pytest.raises(KnowledgeBaseError, match="dim=8"):
        evaluate_hotswap(pipe, [kbs["A"].path, world["root"] / "kb_dim8"], [world["data"]["A"]], show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="no such knowledge-base directory"):
        evaluate_hotswap(pipe, [tmp_path / "missing"], [world["data"]["A"]], show_progress=False)
    assert pipe.calls == [] and pipe.model.retriever.knowledge_base is kbs["A"]


def test_bad_data_and_arguments(world, tmp_path):
    kbs = world["kbs"]
    pipe = OraclePipeline(kbs["A"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q0"}\n')
    with pytest.raises(RagError, match="bad.jsonl"):
        evaluate_hotswap(pipe, [kbs["A"].path], [bad], show_progress=False)
    with pytest.raises(ConfigError):
        evaluate_hotswap(pipe, [], [world["data"]["A"]], show_progress=False)
    with pytest.raises(ConfigError):
        evaluate_hotswap(pipe, [kbs["A"].path], [world["data"]["A"]], batch_size=0, show_progress=False)
    with pytest.raises(ConfigError, match="labels"):
        evaluate_hotswap(pipe, [kbs["A"].path], [world["data"]["A"]], kb_labels=["x", "y"], show_progress=False)


def test_a_swap_from_elsewhere_during_evaluation_is_detected(world):
    kbs = world["kbs"]
    pipe = OraclePipeline(kbs["A"])
    inner = pipe.generate

    def meddling(questions, **kw):  # someone swaps the live model mid-evaluation
        serving_a = pipe.model.retriever.knowledge_base.version == kbs["A"].version
        pipe.model.retriever.set_knowledge_base(kbs["B"] if serving_a else kbs["A"])
        return inner(questions, **kw)

    pipe.generate = meddling
    with pytest.raises(RagError, match="something else swapped"):
        evaluate_hotswap(pipe, [kbs["A"].path], [world["data"]["A"]], show_progress=False)


def test_cli_with_a_tiny_rag_model(tmp_path, demo_passages, tiny_dpr_question_dir, tiny_dpr_context_dir, tiny_bart_dir, capsys):
    from rag.cli import main
    from rag.knowledge.encoders import TextEncoder
    from rag.models.rag.model import RagModel

    enc = TextEncoder(tiny_dpr_context_dir)
    for tag in "AB":
        KnowledgeBase.build([Passage(p.id, p.title, f"[{tag}] {p.text}") for p in demo_passages[:8]], enc,
                            tmp_path / f"kb_{tag}", index="flat", show_progress=False)
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tmp_path / "kb_A",
                             n_docs=2).save_pretrained(tmp_path / "model")
    qa = [_write_qa(tmp_path / f"qa_{t}.jsonl", [f"{t} answer {i}" for i in range(3)]) for t in "AB"]
    argv = ["hotswap-eval", "--model", str(tmp_path / "model"), "--kb", str(tmp_path / "kb_A"), "--kb", str(tmp_path / "kb_B"),
            "--data", qa[0], "--data", qa[1], "--max-new-tokens", "3", "--quiet", "--plot", str(tmp_path / "heat.png")]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["em"]) == 2 and all(len(row) == 2 and all(0 <= v <= 1 for v in row) for row in out["em"])
    assert out["kb_labels"] == ["kb_A", "kb_B"] and out["n_questions"] == [3, 3]
    assert len(set(out["kb_versions"])) == 2
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    assert main(argv) == 0
    assert "knowledge base" in capsys.readouterr().out
    assert main(argv[:-2] + ["--kb", str(tmp_path / "nope")]) == 2  # a RagError becomes exit status 2


def test_result_rejects_unknown_metric():
    r = HotswapEvalResult(["a"], ["v"], ["p"], ["d"], [1], [[1.0]], [[1.0]])
    with pytest.raises(ConfigError):
        r.table("bleu")
