"""In-Context RALM generation: equality with transformers' generate on doc ∘ prompt, retrieval positions and queries,
the per-segment loop, sampling and beam search, provenance spans."""

from __future__ import annotations

import pytest
import torch

from rag.generation.search import GenerationConfig
from rag.knowledge.passages import Passage
from rag.knowledge.types import Retrieved
from rag.models.ralm.generate import ralm_generate
from rag.models.ralm.model import InContextRALM, RalmConfig, doc_text, window_start
from rag.utils.errors import ConfigError

SMALL = dict(max_length=96, doc_max_length=24)
PROMPTS = ["Hydrogen is the lightest element and", "The noble gases are"]


class Recording:
    """A real retriever whose calls are recorded: ``calls[i]`` = the queries of call i."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def retrieve(self, queries, k):
        self.calls.append(list(queries))
        return self.inner.retrieve(queries, k)


class Fixed:
    """Returns one fixed passage for every query (score 1.0)."""

    def __init__(self, passage: Passage):
        self.passage, self.calls = passage, []

    def retrieve(self, queries, k):
        self.calls.append(list(queries))
        n = len(queries)
        return Retrieved(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1), [[self.passage] for _ in queries], None,
                         "fixed-v1")


def _user_window(tok, passage, prompt, doc_max_length):
    """doc ∘ [BOS] ∘ prompt, as a user builds it from the documented rule."""
    doc = tok(doc_text(passage), add_special_tokens=False)["input_ids"][:doc_max_length]
    return doc + [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("n_new", [5, 12])
def test_one_segment_equals_transformers_generate(lm, demo_passages, n_new):
    model, tok = lm
    doc = demo_passages[3]
    ralm = InContextRALM(model, tok, Fixed(doc), RalmConfig(stride=n_new, query_length=8, **SMALL))
    for prompt in PROMPTS:
        [c] = ralm_generate(ralm, [prompt], GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new))
        ids = torch.tensor([_user_window(tok, doc, prompt, SMALL["doc_max_length"])])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        assert c.token_ids == ref[0, ids.shape[1]:].tolist() and len(c.token_ids) == n_new
        assert [(s.start, s.end, s.passage_id) for s in c.segments] == [(0, n_new, doc.id)]


def test_batch_equals_transformers_generate_left_padded(lm, demo_passages):
    model, tok = lm
    doc = demo_passages[0]
    ralm = InContextRALM(model, tok, Fixed(doc), RalmConfig(stride=6, query_length=8, **SMALL))
    found = ralm_generate(ralm, PROMPTS, GenerationConfig(max_new_tokens=6, min_new_tokens=6))
    rows = [_user_window(tok, doc, p, SMALL["doc_max_length"]) for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert [c.token_ids for c in found] == ref[:, width:].tolist()


def _segment_loop(model, tok, retriever, prompt, n_new, stride, query_length, max_length, doc_max_length):
    """The straightforward loop: per segment one retrieval, one window doc ∘ prefix, transformers' greedy generate."""
    stream = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
    gen, queries = [], []
    while len(gen) < n_new:
        prefix = stream + gen
        query = tok.decode(prefix[max(1, len(prefix) - query_length):])
        queries.append(query)
        p = retriever.retrieve([query], 1).passages[0][0]
        doc = tok(doc_text(p), add_special_tokens=False)["input_ids"][:doc_max_length]
        seg = min(stride, n_new - len(gen))
        window = doc + prefix[window_start(len(prefix), len(prefix) + seg, len(doc), max_length):]
        ids = torch.tensor([window])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=seg, min_new_tokens=seg,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        gen += out[0, ids.shape[1]:].tolist()
    return gen, queries


