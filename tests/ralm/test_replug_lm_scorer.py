"""Black-box LMs for REPLUG: a local transformers LM and an OpenAI-compatible completions endpoint (a real server on
loopback serving the tiny GPT-2's log-probs) give the same continuation log-probs; retries, timeouts, replies without
log-probs and HTTP errors are clear errors; the score cache never asks twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.models.replug.lm_scorer import (
    CompletionsLMScorer,
    LMEndpointError,
    LocalLMScorer,
    ScoreCache,
    document_logprobs,
    replug_prompt,
)
from rag.utils.errors import ConfigError

PAIRS = [("Hydrogen\nHydrogen is the lightest element.\n\nThe lightest element is", " hydrogen."),
         ("Helium is a noble gas.\n\nA noble gas", " does not react."),
         ("Carbon forms four bonds.", " Diamond and graphite are carbon.")]


def test_local_scorer_equals_the_conditioned_lm(lm):
    model, tok = lm
    scorer = LocalLMScorer(model, tok, batch_size=2)
    got = scorer.continuation_logprobs([p for p, _ in PAIRS], [c for _, c in PAIRS])
    for (p, c), lp in zip(PAIRS, got):
        pi, ci = tok(p, add_special_tokens=False)["input_ids"], tok(c, add_special_tokens=False)["input_ids"]
        ids = [tok.eos_token_id if tok.bos_token_id is None else tok.bos_token_id] + pi + ci
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        want = [float(full[len(ids) - len(ci) - 1 + t, ci[t]]) for t in range(len(ci))]
        np.testing.assert_allclose(lp, want, atol=1e-5)


def test_endpoint_scores_equal_the_local_lm_and_the_cache_never_asks_twice(lm, server):
    url, _ = server
    local = LocalLMScorer(*lm)
    remote = CompletionsLMScorer(url, "tiny", batch_size=2, timeout=10)
    want = local.continuation_logprobs([p for p, _ in PAIRS], [c for _, c in PAIRS])
    got = remote.continuation_logprobs([p for p, _ in PAIRS], [c for _, c in PAIRS])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5)
    cache = ScoreCache()
    docs, xs, ys = ["Hydrogen is light.", "Helium is inert."], ["The lightest element is",
                                                                "The lightest element is"], [" hydrogen."] * 2
    first = document_logprobs(remote, docs, xs, ys, cache=cache)
    sent = remote.requests
    again = document_logprobs(remote, docs, xs, ys, cache=cache)
    assert remote.requests == sent and cache.hits == 2 and cache.misses == 2 and len(cache) == 2
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(first[0], local.continuation_logprobs([replug_prompt(docs[0], xs[0])], ys[:1])[0], atol=1e-5)
    # the LM identity is part of the key: another LM is asked
    document_logprobs(local, docs, xs, ys, cache=cache)
    assert len(cache) == 4


def test_endpoint_failures_are_clear_errors(server):
    url, _ = server
    with pytest.raises(LMEndpointError, match="no prompt log-probs.*echo=True"):
        CompletionsLMScorer(url, "nologprobs").continuation_logprobs(["a prompt"], [" more"])
    broken = CompletionsLMScorer(url, "broken", max_retries=2, backoff=0.0)
    with pytest.raises(LMEndpointError, match=r"HTTP 503.*3 attempt"):
        broken.continuation_logprobs(["a prompt"], [" more"])
    assert broken.requests == 3  # one try + two retries, then the error
    with pytest.raises(LMEndpointError, match="timed out after 0.2 s"):
        CompletionsLMScorer(url, "slow", timeout=0.2, max_retries=1, backoff=0.0).continuation_logprobs(["a prompt"], [" more"])
    with pytest.raises(LMEndpointError, match="HTTP 404.*model name"):
        CompletionsLMScorer(url, "unknown").continuation_logprobs(["a prompt"], [" more"])
    flaky = CompletionsLMScorer(url, "flaky", max_retries=3, backoff=0.0)
    assert len(flaky.continuation_logprobs(["a prompt"], [" more"])[0]) >= 1  # recovered by a retry
    with pytest.raises(LMEndpointError, match="could not be reached"):
        CompletionsLMScorer("http://127.0.0.1:9/v1", "tiny", max_retries=0, timeout=2).continuation_logprobs(["p"], [" q"])
    with pytest.raises(ConfigError, match="base_url"):
        CompletionsLMScorer("localhost:8000", "tiny")
    with pytest.raises(ConfigError, match="timeout"):
        CompletionsLMScorer(url, "tiny", timeout=0)
    with pytest.raises(ConfigError, match="empty or whitespace"):
        document_logprobs(CompletionsLMScorer(url, "tiny"), ["d"], ["   "], [" y"])
