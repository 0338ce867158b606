"""benchmarks/hybrid_recall.py: --select, the rule that chose BM25's title weight and the fusion's β on development sets;
--model, a trained model's rows are the recall of what that model itself retrieves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rag.models.rag.model import RagModel, RagModelConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_recall.py"


def load():
    spec = importlib.util.spec_from_file_location("hybrid_recall_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(dense, bm25s: dict, hybrids: dict) -> dict:
    out = {"n": 10, "dense R@1": dense[0], "dense R@3": dense[1]}
    for t, (r1, r3) in bm25s.items():
        out[f"title×{t} bm25 R@1"], out[f"title×{t} bm25 R@3"] = r1, r3
    for (t, b), (r1, r3) in hybrids.items():
        out[f"title×{t} hybrid β={b} R@1"], out[f"title×{t} hybrid β={b} R@3"] = r1, r3
    return out


def test_select_keeps_settings_at_least_as_good_as_either_retriever_then_takes_the_best_mean(tmp_path):
    bench = load()
    # title×1 β=0.5 has the best mean but loses to BM25 on one set and count; title×2 and ×3 at β=1 tie: the smaller wins
    a = {"sets": {"s1": row((50, 80), {1: (60, 90), 2: (70, 90), 3: (70, 90)},
                            {(1, 0.5): (95, 100), (2, 1.0): (80, 95), (3, 1.0): (80, 95), (2, 0.5): (60, 95)})}}
    b = {"sets": {"s2": row((70, 90), {1: (50, 95), 2: (60, 95), 3: (60, 95)},
                            {(1, 0.5): (90, 94), (2, 1.0): (75, 95), (3, 1.0): (75, 95), (2, 0.5): (90, 96)})}}
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    result = bench.select(paths)
    by = {c["setting"]: c for c in result["candidates"]}
    assert by["title×1 hybrid β=0.5"]["min_margin"] == -1.0 and by["title×2 hybrid β=0.5"]["min_margin"] == -10.0
    assert by["title×2 hybrid β=1.0"]["min_margin"] == 0.0 and by["title×2 hybrid β=1.0"]["mean"] == 86.25
    assert result["chosen"]["setting"] == "title×2 hybrid β=1.0"
    assert (result["chosen"]["title_weight"], result["chosen"]["bm25_weight"]) == (2, 1.0)
    assert len(result["sets"]) == 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bpe_tokenizer, demo_passages, minilm_path):
    """20 passages embedded by MiniLM, whose knowledge base names a query encoder with MiniLM's weights moved by noise
    (frozen: poor), and two saved models over it: one with that query encoder, one with MiniLM itself (as if training had
    repaired it). The questions name each passage's element."""
    from rag.generators.tiny import save, tiny_gpt2
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    root = tmp_path_factory.mktemp("recall_models")
    noisy = TextEncoder(minilm_path, role="question")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    noisy.save_pretrained(root / "noisy")
    kb = root / "kb"
    KnowledgeBase.build(demo_passages[:20], TextEncoder(minilm_path), kb, index="flat", bm25=True,
                        query_encoder=str(root / "noisy"), show_progress=False)
    base = save(tiny_gpt2(bpe_tokenizer, max_positions=512, seed=3), bpe_tokenizer, root / "base")
    config = RagModelConfig(n_docs=3, max_context_length=80, retrieval="hybrid", hybrid_bm25_weight=0.1)
    RagModel.from_components(None, base, kb, config).save_pretrained(root / "frozen")
    learned = RagModel.from_components(minilm_path, base, kb, config)
    learned.save_pretrained(root / "learned")
    records = [{"question": f"Which chemical element is called {p.title.lower()}?", "answers": [p.title], "element": p.title}
               for p in demo_passages[:20]]
    qa = root / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(kb), root, records, learned.eval()


def test_a_models_rows_are_the_recall_of_its_own_retrieval(setup, capsys):
    kb, root, records, learned = setup
    bench = load()
    out = root / "out.json"
    assert bench.main(["--kb", kb, "--sets", str(root / "qa.jsonl"), "--bm25-weight", "0.1", "--threads", "1",
                       "--model", f"frozen={root / 'frozen'}", "--model", f"learned={root / 'learned'}", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["models"] == {"frozen": str(root / "frozen"), "learned": str(root / "learned")}
    row = report["sets"][str(root / "qa.jsonl")]
    # the untrained model's query encoder is the knowledge base's own: its rows are the frozen retrievers'
    for k in (1, 3):
        assert row[f"frozen dense R@{k}"] == row[f"dense R@{k}"]
        assert row[f"frozen hybrid R@{k}"] == row[f"hybrid R@{k}"]
    questions = [r["question"] for r in records]
    for kind in ("dense", "hybrid"):
        with torch.no_grad():
            found = learned.scoring.score(questions, 3, retrieval=kind)[0].passages
        for k in (1, 3):
            hits = sum(any(p.title == r["element"] for p in ps[:k]) for ps, r in zip(found, records))
            assert row[f"learned {kind} R@{k}"] == round(100 * hits / len(records), 1)
    assert row["learned dense R@1"] >= row["frozen dense R@1"] + 50  # the rows read the saved encoder, not the KB's
    assert "learned dense R@1" in capsys.readouterr().out


def test_a_model_given_without_a_label_is_refused(setup):
    kb, root, *_ = setup
    with pytest.raises(SystemExit, match="LABEL=DIR"):
        load().main(["--kb", kb, "--sets", str(root / "qa.jsonl"), "--model", str(root / "frozen"), "--out",
                     str(root / "x.json")])
