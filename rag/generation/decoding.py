"""Decoding for RAG (Lewis et al. 2020, §2.5): RAG-Token beam search / greedy, RAG-Sequence thorough and fast.

Everything here works on a seq2seq generator (`transformers` BART / T5, or any module with the same
`get_encoder()` / `forward(encoder_outputs=..., decoder_input_ids=..., past_key_values=...)` interface; put
it in eval mode first, nothing here changes its mode) and on already-tokenized contexts: row
`b * n_docs + k` of the context tensors is question `b` joined with its `k`-th retrieved passage, and
`doc_scores[b, k]` is that passage's retrieval score (`q · d`).

Efficiency by design (ARCHITECTURE invariant 2; measured by `benchmarks/decode_bench.py`, README "Benchmarks"):

* `encode_contexts` runs the generator encoder once per (question, passage); every search and the
  RAG-Sequence rescoring below reuse those states (index-selected, never re-encoded). transformers'
  `RagSequenceForGeneration.generate` re-encodes every context once per candidate instead.
* Cross-attention keys/values are projected once per context. For BART the decoder rows of one context
  (beams; for RAG-Token every beam of the question) attend to the context's keys/values in place, which are
  never copied to rows (one single-query attention call per row slot, so the rounding is transformers'). Other generators: the first decoder step
  (every row feeds the decoder start token) runs once per context and its cache is copied to the context's
  rows. transformers runs that step on every row, recomputing the same keys/values `num_beams` times, and
  copies them again at every beam reorder.
* Beam search and greedy search decode incrementally with the decoder KV cache. Beam reordering moves
  only the self-attention cache: cross-attention keys/values are identical for every beam of a row group.
  RAG-Sequence searches all questions' passages in one batched search (transformers: one per question).
* Thorough decoding scores every (candidate, passage) pair in one teacher-forced decoder pass on the
  keys/values the search already computed, stopping each candidate at its EOS. For BART the pairs of one
  passage are packed end to end into one decoder sequence (block-diagonal causal self-attention, per-pair
  positions), so only real tokens are computed and the passage's keys/values are used in place; chunks bound
  the `(tokens, vocab)` logits memory (`rescore_batch_size`).
* Large gathers use advanced indexing, not `index_select` (many times slower on CPU with several threads).

The search itself follows the semantics of `transformers`' (v5) vectorized beam search exactly — candidate
pool of `2 * num_beams` continuations, length penalty `sum_logprob / generated_len ** length_penalty` with
`generated_len` counting EOS but not the decoder start token, the same early-stopping heuristic and
`early_stopping in {True, False, "never"}` — so outputs are token-identical to
`RagTokenForGeneration.generate` and to `RagSequenceForGeneration.generate` (see `rag_sequence_generate`
for the differences that remain and why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from rag.errors import ConfigError, RagError
from rag.generation.marginalize import doc_log_prior, token_marginal_logprobs

__all__ = [
    "GenerationConfig",
    "EncodedContexts",
    "GenerationOutput",
    "DocumentHypotheses",
    "encode_contexts",
    "rag_token_generate",
    "generate_per_document",
    "teacher_forced_logprobs",
    "rag_sequence_generate",
]

# Score transformers' beam search uses for "impossible" entries. Kept identical (not -inf) because the
# bookkeeping adds it to real scores and the float32 rounding of those sums decides ties.
_IMPOSSIBLE = -1.0e9


@dataclass(frozen=True)
class GenerationConfig:
    """Typed decoding options. Lengths follow transformers: `max_length`/`min_length` count the decoder start token.

    Token ids left as `None` are read from `generator.generation_config`, then `generator.config`.
    """

    max_new_tokens: int = 20
    """Most tokens generated after the decoder start token (used when `max_length` is None)."""
    max_length: int | None = None
    """Total output length including the decoder start token (transformers' `max_length`); overrides `max_new_tokens`."""
    min_length: int = 0
    """EOS is banned while the output (decoder start token included) is shorter than this (transformers' `min_length`)."""
    min_new_tokens: int = 0
    """EOS is banned until this many tokens were generated after the decoder start token."""
    num_beams: int = 1
    """Beam width; 1 means greedy search."""
    num_return_sequences: int = 1
    """Sequences returned per question (RAG-Token: at most `num_beams`; RAG-Sequence: best of all candidates)."""
    length_penalty: float = 1.0
    """Finished beams are ranked by `sum_logprob / generated_len ** length_penalty` (0 = no normalisation)."""
    early_stopping: bool | Literal["never"] = False
    """True: stop a question once `num_beams` beams finished; False: stop when a running beam cannot beat the
    worst finished one at its current length (transformers' heuristic); "never": canonical beam search bound."""
    no_repeat_ngram_size: int = 0
    """If > 0, no n-gram of this size (over the decoder tokens, start token included) occurs twice."""
    forced_bos_token_id: int | None = None
    """Token forced as the first generated token (BART checkpoints use 0). A forced token scores log 1 = 0."""
    forced_eos_token_id: int | None = None
    """Token forced as the last token when `max_length` is reached (BART checkpoints use 2)."""
    decoder_start_token_id: int | None = None
    """First decoder input (BART: `</s>`=2, T5: pad=0); from the generator's config when None."""
    eos_token_id: int | None = None
    """End-of-sequence token; from the generator's config when None."""
    pad_token_id: int | None = None
    """Fills sequences after EOS; from the generator's config when None."""
    bos_token_id: int | None = None
    """Only used by the transformers-compatible RAG-Sequence scoring (skips a leading BOS); from the config when None."""

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"GenerationConfig.{field}: {msg}")

        need(isinstance(self.num_beams, int) and self.num_beams >= 1, "num_beams",
             f"must be an int >= 1, got {self.num_beams!r}")
        need(isinstance(self.num_return_sequences, int) and self.num_return_sequences >= 1, "num_return_sequences",
             f"must be an int >= 1, got {self.num_return_sequences!r}")
        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens",
             f"must be an int >= 1, got {self.max_new_tokens!r}")
        need(self.max_length is None or (isinstance(self.max_length, int) and self.max_length >= 2), "max_length",
             f"must be None or an int >= 2 (it counts the decoder start token), got {self.max_length!r}")
        need(isinstance(self.min_length, int) and self.min_length >= 0, "min_length",
             f"must be an int >= 0, got {self.min_length!r}")
        need(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0, "min_new_tokens",
             f"must be an int >= 0, got {self.min_new_tokens!r}")
        need(isinstance(self.no_repeat_ngram_size, int) and self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size",
             f"must be an int >= 0, got {self.no_repeat_ngram_size!r}")
        need(self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never", "early_stopping",
             f"must be True, False or 'never', got {self.early_stopping!r}")
        need(isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty), "length_penalty",
             f"must be a finite number, got {self.length_penalty!r}")

    @property
    def total_max_length(self) -> int:
        """Output length limit including the decoder start token."""
        return self.max_length if self.max_length is not None else 1 + self.max_new_tokens


