"""The embedded default: the shipped demo checkpoint answers held-out questions from its knowledge base, offline.

These tests load ``checkpoints/demo`` exactly as ``rag demo`` / ``rag generate`` / ``rag.load("demo")`` do,
so they fail if the checkpoint, its referenced encoders or the decoding path change what it answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "checkpoints" / "demo" / "eval.json"


@pytest.fixture(scope="module")
def demo_pipe(tmp_path_factory):
    import os

    from rag.demo.kb import ensure_demo_kb
    from rag.pipeline import load

    kb = ensure_demo_kb(tmp_path_factory.mktemp("demo") / "kb", show_progress=False)
    return load("demo", knowledge_base=kb.path)


def test_checkpoint_is_small_and_references_its_encoders():
    root = REPORT.parent
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert size < 50 * 2**20
    meta = json.loads((root / "rag_config.json").read_text())
    assert meta["question_encoder"].get("reference") is True
    assert json.loads((root / "generator" / "config.json").read_text())["rag_warm_start"]["encoder"] == "minilm"


def test_held_out_exact_match_is_what_checkpoints_readme_reports(demo_pipe):
    """Greedy answers to the held-out dev questions reproduce the EM recorded when the checkpoint was made."""
    from rag.eval.metrics import ExactMatch
    from rag.training.data import read_qa

    dev = read_qa("demo:dev")
    em = ExactMatch()
    for i in range(0, len(dev), 34):
        chunk = dev[i:i + 34]
        answers = demo_pipe.generate([e.question for e in chunk], num_beams=1, max_new_tokens=12, decoding="fast")
        em.update([a.text for a in answers], [list(e.answers) for e in chunk])
    recorded = json.loads(REPORT.read_text())["dev"]["em"]
    assert float(em.compute()) == pytest.approx(recorded, abs=0.02)
    assert recorded > 0.1  # the model answers from the knowledge base (closed-book: 0)


def test_rag_demo_cli_answers(tmp_path, capsys, monkeypatch):
    from rag.cli import main

    monkeypatch.setenv("RAG_CACHE", str(tmp_path))
    assert main(["demo", "what is the atomic number of argon?", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and lines[0]["question"] == "what is the atomic number of argon?"
    assert lines[0]["passages"] and lines[0]["kb_version"]


def test_rag_demo_retrieve_only_prints_passages(tmp_path, capsys, monkeypatch):
    from rag.cli import main

    monkeypatch.setenv("RAG_CACHE", str(tmp_path))
    assert main(["demo", "which element has the symbol W?", "--retrieve-only", "-k", "2", "--json"]) == 0
    hits = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(hits) == 1 and len(hits[0]["passages"]) == 2
