"""REPLUG answer-option scoring and generation: one document equals the plainly conditioned LM, equal scores give the
mean of the k distributions, the weights follow softmax(scores / temperature), greedy / beam / sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rag.generation.causal import causal_generate
from rag.generation.search import GenerationConfig
from rag.models.replug.ensemble import replug_generate, replug_score_options
from rag.models.replug.lm_scorer import LocalLMScorer, replug_prompt
from rag.utils.errors import ConfigError

DOCS = ["Hydrogen is the lightest element.", "Helium is a noble gas.", "Carbon forms four bonds."]
QUESTION = "Question: which element is the lightest?\nAnswer:"
OPTIONS = [" hydrogen", " helium gas", " carbon"]
LM_ATOL = 1e-4
"""Float32 forward passes of different batch shapes (one prompt vs K prompts padded together) take different BLAS
kernels: a token's log-prob agrees to ~1e-6 of the logits' scale, so a sum over an option's few tokens to ~1e-5. The
mixing itself is float64; 1e-4 still tells a wrong mixture (differences of 1e-2 and more) from rounding."""


def test_options_one_document_equals_the_conditioned_lm(lm):
    scorer = LocalLMScorer(*lm)
    got = replug_score_options(scorer, QUESTION, OPTIONS, DOCS[:1], [3.0])
    want = [scorer.continuation_logprobs([replug_prompt(DOCS[0], QUESTION)], [o])[0].sum() for o in OPTIONS]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=LM_ATOL)


@pytest.mark.parametrize("marginalization", ["token", "sequence"])
def test_options_equal_scores_mean_and_weights(lm, marginalization):
    scorer = LocalLMScorer(*lm)
    per_doc = [[scorer.continuation_logprobs([replug_prompt(d, QUESTION)], [o])[0] for d in DOCS] for o in OPTIONS]
    for scores, tau in (([1.0, 1.0, 1.0], 1.0), ([2.0, 0.5, -1.0], 0.5), ([2.0, 0.5, -1.0], 3.0)):
        lam = np.exp(np.asarray(scores) / tau)
        lam /= lam.sum()
        got = replug_score_options(scorer, QUESTION, OPTIONS, DOCS, scores, retrieval_temperature=tau,
                                   marginalization=marginalization)
        for o, rows in enumerate(per_doc):
            p = np.exp(np.stack(rows))  # (k, T)
            want = np.log(lam @ p).sum() if marginalization == "token" else math.log(lam @ p.prod(1))
            assert got[o].item() == pytest.approx(want, rel=0, abs=LM_ATOL)


def _prompt(tok, doc, x):
    ctx = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return tok(doc, add_special_tokens=False)["input_ids"] + [ctx] + tok(x, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("beams", [1, 3])
def test_generation_with_one_document_equals_the_conditioned_lm(lm, beams):
    model, tok = lm
    cfg = GenerationConfig(max_new_tokens=6, num_beams=beams, num_return_sequences=beams)
    seqs, scores = replug_generate(model, tok, ["The lightest element is"], [DOCS[:1]], [[0.3]], config=cfg)
    ids = torch.tensor([_prompt(tok, DOCS[0], "The lightest element is")])
    ref, ref_scores = causal_generate(model, ids, None, cfg)
    n_doc = len(tok(DOCS[0], add_special_tokens=False)["input_ids"])
    assert torch.equal(seqs, ref[:, n_doc:])  # same generated tokens after the same input tokens
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)


def test_generation_mixes_next_token_distributions_in_probability_space(lm):
    model, tok = lm
    x = "Hydrogen and helium are"
    scores = torch.tensor([[1.0, 0.2, -0.5]])
    cfg = GenerationConfig(max_new_tokens=4)
    seqs, loglik = replug_generate(model, tok, [x], [DOCS], scores, retrieval_temperature=0.7, config=cfg)
    lam = torch.softmax(scores[0] / 0.7, 0)
    gen = seqs[0, -4:].tolist()
    want = 0.0
    for t in range(4):  # greedy over the mixture, recomputed one full forward pass per document and step
        probs = []
        for d in DOCS:
            ids = torch.tensor([_prompt(tok, d, x) + gen[:t]])
            with torch.no_grad():
                probs.append(torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1))
        mix = (lam.double()[:, None] * torch.stack(probs)).sum(0)
        assert int(mix.argmax()) == gen[t]
        want += math.log(float(mix[gen[t]]))
    assert loglik.item() == pytest.approx(want, abs=1e-4)


def test_generation_sampling_is_seeded_and_batched(lm):
    model, tok = lm
    cfg = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=20)
    def run():
        return replug_generate(model, tok, ["Hydrogen is", "Noble gases are"], [DOCS[:2], DOCS[1:]], [[0.0, 1.0], [2.0, 0.0]],
                                      config=cfg, rng=torch.Generator().manual_seed(3))[0]
    a, b = run(), run()
    assert torch.equal(a, b) and a.shape[0] == 2
    with pytest.raises(ConfigError, match="same number k >= 1"):
        replug_generate(model, tok, ["a", "b"], [DOCS[:2], DOCS[:1]], [[0.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ConfigError, match="empty or whitespace"):
        replug_generate(model, tok, [" "], [DOCS[:1]], [[0.0]])
    with pytest.raises(ConfigError, match="temperature"):
        replug_generate(model, tok, ["x"], [DOCS[:1]], [[0.0]], retrieval_temperature=0.0)
