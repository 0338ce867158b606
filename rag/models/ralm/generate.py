"""In-Context RALM generation (Ram et al. 2023, §3): open-ended continuation that re-retrieves every ``s`` generated tokens.

A prompt is read as evaluation reads a text (:meth:`~rag.models.ralm.model.CausalScorer.stream`: ``[ctx] + tokens``). Before
generated token ``j·s`` (j = 0, 1, ...) the last ``ℓ`` tokens of (prompt + generated so far) — never the ctx token —
are the query (Eq. 4); the retrieved document is prepended and the LM window is ``doc ∘ stream[c:]`` with the prefix
cut from the left so that document + prefix + the segment's tokens fit (:func:`~rag.models.ralm.model.window_start`, the
evaluation's rule). The segment's tokens are then decoded with the KV cache of that window.

:class:`RetrievingDecoder` is a search :class:`~rag.generation.search.Decoder`, so the one generic search drives it:
greedy search, sampling (a seeded ``torch.Generator``) and beam search (each beam re-retrieves for its own prefix).
Rows are batched: one retrieval call per boundary for every row still running (identical prefixes are retrieved
once), one left-padded prefill (:class:`~rag.generation.causal.CausalLMDecoder`). Which document was in context for
which generated tokens is returned per sequence as :class:`SegmentProvenance` spans. Rows may be marked not to retrieve
(``retrieve=``): they read the prompt alone, in the same batch (the RetRobust back-off's no-retrieval generation).

With one segment (``stride >= max_new_tokens``) and a fixed document the result is token-identical to
``model.generate(doc ∘ [ctx] ∘ prompt)`` (greedy), since the prefill and the cached steps are the ones transformers runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from rag.generation.answers import Answer, PassageProvenance, SegmentProvenance, through_eos
from rag.generation.causal import CausalLMDecoder
from rag.generation.search import GenerationConfig, beam_search, config_token_id, greedy_search, resolve_spec, sample
from rag.knowledge.passages import Passage
from rag.models.ralm.model import InContextRALM, window_start
from rag.utils.errors import ConfigError, RagError

__all__ = ["SegmentProvenance", "Continuation", "RetrievingDecoder", "ralm_generate"]


@dataclass
class Continuation:
    """One generated continuation of a prompt.

    token_ids: generated ids through the first EOS (padding dropped); log_likelihood: Σ log p of them (beam search: the
    length-penalised beam score); segments: the document in context for each stride segment of `token_ids`;
    passages: the documents, aligned with `segments`.
    """

    prompt: str
    token_ids: list[int]
    log_likelihood: float
    segments: list[SegmentProvenance] = field(default_factory=list)
    passages: list[Passage] = field(default_factory=list)


_Hit = tuple  # (Passage, score, kb_version, query)


class RetrievingDecoder:
    """A search ``Decoder`` over rows continuing prompt streams, re-retrieving every ``stride`` generated tokens.

    `streams`: per row, ``[ctx] + prompt tokens``. At generated position ``j·stride`` (the first ``step`` included) each
    running row retrieves for the last ``query_length`` tokens of its prefix, its window ``doc ∘ prefix`` is built and
    prefilled; other steps feed one token per row with the KV cache. Retrievals are memoised by prefix (``hits``), so
    the provenance of any returned hypothesis can be read back with :meth:`segments`. `retrieving`: per row, False for a
    row that never retrieves (its window is its prefix alone; default: every row retrieves).
    """

    def __init__(self, ralm: InContextRALM, streams: Sequence[Sequence[int]], *, max_new_tokens: int, eos: int, retriever=None,
                 retrieving: Optional[Sequence[bool]] = None):
        self.ralm, self.scorer, self.config = ralm, ralm.scorer, ralm.config
        self.retriever = retriever if retriever is not None else ralm.retriever
        if self.retriever is None:
            raise ConfigError("In-Context RALM generation needs a retriever (--retrieval bm25|dense with --kb)")
        self.histories = [list(s) for s in streams]
        self.max_new_tokens, self.eos = int(max_new_tokens), int(eos)
        self.generated = 0
        self.inner: Optional[CausalLMDecoder] = None
        self.hits: dict[tuple, _Hit] = {}
        self.retrieval_calls = 0
        self.prompt_lens = [len(s) for s in streams]
        self.retrieving = [True] * len(streams) if retrieving is None else [bool(r) for r in retrieving]
        if len(self.retrieving) != len(streams):
            raise RagError(f"retrieving has {len(self.retrieving)} flags for {len(streams)} rows")

    # ------------------------------------------------------------------ Decoder protocol
    def step(self, tokens: Tensor) -> Tensor:
        if self.inner is not None:
            for h, t in zip(self.histories, tokens.tolist()):
                h.append(int(t))
            self.generated += 1
        if self.generated % self.config.stride == 0:
            return self._restart(tokens.device)
        return self.inner.step(tokens)

    def reorder(self, rows: Tensor) -> None:
        idx = rows.tolist()
        self.histories = [list(self.histories[i]) for i in idx]
        self.prompt_lens = [self.prompt_lens[i] for i in idx]
        self.retrieving = [self.retrieving[i] for i in idx]
        self.inner.reorder(rows)

    # ------------------------------------------------------------------ retrieval and windows
    def _finished(self, r: int) -> bool:
        return self.eos in self.histories[r][self.prompt_lens[r]:]

    def _retrieve(self, prefixes: list[tuple]) -> None:
        """Retrieve (one call) for the prefixes not seen yet; the query is their last ``ℓ`` tokens, never the ctx token."""
        new = list(dict.fromkeys(p for p in prefixes if p not in self.hits))
        if not new:
            return
        ql = self.config.query_length
        queries = self.scorer.tokenizer.batch_decode([list(p[max(1, len(p) - ql):]) for p in new])
        reranker = self.ralm.reranker
        k = self.config.k if reranker is not None else 1
        r = self.retriever.retrieve(queries, k)
        self.retrieval_calls += 1
        best = np.zeros(len(new), dtype=np.int64)
        if reranker is not None:
            best = np.asarray(reranker.scores(self.ralm,
                                              [(list(p), len(p), list(ps)) for p, ps in zip(new, r.passages)])).argmax(axis=1)
        for i, (p, q) in enumerate(zip(new, queries)):
            j = int(best[i])
            self.hits[p] = (r.passages[i][j], float(r.scores[i, j]), r.kb_version, q)

    def _restart(self, device) -> Tensor:
        """A segment boundary: retrieve for every running row, prefill ``doc ∘ prefix`` windows, return next-token logits."""
        rows = range(len(self.histories))
        running = [r for r in rows if not self._finished(r)]
        reading = [r for r in running if self.retrieving[r]]
        self._retrieve([tuple(self.histories[r]) for r in reading])
        seg = min(self.config.stride, self.max_new_tokens - self.generated)
        L = self.scorer.max_length
        windows = []
        docs = self.scorer.doc_tokens([self.hits[tuple(self.histories[r])][0] for r in reading]) if reading else []
        doc_of = {**{r: [] for r in running}, **dict(zip(reading, docs))}
        for r in rows:
            h = self.histories[r]
            if r not in doc_of:  # finished: its scores are never used; one token keeps the batch small
                windows.append([self.scorer.pad_id])
                continue
            doc = doc_of[r]
            windows.append(list(doc) + h[window_start(len(h), len(h) + seg, len(doc), L):])
        width = max(len(w) for w in windows)
        ids = torch.full((len(windows), width), self.scorer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(windows), width), dtype=torch.long)
        for i, w in enumerate(windows):
            ids[i, width - len(w):] = torch.as_tensor(w, dtype=torch.long)
            mask[i, width - len(w):] = 1
        ids, mask = ids.to(device), mask.to(device)
        self.inner = CausalLMDecoder(self.scorer.model, ids, mask)
        return self.inner.step(ids[:, -1])

    # ------------------------------------------------------------------ provenance
    def segments(self, stream: Sequence[int], generated: Sequence[int]) -> tuple[list[SegmentProvenance], list[Passage]]:
        """The segments of a hypothesis: prompt `stream` continued by `generated` (ids through EOS)."""
        out, passages = [], []
        s = self.config.stride
        for a in range(0, len(generated), s):
            hit = self.hits.get(tuple(stream) + tuple(generated[:a]))
            if hit is None:  # cannot happen: every boundary of a returned hypothesis was retrieved for
                raise RagError(f"no retrieval recorded for generated position {a}; this is a bug")
            p, score, version, query = hit
            out.append(SegmentProvenance(a, min(a + s, len(generated)), p.id, p.title, score, version, query))
            passages.append(p)
        return out, passages


def check_new_token_lengths(config: GenerationConfig) -> None:
    """Refuse ``max_length`` / ``min_length``: a generation whose window holds a document counts new tokens."""
    if config.max_length is not None or config.min_length:
        raise ConfigError("In-Context RALM / REPLUG generation counts new tokens: use max_new_tokens / min_new_tokens, not "
                          "max_length / min_length (the window holds a retrieved document before the prompt)")


def ralm_generate(ralm: InContextRALM, prompts: Sequence[str], config: GenerationConfig = GenerationConfig(), *,
                  retriever=None, rng: Optional[torch.Generator] = None,
                  retrieve: Optional[Sequence[bool]] = None) -> list[Continuation]:
    """Continue each prompt with In-Context RALM: re-retrieval every ``ralm.config.stride`` generated tokens with a query
    of the last ``ralm.config.query_length`` tokens, the document prepended (see the module docstring).

    config: greedy (default), sampling (``do_sample``, with `rng` a seeded ``torch.Generator`` on the LM's device) or
    beam search (``num_beams``; ``num_return_sequences`` best per prompt). Lengths are ``max_new_tokens`` /
    ``min_new_tokens`` (``max_length`` / ``min_length`` count a prompt whose window changes, and are refused).
    retriever: overrides ``ralm.retriever`` (e.g. one knowledge-base version pinned for the call).
    retrieve: per prompt, False to continue it without retrieval (the LM on the prompt alone; no segments), in the same
    batch as the others (default: every prompt retrieves).
    Returns ``len(prompts) * num_return_sequences`` continuations, best first per prompt.
    """
    check_new_token_lengths(config)
    scorer = ralm.scorer
    model = scorer.model
    streams = [scorer.stream(p) for p in prompts]
    retrieve = [True] * len(streams) if retrieve is None else [bool(r) for r in retrieve]
    if len(retrieve) != len(streams):
        raise RagError(f"retrieve has {len(retrieve)} flags for {len(streams)} prompts; give one per prompt")
    if any(len(s) < 2 for s in streams):
        raise RagError("every prompt needs at least one token; give it text")
    eos = config_token_id(config, model, "eos_token_id", False)
    eos = scorer.tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ConfigError("the LM has no EOS token id; set tokenizer.eos_token or pass eos_token_id")
    config = replace(config, eos_token_id=int(eos), pad_token_id=config.pad_token_id if config.pad_token_id is not None
                     else scorer.pad_id)
    width = max(len(s) for s in streams)
    start = torch.full((len(streams), width), scorer.pad_id, dtype=torch.long)
    for i, s in enumerate(streams):
        start[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
    start = start.to(scorer.device)
    spec = resolve_spec(config, model, prompt_len=width, pad_fallback=int(eos))
    beams, n_ret = config.num_beams, config.num_return_sequences
    if beams == 1:
        if n_ret != 1:
            raise ConfigError("num_return_sequences > 1 needs beam search (num_beams >= num_return_sequences)")
        decoder = RetrievingDecoder(ralm, streams, max_new_tokens=config.max_new_tokens, eos=spec.eos, retriever=retriever,
                                    retrieving=retrieve)
        seqs, scores = (sample(decoder, start, spec, rng) if config.do_sample else greedy_search(decoder, start, spec))
        owners = list(range(len(streams)))
    else:
        if n_ret > beams:
            raise ConfigError(f"num_return_sequences={n_ret} exceeds num_beams={beams}")
        decoder = RetrievingDecoder(ralm, [s for s in streams for _ in range(beams)], max_new_tokens=config.max_new_tokens,
                                    eos=spec.eos, retriever=retriever, retrieving=[r for r in retrieve for _ in range(beams)])
        found = beam_search(decoder, start, spec)
        seqs, scores, _ = found.crop(n_ret)
        seqs, scores = seqs.reshape(-1, seqs.shape[-1]), scores.reshape(-1)
        owners = [i for i in range(len(streams)) for _ in range(n_ret)]
    out = []
    for row, i in enumerate(owners):
        gen = through_eos(seqs[row, width:].tolist(), spec.eos)
        segments, passages = decoder.segments(streams[i], gen) if retrieve[i] else ([], [])
        out.append(Continuation(prompts[i], gen, float(scores[row]), segments, passages))
    return out


def continuation_text(tok, stream: list[int], generated: list[int]) -> str:
    """The generated tokens' text as it continues the prompt (``stream`` = ctx + prompt tokens)."""
    prompt_ids = stream[1:]
    special = set(tok.all_special_ids)
    shown = [t for t in generated if t not in special]
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + shown, skip_special_tokens=True)
    return full[len(before):] if full.startswith(before) else tok.decode(shown, skip_special_tokens=True)


def continuation_answer(ralm, c: "Continuation", kb_version: str) -> Answer:
    """An In-Context RALM continuation as an :class:`Answer`: each document read once in its passages, segments kept."""
    tok = ralm.scorer.tokenizer
    versions = {s.kb_version for s in c.segments}
    if versions - {kb_version}:  # cannot happen: the call's retriever serves one pinned version
        raise RuntimeError(f"one generation read passages of several knowledge bases: {sorted(versions)}")
    text = continuation_text(tok, ralm.scorer.stream(c.prompt), c.token_ids)
    seen: dict = {}
    for p, seg in zip(c.passages, c.segments):
        seen.setdefault((p.id, p.title, p.text), PassageProvenance(p.id, p.title, p.text, seg.score, 1.0))
    return Answer(c.prompt, text, c.log_likelihood, kb_version, list(seen.values()),
                  tokens=tok.convert_ids_to_tokens(c.token_ids), segments=c.segments)