@pytest.mark.parametrize("stride, query_length, max_length", [(3, 4, 96), (4, 16, 60)])
def test_retrieval_positions_queries_and_segments(lm, bm25, stride, query_length, max_length):
    model, tok = lm
    n_new = 10
    rec = Recording(bm25)
    cfg = RalmConfig(stride=stride, query_length=query_length, max_length=max_length, doc_max_length=24)
    ralm = InContextRALM(model, tok, rec, cfg)
    [c] = ralm_generate(ralm, [PROMPTS[0]], GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new))
    # retrieval happens before generated tokens 0, s, 2s, ... and never after the last one
    starts = list(range(0, n_new, stride))
    assert len(rec.calls) == len(starts) and all(len(q) == 1 for q in rec.calls)
    stream = [tok.bos_token_id] + tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    for (q,), a in zip(rec.calls, starts):
        prefix = stream + c.token_ids[:a]
        assert q == tok.decode(prefix[max(1, len(prefix) - query_length):])  # exactly the last ℓ tokens, never BOS
    assert [(s.start, s.end) for s in c.segments] == [(a, min(a + stride, n_new)) for a in starts]
    assert [s.query for s in c.segments] == [q for (q,) in rec.calls]
    hits = [bm25.retrieve(q, 1) for q in rec.calls]
    assert [s.passage_id for s in c.segments] == [h.passages[0][0].id for h in hits]
    assert [s.score for s in c.segments] == pytest.approx([float(h.scores[0, 0]) for h in hits])
    # and the whole generation equals the straightforward per-segment loop
    ref, queries = _segment_loop(model, tok, bm25, PROMPTS[0], n_new, stride, query_length, max_length, 24)
    assert c.token_ids == ref and queries == [s.query for s in c.segments]


def test_batched_rows_retrieve_together_and_match_one_by_one(lm, bm25):
    model, tok = lm
    rec = Recording(bm25)
    ralm = InContextRALM(model, tok, rec, RalmConfig(stride=4, query_length=8, **SMALL))
    cfg = GenerationConfig(max_new_tokens=9, min_new_tokens=9)
    both = ralm_generate(ralm, PROMPTS, cfg)
    assert len(rec.calls) == 3 and all(len(q) == 2 for q in rec.calls)  # one call per boundary for both rows
    alone = [ralm_generate(InContextRALM(model, tok, bm25, ralm.config), [p], cfg)[0] for p in PROMPTS]
    assert [c.token_ids for c in both] == [c.token_ids for c in alone]
    assert [[s.passage_id for s in c.segments] for c in both] == [[s.passage_id for s in c.segments] for c in alone]


def test_sampling_is_seeded_and_beams_carry_provenance(lm, bm25):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=3, query_length=8, **SMALL))
    cfg = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20)
    a = ralm_generate(ralm, PROMPTS, cfg, rng=torch.Generator().manual_seed(7))
    b = ralm_generate(ralm, PROMPTS, cfg, rng=torch.Generator().manual_seed(7))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [[s.passage_id for s in c.segments] for c in a] == [[s.passage_id for s in c.segments] for c in b]
    greedy = ralm_generate(ralm, PROMPTS, GenerationConfig(max_new_tokens=8, min_new_tokens=8))
    beams = ralm_generate(ralm, PROMPTS,
                          GenerationConfig(max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=2))
    assert len(beams) == 4
    for c in beams:  # each hypothesis' documents are those its own prefixes retrieve
        stream = [tok.bos_token_id] + tok(c.prompt, add_special_tokens=False)["input_ids"]
        for s in c.segments:
            prefix = stream + c.token_ids[:s.start]
            assert s.passage_id == bm25.retrieve([tok.decode(prefix[max(1, len(prefix) - 8):])], 1).passages[0][0].id
    for first, second in zip(beams[::2], beams[1::2]):  # best first per prompt
        assert first.log_likelihood >= second.log_likelihood
    assert len(greedy) == 2


def test_bad_settings(lm, bm25):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, **SMALL))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        ralm_generate(ralm, PROMPTS, GenerationConfig(max_length=40))
    with pytest.raises(ConfigError, match="--stride"):
        InContextRALM(model, tok, bm25, RalmConfig(stride=90, query_length=8, **SMALL))
    with pytest.raises(ConfigError, match="retriever"):
        ralm_generate(InContextRALM(model, tok, None, RalmConfig(**SMALL)), PROMPTS)