@dataclass(frozen=True)
class _Spec:
    """A `GenerationConfig` with every token id resolved against one generator."""

    cfg: GenerationConfig
    start: int
    eos: int
    pad: int
    bos: int | None
    max_length: int
    min_length: int

    @property
    def num_beams(self) -> int:
        return self.cfg.num_beams


def _resolve(config: GenerationConfig, generator) -> _Spec:
    sources = [getattr(generator, "generation_config", None), getattr(generator, "config", None)]

    def pick(name: str, required: bool) -> int | None:
        value = getattr(config, name)
        for src in sources:
            if value is None and src is not None:
                value = getattr(src, name, None)
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise ConfigError(f"GenerationConfig.{name}: several ids {value} are not supported; pass one id explicitly")
            value = value[0]
        if value is None and required:
            raise ConfigError(f"GenerationConfig.{name} is not set and the generator config has none; pass it explicitly")
        return None if value is None else int(value)

    max_length = config.total_max_length
    min_length = max(config.min_length, 1 + config.min_new_tokens if config.min_new_tokens > 0 else 0)
    return _Spec(cfg=config, start=pick("decoder_start_token_id", True), eos=pick("eos_token_id", True),
                 pad=pick("pad_token_id", True), bos=pick("bos_token_id", False),
                 max_length=max_length, min_length=min_length)


@dataclass(frozen=True)
class EncodedContexts:
    """Generator-encoder states of every (question, passage) context, computed once per decoding call.

    `last_hidden_state` is `(batch * n_docs, src_len, d_model)`, `attention_mask` `(batch * n_docs, src_len)`.
    """

    last_hidden_state: Tensor
    attention_mask: Tensor

    def __len__(self) -> int:
        return self.last_hidden_state.shape[0]


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


# ----------------------------------------------------------------------------------------------------------
# Encoder and incremental decoder


def _check_contexts(contexts: EncodedContexts, doc_scores: Tensor) -> tuple[int, int]:
    if doc_scores.dim() != 2:
        raise RagError(f"doc_scores must be (batch, n_docs), got shape {tuple(doc_scores.shape)}")
    batch, n_docs = doc_scores.shape
    if len(contexts) != batch * n_docs:
        raise RagError(
            f"contexts hold {len(contexts)} rows but doc_scores is {tuple(doc_scores.shape)}: "
            f"expected batch * n_docs = {batch * n_docs} context rows (question-major, one per retrieved passage)")
    return batch, n_docs


@torch.no_grad()
def encode_contexts(generator, context_input_ids: Tensor, context_attention_mask: Tensor) -> EncodedContexts:
    """Run the generator encoder once over all `(batch * n_docs, src_len)` contexts.

    Everything downstream (searches, rescoring) reuses the returned states.
    """
    if context_input_ids.dim() != 2 or context_attention_mask.shape != context_input_ids.shape:
        raise RagError(
            f"context_input_ids and context_attention_mask must both be (batch * n_docs, src_len); got "
            f"{tuple(context_input_ids.shape)} and {tuple(context_attention_mask.shape)}")
    out = generator.get_encoder()(input_ids=context_input_ids, attention_mask=context_attention_mask, return_dict=True)
    return EncodedContexts(last_hidden_state=out.last_hidden_state, attention_mask=context_attention_mask)


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """`t[index]` along dim 0. Advanced indexing, not `index_select`: on CPU with several threads the latter
    is many times slower for the large `(rows, heads, src_len, head_dim)` tensors copied here."""
    return t[index]


