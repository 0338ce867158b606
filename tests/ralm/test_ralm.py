"""In-Context RALM: positions and queries, windows, the scored tokens, equality with a user's sliding window and
with the one-window-at-a-time loop, the leakage guard, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rag.eval.perplexity import evaluate_perplexity
from rag.models.ralm.model import (
    CausalScorer,
    EvalText,
    InContextRALM,
    RalmConfig,
    chunk_spans,
    doc_text,
    own_document_filter,
    query_spans,
    window_ids,
)
from rag.utils.errors import ConfigError, RagError

SMALL = dict(max_length=96, doc_max_length=40)


def _texts(demo_passages, n=4):
    return [EvalText(p.text, p.id, p.title) for p in demo_passages[:n]]


def test_positions_and_queries_by_hand():
    # stream = [ctx, t1..t10]: chunks of 4 from position 1, the last one short
    spans = chunk_spans(10, 4)
    assert spans == [(1, 5), (5, 9), (9, 11)]
    assert query_spans(spans, 3) == [None, (2, 5), (6, 9)]  # the last 3 tokens before each chunk
    assert query_spans(spans, 8) == [None, (1, 5), (1, 9)]  # never the ctx token at position 0
    assert chunk_spans(8, 4) == [(1, 5), (5, 9)]
    assert chunk_spans(3, 1) == [(1, 2), (2, 3), (3, 4)]
    assert query_spans(chunk_spans(3, 1), 1) == [None, (1, 2), (2, 3)]


def test_plan_decodes_the_last_query_length_tokens(lm, bm25):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=3, query_length=5, **SMALL))
    stream = ralm.scorer.stream("Hydrogen is the lightest element and helium is the second lightest of all.")
    spans, queries = ralm.plan(stream)
    assert spans == chunk_spans(len(stream) - 1, 3) and queries[0] is None
    for (a, _), q in zip(spans[1:], queries[1:]):
        assert q == tok.decode(stream[max(1, a - 5):a])


def test_window_cuts_the_prefix_from_the_left_never_the_scored_tokens():
    stream = list(range(20))
    doc = [100, 101, 102]
    assert window_ids(stream, 15, 19, doc, 10) == [100, 101, 102, 12, 13, 14, 15, 16, 17, 18]
    assert window_ids(stream, 2, 5, doc, 10) == [100, 101, 102, 0, 1, 2, 3, 4]  # short prefix: all of it
    assert window_ids(stream, 15, 19, [], 6) == [13, 14, 15, 16, 17, 18]
    with pytest.raises(ConfigError, match="cannot fit.*--doc-max-length"):
        window_ids(stream, 15, 19, doc, 7)  # 3 + 4 leaves no prefix token


def test_every_text_token_is_scored_once(lm, bm25, demo_passages):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, **SMALL))
    texts = _texts(demo_passages)
    scores = list(ralm.score_texts(texts))
    for t, s in zip(texts, scores):
        ids = tok(t.text, add_special_tokens=False)["input_ids"]
        assert s.tokens.tolist() == ids and s.token_logprobs.shape == (len(ids),)
        assert np.all(s.token_logprobs < 0) and np.all(np.isfinite(s.token_logprobs))
        assert len(s.doc_ids) == math.ceil(len(ids) / 4) and s.doc_ids[0] is None and all(s.doc_ids[1:])
        assert s.n_bytes == len(t.text.encode()) and s.n_words == len(t.text.split())


def _user_sliding_window(model, ids, max_length, stride):
    """The transformers guide "Perplexity of fixed-length models", as a user writes it."""
    nlls, prev_end = [], 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + max_length, ids.size(1))
        trg_len = end - prev_end
        inp = ids[:, begin:end]
        target = inp.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(inp, labels=target).loss
        nlls.append(loss * (trg_len - (1 if begin == 0 else 0)))  # the first window's first token has no label
        prev_end = end
        if end == ids.size(1):
            break
    return torch.stack(nlls).sum().item()


def test_no_retrieval_equals_the_plain_sliding_window_perplexity(lm, demo_passages):
    model, tok = lm
    text = " ".join(p.text for p in demo_passages[:3])
    # the guide's grid: a first window of max_length tokens, then steps of `stride`; ours without retrieval: chunks of
    # window_step = (max_length - 1) // 2 from token 1, whatever the retrieval --stride. They coincide when
    # max_length = 1 + 2·window_step and the text's length is a multiple of the step.
    max_length = 33
    stride = (max_length - 1) // 2
    n = stride * (len(tok(text, add_special_tokens=False)["input_ids"]) // stride)
    ids = tok(text, add_special_tokens=False)["input_ids"][:n]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    ralm = InContextRALM(model, tok, None, RalmConfig(stride=4, max_length=max_length, batch_size=5))
    assert ralm.window_step == stride
    result = evaluate_perplexity(ralm, [text])
    user_ids = torch.tensor([[tok.bos_token_id] + ids])  # the user prepends BOS so the first token is scored too
    expected = _user_sliding_window(model, user_ids, max_length, stride)
    assert result.tokens == len(ids)
    assert result.nll == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected / len(ids)), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(expected / math.log(2) / len(text.encode()), rel=1e-5)
    assert result.word_perplexity == pytest.approx(math.exp(expected / len(text.split())), rel=1e-5)


class _Counting:
    """Wraps a CausalScorer, counting the token positions the LM runs over (every window's length)."""

    def __init__(self, scorer):
        self.scorer, self.positions = scorer, 0
        real = scorer.score_positions

        def counted(windows, positions, **kw):
            self.positions += sum(len(w) for w in windows)
            return real(windows, positions, **kw)

        scorer.score_positions = counted


def test_without_retrieval_the_stride_does_not_matter_and_the_work_is_bounded(lm, demo_passages):
    """Issue #28.9: `rag lm-eval --retrieval none` is plain sliding-window perplexity: the retrieval stride changes
    neither the result nor the work (stride 4 ran one window per 4 tokens: a 155 KB line did not finish in 150 s). Bound:
    windows of max_length tokens advancing by window_step = (max_length - 1) // 2, so the LM runs over at most
    ~max_length / window_step (~2) times the text's tokens and every token sees >= max_length - window_step tokens."""
    model, tok = lm
    text = " ".join(p.text for p in demo_passages[:40])  # ~several thousand tokens, many windows
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    max_length = 64
    results = {}
    for stride in (1, 4, 64):
        ralm = InContextRALM(model, tok, None, RalmConfig(stride=stride, max_length=max_length, batch_size=16))
        counter = _Counting(ralm.scorer)
        results[stride] = (evaluate_perplexity(ralm, [text]).nll, counter.positions)
    assert results[1] == results[4] == results[64]  # identical windows, identical numbers
    step = (max_length - 1) // 2
    assert results[4][1] <= (n // step + 2) * max_length <= 2.2 * n + 2 * max_length
    # the context bound: every scored token after the first window has >= max_length - step tokens before it
    ralm = InContextRALM(model, tok, None, RalmConfig(max_length=max_length))
    stream = ralm.scorer.stream(text)
    from rag.models.ralm.model import window_start
    for a, b in chunk_spans(len(stream) - 1, ralm.window_step):
        c = window_start(a, b, 0, max_length)
        assert a - c >= min(a, max_length - step) and b - c <= max_length


def _one_window_at_a_time(model, tok, retriever, text: EvalText, stride, query_length, max_length, doc_max_length):
    """The authors' loop shape: per stride one retrieval call, one tokenization of the document, one batch-1 window."""
    bos = tok.bos_token_id
    stream = [bos] + tok(text.text, add_special_tokens=False)["input_ids"]
    out = []
    for a in range(1, len(stream), stride):
        b = min(a + stride, len(stream))
        doc = []
        if a > 1:
            query = tok.decode(stream[max(1, a - query_length):a])
            hits = retriever.retrieve([query], 10)
            best = next(p for p in hits.passages[0] if p.title != text.title and p.id != text.id)
            doc = tok(doc_text(best), add_special_tokens=False, truncation=True, max_length=doc_max_length)["input_ids"]
        prefix_room = max_length - len(doc) - (b - a)
        inp = torch.tensor([doc + stream[max(0, a - prefix_room):b]])
        with torch.no_grad():
            logp = torch.log_softmax(model(inp).logits[0, -(b - a) - 1:-1].float(), -1)
        out.append(logp.gather(-1, inp[0, -(b - a):, None]).squeeze(-1).double().numpy())
    return np.concatenate(out)


@pytest.mark.parametrize("stride, query_length", [(4, 8), (3, 16)])
def test_batched_evaluator_equals_one_window_at_a_time(lm, bm25, demo_passages, stride, query_length):
    model, tok = lm
    texts = _texts(demo_passages, 3)
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=stride, query_length=query_length, batch_size=7, **SMALL))
    for t, s in zip(texts, ralm.score_texts(texts)):
        ref = _one_window_at_a_time(model, tok, bm25, t, stride, query_length, SMALL["max_length"], SMALL["doc_max_length"])
        np.testing.assert_allclose(s.token_logprobs, ref, rtol=1e-5, atol=1e-5)


