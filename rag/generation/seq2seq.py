"""Seq2seq generators for search and rescoring: encoded contexts, incremental decoders with KV caches, teacher forcing.

Everything here works on a seq2seq generator (`transformers` BART / T5, or any module with the same
`get_encoder()` / `forward(encoder_outputs=..., decoder_input_ids=..., past_key_values=...)` interface; put
it in eval mode first, nothing here changes its mode) and on already-tokenized contexts `(N, src_len)`
(for RAG, row `b * n_docs + k` is question `b` joined with its `k`-th retrieved passage).

Efficiency by design (ARCHITECTURE invariant 2; `benchmarks/decode_bench.py`, docs/benchmarks.md "Decoding"):

* `encode_contexts` runs the generator encoder once per context; every search and the rescoring below reuse
  those states (index-selected, never re-encoded). transformers' `RagSequenceForGeneration.generate`
  re-encodes every context once per candidate instead.
* Cross-attention keys/values are projected once per context. For BART the decoder rows of one context
  attend to them in place (`rag.generation.bart`). Other generators: the first decoder step (every row feeds
  the decoder start token) runs once per context and its cache is copied to the context's rows.
  transformers runs that step on every row, recomputing the same keys/values `num_beams` times, and copies
  them again at every beam reorder.
* Searches decode incrementally with the decoder KV cache. Beam reordering moves only the self-attention
  cache: cross-attention keys/values are identical for every beam of a row group.
* Teacher-forced rescoring scores every (sequence, context) pair in one decoder pass on the keys/values a
  search already computed, stopping each sequence at its EOS; for BART the pairs of one context are packed
  into one decoder sequence (`rag.generation.bart.rescore_packed`). Chunks bound the `(tokens, vocab)` logits.
* Large gathers use advanced indexing, not `index_select` (many times slower on CPU with several threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rag.generation.bart import BartStepDecoder, is_bart, rescore_packed
from rag.generation.kv_cache import cache_kwarg, output_cache
from rag.generation.search import SearchSpec, config_token_id, resolve_spec, unit_boundary, unit_rows
from rag.utils.errors import ConfigError, RagError

__all__ = [
    "EncodedContexts",
    "encode_contexts",
    "gather_rows",
    "Seq2SeqStepDecoder",
    "seq2seq_decoder",
    "teacher_forced_logprobs",
    "teacher_forced",
]


@dataclass(frozen=True)
class EncodedContexts:
    """Generator-encoder states of every (question, passage) context, computed once per decoding call.

    `last_hidden_state` is `(batch * n_docs, src_len, d_model)`, `attention_mask` `(batch * n_docs, src_len)`.
    """

    last_hidden_state: Tensor
    attention_mask: Tensor

    def __len__(self) -> int:
        return self.last_hidden_state.shape[0]

    # The contexts protocol the RAG decoders read (rag.generation.decoding.DecodingContexts).
    @property
    def device(self) -> torch.device:
        return self.last_hidden_state.device

    def search_spec(self, config, generator) -> SearchSpec:
        """The search spec of a per-context search: one start token, the decoder start token."""
        return resolve_spec(config, generator, prompt_len=1)

    def start_tokens(self, config, generator, rows: Tensor) -> Tensor:
        """`(len(rows), 1)` start tokens of the searches of contexts `rows`: the decoder start token."""
        start = config_token_id(config, generator, "decoder_start_token_id", True)
        return torch.full((rows.shape[0], 1), start, dtype=torch.long, device=rows.device)

    def check_shared_start(self, start: Tensor, n_docs: int) -> None:
        """Every context starts from the decoder start token: the K contexts of a question always share it."""

    def decoder(self, generator, context_of_row: Tensor, keep_cross_kv: bool = False):
        """A search `Decoder` whose row `i` attends to context `context_of_row[i]` (:func:`seq2seq_decoder`)."""
        return seq2seq_decoder(generator, self, context_of_row, keep_cross_kv=keep_cross_kv)

    def teacher_forced(self, generator, sequences: Tensor, context_index: Tensor, max_rows: int | None = None,
                       cross_kv: list[tuple[Tensor, Tensor]] | None = None, eos: int | None = None) -> Tensor:
        """`log p(y_t | x, z, y_<t)` `(C, K, T - 1)` on these encoder states (:func:`teacher_forced`)."""
        return teacher_forced(generator, self, sequences, context_index, max_rows, cross_kv=cross_kv, eos=eos)



@torch.no_grad()
def encode_contexts(generator, context_input_ids: Tensor, context_attention_mask: Tensor) -> EncodedContexts:
    """Run the generator encoder once over all `(batch * n_docs, src_len)` contexts.

    Everything downstream (searches, rescoring) reuses the returned states.
    """
    if context_input_ids.dim() != 2 or context_attention_mask.shape != context_input_ids.shape:
        raise RagError(
            f"context_input_ids and context_attention_mask must both be (batch * n_docs, src_len); got "
            f"{tuple(context_input_ids.shape)} and {tuple(context_attention_mask.shape)}")
    unit_boundary()  # the encoder pass is a unit of its own (after retrieval, before decoding)
    out = generator.get_encoder()(input_ids=context_input_ids, attention_mask=context_attention_mask, return_dict=True)
    return EncodedContexts(last_hidden_state=out.last_hidden_state, attention_mask=context_attention_mask)



def gather_rows(t: Tensor, index: Tensor) -> Tensor:
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
    return out.logits[:, -1, :].float(), output_cache(out)


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

    self_cache = DynamicCache() if self_kv is None else _dynamic_cache([(gather_rows(k, rows), gather_rows(v, rows))
                                                                        for k, v in self_kv])
    return EncoderDecoderCache(self_cache, _dynamic_cache([(gather_rows(k, rows), gather_rows(v, rows)) for k, v in cross_kv]))


class Seq2SeqStepDecoder:
    """A search `Decoder` (`step`, `reorder`): rows that each attend to one encoded context, one token at a time
    with a KV cache.

    The first step (every row feeds the decoder start token) runs once per *context*, not per row: its logits
    and cache — the cross-attention keys/values included, the expensive part — are then copied to the rows
    of that context (beams, and for RAG-Token the beams of every question). transformers instead runs it on
    every row, recomputing the same cross-attention keys/values `num_beams` times.

    A generator whose ``needs_copy_history`` is true (the pointer generator with the bigram continuation bias) also
    gets each row's decoder input ids so far as ``copy_history``, kept and reordered with the rows here.
    """

    def __init__(self, generator, contexts: EncodedContexts, context_of_row: Tensor, keep_cross_kv: bool = False):
        from transformers.modeling_outputs import BaseModelOutput

        self.keep_cross_kv = keep_cross_kv
        self.generator = generator
        self.contexts = contexts
        self.context_of_row = context_of_row
        self.identity = identity = context_of_row.shape[0] == len(contexts) and bool(
            (context_of_row == torch.arange(len(contexts), device=context_of_row.device)).all())
        states = contexts.last_hidden_state if identity else gather_rows(contexts.last_hidden_state, context_of_row)
        self.encoder_outputs = BaseModelOutput(last_hidden_state=states)
        self.mask = contexts.attention_mask if identity else gather_rows(contexts.attention_mask, context_of_row)
        self.cache = None
        self.history: Tensor | None = None
        """`(rows, steps)` the tokens fed so far, if the generator needs them (``needs_copy_history``), else None."""
        self.track_history = bool(getattr(generator, "needs_copy_history", False))
        self.cross_kv: list[tuple[Tensor, Tensor]] | None = None
        """Per-context (not per-row) cross-attention keys/values after the first step, kept for reuse (rescoring)
        when `keep_cross_kv`."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` `(rows,)`; return next-token logits `(rows, vocab)` in float32."""
        if self.track_history:
            self.history = tokens[:, None] if self.history is None else torch.cat([self.history, tokens[:, None]], 1)
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
                return gather_rows(logits, self.context_of_row)
        extra = {"copy_history": self.history} if self.track_history else {}
        out = self.generator(encoder_outputs=self.encoder_outputs, attention_mask=self.mask,
                             decoder_input_ids=tokens[:, None], **cache_kwarg(self.generator, self.cache), use_cache=True,
                             return_dict=True, **extra)
        self.cache = output_cache(out)
        return out.logits[:, -1, :].float()

    def reorder(self, rows: Tensor) -> None:
        """Make row `i` continue from row `rows[i]` (only ever within one context group)."""
        from transformers.cache_utils import EncoderDecoderCache

        if self.history is not None:
            self.history = self.history[rows]
        if isinstance(self.cache, EncoderDecoderCache):
            # Cross-attention K/V depend only on the context, identical for every row a beam can move between.
            self.cache.self_attention_cache.reorder_cache(rows)
        elif hasattr(self.cache, "reorder_cache"):
            self.cache.reorder_cache(rows)
        else:
            raise RagError(f"the generator returned a cache of type {type(self.cache).__name__} that cannot be "
                           "reordered for beam search; use num_beams=1 or a transformers Cache")


