"""REPLUG perplexity evaluation (`RalmConfig(ensemble=K)`, `rag lm-eval --ensemble K`): equality with a one-window-at-a-time
loop, K = 1 equals In-Context RALM, the weights, the random-document control, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.generation.marginalize import doc_log_prior, token_marginal_target_logprobs
from rag.models.ralm.model import (
    EvalText,
    InContextRALM,
    RalmConfig,
    chunk_spans,
    own_document_filter,
    query_spans,
    retrieve_excluding,
    window_ids,
)
from rag.utils.errors import ConfigError

SMALL = dict(max_length=96, doc_max_length=40, stride=6, query_length=8)


def _texts(demo_passages, n=3):
    return [EvalText(p.text, p.id, p.title) for p in demo_passages[:n]]


def _reference(model, tok, retriever, text: EvalText, k: int, temperature: float) -> np.ndarray:
    """The straightforward REPLUG loop: per chunk, per document, one LM pass over doc ∘ prefix (batch 1), then
    log Σ_d softmax(s/τ)_d p(y_t | d ∘ x) per token."""
    ralm = InContextRALM(model, tok, retriever, RalmConfig(ensemble=k, retrieval_temperature=temperature, **SMALL))
    sc = ralm.scorer
    stream = sc.stream(text.text)
    spans = chunk_spans(len(stream) - 1, SMALL["stride"])
    out = []
    for (a, b), q in zip(spans, query_spans(spans, SMALL["query_length"])):
        if q is None:
            w = stream[:b]
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([w])).logits[0].double(), -1)
            out += [float(lp[t - 1, w[t]]) for t in range(a, b)]
            continue
        query = tok.decode(stream[q[0]:q[1]])
        cands = retrieve_excluding(retriever, [query], k, [own_document_filter(text)])[0]
        per_doc = []
        for doc in sc.doc_tokens([p for p, _ in cands]):
            w = window_ids(stream, a, b, doc, sc.max_length)
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([w])).logits[0].double(), -1)
            n = b - a
            per_doc.append([float(lp[len(w) - n - 1 + t, w[len(w) - n + t]]) for t in range(n)])
        lam = torch.softmax(torch.tensor([s for _, s in cands], dtype=torch.float64) / temperature, 0)
        mix = torch.logsumexp(torch.tensor(per_doc, dtype=torch.float64) + lam.log()[:, None], 0)
        out += mix.tolist()
    return np.asarray(out)


@pytest.mark.parametrize("k, temperature", [(3, 1.0), (2, 5.0)])
def test_ensemble_equals_the_one_window_at_a_time_loop(lm, bm25, demo_passages, k, temperature):
    model, tok = lm
    texts = _texts(demo_passages, 2)
    ralm = InContextRALM(model, tok, bm25, RalmConfig(ensemble=k, retrieval_temperature=temperature, batch_size=5, **SMALL))
    for score, t in zip(ralm.score_texts(texts), texts):
        ref = _reference(model, tok, bm25, t, k, temperature)
        np.testing.assert_allclose(score.token_logprobs, ref, atol=1e-5)
        assert all(d is None or len(d) == k for d in score.doc_ids)


def test_ensemble_of_one_equals_in_context_ralm(lm, bm25, demo_passages):
    model, tok = lm
    texts = _texts(demo_passages)
    plain = list(InContextRALM(model, tok, bm25, RalmConfig(**SMALL)).score_texts(texts))
    one = list(InContextRALM(model, tok, bm25, RalmConfig(ensemble=1, retrieval_temperature=0.3, **SMALL)).score_texts(texts))
    for a, b in zip(plain, one):  # the ensemble path batches its windows its own way: float32 LM rounding, not equality
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=0, atol=1e-5)
        assert [None if d is None else [d] for d in a.doc_ids] == b.doc_ids


def test_weights_follow_softmax_of_scores_over_temperature():
    lp = torch.log(torch.tensor([[[0.5, 0.1], [0.2, 0.6], [0.9, 0.3]]], dtype=torch.float64))  # (1, K=3, T=2)
    scores = torch.tensor([[2.0, 1.0, -1.0]], dtype=torch.float64)
    for tau in (0.5, 1.0, 4.0):
        lam = np.exp(np.array([2.0, 1.0, -1.0]) / tau)
        lam /= lam.sum()
        want = np.log(lam @ np.array([[0.5, 0.1], [0.2, 0.6], [0.9, 0.3]]))
        got = token_marginal_target_logprobs(lp, doc_log_prior(scores, temperature=tau))[0].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12)
    # equal scores: the mean of the K distributions, whatever the temperature
    got = token_marginal_target_logprobs(lp, doc_log_prior(torch.full((1, 3), 0.7, dtype=torch.float64), temperature=0.1))
    np.testing.assert_allclose(got[0].exp().numpy(), [(0.5 + 0.2 + 0.9) / 3, (0.1 + 0.6 + 0.3) / 3], rtol=1e-12)


def test_probability_space_differs_from_averaging_logits():
    # two documents, vocabulary of 2: p1 = (0.9, 0.1), p2 = (0.1, 0.9); the mixture is (0.5, 0.5), the averaged logits
    # (log 0.9 + log 0.1) / 2 for both tokens also give (0.5, 0.5); make them asymmetric to tell them apart
    p = torch.tensor([[[0.98, 0.02], [0.4, 0.6]]], dtype=torch.float64)  # (1, K=2, V=2)
    prior = doc_log_prior(torch.zeros(1, 2, dtype=torch.float64))
    from rag.generation.marginalize import token_marginal_logprobs

    mix = token_marginal_logprobs(p.log(), prior)[0].exp()
    np.testing.assert_allclose(mix.numpy(), [0.69, 0.31], rtol=1e-12)
    logit_avg = torch.softmax(p.log().mean(1), -1)[0]
    assert abs(float(logit_avg[0]) - 0.69) > 0.05  # ≈ 0.848: a different (geometric) mixture


def test_random_docs_control_and_bad_input(lm, bm25, demo_passages):
    model, tok = lm
    texts = _texts(demo_passages, 2)
    a = list(InContextRALM(model, tok, bm25, RalmConfig(ensemble=3, random_docs=True, seed=1, **SMALL)).score_texts(texts))
    b = list(InContextRALM(model, tok, bm25, RalmConfig(ensemble=3, random_docs=True, seed=1, **SMALL)).score_texts(texts))
    top = list(InContextRALM(model, tok, bm25, RalmConfig(ensemble=3, **SMALL)).score_texts(texts))
    assert [x.doc_ids for x in a] == [x.doc_ids for x in b]  # seeded
    assert [x.doc_ids for x in a] != [x.doc_ids for x in top]
    for t, s in zip(texts, a):  # the leakage guard holds for random documents too
        assert not any(pid == t.id for ids in s.doc_ids if ids for pid in ids)
    with pytest.raises(ConfigError, match="--ensemble"):
        RalmConfig(ensemble=0).check()
    with pytest.raises(ConfigError, match="--retrieval-temperature"):
        RalmConfig(ensemble=2, retrieval_temperature=0.0).check()
    with pytest.raises(ConfigError, match="--ensemble K"):
        RalmConfig(random_docs=True).check()
    with pytest.raises(ConfigError, match="knowledge base holds"):
        list(InContextRALM(model, tok, bm25, RalmConfig(ensemble=len(demo_passages) + 1, **SMALL)).score_texts(texts))
    with pytest.raises(ConfigError, match="needs retrieval"):
        InContextRALM(model, tok, None, RalmConfig(ensemble=2, **SMALL))
