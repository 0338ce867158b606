"""Zero-shot LM reranking (§6.1): the ranking rule, the batched scores against a brute-force loop, the reranked
document is the one the LM reads; a reranking LM with its own tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.models.ralm.model import CausalScorer, EvalText, InContextRALM, RalmConfig, doc_text, retrieve_excluding
from rag.models.ralm.rerank import LMReranker, best_documents
from rag.utils.errors import ConfigError

SMALL = dict(max_length=96, doc_max_length=40)


def test_best_document_is_the_argmax_of_the_prefix_likelihood():
    # log p(y' | [d_i; x]) for 2 chunks x 4 candidates: the planted document (index 2, then 0) explains y' best
    ll = np.array([[-30.0, -29.5, -3.0, -41.0], [-2.5, -7.0, -7.0, -2.6]])
    assert best_documents(ll).tolist() == [2, 0]
    assert best_documents(torch.tensor([[1.0, 1.0]])).tolist() == [0]  # ties: the retriever's order
    with pytest.raises(ConfigError):
        best_documents(np.zeros(3))


def _brute_force(model, tok, stream, a, doc, m, max_length):
    room = max_length - len(doc) - m
    inp = torch.tensor([doc + stream[max(0, a - m - room):a]])
    with torch.no_grad():
        lp = torch.log_softmax(model(inp).logits[0, -m - 1:-1].float(), -1)
    return lp.gather(-1, inp[0, -m:, None]).sum().item()


def test_lm_reranker_scores_equal_a_brute_force_loop_and_choose_the_document_read(lm, bm25, demo_passages):
    model, tok = lm
    reranker = LMReranker(rerank_tokens=6)
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, k=5, **SMALL), reranker)
    text = EvalText(demo_passages[7].text, demo_passages[7].id, demo_passages[7].title)
    stream = ralm.scorer.stream(text.text)
    spans, queries = ralm.plan(stream)
    from rag.models.ralm.model import own_document_filter

    guard = own_document_filter(text)
    cands = retrieve_excluding(bm25, queries[1:], 5, [guard] * (len(queries) - 1))
    requests = [(stream, a, [p for p, _ in c]) for (a, _), c in zip(spans[1:], cands)]
    scores = reranker.scores(ralm, requests)
    assert scores.shape == (len(requests), 5)
    for (s, a, docs), row in zip(requests[:4], scores):
        m = min(6, a - 1)
        for doc, got in zip(docs, row):
            ids = tok(doc_text(doc), add_special_tokens=False, truncation=True, max_length=40)["input_ids"]
            assert got == pytest.approx(_brute_force(model, tok, s, a, ids, m, 96), rel=1e-5, abs=1e-4)
    chosen = [r[2][i].id for r, i in zip(requests, best_documents(scores))]
    (result,) = ralm.score_texts([text])
    assert result.doc_ids[1:] == chosen
    assert any(i != 0 for i in best_documents(scores))  # reranking changes the retriever's choice somewhere


def test_a_smaller_reranking_lm_with_its_own_tokenizer(lm, bm25, demo_passages, tmp_path):
    from rag.generators import tiny
    from rag.generators.load import load_generator

    model, tok = lm
    small_tok = tiny.train_bpe_tokenizer(tiny.sample_texts(), vocab_size=350)
    small_dir = tiny.save(tiny.tiny_gpt2(small_tok, d_model=16, layers=1, max_positions=128, seed=3), small_tok,
                          tmp_path / "small")
    sm, st, _ = load_generator(small_dir, kind="causal")
    reranker = LMReranker(CausalScorer(sm, st, max_length=64, doc_max_length=24), rerank_tokens=4)
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, k=3, **SMALL), reranker)
    text = EvalText(demo_passages[3].text, demo_passages[3].id, demo_passages[3].title)
    stream = ralm.scorer.stream(text.text)
    a = 9
    docs = [p for p, _ in retrieve_excluding(bm25, [tok.decode(stream[1:a])], 3, [None])[0]]
    got = reranker.scores(ralm, [(stream, a, docs)])[0]
    own = st(tok.decode(stream[1:a]), add_special_tokens=False)["input_ids"]
    s2 = [st.bos_token_id] + own
    for doc, g in zip(docs, got):
        ids = st(doc_text(doc), add_special_tokens=False, truncation=True, max_length=24)["input_ids"]
        assert g == pytest.approx(_brute_force(sm, st, s2, len(s2), ids, 4, 64), rel=1e-5, abs=1e-4)
    (result,) = ralm.score_texts([text])
    assert len(result.token_logprobs) == len(stream) - 1


def test_rerank_tokens_that_cannot_fit_are_refused(lm, bm25, demo_passages):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, k=2, **SMALL), LMReranker(rerank_tokens=60))
    with pytest.raises(ConfigError, match="--rerank-tokens"):
        list(ralm.score_texts([EvalText(demo_passages[2].text, demo_passages[2].id)]))
