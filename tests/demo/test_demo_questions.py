"""`rag demo`'s example questions are each answered right by the default model (slow: it loads SmolLM2)."""

from __future__ import annotations

import json

import pytest

from rag.cli import main
from rag.cli.demo import DEFAULT_ANSWERS, DEFAULT_QUESTIONS
from rag.eval.metrics import normalize_answer


@pytest.mark.slow
def test_every_example_question_of_rag_demo_is_answered_right(capsys):
    assert main(["demo", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["question"] for r in rows] == DEFAULT_QUESTIONS
    got = {r["question"]: r["text"] for r in rows}
    assert {q: normalize_answer(a) for q, a in got.items()} == {q: normalize_answer(a) for q, a in DEFAULT_ANSWERS.items()}