def _shared_cross_attention(cache) -> list[tuple[Tensor, Tensor]] | None:
    """The per-layer cross-attention `(keys, values)` of a transformers `EncoderDecoderCache`, if it holds them."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    if not isinstance(cache, EncoderDecoderCache) or not isinstance(cache.cross_attention_cache, DynamicCache):
        return None
    layers = cache.cross_attention_cache.layers
    if not layers or not all(cache.is_updated.get(i) for i in range(len(layers))):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def _context_step(generator, contexts: EncodedContexts, token: int) -> tuple[Tensor, object]:
    """One decoder step of `token` on every context, each context once: logits `(N, vocab)` float32 and the cache.

    The cache then holds each context's cross-attention keys/values, computed here once per context.
    """
    from transformers.modeling_outputs import BaseModelOutput

    n = len(contexts)
    tokens = torch.full((n, 1), int(token), dtype=torch.long, device=contexts.last_hidden_state.device)
    out = generator(encoder_outputs=BaseModelOutput(last_hidden_state=contexts.last_hidden_state),
                    attention_mask=contexts.attention_mask, decoder_input_ids=tokens, use_cache=True, return_dict=True)
    return out.logits[:, -1, :].float(), out.past_key_values


def _dynamic_cache(kv: list[tuple[Tensor, Tensor]]):
    """A transformers `DynamicCache` holding the given per-layer `(keys, values)` as they are (no copy)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache([(None, None)] * len(kv))  # one empty layer per decoder layer
    for layer, (k, v) in zip(cache.layers, kv):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def _gathered_cache(self_kv: list[tuple[Tensor, Tensor]] | None, cross_kv: list[tuple[Tensor, Tensor]], rows: Tensor):
    """An `EncoderDecoderCache` for decoder rows `rows` (indices into the per-context `self_kv` / `cross_kv`)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    self_cache = DynamicCache() if self_kv is None else _dynamic_cache([(_rows(k, rows), _rows(v, rows)) for k, v in self_kv])
    return EncoderDecoderCache(self_cache, _dynamic_cache([(_rows(k, rows), _rows(v, rows)) for k, v in cross_kv]))


class _IncrementalDecoder:
    """Decoder rows that each attend to one encoded context, decoded one token at a time with a KV cache.

    The first step (every row feeds the decoder start token) runs once per *context*, not per row: its logits
    and cache — the cross-attention keys/values included, the expensive part — are then copied to the rows
    of that context (beams, and for RAG-Token the beams of every question). transformers instead runs it on
    every row, recomputing the same cross-attention keys/values `num_beams` times.
    """

    def __init__(self, generator, contexts: EncodedContexts, context_of_row: Tensor, keep_cross_kv: bool = False):
        from transformers.modeling_outputs import BaseModelOutput

        self.keep_cross_kv = keep_cross_kv
        self.generator = generator
        self.contexts = contexts
        self.context_of_row = context_of_row
        self.identity = identity = context_of_row.shape[0] == len(contexts) and bool(
            (context_of_row == torch.arange(len(contexts), device=context_of_row.device)).all())
        states = contexts.last_hidden_state if identity else _rows(contexts.last_hidden_state, context_of_row)
        self.encoder_outputs = BaseModelOutput(last_hidden_state=states)
        self.mask = contexts.attention_mask if identity else _rows(contexts.attention_mask, context_of_row)
        self.cache = None
        self.cross_kv: list[tuple[Tensor, Tensor]] | None = None
        """Per-context (not per-row) cross-attention keys/values after the first step, kept for reuse (rescoring)
        when `keep_cross_kv`."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` `(rows,)`; return next-token logits `(rows, vocab)` in float32."""
        if self.cache is None and bool((tokens == tokens[0]).all()):
            logits, cache = _context_step(self.generator, self.contexts, int(tokens[0]))
            cross_kv = _shared_cross_attention(cache)
            if cross_kv is not None:
                self.cross_kv = cross_kv if self.keep_cross_kv else None
                if self.identity:
                    self.cache = cache
                    return logits
                self_kv = [(layer.keys, layer.values) for layer in cache.self_attention_cache.layers]
                self.cache = _gathered_cache(self_kv, cross_kv, self.context_of_row)  # a gather, no compute
                return _rows(logits, self.context_of_row)
        out = self.generator(encoder_outputs=self.encoder_outputs, attention_mask=self.mask,
                             decoder_input_ids=tokens[:, None], past_key_values=self.cache, use_cache=True,
                             return_dict=True)
        self.cache = out.past_key_values
        return out.logits[:, -1, :].float()

    def reorder(self, rows: Tensor) -> None:
        """Make row `i` continue from row `rows[i]` (only ever within one context group)."""
        from transformers.cache_utils import EncoderDecoderCache

        if isinstance(self.cache, EncoderDecoderCache):
            # Cross-attention K/V depend only on the context, identical for every row a beam can move between.
            self.cache.self_attention_cache.reorder_cache(rows)
        elif hasattr(self.cache, "reorder_cache"):
            self.cache.reorder_cache(rows)
        else:
            raise RagError(f"the generator returned a cache of type {type(self.cache).__name__} that cannot be "
                           "reordered for beam search; use num_beams=1 or a transformers Cache")