def test_leakage_guard_excludes_the_own_document(lm, bm25, demo_passages):
    model, tok = lm
    texts = _texts(demo_passages, 3)  # each text is a KB passage: unguarded, BM25 retrieves it for itself
    guarded = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=16, **SMALL))
    open_ = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=16, exclude_own=False, **SMALL))
    for t, g, o in zip(texts, guarded.score_texts(texts), open_.score_texts(texts)):
        assert t.id not in g.doc_ids
        assert o.doc_ids.count(t.id) > len(o.doc_ids) // 2
    is_own = own_document_filter(EvalText("x", "wiki/Paris", "Paris"))
    from rag.knowledge.passages import Passage

    assert is_own(Passage("wiki/Paris-3", "Other", "")) and is_own(Passage("q", "Paris", ""))
    assert not is_own(Passage("wiki/Paris-France", "France", "")) and own_document_filter(EvalText("x")) is None


def test_bad_inputs_name_the_option(lm, bm25, tiny_bart_dir):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=8, **SMALL))
    with pytest.raises(RagError, match="shorter than one stride.*--stride 8"):
        list(ralm.score_texts([EvalText("Tin is", "t")]))
    for kw, flag in (({"stride": 0}, "--stride"), ({"query_length": 0}, "--query-length")):
        with pytest.raises(ConfigError, match=flag):
            InContextRALM(model, tok, bm25, RalmConfig(**{**SMALL, **kw}))
    with pytest.raises(ConfigError, match="cannot fit.*--max-length"):
        InContextRALM(model, tok, bm25, RalmConfig(stride=60, max_length=96, doc_max_length=40))
    InContextRALM(model, tok, None, RalmConfig(stride=60, max_length=96, doc_max_length=40))  # no document: fits
    with pytest.raises(ConfigError, match="exceeds the LM's 256 positions"):
        InContextRALM(model, tok, None, RalmConfig(max_length=512))
    from transformers import AutoTokenizer

    from rag.generators.load import load_generator

    bare = AutoTokenizer.from_pretrained(tok.name_or_path)
    bare.pad_token = bare.eos_token = bare.bos_token = None
    with pytest.raises(ConfigError, match="neither a pad/BOS nor an EOS"):
        CausalScorer(model, bare)
    seq2seq, _, _ = load_generator(tiny_bart_dir)
    with pytest.raises(ConfigError, match="decoder-only"):
        CausalScorer(seq2seq, tok)