def seq2seq_decoder(generator, contexts: EncodedContexts, context_of_row: Tensor, keep_cross_kv: bool = False):
    """A search `Decoder` whose row `i` attends to context `context_of_row[i]`.

    The BART fast path (`rag.generation.bart.BartStepDecoder`) when it applies (every used context has the
    same number of rows), else the generic `Seq2SeqStepDecoder`. With `keep_cross_kv` the decoder's
    `cross_kv` holds the per-context cross-attention keys/values after the first step (for rescoring), or None.
    """
    if is_bart(generator):
        order = torch.sort(context_of_row, stable=True).indices
        used, counts = torch.unique_consecutive(context_of_row[order], return_counts=True)
        if counts.numel() and bool((counts == counts[0]).all()):
            n = len(contexts)
            all_used = used.numel() == n and bool((used == torch.arange(n, device=used.device)).all())
            states = contexts.last_hidden_state if all_used else gather_rows(contexts.last_hidden_state, used)
            mask = contexts.attention_mask if all_used else gather_rows(contexts.attention_mask, used)
            return BartStepDecoder(generator, states, mask, order, int(counts[0]), keep_cross_kv and all_used)
    return Seq2SeqStepDecoder(generator, contexts, context_of_row, keep_cross_kv)


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
    return teacher_forced(generator, contexts, sequences, context_index, batch_size, cross_kv=None)