def _bart_cross_kv(generator, states: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per-layer cross-attention `(keys, values)` `(N, heads, src_len, head_dim)` of BART encoder states
    `(N, src_len, d_model)`, laid out as transformers' cache holds them (contiguous)."""
    n, src_len, _ = states.shape
    out = []
    for layer in generator.model.decoder.layers:
        attn = layer.encoder_attn
        out.append(tuple(proj(states).view(n, src_len, -1, attn.head_dim).transpose(1, 2).contiguous()
                         for proj in (attn.k_proj, attn.v_proj)))
    return out


class _BartIncrementalDecoder:
    """`_IncrementalDecoder` for BART (same interface): cross-attention folded per context.

    The rows of one context (its beams; for RAG-Token the beams of its question) are folded to
    `(contexts, rows_per_context)` and attend to that context's keys/values in place (`_cross_attend_rows`),
    so the keys/values are projected once per context and never copied to rows (transformers copies them to
    every row and again at every beam reorder). Self-attention and everything else run per row, as in BART.
    """

    def __init__(self, generator, contexts: EncodedContexts, context_of_row: Tensor, order: Tensor, used: Tensor,
                 per_context: int, keep_cross_kv: bool = False):
        device = context_of_row.device
        self.generator = generator
        self.per_context = per_context
        # Rows sorted by context (stable) fold to (contexts, per_context); None when they already are.
        in_order = bool((order == torch.arange(order.numel(), device=device)).all())
        self.order = None if in_order else order
        self.inverse = None if in_order else torch.argsort(order)
        all_used = used.numel() == len(contexts) and bool((used == torch.arange(len(contexts), device=device)).all())
        states = contexts.last_hidden_state if all_used else _rows(contexts.last_hidden_state, used)
        mask = contexts.attention_mask if all_used else _rows(contexts.attention_mask, used)
        self.mask = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        self.kv = _bart_cross_kv(generator, states)
        self.cross_kv = self.kv if keep_cross_kv and all_used else None
        """Per-context cross-attention keys/values (indexed by context), kept for rescoring when `keep_cross_kv`."""
        self.self_kv: list[tuple[Tensor, Tensor]] | None = None
        self.length = 0

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` `(rows,)`; return next-token logits `(rows, vocab)` in float32."""
        dec, rows = self.generator.model.decoder, tokens.shape[0]
        ids = tokens[:, None]
        position = torch.full((1,), self.length, dtype=torch.long, device=tokens.device)
        hidden = dec.layernorm_embedding(dec.embed_tokens(ids) + dec.embed_positions(ids, position_ids=position))
        past = self.self_kv or [None] * len(dec.layers)
        self_kv = []
        for layer, (key, value), cached in zip(dec.layers, self.kv, past):
            sa = layer.self_attn
            k = sa.k_proj(hidden).view(rows, 1, -1, sa.head_dim).transpose(1, 2)
            v = sa.v_proj(hidden).view(rows, 1, -1, sa.head_dim).transpose(1, 2)
            if cached is not None:
                k, v = torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2)
            self_kv.append((k, v))
            hidden = layer.self_attn_layer_norm(hidden + _attend(sa, hidden, k, v, None, causal=False))
            folded = (hidden if self.order is None else hidden[self.order]).view(-1, self.per_context, hidden.shape[-1])
            cross = _cross_attend_rows(layer.encoder_attn, folded, key, value, self.mask).view(rows, 1, -1)
            hidden = layer.encoder_attn_layer_norm(hidden + (cross if self.inverse is None else cross[self.inverse]))
            hidden = layer.final_layer_norm(hidden + layer.fc2(layer.activation_fn(layer.fc1(hidden))))
        self.self_kv = self_kv
        self.length += 1
        return (self.generator.lm_head(hidden[:, 0]) + self.generator.final_logits_bias).float()

    def reorder(self, rows: Tensor) -> None:
        """Make row `i` continue from row `rows[i]` (only ever within one context group)."""
        self.self_kv = [(_rows(k, rows), _rows(v, rows)) for k, v in self.self_kv]


def _incremental_decoder(generator, contexts: EncodedContexts, context_of_row: Tensor, keep_cross_kv: bool = False):
    """The BART fast path when it applies (every used context has the same number of rows), else the generic one."""
    if _is_bart(generator):
        order = torch.sort(context_of_row, stable=True).indices
        used, counts = torch.unique_consecutive(context_of_row[order], return_counts=True)
        if counts.numel() and bool((counts == counts[0]).all()):
            return _BartIncrementalDecoder(generator, contexts, context_of_row, order, used, int(counts[0]),
                                           keep_cross_kv)
    return _IncrementalDecoder(generator, contexts, context_of_row, keep_cross_kv)


# ----------------------------------------------------------------------------------------------------------
# Logits processing (same semantics and order as transformers' processors for these options)


def _constraints(seqs: Tensor, vocab: int, spec: _Spec) -> tuple[Tensor | None, int | None]:
    """Tokens banned after `seqs` `(rows, cur_len)`, and the token forced at this step, if any."""
    cur_len = seqs.shape[1]
    cfg = spec.cfg
    banned = None
    n = cfg.no_repeat_ngram_size
    if n > 0 and cur_len >= n:
        banned = torch.zeros(seqs.shape[0], vocab, dtype=torch.bool, device=seqs.device)
        if n == 1:
            banned.scatter_(1, seqs, True)
        else:
            heads = seqs.unfold(1, n - 1, 1)[:, : cur_len - n + 1]  # every (n-1)-gram that has a successor
            suffix = seqs[:, cur_len - n + 1:]  # the last n-1 tokens
            follow = seqs[:, n - 1:]  # the successor of each head
            row, pos = (heads == suffix[:, None, :]).all(-1).nonzero(as_tuple=True)
            banned[row, follow[row, pos]] = True
    if cur_len < spec.min_length:
        if banned is None:
            banned = torch.zeros(seqs.shape[0], vocab, dtype=torch.bool, device=seqs.device)
        banned[:, spec.eos] = True
    forced = None
    if cfg.forced_bos_token_id is not None and cur_len == 1:
        forced = cfg.forced_bos_token_id
    if cfg.forced_eos_token_id is not None and cur_len == spec.max_length - 1:
        forced = cfg.forced_eos_token_id
    return banned, forced


def _apply(scores: Tensor, banned: Tensor | None, forced: int | None) -> Tensor:
    if forced is not None:
        out = torch.full_like(scores, -math.inf)
        out[:, forced] = 0
        return out
    return scores if banned is None else scores.masked_fill(banned, -math.inf)


# ----------------------------------------------------------------------------------------------------------
# Search engines over a `step(last_tokens) -> logits` closure


def _greedy(step: Callable[[Tensor], Tensor], rows: int, spec: _Spec, device) -> tuple[Tensor, Tensor]:
    """Greedy search; returns sequences `(rows, T)` and their log-likelihoods `(rows,)`."""
    seqs = torch.full((rows, 1), spec.start, dtype=torch.long, device=device)
    running = torch.ones(rows, dtype=torch.bool, device=device)
    loglik = torch.zeros(rows, dtype=torch.float32, device=device)
    while True:
        logits = step(seqs[:, -1])
        banned, forced = _constraints(seqs, logits.shape[-1], spec)
        token = _apply(logits, banned, forced).argmax(-1)
        logp = _apply(torch.log_softmax(logits, -1), banned, forced).gather(1, token[:, None]).squeeze(1)
        loglik = loglik + torch.where(running, logp, torch.zeros_like(logp))
        token = torch.where(running, token, torch.full_like(token, spec.pad))
        seqs = torch.cat([seqs, token[:, None]], dim=1)
        running = running & (token != spec.eos) & (seqs.shape[1] < spec.max_length)
        if not bool(running.any()):
            return seqs, loglik


@dataclass
class _Beams:
    sequences: Tensor  # (items, beams, max_length)
    scores: Tensor  # (items, beams) length-penalised
    loglik: Tensor  # (items, beams) raw, -inf where no finished hypothesis
    gen_len: Tensor  # (items, beams) generated tokens (bookkeeping length, as transformers crops by it)


def _take(t: Tensor, idx: Tensor) -> Tensor:
    """Select along dim 1 of `t` `(items, n, ...)` with `idx` `(items, m)`."""
    return torch.take_along_dim(t, idx.view(idx.shape + (1,) * (t.dim() - 2)), dim=1)


def _beam_search(step: Callable[[Tensor], Tensor], reorder: Callable[[Tensor], None], items: int,
                 spec: _Spec, device) -> _Beams:
    """Beam search over `items` independent inputs with `spec.num_beams` beams each.

    `step` maps the last tokens of all `items * beams` rows (item-major) to next-token logits; `reorder`
    receives, for every new row, the flat index of the row it continues. Bookkeeping mirrors transformers'
    vectorized beam search (same candidate pool, -1e9 sentinels, length penalty and stopping heuristic),
    which makes the outputs token-identical to it.
    """
    cfg = spec.cfg
    beams, max_len, lp = cfg.num_beams, spec.max_length, float(cfg.length_penalty)
    pool = 2 * beams  # continuations kept per item: enough to refill the beam if `beams` of them end in EOS
    in_top = torch.arange(pool, device=device) < beams
    run_seq = torch.full((items, beams, max_len), spec.pad, dtype=torch.long, device=device)
    run_seq[:, :, 0] = spec.start
    run_score = torch.zeros(items, beams, dtype=torch.float32, device=device)
    run_score[:, 1:] = _IMPOSSIBLE  # all beams start identical: expand only the first one
    fin_seq = run_seq.clone()
    fin_score = torch.full((items, beams), _IMPOSSIBLE, dtype=torch.float32, device=device)
    fin_ll = torch.full((items, beams), -math.inf, dtype=torch.float32, device=device)
    fin_len = torch.zeros(items, beams, dtype=torch.long, device=device)
    fin_done = torch.zeros(items, beams, dtype=torch.bool, device=device)
    can_improve = torch.ones(items, 1, dtype=torch.bool, device=device)
    item_offset = torch.arange(items, device=device)[:, None] * beams
    cur = 1
    while True:
        logits = step(run_seq[:, :, cur - 1].reshape(-1))
        vocab = logits.shape[-1]
        banned, forced = _constraints(run_seq[:, :, :cur].reshape(items * beams, cur), vocab, spec)
        logp = _apply(torch.log_softmax(logits, -1), banned, forced)
        total = (logp.view(items, beams, vocab) + run_score[:, :, None]).view(items, beams * vocab)
        cand_score, cand_flat = torch.topk(total, pool)
        cand_src = cand_flat // vocab
        cand_seq = _take(run_seq, cand_src)
        cand_seq[:, :, cur] = cand_flat % vocab
        ends = (cand_seq[:, :, cur] == spec.eos) | (cur + 1 >= max_len)

        # Beams that keep running: best `beams` candidates that did not end.
        alive_score = cand_score + ends.to(torch.float32) * _IMPOSSIBLE
        keep = torch.topk(alive_score, beams).indices
        run_seq, run_score, run_src = _take(cand_seq, keep), _take(alive_score, keep), _take(cand_src, keep)

        # Finished hypotheses: merge candidates that just ended (only from the top `beams`) into the pool.
        ended_now = ends & in_top[None, :]
        merged_new = cand_score / (cur ** lp)
        merged_new += (fin_done.all(-1, keepdim=True) & (cfg.early_stopping is True)).to(torch.float32) * _IMPOSSIBLE
        merged_new += (~can_improve).to(torch.float32) * _IMPOSSIBLE
        merged_new += (~ended_now) * _IMPOSSIBLE
        merged = torch.cat([fin_score, merged_new], dim=1)
        best = torch.topk(merged, beams).indices
        fin_seq = _take(torch.cat([fin_seq, cand_seq], 1), best)
        fin_score = _take(merged, best)
        fin_done = _take(torch.cat([fin_done, ended_now], 1), best)
        new_ll = torch.where(ended_now, cand_score, torch.full_like(cand_score, -math.inf))
        fin_ll = _take(torch.cat([fin_ll, new_ll], 1), best)
        fin_len = _take(torch.cat([fin_len, torch.full_like(cand_src, cur)], 1), best)

        cur += 1
        if cfg.early_stopping == "never" and lp > 0.0:
            best_len = max_len - 1
        else:
            best_len = cur - 1
        best_running = run_score[:, :1] / (best_len ** lp)
        worst_finished = torch.where(fin_done, fin_score.min(1, keepdim=True).values, _IMPOSSIBLE)
        can_improve = can_improve & (best_running > worst_finished).any(-1, keepdim=True)
        all_full = bool(fin_done.all()) and cfg.early_stopping is True
        if not bool(can_improve.any()) or all_full or bool(ends.all()):
            return _Beams(fin_seq, fin_score, fin_ll, fin_len)
        reorder((item_offset + run_src).reshape(-1))


def _crop(beams: _Beams, keep: int) -> tuple[Tensor, Tensor, Tensor]:
    """First `keep` beams of every item, cropped to the longest of them: `(items, keep, T)`, scores, loglik."""
    width = 1 + int(beams.gen_len[:, :keep].max())
    return beams.sequences[:, :keep, :width], beams.scores[:, :keep], beams.loglik[:, :keep]


# ----------------------------------------------------------------------------------------------------------
# RAG-Token


@torch.no_grad()
def rag_token_generate(generator, contexts: EncodedContexts, doc_scores: Tensor,
                       config: GenerationConfig = GenerationConfig()) -> GenerationOutput:
    """RAG-Token decoding (§2.5): greedy (`num_beams=1`) or beam search over the marginal transition
    `p'(y_i|x, y_<i) = Σ_z p(z|x) p(y_i|x, z, y_<i)` (Eq. 2), with `p(z|x) = softmax(doc_scores)`.

    contexts: the encoded `(batch * n_docs)` contexts (`encode_contexts`); doc_scores `(batch, n_docs)`.
    One decoder step runs `batch * num_beams * n_docs` rows with the KV cache. Token-identical to
    `transformers.RagTokenForGeneration.generate` given the same contexts, doc scores and options.
    Returns `GenerationOutput` with `batch * num_return_sequences` rows (`doc_posteriors` None).
    """
    batch, n_docs = _check_contexts(contexts, doc_scores)
    spec = _resolve(config, generator)
    beams = config.num_beams
    if config.num_return_sequences > beams:
        raise ConfigError(f"GenerationConfig.num_return_sequences={config.num_return_sequences} exceeds num_beams="
                          f"{beams}: RAG-Token beam search returns at most num_beams sequences per question")
    device = doc_scores.device
    docs = torch.arange(n_docs, device=device)
    # Decoder rows are (question, beam, doc): row -> context question * n_docs + doc.
    context_of_row = (torch.arange(batch, device=device)[:, None, None] * n_docs + docs).expand(batch, beams, n_docs)
    decoder = _incremental_decoder(generator, contexts, context_of_row.reshape(-1))
    log_prior = doc_log_prior(doc_scores.float()).repeat_interleave(beams, dim=0)  # (batch*beams, n_docs)

    def step(tokens: Tensor) -> Tensor:
        logits = decoder.step(tokens.repeat_interleave(n_docs))
        doc_logprobs = torch.log_softmax(logits, -1).view(batch * beams, n_docs, -1)
        return token_marginal_logprobs(doc_logprobs, log_prior)  # Eq. 2, one step: (batch*beams, vocab)

    if beams == 1:
        seqs, loglik = _greedy(step, batch, spec, device)
        return GenerationOutput(sequences=seqs, scores=loglik, log_likelihood=loglik)

    def reorder(src_rows: Tensor) -> None:
        decoder.reorder((src_rows[:, None] * n_docs + docs).reshape(-1))

    found = _beam_search(step, reorder, batch, spec, device)
    seqs, scores, loglik = _crop(found, config.num_return_sequences)
    return GenerationOutput(sequences=seqs.reshape(-1, seqs.shape[-1]), scores=scores.reshape(-1),
                            log_likelihood=loglik.reshape(-1))


# ----------------------------------------------------------------------------------------------------------
# RAG-Sequence


@torch.no_grad()
def generate_per_document(generator, contexts: EncodedContexts,
                          config: GenerationConfig = GenerationConfig()) -> DocumentHypotheses:
    """Search each context on its own, `p(y|x, z)` without the document prior (RAG-Sequence's first stage).

    All `N = batch * n_docs` contexts are searched in one batched call (`N * num_beams` decoder rows, KV
    cache); `num_beams=1` is greedy search. Returns every context's `num_beams` hypotheses, best first.
    """
    return _per_document(generator, contexts, config)[0]


def _per_document(generator, contexts: EncodedContexts, config: GenerationConfig, keep_cross_kv: bool = False):
    """`generate_per_document`, plus (with `keep_cross_kv`) the per-context cross-attention keys/values it
    computed, or None."""
    spec = _resolve(config, generator)
    device = contexts.last_hidden_state.device
    items, beams = len(contexts), config.num_beams
    decoder = _incremental_decoder(generator, contexts, torch.arange(items, device=device).repeat_interleave(beams),
                                   keep_cross_kv=keep_cross_kv)
    if beams == 1:
        seqs, loglik = _greedy(decoder.step, items, spec, device)
        hyps = DocumentHypotheses(sequences=seqs[:, None], scores=loglik[:, None], log_likelihood=loglik[:, None])
        return hyps, decoder.cross_kv
    found = _beam_search(decoder.step, decoder.reorder, items, spec, device)
    seqs, scores, loglik = _crop(found, beams)
    return DocumentHypotheses(sequences=seqs, scores=scores, log_likelihood=loglik), decoder.cross_kv


@torch.no_grad()
def teacher_forced_logprobs(generator, contexts: EncodedContexts, sequences: Tensor, context_index: Tensor,
                            batch_size: int | None = None) -> Tensor:
    """`log p(y_t | x, z, y_<t)` of every sequence under each of its contexts, reusing the encoder states.

    sequences `(C, T)` start with the decoder start token; context_index `(C, K)` holds rows of `contexts`.
    Returns `(C, K, T - 1)`: entry `t` scores `sequences[:, t + 1]`. One teacher-forced decoder pass over
    the `C * K` (sequence, context) rows, at most `batch_size` rows at a time to bound memory (None: automatic,
    ~256 MiB of logits for BART, else 64 rows; BART takes at least all rows of one context per pass). Each
    context's cross-attention keys/values are computed once, not per row: BART generators pack the rows of one
    context into one decoder sequence attending to them (no per-row copies at all); other generators get them
    copied to each row.
    """
    return _teacher_forced(generator, contexts, sequences, context_index, batch_size, cross_kv=None)


def _teacher_forced(generator, contexts: EncodedContexts, sequences: Tensor, context_index: Tensor,
                    max_rows: int | None, cross_kv: list[tuple[Tensor, Tensor]] | None, eos: int | None = None) -> Tensor:
    """`teacher_forced_logprobs`; `cross_kv`: per-context cross-attention keys/values already computed, if any.

    With `eos`, positions after a sequence's first `eos` target are not computed (left 0), and each chunk runs
    only up to its longest row (generic path: rows sorted by that length), so padding costs little decoder
    work. (Causal attention makes the kept positions independent of the dropped ones.)
    """
    from transformers.modeling_outputs import BaseModelOutput

    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ConfigError(f"rescore batch_size must be None (automatic) or an int >= 1, got {max_rows!r}")
    n_cand, n_docs = context_index.shape
    if sequences.shape[0] != n_cand or sequences.shape[1] < 2:
        raise RagError(f"sequences {tuple(sequences.shape)} must be (C, T >= 2) with C = {n_cand} rows of context_index")
    rows = context_index.reshape(-1)
    if cross_kv is None and rows.numel() > 0:
        used, rows = torch.unique(rows, return_inverse=True)  # compute K/V only for the contexts scored here
        if used.numel() < len(contexts):
            contexts = EncodedContexts(_rows(contexts.last_hidden_state, used), _rows(contexts.attention_mask, used))
        _, cache = _context_step(generator, contexts, int(sequences[0, 0]))
        cross_kv = _shared_cross_attention(cache)
        del cache
    width = sequences.shape[1] - 1
    if cross_kv is not None and _is_bart(generator):
        if eos is None:
            length = torch.full((n_cand,), width, dtype=torch.long, device=sequences.device)
        else:
            is_eos = (sequences[:, 1:] == eos).long()
            length = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, width)
        return _rescore_packed(generator, contexts, sequences, rows.view(n_cand, n_docs), cross_kv, length, max_rows)
    batch_size = 64 if max_rows is None else max_rows
    if eos is None:
        order = torch.arange(n_cand * n_docs, device=sequences.device)
        lengths = torch.full((n_cand * n_docs,), width, dtype=torch.long, device=sequences.device)
    else:
        is_eos = (sequences[:, 1:] == eos).long()
        length = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, width)  # targets up to the first EOS
        lengths = length.repeat_interleave(n_docs)
        lengths, order = torch.sort(lengths, descending=True, stable=True)
    out = torch.zeros(n_cand * n_docs, width, dtype=torch.float32, device=sequences.device)
    for lo in range(0, rows.shape[0], batch_size):
        pick = order[lo:lo + batch_size]  # flat (candidate, doc) rows of this chunk
        n = int(lengths[lo:lo + batch_size].max())
        cand = pick // n_docs
        ctx = rows[pick]
        past = None if cross_kv is None else _gathered_cache(None, cross_kv, ctx)
        logits = generator(encoder_outputs=BaseModelOutput(last_hidden_state=_rows(contexts.last_hidden_state, ctx)),
                           attention_mask=_rows(contexts.attention_mask, ctx), decoder_input_ids=sequences[cand, :n],
                           past_key_values=past, use_cache=past is not None, return_dict=True).logits
        del past
        lp = torch.log_softmax(logits.float(), -1).gather(-1, sequences[cand, 1:n + 1, None]).squeeze(-1)
        if eos is not None:
            lp = lp.masked_fill(torch.arange(n, device=lp.device) >= lengths[lo:lo + batch_size, None], 0.0)
        out[pick, :n] = lp
    return out.view(n_cand, n_docs, -1)


def _is_bart(generator) -> bool:
    """Whether the BART fast paths (search steps, packed rescoring) reproduce `generator`'s decoder
    (transformers BART, eval mode)."""
    try:
        from transformers import BartForConditionalGeneration
        from transformers.models.bart.modeling_bart import BartDecoderLayer
    except ImportError:  # pragma: no cover - transformers without BART
        return False
    return (type(generator) is BartForConditionalGeneration and not generator.training
            and all(type(layer) is BartDecoderLayer for layer in generator.model.decoder.layers))


def _attend(attn, hidden: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """BART attention `attn` (its q/out projections and scaling) of `hidden` `(n, q_len, d)` over `key`/`value`
    `(n, heads, kv_len, head_dim)`; `mask` `(n, 1, 1, kv_len)` bool (True = attend) or None."""
    n, q_len, _ = hidden.shape
    query = attn.q_proj(hidden).view(n, q_len, -1, attn.head_dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                                           scale=attn.scaling)
    return attn.out_proj(out.transpose(1, 2).reshape(n, q_len, -1))


def _cross_attend_rows(attn, folded: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
    """BART cross-attention of one decoder step, `folded` `(contexts, rows_per_context, d)` over each context's
    `key`/`value` `(contexts, heads, src_len, head_dim)` as they are (no copy to rows).

    One attention call per row slot with a single query each, not one call with `rows_per_context` queries:
    torch's CPU attention kernel rounds a multi-query block differently (a few ulp) from the single query
    transformers' decoder step feeds it, and near-tied beams then rank differently. This keeps the result
    bit-identical to transformers' per-row step while still reading the keys/values in place.
    """
    n, per_context, _ = folded.shape
    query = attn.q_proj(folded).view(n, per_context, -1, attn.head_dim).transpose(1, 2)  # (n, heads, P, hd)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(query[:, :, j:j + 1], key, value, attn_mask=mask,
                                                                      scale=attn.scaling)
                     for j in range(per_context)], dim=2)
    return attn.out_proj(out.transpose(1, 2).reshape(n, per_context, -1))


def _bart_packed_hidden(generator, ids: Tensor, positions: Tensor, allowed: Tensor,
                        cross_kv: list[tuple[Tensor, Tensor]], context_mask: Tensor) -> Tensor:
    """Teacher-forced BART decoder output states `(G, L, d_model)` of tokens packed per context.

    ids/positions `(G, L)`: context `g`'s (sequence, context) pairs laid end to end, each at its own
    decoder positions `0, 1, ...`; allowed `(G, L, L)` bool: query token may attend key token (same pair, not
    later). Cross-attention runs over context `g`'s keys/values `cross_kv[layer]` `(G, heads, src_len, head_dim)`
    as they are, one query sequence per context. Same math as BART's decoder on each pair alone.
    """
    dec = generator.model.decoder
    embed_pos = dec.embed_positions
    hidden = dec.layernorm_embedding(
        dec.embed_tokens(ids) + torch.nn.functional.embedding(positions + embed_pos.offset, embed_pos.weight))
    groups, length = ids.shape
    self_mask = allowed[:, None]
    cross_mask = None if bool(context_mask.all()) else context_mask.bool()[:, None, None, :]
    for layer, (key, value) in zip(dec.layers, cross_kv):
        sa = layer.self_attn
        k = sa.k_proj(hidden).view(groups, length, -1, sa.head_dim).transpose(1, 2)
        v = sa.v_proj(hidden).view(groups, length, -1, sa.head_dim).transpose(1, 2)
        hidden = layer.self_attn_layer_norm(hidden + _attend(sa, hidden, k, v, self_mask, causal=False))
        hidden = layer.encoder_attn_layer_norm(
            hidden + _attend(layer.encoder_attn, hidden, key, value, cross_mask, causal=False))
        hidden = layer.final_layer_norm(hidden + layer.fc2(layer.activation_fn(layer.fc1(hidden))))
    return hidden


def _rescore_packed(generator, contexts: EncodedContexts, sequences: Tensor, context_index: Tensor,
                    cross_kv: list[tuple[Tensor, Tensor]], lengths: Tensor, max_rows: int | None) -> Tensor:
    """`_teacher_forced` for BART: the (sequence, context) pairs of each context packed into one decoder sequence.

    Packing (block-diagonal causal self-attention, per-pair positions) computes only the `lengths[c]` scored
    targets of each pair, no padding to the longest, and uses each context's cross-attention keys/values in
    place. lengths `(C,)`: targets to score per sequence (later ones are left 0). Returns `(C, K, T - 1)`.
    """
    n_cand, n_docs = context_index.shape
    width = sequences.shape[1] - 1
    device = sequences.device
    flat_ctx = context_index.reshape(-1)
    order = torch.sort(flat_ctx, stable=True).indices  # (candidate, doc) pairs grouped by context
    ctx_of, counts = torch.unique_consecutive(flat_ctx[order], return_counts=True)
    per_context = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(order.numel(), device=device) - starts.repeat_interleave(counts)
    grid = torch.full((ctx_of.numel(), per_context), -1, dtype=torch.long, device=device)
    grid[torch.arange(ctx_of.numel(), device=device).repeat_interleave(counts), slot] = order  # pair or -1 (padding)
    pair_len = torch.where(grid >= 0, lengths[grid.clamp(min=0) // n_docs], 0)  # scored targets per pair
    out = torch.zeros(n_cand * n_docs, width, dtype=torch.float32, device=device)
    vocab = generator.config.vocab_size
    if max_rows is None:  # bound the (tokens, vocab) float32 logits to ~256 MiB
        max_rows = max(per_context, (256 << 20) // max(1, 4 * vocab * max(1, int(lengths.max()))))
    groups_per_chunk = max(1, max_rows // per_context)
    for lo in range(0, ctx_of.numel(), groups_per_chunk):
        sel = slice(lo, lo + groups_per_chunk)
        c, pairs, plen = ctx_of[sel], grid[sel], pair_len[sel]
        ends = plen.cumsum(1)
        total = ends[:, -1]
        p = torch.arange(int(total.max()), device=device).expand(c.numel(), -1).contiguous()
        real = p < total[:, None]
        which = torch.searchsorted(ends, p, right=True).clamp(max=per_context - 1)  # pair slot of every token
        positions = torch.where(real, p - (ends - plen).gather(1, which), 0)
        seq = pairs.gather(1, which).clamp(min=0) // n_docs
        ids, targets = sequences[seq, positions], sequences[seq, positions + 1]
        segment = torch.where(real, which, per_context)
        allowed = (segment[:, :, None] == segment[:, None, :]) & (positions[:, None, :] <= positions[:, :, None])
        span = int(c[0]), int(c[-1]) + 1
        if span[1] - span[0] == c.numel():  # consecutive contexts: views, no copy
            kv = [(k[span[0]:span[1]], v[span[0]:span[1]]) for k, v in cross_kv]
            mask = contexts.attention_mask[span[0]:span[1]]
        else:
            kv = [(_rows(k, c), _rows(v, c)) for k, v in cross_kv]
            mask = _rows(contexts.attention_mask, c)
        hidden = _bart_packed_hidden(generator, ids, positions, allowed, kv, mask)[real]  # (tokens, d_model)
        logits = generator.lm_head(hidden) + generator.final_logits_bias[0]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[real][:, None]).squeeze(-1)
        out[pairs.gather(1, which)[real], positions[real]] = lp
    return out.view(n_cand, n_docs, width)


def _per_doc_terms(token_lp: Tensor, targets: Tensor, log_prior: Tensor, question: Tensor, spec: _Spec,
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


@torch.no_grad()
def rag_sequence_generate(generator, contexts: EncodedContexts, doc_scores: Tensor,
                          config: GenerationConfig = GenerationConfig(),
                          decoding: Literal["thorough", "fast"] = "thorough", dedup: bool = True,
                          convention: Literal["transformers", "paper"] = "transformers",
                          rescore_batch_size: int | None = None) -> GenerationOutput:
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

    Remaining difference to transformers 5: its per-passage search drops `context_attention_mask`
    (`generate(attention_mask=None)`, and v5 infers no mask for encoder-decoder models), so padded contexts
    attend to their pads there but not in rescoring; here the mask is always used, so outputs match it only
    for unpadded contexts. It also re-encodes every context once per candidate during rescoring.

    Returns `GenerationOutput` (`batch * num_return_sequences` rows) with `doc_posteriors` `p(z|x, y)`
    (fast decoding: zero for passages that did not produce `y`).
    """
    if decoding not in ("thorough", "fast"):
        raise ConfigError(f"decoding must be 'thorough' or 'fast', got {decoding!r}")
    if convention not in ("transformers", "paper"):
        raise ConfigError(f"convention must be 'transformers' or 'paper', got {convention!r}")
    batch, n_docs = _check_contexts(contexts, doc_scores)
    spec = _resolve(config, generator)
    device = doc_scores.device
    log_prior = doc_log_prior(doc_scores.float())  # (batch, n_docs)
    hyps, cross_kv = _per_document(generator, contexts, config, keep_cross_kv=decoding == "thorough")
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
        token_lp = _teacher_forced(generator, contexts, cands, question[:, None] * n_docs + docs,
                                   max_rows=rescore_batch_size, cross_kv=cross_kv, eos=spec.eos)
        terms = _per_doc_terms(token_lp, cands[:, 1:], cand_prior, question, spec, convention)
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
