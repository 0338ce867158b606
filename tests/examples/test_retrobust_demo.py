"""examples/retrobust_demo.py: the NLI back-off with planted NLI models (a tiny
classifier whose output is fixed by its bias: always "entailment" or always "neutral"), and the script end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from rag.knowledge.passages import Passage

REPO = Path(__file__).resolve().parents[2]
LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}


@pytest.fixture(scope="module")
def demo():
    sys.path.insert(0, str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location("retrobust_demo", REPO / "examples" / "retrobust_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planted_nli_dir(tmp_path, wordpiece_tokenizer, winner: int) -> str:
    from rag.generators.tiny import tiny_bert_classifier

    model = tiny_bert_classifier(wordpiece_tokenizer, LABELS)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.full((3,), -5.0))
        model.classifier.bias[winner] = 5.0
    path = tmp_path / f"nli{winner}"
    model.save_pretrained(path)
    wordpiece_tokenizer.save_pretrained(path)
    return str(path)


def test_nli_backoff_follows_the_planted_model(demo, tmp_path, wordpiece_tokenizer):
    from rag.retrobust.nli import NLIScorer

    passages = [Passage("elements/oxygen", "Oxygen", "Symbol: O."), Passage("elements/iron", "Iron", "Symbol: Fe.")]
    qs, with_ret, without = ["symbol of oxygen?", "symbol of neon?"], ["O", "Fe"], ["O", "Ne"]
    entails = NLIScorer.from_pretrained(_planted_nli_dir(tmp_path, wordpiece_tokenizer, 0))
    answers, probs = demo.nli_backoff(entails, passages, qs, with_ret, without, 0.5)
    assert answers == with_ret and min(probs) > 0.99
    neutral = NLIScorer.from_pretrained(_planted_nli_dir(tmp_path, wordpiece_tokenizer, 1))
    answers, probs = demo.nli_backoff(neutral, passages, qs, with_ret, without, 0.5)
    assert answers == without and max(probs) < 0.01  # neutral counts against entailment


@pytest.mark.slow
def test_demo_end_to_end(demo, tmp_path, wordpiece_tokenizer):
    nli = _planted_nli_dir(tmp_path, wordpiece_tokenizer, 0)
    out = tmp_path / "results.json"
    assert demo.main(["--minutes", "0.02", "--n-known", "8", "--n-kb", "8", "--n-multihop", "2", "--nli", nli,
                      "--out", str(tmp_path / "run"), "--results", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["contexts"]) == {"known", "kb-only"}
    for group in r["contexts"].values():
        assert set(group) == {"top-1", "low-ranked", "random"}
        for cell in group.values():
            assert cell["n"] == 8 and cell["nli_kept_retrieval"] == 100.0  # the planted model entails everything
            assert cell["retrieval+nli"] == cell["retrieval"]
    assert r["readers"]["retrobust"]["context_kinds"]["random"] > 0 and r["readers"]["top-1"]["context_kinds"]["random"] == 0
    assert r["selfask"]["n"] == 2 and set(r["selfask"]["with_retrieval"]["stopped"]) <= {"final_answer", "step_limit",
                                                                                         "malformed",
                                                                                           "repeated_follow_up"}
