"""RAG decoding (Lewis et al. 2020, §2.5): RAG-Token beam search / greedy, RAG-Sequence thorough and fast.

The RAG layer over the generic pieces: `rag.generation.search` (greedy / beam search over a `Decoder`),
`rag.generation.seq2seq` (encoded contexts, incremental decoders, teacher-forced rescoring) and
`rag.generation.marginalize` (the document marginals). It works on a seq2seq generator in eval mode and on
already-encoded contexts: row `b * n_docs + k` of the contexts is question `b` joined with its `k`-th
retrieved passage, and `doc_scores[b, k]` is that passage's retrieval score (`q · d`).

Efficiency by design (ARCHITECTURE invariant 2; `benchmarks/decode_bench.py`, docs/benchmarks.md "Decoding";
the encoder / cache / rescoring notes live in `rag.generation.seq2seq` and `rag.generation.bart`):

* RAG-Token decodes `batch * num_beams * n_docs` decoder rows per step, mixed per (question, beam) by
  `TokenMarginalDecoder` (Eq. 2, one step); cross-attention keys/values are shared by the beams of a context.
* RAG-Sequence searches all questions' passages in one batched search (transformers: one per question).
* Thorough decoding scores every (candidate, passage) pair in one teacher-forced decoder pass on the
  keys/values the search already computed, stopping each candidate at its EOS (`rescore_batch_size` bounds
  the logits memory).

The search follows transformers' (v5) beam search exactly (see `rag.generation.search`), so outputs are
token-identical to `RagTokenForGeneration.generate` and to `RagSequenceForGeneration.generate` (see
`rag_sequence_generate` for the differences that remain and why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
from torch import Tensor

from rag.generation.causal import CausalPrompts
from rag.generation.marginalize import doc_log_prior, token_marginal_logprobs
from rag.generation.search import (
    Decoder,
    GenerationConfig,
    SearchSpec,
    beam_search,
    greedy_search,
    sample,
)
from rag.generation.seq2seq import EncodedContexts, encode_contexts
from rag.generation.spans import PassageSpans
from rag.utils.errors import ConfigError, RagError

__all__ = [
    "GenerationConfig",
    "EncodedContexts",
    "GenerationOutput",
    "DocumentHypotheses",
    "TokenMarginalDecoder",
    "encode_contexts",
    "CausalPrompts",
    "DecodingContexts",
    "token_marginal_search",
    "rag_token_generate",
    "generate_per_document",
    "teacher_forced_logprobs",
    "rag_sequence_generate",
]


@dataclass(frozen=True)
class GenerationOutput:
    """What a RAG decoder returns, `R = num_return_sequences` rows per question, best first.

    sequences:      `(batch * R, T)` token ids starting with the decoder start token, pad-filled after EOS.
    scores:         `(batch * R,)` the value the sequences were ranked by (RAG-Token beam search: the
                    length-penalised beam score; RAG-Sequence: the marginal log-likelihood estimate).
    log_likelihood: `(batch * R,)` `log p(y|x)` without length penalty, under the decoder's approximation.
    doc_posteriors: `(batch * R, n_docs)` `p(z|x, y)` (RAG-Sequence only, else None); rows of returned
                    padding candidates are all zero.
    """

    sequences: Tensor
    scores: Tensor
    log_likelihood: Tensor
    doc_posteriors: Tensor | None = None


@dataclass(frozen=True)
class DocumentHypotheses:
    """Per-passage search results (RAG-Sequence's first stage), `N = batch * n_docs` contexts, `M = num_beams`.

    sequences:      `(N, M, T)` hypotheses of each context, best first (pad-filled).
    scores:         `(N, M)` beam scores (length-penalised; greedy: the log-likelihood).
    log_likelihood: `(N, M)` `log p(y|x, z)` of each hypothesis (forced tokens count 0); -inf for a beam slot
                    that never received a finished hypothesis.
    """

    sequences: Tensor
    scores: Tensor
    log_likelihood: Tensor


class DecodingContexts(Protocol):
    """What the decoders read, row `b * n_docs + k` being question `b` with its `k`-th passage: a seq2seq generator's
    encoded contexts (`EncodedContexts`) or a causal generator's prompts (`CausalPrompts`). Each kind says how its
    searches start and builds the `Decoder` rows and the teacher-forced rescoring over it, so the decoders below are
    written once for every generator (`rag.generators` makes these contexts)."""

    def __len__(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def search_spec(self, config: GenerationConfig, generator) -> SearchSpec:
        """The resolved spec of a search from one start token (`max_length` = 1 + the generated tokens)."""

    def start_tokens(self, config: GenerationConfig, generator, rows: Tensor) -> Tensor:
        """`(len(rows), 1)` start tokens of the searches of contexts `rows`."""

    def check_shared_start(self, start: Tensor, n_docs: int) -> None:
        """Raise unless the `n_docs` contexts of each question start from its token `start` `(batch, 1)` (RAG-Token)."""

    def decoder(self, generator, context_of_row: Tensor, keep_cross_kv: bool = False) -> Decoder:
        """A `Decoder` whose row `i` reads context `context_of_row[i]`; `keep_cross_kv`: keep what rescoring reuses."""

    def teacher_forced(self, generator, sequences: Tensor, context_index: Tensor, max_rows: int | None = None,
                       cross_kv=None, eos: int | None = None) -> Tensor:
        """`log p(y_t | x, z, y_<t)` `(C, K, T - 1)` of sequences `(C, T)` under contexts `context_index` `(C, K)`."""


Contexts = DecodingContexts
"""What the decoders read (kept name): any `DecodingContexts`."""


def _check_contexts(contexts: Contexts, doc_scores: Tensor, name: str = "contexts") -> tuple[int, int]:
    if doc_scores.dim() != 2:
        raise RagError(f"doc_scores must be (batch, n_docs), got shape {tuple(doc_scores.shape)}")
    batch, n_docs = doc_scores.shape
    if len(contexts) != batch * n_docs:
        raise RagError(
            f"{name} hold {len(contexts)} rows but doc_scores is {tuple(doc_scores.shape)}: "
            f"expected batch * n_docs = {batch * n_docs} context rows (question-major, one per retrieved passage)")
    return batch, n_docs


class TokenMarginalDecoder:
    """A search `Decoder` over `rows` hypotheses, each mixing `n_docs` rows of an inner decoder (RAG-Token, Eq. 2;
    REPLUG's per-token ensemble): `log Σ_z p(z|x) p(· | x, z, y_<t)` per step.

    inner: a `Decoder` with `rows * n_docs` rows, row `r * n_docs + k` being hypothesis `r` under document `k`.
    log_prior: `(rows, n_docs)` document log-priors `log p(z|x)` of each hypothesis' input.
    """

    def __init__(self, inner: Decoder, log_prior: Tensor):
        self.inner = inner
        self.log_prior = log_prior
        self.n_docs = log_prior.shape[1]
        self.docs = torch.arange(self.n_docs, device=log_prior.device)

    def step(self, tokens: Tensor) -> Tensor:
        """tokens `(rows,)` -> marginal next-token log-probs `(rows, vocab)`."""
        logits = self.inner.step(tokens.repeat_interleave(self.n_docs))
        doc_logprobs = torch.log_softmax(logits, -1).view(tokens.shape[0], self.n_docs, -1)
        return token_marginal_logprobs(doc_logprobs, self.log_prior)  # Eq. 2, one step

    def reorder(self, rows: Tensor) -> None:
        """Hypothesis `i` continues from `rows[i]`: move all of its documents' inner rows."""
        self.inner.reorder((rows[:, None] * self.n_docs + self.docs).reshape(-1))


def _spec(config: GenerationConfig, generator, contexts: Contexts) -> SearchSpec:
    """The search spec for RAG decoding: one start token, the decoder start token (seq2seq) or the last prompt token
    (causal: lengths count only it, so `max_length` = 1 + the generated tokens for both kinds)."""
    if config.do_sample:
        raise ConfigError("GenerationConfig.do_sample: RAG-Token / RAG-Sequence decoding does not sample; "
                          "use do_sample=False (greedy or beam search)")
    return contexts.search_spec(config, generator)


@torch.no_grad()
def teacher_forced_logprobs(generator, contexts: Contexts, sequences: Tensor, context_index: Tensor,
                            batch_size: int | None = None) -> Tensor:
    """`log p(y_t | x, z, y_<t)` `(C, K, T - 1)` of sequences `(C, T)` (starting with the start token) under each of
    their contexts `context_index` `(C, K)`, reusing the encoder states / prompt KV caches
    (`rag.generation.seq2seq.teacher_forced_logprobs`, `rag.generation.causal.causal_teacher_forced`)."""
    return contexts.teacher_forced(generator, sequences, context_index, max_rows=batch_size)


# ----------------------------------------------------------------------------------------------------------
# RAG-Token


@torch.no_grad()
def token_marginal_search(decoder: Decoder, start: Tensor, log_prior: Tensor, spec: SearchSpec,
                          rng: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The one RAG-Token / REPLUG search: greedy, sampling (`spec.cfg.do_sample`) or beam search over the per-step
    mixture `log Σ_z p(z|x) p(y_t | x, z, y_<t)` (Eq. 2) of `decoder`'s rows.

    decoder: `items * beams * n_docs` rows (item-major, then beam, then document); start `(items, S)`; log_prior
    `(items, n_docs)`. Returns sequences `(items * R, T)`, the ranking scores and the log-likelihoods `(items * R,)`
    (`R = num_return_sequences`; greedy and sampling: the log-likelihood for both).
    """
    cfg = spec.cfg
    beams = cfg.num_beams
    if beams == 1:
        if cfg.num_return_sequences != 1:
            raise ConfigError("GenerationConfig.num_return_sequences > 1 needs beam search (num_beams >= num_return_sequences)")
        mixed = TokenMarginalDecoder(decoder, log_prior)
        seqs, loglik = sample(mixed, start, spec, rng) if cfg.do_sample else greedy_search(mixed, start, spec)
        return seqs, loglik, loglik
    if cfg.num_return_sequences > beams:
        raise ConfigError(f"GenerationConfig.num_return_sequences={cfg.num_return_sequences} exceeds num_beams={beams}: "
                          "beam search returns at most num_beams sequences per input")
    found = beam_search(TokenMarginalDecoder(decoder, log_prior.repeat_interleave(beams, 0)), start, spec)
    seqs, scores, loglik = found.crop(cfg.num_return_sequences)
    return seqs.reshape(-1, seqs.shape[-1]), scores.reshape(-1), loglik.reshape(-1)


@torch.no_grad()
def rag_token_generate(generator, contexts: Contexts, doc_scores: Tensor,
                       config: GenerationConfig = GenerationConfig(), spans: PassageSpans | None = None) -> GenerationOutput:
    """RAG-Token decoding (§2.5): greedy (`num_beams=1`) or beam search over the marginal transition
    `p'(y_i|x, y_<i) = Σ_z p(z|x) p(y_i|x, z, y_<i)` (Eq. 2), with `p(z|x) = softmax(doc_scores)`.

    contexts: the encoded `(batch * n_docs)` contexts (`encode_contexts`), or a causal generator's prompts
    (`CausalPrompts`: the K prompts of a question end with the same token, the search's start token; each keeps its
    own KV cache, REPLUG's ensemble); doc_scores `(batch, n_docs)`. One decoder step runs `batch * num_beams * n_docs`
    rows with the KV cache. Seq2seq: token-identical to `transformers.RagTokenForGeneration.generate` given the same
    contexts, doc scores and options. Returns `GenerationOutput` with `batch * num_return_sequences` rows
    (`doc_posteriors` None); sequences start with the start token. `spans`: extractive decoding, every answer a span
    of its question's K passages (:class:`~rag.generation.spans.PassageSpans`, one entry per context).
    """
    batch, n_docs = _check_contexts(contexts, doc_scores)
    spec = _spec(config, generator, contexts)
    beams = config.num_beams
    if spans is not None:
        spec = replace(spec, allowed=spans.constraint([range(q * n_docs, (q + 1) * n_docs) for q in range(batch)
                                                       for _ in range(beams)], spec.eos))
    if config.num_return_sequences > beams:
        raise ConfigError(f"GenerationConfig.num_return_sequences={config.num_return_sequences} exceeds num_beams="
                          f"{beams}: RAG-Token beam search returns at most num_beams sequences per question")
    device = doc_scores.device
    docs = torch.arange(n_docs, device=device)
    first = torch.arange(batch, device=device) * n_docs
    start = contexts.start_tokens(config, generator, first)
    contexts.check_shared_start(start, n_docs)
    # Decoder rows are (question, beam, doc): row -> context question * n_docs + doc.
    context_of_row = (first[:, None, None] + docs).expand(batch, beams, n_docs)
    log_prior = doc_log_prior(doc_scores.float())  # (batch, n_docs)
    seqs, scores, loglik = token_marginal_search(contexts.decoder(generator, context_of_row.reshape(-1)), start,
                                                 log_prior, spec)
    return GenerationOutput(sequences=seqs, scores=scores, log_likelihood=loglik)


# ----------------------------------------------------------------------------------------------------------
# RAG-Sequence


@torch.no_grad()
def generate_per_document(generator, contexts: Contexts,
                          config: GenerationConfig = GenerationConfig()) -> DocumentHypotheses:
    """Search each context on its own, `p(y|x, z)` without the document prior (RAG-Sequence's first stage).

    All `N = batch * n_docs` contexts are searched in one batched call (`N * num_beams` decoder rows, KV
    cache); `num_beams=1` is greedy search. Returns every context's `num_beams` hypotheses, best first.
    """
    return _per_document(generator, contexts, config)[0]


def _per_document(generator, contexts: Contexts, config: GenerationConfig, keep_cross_kv: bool = False,
                  spans: PassageSpans | None = None):
    """`generate_per_document`, plus (with `keep_cross_kv`) the per-context cross-attention keys/values it
    computed, or None. `spans`: each context's answers are spans of its passage (extractive decoding)."""
    spec = _spec(config, generator, contexts)
    items, beams = len(contexts), config.num_beams
    if spans is not None:
        spec = replace(spec, allowed=spans.constraint([(i,) for i in range(items) for _ in range(beams)], spec.eos))
    rows = torch.arange(items, device=doc_device(contexts))
    start = contexts.start_tokens(config, generator, rows)
    decoder = contexts.decoder(generator, rows.repeat_interleave(beams), keep_cross_kv=keep_cross_kv)
    cross_kv = lambda: getattr(decoder, "cross_kv", None)  # noqa: E731  (set by the first step)
    if beams == 1:
        seqs, loglik = greedy_search(decoder, start, spec)
        hyps = DocumentHypotheses(sequences=seqs[:, None], scores=loglik[:, None], log_likelihood=loglik[:, None])
        return hyps, cross_kv()
    found = beam_search(decoder, start, spec)
    seqs, scores, loglik = found.crop(beams)
    return DocumentHypotheses(sequences=seqs, scores=scores, log_likelihood=loglik), cross_kv()


def doc_device(contexts: Contexts) -> torch.device:
    return contexts.device


def _per_doc_terms(token_lp: Tensor, targets: Tensor, log_prior: Tensor, question: Tensor, spec: SearchSpec,
                   convention: str) -> Tensor:
    """`log p(z|x) + log p(y|x, z)` per candidate and document `(C, K)` from token log-probs `(C, K, T-1)`."""
    if convention == "paper":
        is_eos = targets == spec.eos
        counted = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to and including the first EOS
        forced = torch.zeros_like(counted)
        if spec.cfg.forced_bos_token_id is not None:
            forced[:, 0] = targets[:, 0] == spec.cfg.forced_bos_token_id
        if spec.cfg.forced_eos_token_id is not None and targets.shape[1] >= spec.max_length - 1:
            forced[:, spec.max_length - 2] = targets[:, spec.max_length - 2] == spec.cfg.forced_eos_token_id
        keep = counted & ~forced
        return log_prior + token_lp.masked_fill(~keep[:, None, :], 0.0).sum(-1)
    # transformers' RagSequenceForGeneration.get_nll(exclude_bos_score=True): prior added on the second target
    # token, pad-id targets dropped (with whatever prior they carried), and the first token dropped when every
    # candidate of the question starts with BOS.
    terms = token_lp.clone()
    if terms.shape[-1] > 1:
        terms[:, :, 1] = terms[:, :, 1] + log_prior
    terms = terms.masked_fill((targets == spec.pad)[:, None, :], 0.0)
    summed = terms.sum(-1)
    if spec.bos is not None:
        starts_bos = (targets[:, 0] == spec.bos).long()
        n_q = int(question.max()) + 1
        all_bos = torch.zeros(n_q, dtype=torch.long, device=targets.device).index_add_(0, question, 1 - starts_bos) == 0
        summed = torch.where(all_bos[question][:, None], terms[:, :, 1:].sum(-1), summed)
    return summed


def _span_held(spans: PassageSpans, cands: Tensor, cand_q: list[int], producers: list[dict], n_docs: int,
               spec) -> Tensor:
    """``(C, n_docs)``: whether passage d of candidate c's question holds it as a span, or produced it in its search."""
    skip = [t for t in (spec.eos, spec.pad) if t is not None]
    rows = [row[spec.prompt_len:] for row in cands.tolist()]  # the answer, after the search's start tokens
    held = torch.zeros(len(rows), n_docs, dtype=torch.bool)
    for c, (q, row) in enumerate(zip(cand_q, rows)):
        for d in range(n_docs):
            held[c, d] = d in producers[c] or spans.holds(q * n_docs + d, row, skip)
    return held.to(cands.device)


@torch.no_grad()
def rag_sequence_generate(generator, contexts: Contexts, doc_scores: Tensor,
                          config: GenerationConfig = GenerationConfig(),
                          decoding: Literal["thorough", "fast"] = "thorough", dedup: bool = True,
                          convention: Literal["transformers", "paper"] = "transformers",
                          rescore_batch_size: int | None = None,
                          search_contexts: EncodedContexts | None = None,
                          spans: PassageSpans | None = None) -> GenerationOutput:
    """RAG-Sequence decoding (§2.5): search every passage, pool the hypotheses, rank by `p(y|x)` (Eq. 1).

    1. `generate_per_document`: `num_beams` hypotheses per (question, passage), scored by `p(y|x, z)` alone
       (the document prior is constant within one passage's search; paper and transformers agree). With
       `num_beams=1` this is the paper's greedy QA mode (one candidate per passage).
    2. Candidates of a question = its `n_docs * num_beams` hypotheses in (passage, beam rank) order; with
       `dedup` identical token sequences are kept once (first occurrence), else duplicates stay and tie.
    3. Ranking, `decoding=`:
       * "thorough": `p(y|x) = Σ_z p(z|x) p(y|x, z)` over all passages, `p(y|x, z)` from ONE batched
         teacher-forced decoder pass over every (candidate, passage) pair on the stored encoder states and the
         search's cross-attention keys/values, `rescore_batch_size` rows at a time (None: automatic, see
         `teacher_forced_logprobs`). (The paper runs the extra pass only for passages whose beam lacks `y`;
         same value.)
       * "fast": the paper's approximation `p(y|x, z) ≈ 0` unless `y` is in passage `z`'s beam: score =
         logsumexp over the passages that produced `y` of `log p(z|x) + log p(y|x, z)` (beam log-likelihoods,
         unpenalised), no extra decoder pass. transformers has no fast decoding.
    4. The best `num_return_sequences` candidates per question are returned (all-pad rows with score -inf
       when a question has fewer candidates; transformers raises instead).

    `convention` selects how "thorough" turns token log-probs into `log p(y|x, z)`:
      * "transformers" (default; token-identical to `RagSequenceForGeneration.generate`): its `get_nll` with
        `exclude_bos_score=True` — the log-prior is added to the second target token (so a candidate that is
        only EOS loses its prior), every target equal to the pad id is skipped, and the first token is skipped
        when all candidates of the question start with BOS.
      * "paper": Eq. 1 literally — every generated token up to and including the first EOS counts once,
        forced BOS/EOS tokens count log 1 (as in the search), the prior is added once per passage.
    Fast decoding always uses the paper's definition (the beam log-likelihoods).

    `search_contexts`: what the per-passage search (step 1) attends to; None: `contexts`, the masked encodings.
    transformers 5's per-passage search drops `context_attention_mask` (`generate(attention_mask=None)`, and v5
    infers no mask for encoder-decoder models), so its padded contexts attend to their pads there but not in
    rescoring: pass the contexts encoded without a mask, as it pads them (`rag.models.rag.generate.unmasked_contexts`;
    `RagModelConfig.mask_padded_contexts=False` does this), to reproduce that; rescoring always uses `contexts`.
    (transformers also re-encodes every context once per candidate during rescoring.)

    `spans`: extractive decoding, each passage's search only takes spans of that passage
    (:class:`~rag.generation.spans.PassageSpans`, one entry per context), and thorough rescoring counts a candidate
    only under the passages that hold it as a span (and those whose search produced it): the extractive reader gives
    no probability to an answer its passage does not state, so a name read in a low-prior passage is not credited with
    the likelihood the model's memory gives it under the passage the question is about.

    Returns `GenerationOutput` (`batch * num_return_sequences` rows) with `doc_posteriors` `p(z|x, y)`
    (fast decoding: zero for passages that did not produce `y`).
    """
    if decoding not in ("thorough", "fast"):
        raise ConfigError(f"decoding must be 'thorough' or 'fast', got {decoding!r}")
    if convention not in ("transformers", "paper"):
        raise ConfigError(f"convention must be 'transformers' or 'paper', got {convention!r}")
    batch, n_docs = _check_contexts(contexts, doc_scores)
    search = contexts if search_contexts is None else search_contexts
    if search is not contexts:
        _check_contexts(search, doc_scores, "search_contexts")
    spec = _spec(config, generator, contexts)
    device = doc_scores.device
    log_prior = doc_log_prior(doc_scores.float())  # (batch, n_docs)
    # The search's cross-attention keys/values serve rescoring only when both attend to the same encodings.
    hyps, cross_kv = _per_document(generator, search, config, keep_cross_kv=decoding == "thorough" and search is contexts,
                                   spans=spans)
    beams, width = config.num_beams, hyps.sequences.shape[-1]
    per_q = n_docs * beams
    flat_seqs = hyps.sequences.reshape(batch, per_q, width)
    flat_ll = hyps.log_likelihood.reshape(batch, per_q)

    # Candidate pool: (question, first hypothesis index) per kept candidate, plus which passages produced it.
    cand_q: list[int] = []
    cand_h: list[int] = []
    producers: list[dict[int, float]] = []  # per candidate: passage -> log p(y|x, z) from its own search
    rows_as_lists = flat_seqs.tolist()
    ll_lists = flat_ll.tolist()
    for q in range(batch):
        groups: dict[tuple, dict[int, float]] = {}
        for h in range(per_q):
            key = tuple(rows_as_lists[q][h])
            prod = groups.setdefault(key, {})
            doc = h // beams
            prod[doc] = max(prod.get(doc, -math.inf), ll_lists[q][h])
        seen: set[tuple] = set()
        for h in range(per_q):
            key = tuple(rows_as_lists[q][h])
            if dedup and key in seen:
                continue
            seen.add(key)
            cand_q.append(q)
            cand_h.append(h)
            producers.append(groups[key])
    question = torch.tensor(cand_q, dtype=torch.long, device=device)
    hyp = torch.tensor(cand_h, dtype=torch.long, device=device)
    cands = flat_seqs[question, hyp]  # (C, width)
    cand_prior = log_prior[question]  # (C, n_docs)

    if decoding == "thorough":
        docs = torch.arange(n_docs, device=device)
        token_lp = contexts.teacher_forced(generator, cands, question[:, None] * n_docs + docs, rescore_batch_size,
                                           cross_kv, spec.eos)
        terms = _per_doc_terms(token_lp, cands[:, 1:], cand_prior, question, spec, convention)
        if spans is not None:  # p(y|x, z) = 0 under a passage whose constrained search cannot give y
            terms = terms.masked_fill(~_span_held(spans, cands, cand_q, producers, n_docs, spec), -math.inf)
    else:
        own = torch.full((len(cand_q), n_docs), -math.inf, dtype=torch.float32, device=device)
        for c, prod in enumerate(producers):
            for doc, ll in prod.items():
                own[c, doc] = ll
        terms = cand_prior + own
    score = torch.logsumexp(terms, dim=1)  # (C,)
    posterior = torch.softmax(terms, dim=1).nan_to_num(0.0)

    ret = config.num_return_sequences
    out_seq = torch.full((batch, ret, width), spec.pad, dtype=torch.long, device=device)
    out_score = torch.full((batch, ret), -math.inf, dtype=torch.float32, device=device)
    out_post = torch.zeros(batch, ret, n_docs, dtype=torch.float32, device=device)
    for q in range(batch):
        mine = (question == q).nonzero(as_tuple=True)[0]
        top = mine[torch.topk(score[mine], min(ret, mine.numel())).indices]
        out_seq[q, : top.numel()] = cands[top]
        out_score[q, : top.numel()] = score[top]
        out_post[q, : top.numel()] = posterior[top]
    out_score = out_score.reshape(-1)
    return GenerationOutput(sequences=out_seq.reshape(batch * ret, width), scores=out_score,
                            log_likelihood=out_score.clone(), doc_posteriors=out_post.reshape(batch * ret, n_docs))