def teacher_forced(generator, contexts: EncodedContexts, sequences: Tensor, context_index: Tensor,
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
            contexts = EncodedContexts(gather_rows(contexts.last_hidden_state, used), gather_rows(contexts.attention_mask, used))
        _, cache = _context_step(generator, contexts, int(sequences[0, 0]))
        cross_kv = _shared_cross_attention(cache)
        del cache
    width = sequences.shape[1] - 1
    if cross_kv is not None and is_bart(generator):
        if eos is None:
            length = torch.full((n_cand,), width, dtype=torch.long, device=sequences.device)
        else:
            is_eos = (sequences[:, 1:] == eos).long()
            length = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, width)
        return rescore_packed(generator, contexts.attention_mask, sequences, rows.view(n_cand, n_docs), cross_kv, length,
                              max_rows)
    batch_size = unit_rows(64) if max_rows is None else max_rows
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
        unit_boundary()  # one chunk is one bounded unit of work
        pick = order[lo:lo + batch_size]  # flat (candidate, doc) rows of this chunk
        n = int(lengths[lo:lo + batch_size].max())
        cand = pick // n_docs
        ctx = rows[pick]
        past = None if cross_kv is None else _gathered_cache(None, cross_kv, ctx)
        logits = generator(encoder_outputs=BaseModelOutput(last_hidden_state=gather_rows(contexts.last_hidden_state, ctx)),
                           attention_mask=gather_rows(contexts.attention_mask, ctx), decoder_input_ids=sequences[cand, :n],
                           **cache_kwarg(generator, past), use_cache=past is not None, return_dict=True).logits
        del past
        lp = torch.log_softmax(logits.float(), -1).gather(-1, sequences[cand, 1:n + 1, None]).squeeze(-1)
        if eos is not None:
            lp = lp.masked_fill(torch.arange(n, device=lp.device) >= lengths[lo:lo + batch_size, None], 0.0)
        out[pick, :n] = lp
    return out.view(n_cand, n_docs, -1)


