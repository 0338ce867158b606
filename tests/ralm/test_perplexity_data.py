"""`--data` readers of rag lm-eval (JSONL, plain text, datasets directory) and the perplexity totals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rag.eval.perplexity import perplexity_totals, read_eval_texts
from rag.models.ralm.model import EvalText, TextScore
from rag.utils.errors import CorpusError


def test_jsonl_text_and_datasets_sources(tmp_path):
    import datasets

    j = tmp_path / "a.jsonl"
    j.write_text(json.dumps({"id": 7, "title": "Tin", "text": "Tin is soft."}) + "\n\n" + json.dumps({"text": "Lead."}) + "\n",
                 encoding="utf-8")
    assert read_eval_texts(j) == [EvalText("Tin is soft.", "7", "Tin"), EvalText("Lead.")]
    assert read_eval_texts(j, limit=1) == [EvalText("Tin is soft.", "7", "Tin")]
    t = tmp_path / "wiki.txt"
    t.write_text(" = Tin = \n\nTin is a metal .\n", encoding="utf-8")
    assert read_eval_texts(t) == [EvalText(" = Tin = \n\nTin is a metal .\n")]
    d = tmp_path / "ds"
    datasets.Dataset.from_dict({"body": ["One text.", "Two texts."], "id": ["a", "b"]}).save_to_disk(str(d))
    assert read_eval_texts(d, field="body") == [EvalText("One text.", "a"), EvalText("Two texts.", "b")]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": \n', r"a.jsonl:2: invalid JSON"),
    ('{"body": "x"}\n', r"a.jsonl:1: field 'text' is missing or empty.*--text-field"),
    ("", "holds no text"),
])
def test_bad_data_names_the_line_and_field(tmp_path, content, message):
    p = tmp_path / "a.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(CorpusError, match=message):
        read_eval_texts(p)
    with pytest.raises(CorpusError, match="no such file"):
        read_eval_texts(tmp_path / "missing.jsonl")


def test_totals_token_word_and_byte_normalisations():
    a = TextScore("a", np.log(np.array([0.5, 0.25])), np.array([1, 2]), n_words=1, n_bytes=3, doc_ids=[None, "x"])
    b = TextScore("b", np.log(np.array([0.5])), np.array([3]), n_words=1, n_bytes=5, doc_ids=[None])
    r = perplexity_totals([a, b])
    nll = -math.log(0.5 * 0.25 * 0.5)
    assert r.nll == pytest.approx(nll) and (r.tokens, r.words, r.bytes, r.texts, r.retrieved_chunks) == (3, 2, 8, 2, 1)
    assert r.perplexity == pytest.approx(math.exp(nll / 3))
    assert r.word_perplexity == pytest.approx(math.exp(nll / 2))
    assert r.bits_per_byte == pytest.approx(nll / math.log(2) / 8)  # = 4 bits over 8 bytes
    assert r.to_dict()["bits_per_byte"] == pytest.approx(0.5)
