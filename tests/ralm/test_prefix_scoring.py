"""Windows that start with a shared document score the same with the document's keys and values computed once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.models.ralm.model import CausalScorer
from rag.models.ralm.prefix_scoring import score_after_documents
from rag.utils.errors import RagError


@pytest.mark.parametrize("split_head", [True, False])
def test_shared_document_cache_equals_whole_windows(lm, split_head):
    model, tok = lm
    scorer = CausalScorer(model, tok, batch_size=3)
    if not split_head:
        scorer._head = None  # the full-logits path
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    docs = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (7, 3, 12, 5)]
    windows = []
    for w in range(11):  # several windows per document, suffixes of different lengths, scattered scored positions
        d = w % len(docs)
        suffix = torch.randint(5, vocab, (2 + (5 * w) % 9,), generator=g).tolist()
        n = len(docs[d])
        windows.append((d, suffix, list(range(n + 1, n + len(suffix)))[w % 2::1 + w % 2]))
    got = score_after_documents(scorer, docs, windows)
    want = scorer.score_positions([docs[d] + s for d, s, _ in windows], [p for *_, p in windows])
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(RagError, match="scored positions"):
        score_after_documents(scorer, docs, [(0, [5, 6], [len(docs[0])])])  # predicted from the document's last token


def test_windows_that_fill_the_lm_window_in_one_batch(lm):
    """A long document with a short suffix batched with a short document and a long suffix: each window fits the
    LM's positions, the padded batch would not (the long-stream In-Context RALM case)."""
    model, tok = lm
    limit = model.config.n_positions
    scorer = CausalScorer(model, tok, batch_size=4)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (limit - 4, 3)]
    suffixes = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (4, limit - 3)]
    windows = [(d, s, list(range(len(docs[d]) + 1, len(docs[d]) + len(s)))) for d, s in enumerate(suffixes)]
    got = score_after_documents(scorer, docs, windows)
    want = scorer.score_positions([docs[d] + s for d, s, _ in windows], [p for *_, p in windows])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
