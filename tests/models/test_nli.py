"""NLIScorer: label discovery, softmax over all classes equal to the model's own logits as a user calls it, batching,
premise-only truncation, threshold validation and the default-model error."""

from __future__ import annotations

import math

import pytest
import torch

from rag.retrobust.nli import NLIScorer, default_nli_model, find_nli_labels, resolve_nli_model, validate_threshold
from rag.utils.errors import ConfigError, RagError

BART_MNLI = {0: "contradiction", 1: "neutral", 2: "entailment"}  # facebook/bart-large-mnli's id2label
ROBERTA_MNLI = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}  # roberta-large-mnli's

PREMISES = [
    "Selenium. Symbol: Se. Atomic number: 34. Discovered by Jons Jacob Berzelius in 1817.",
    "Hydrogen. Symbol: H. Atomic number: 1. Lightest and most abundant element in the universe.",
    "A man is playing a guitar on a stage.",
    "Iron. Symbol: Fe. Atomic number: 26.",
    "Two dogs run across a field.",
]
HYPOTHESES = ["The chemical symbol of selenium is Se.", "Hydrogen is the lightest element.", "A man plays music.",
              "The atomic number of iron is 26.", "Cats are sleeping."]


@pytest.fixture(scope="module")
def nli_dir(tmp_path_factory, wordpiece_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_bert_classifier

    return save(tiny_bert_classifier(wordpiece_tokenizer, BART_MNLI, seed=3), wordpiece_tokenizer, tmp_path_factory.mktemp("nli"))


def _user_probs(path, premises, hypotheses, **tok_kw):
    """What a user gets from the model directly: one padded batch, softmax of the logits."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return model(**tok(premises, hypotheses, padding=True, return_tensors="pt", **tok_kw)).logits.softmax(-1)


@pytest.mark.parametrize("id2label, expected", [
    (BART_MNLI, {"entailment": 2, "neutral": 1, "contradiction": 0}),
    (ROBERTA_MNLI, {"entailment": 2, "neutral": 1, "contradiction": 0}),
    ({0: "Entailment", 1: "Neutral", 2: "Contradiction"}, {"entailment": 0, "neutral": 1, "contradiction": 2}),
    ({"0": "entailment", "1": "not_entailment"}, {"entailment": 0}),  # two-class RTE/QNLI style, string keys
])
def test_label_discovery(id2label, expected):
    assert find_nli_labels(id2label, "m") == expected


def test_no_entailment_label_is_a_clear_error(tmp_path, wordpiece_tokenizer):
    from rag.generators.tiny import save, tiny_bert_classifier

    path = save(tiny_bert_classifier(wordpiece_tokenizer, {0: "LABEL_0", 1: "LABEL_1"}), wordpiece_tokenizer, tmp_path / "m")
    with pytest.raises(ConfigError) as e:
        NLIScorer.from_pretrained(path)
    assert path in str(e.value) and "LABEL_0" in str(e.value) and "entailment" in str(e.value)
    with pytest.raises(ConfigError, match="two classes"):
        find_nli_labels({0: "entailment", 1: "ENTAILMENT"}, "m")


def test_probs_are_the_models_softmax_over_all_classes(nli_dir):
    scorer = NLIScorer.from_pretrained(nli_dir, batch_size=2)  # 5 pairs in 3 batches
    probs = scorer.probs(PREMISES, HYPOTHESES)
    assert probs.shape == (5, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    expected = _user_probs(nli_dir, PREMISES, HYPOTHESES)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)
    ent = scorer.entailment_probs(PREMISES, HYPOTHESES)
    assert scorer.labels["entailment"] == 2
    torch.testing.assert_close(ent, expected[:, 2], atol=1e-5, rtol=1e-4)
    # neutral is not dropped: P(entailment) is below the two-way softmax of entailment vs contradiction
    two_way = expected[:, 2] / (expected[:, 0] + expected[:, 2])
    assert bool((ent < two_way).all())
    assert scorer.probs([], []).shape == (0, 3)


def test_premise_is_truncated_never_the_hypothesis(nli_dir):
    scorer = NLIScorer.from_pretrained(nli_dir, max_length=24)
    long_premise = " ".join(PREMISES * 4)
    hypothesis = "The chemical symbol of selenium is Se."
    from rag.retrobust.nli import encode_nli_pairs

    enc = encode_nli_pairs(scorer.tokenizer, [long_premise], [hypothesis], scorer.max_length)
    ids = enc["input_ids"][0].tolist()
    hyp_ids = scorer.tokenizer(hypothesis, add_special_tokens=False)["input_ids"]
    sep = scorer.tokenizer.sep_token_id
    assert len(ids) == 24 and ids[-len(hyp_ids) - 1:-1] == hyp_ids and ids[-1] == sep
    expected = _user_probs(nli_dir, [long_premise], [hypothesis], truncation="only_first", max_length=24)
    torch.testing.assert_close(scorer.probs([long_premise], [hypothesis]), expected, atol=1e-5, rtol=1e-4)
    # a hypothesis that alone overflows is cut too, with a warning, instead of failing the call
    assert scorer.probs(["short"], [long_premise]).shape == (1, 3)


def test_max_length_is_capped_by_the_model(nli_dir):
    assert NLIScorer.from_pretrained(nli_dir).max_length == 512  # tiny BERT: 512 positions
    assert NLIScorer.from_pretrained(nli_dir, max_length=10_000).max_length == 512


def test_mismatched_inputs(nli_dir):
    with pytest.raises(RagError, match="one hypothesis per premise"):
        NLIScorer.from_pretrained(nli_dir).entailment_probs(["a", "b"], ["c"])


@pytest.mark.parametrize("value", [0, 0.5, 1, "0.25"])
def test_threshold_in_range(value):
    assert validate_threshold(value) == float(value)


@pytest.mark.parametrize("value", [-0.01, 1.5, math.nan, "high", None])
def test_threshold_out_of_range(value):
    with pytest.raises(ConfigError, match="nli_threshold"):
        validate_threshold(value)


def test_default_model_missing_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="rag nli prepare"):
        default_nli_model()
    with pytest.raises(ConfigError, match="rag nli prepare"):
        resolve_nli_model(None)
    assert resolve_nli_model("facebook/bart-large-mnli") == "facebook/bart-large-mnli"
