"""Scoring windows that start with a shared document: the document's keys and values are computed once and reused.

REPLUG perplexity (and In-Context RALM) reads windows ``doc ∘ stream[c:b]``; a document retrieved for several texts (or
several prefix cuts of one text) starts several windows. :func:`score_after_documents` runs each distinct document
through the LM once per block of ``batch_size`` documents (right-padded, causal: the pads change no real position), then
feeds only the windows' remaining tokens with the block's KV cache, rows selected per window, pads masked, positions
continuing after each document. The log-probabilities equal :meth:`~rag.models.ralm.model.CausalScorer.score_positions` of
the whole windows up to float rounding (the benchmark asserts 1e-4).
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch

from rag.generation.kv_cache import cache_kwarg, output_cache
from rag.utils.errors import RagError

__all__ = ["score_after_documents"]


@torch.no_grad()
def score_after_documents(scorer, docs: Sequence[Sequence[int]], windows: Sequence[tuple[int, Sequence[int], Sequence[int]]], *,
                          progress=None) -> list[np.ndarray]:
    """log p(w[t] | w[:t]) of windows ``w = docs[d] ∘ suffix`` at positions ``t`` (window coordinates).

    Args:
        scorer: a :class:`~rag.models.ralm.model.CausalScorer` (model, pad id, ``batch_size``, LM head split).
        docs: the distinct documents' token ids (each non-empty).
        windows: ``(d, suffix, positions)``: the document index, the tokens after it, and the scored positions, every
            ``t > len(docs[d])`` (the token before a scored one lies in the suffix).

    Returns:
        a float64 array per window, in order; the same values as ``scorer.score_positions([docs[d] + suffix], ...)``.
    """
    model, dev, pad, bs = scorer.model, scorer.device, scorer.pad_id, scorer.batch_size
    by_doc: dict[int, list[int]] = {}
    for i, (d, suffix, pos) in enumerate(windows):
        n = len(docs[d])
        if n == 0 or not suffix or (pos and (min(pos) <= n or max(pos) >= n + len(suffix))):
            raise RagError(f"window {i}: scored positions must lie in ({n}, {n + len(suffix)}) after a non-empty document")
        by_doc.setdefault(d, []).append(i)
    split = scorer.head_split
    body = split[0] if split is not None else model
    out: list = [None] * len(windows)
    order = sorted(by_doc, key=lambda d: len(docs[d]))
    for lo in range(0, len(order), bs):
        block = order[lo:lo + bs]
        width = max(len(docs[d]) for d in block)
        ids = torch.full((len(block), width), pad, dtype=torch.long)
        for r, d in enumerate(block):
            ids[r, :len(docs[d])] = torch.as_tensor(docs[d], dtype=torch.long)
        cache = output_cache(body(input_ids=ids.to(dev), use_cache=True, return_dict=True))
        if not hasattr(cache, "reorder_cache"):  # a model without a transformers Cache: whole windows
            idx = [i for d in block for i in by_doc[d]]
            lps = scorer.score_positions([list(docs[windows[i][0]]) + list(windows[i][1]) for i in idx],
                                         [windows[i][2] for i in idx], progress=progress)
            for i, lp in zip(idx, lps):
                out[i] = lp
            continue
        row_of = {d: r for r, d in enumerate(block)}
        members = sorted((i for d in block for i in by_doc[d]), key=lambda i: len(windows[i][1]))
        for wlo in range(0, len(members), bs):
            idx = members[wlo:wlo + bs]
            s_width = max(len(windows[i][1]) for i in idx)
            inp = torch.full((len(idx), s_width), pad, dtype=torch.long)
            mask = torch.ones((len(idx), width + s_width), dtype=torch.long)
            position_ids = torch.zeros((len(idx), s_width), dtype=torch.long)
            rows, cols, targets = [], [], []
            for r, i in enumerate(idx):
                d, suffix, pos = windows[i]
                n = len(docs[d])
                inp[r, :len(suffix)] = torch.as_tensor(suffix, dtype=torch.long)
                mask[r, n:width] = 0  # the document's right padding in the shared cache
                m = len(suffix)  # the suffix's right padding repeats its last position: n + s_width could pass the
                position_ids[r, :m] = torch.arange(n, n + m)  # LM's window when a shorter document's row is wider
                position_ids[r, m:] = n + m - 1
                rows += [r] * len(pos)
                cols += [t - 1 - n for t in pos]  # the state that predicts window token t
                targets += [suffix[t - n] for t in pos]
            rows_cache = copy.deepcopy(cache)
            rows_cache.reorder_cache(torch.as_tensor([row_of[windows[i][0]] for i in idx], dtype=torch.long, device=dev))
            res = body(input_ids=inp.to(dev), attention_mask=mask.to(dev), position_ids=position_ids.to(dev),
                       **cache_kwarg(body, rows_cache), use_cache=True, return_dict=True)
            r_t = torch.as_tensor(rows, dtype=torch.long, device=dev)
            c_t = torch.as_tensor(cols, dtype=torch.long, device=dev)
            tgt = torch.as_tensor(targets, dtype=torch.long, device=dev)
            states = res.last_hidden_state if split is not None else res.logits
            lp = scorer.target_logprobs(states[r_t, c_t], tgt).double().cpu().numpy()
            at = 0
            for i in idx:
                n_pos = len(windows[i][2])
                out[i] = lp[at:at + n_pos]
                at += n_pos
            if progress is not None:
                progress.update(len(rows))
    return out