def test_chunks_reading_the_same_document_share_one_window_and_the_head_split_is_exact(lm, bm25, demo_passages, monkeypatch):
    model, tok = lm
    texts = _texts(demo_passages, 3)
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=2, query_length=16, max_length=128, doc_max_length=40))
    calls = []
    real = ralm.scorer.score_positions
    monkeypatch.setattr(ralm.scorer, "score_positions", lambda w, p, **kw: calls.append(len(w)) or real(w, p, **kw))
    merged = [s.token_logprobs for s in ralm.score_texts(texts)]
    n_chunks = sum(math.ceil(len(tok(t.text, add_special_tokens=False)["input_ids"]) / 2) for t in texts)
    assert sum(calls) < n_chunks  # consecutive chunks often retrieve the same passage
    assert ralm.scorer._head is not None  # GPT-2: base model + LM head reproduce the logits
    ralm.scorer._head = None  # full logits, then gather
    monkeypatch.setattr("rag.models.ralm.model.WINDOW_SLICE", 3)  # and windows built 3 at a time
    for a, b in zip(merged, (s.token_logprobs for s in ralm.score_texts(texts))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for t, lp in zip(texts, merged):
        ref = _one_window_at_a_time(model, tok, bm25, t, 2, 16, 128, 40)
        np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)


def test_leakage_guard_digs_deeper_when_the_own_document_fills_the_top(tmp_path):
    from rag.knowledge.bm25 import BM25Retriever
    from rag.knowledge.passages import Passage
    from rag.models.ralm.model import retrieve_excluding

    own = [Passage(f"doc/tin-{i}", "Tin", f"tin solder pewter bronze part {i}") for i in range(12)]  # a document split in 12
    others = [Passage("doc/lead", "Lead", "lead solder pipes"), Passage("doc/zinc", "Zinc", "zinc bronze brass"),
              Passage("doc/neon", "Neon", "neon lights")]
    r = BM25Retriever.from_passages(own + others, show_progress=False)
    guard = own_document_filter(EvalText("...", "doc/tin", "Tin"))
    (hits,) = retrieve_excluding(r, ["tin solder pewter bronze"], 2, [guard])  # the first 10 hits are all its own
    assert [p.id for p, _ in hits] == ["doc/lead", "doc/zinc"] or [p.id for p, _ in hits] == ["doc/zinc", "doc/lead"]
    (unguarded,) = retrieve_excluding(r, ["tin solder pewter bronze"], 2, [None])
    assert all(p.id.startswith("doc/tin-") for p, _ in unguarded)
    with pytest.raises(RagError, match="only 3 passages remain.*--rerank-k"):
        retrieve_excluding(r, ["tin solder"], 4, [guard])
