"""BART's decoder written out by hand: the fast paths for search steps and packed teacher-forced rescoring.

Same math as transformers' `BartDecoder` (eval mode), rearranged so that work depends on contexts, not rows
(ARCHITECTURE invariant 2; `benchmarks/decode_bench.py`, docs/benchmarks.md "Decoding"):

* `BartStepDecoder`: the decoder rows of one context (beams; for RAG-Token every beam of the question) attend
  to the context's cross-attention keys/values in place — projected once per context, never copied to rows
  (transformers copies them to every row and again at every beam reorder). One single-query attention call
  per row slot, so the rounding is transformers' own and near-tied beams rank the same (a folded multi-query
  call would be faster but rounds differently).
* `rescore_packed`: the (sequence, context) pairs of one context are packed end to end into one decoder
  sequence (block-diagonal causal self-attention, per-pair positions), so only real tokens are computed and
  the context's keys/values are used in place; chunks bound the `(tokens, vocab)` logits memory.

Pure torch on tensors (states, masks, keys/values); `rag.generation.seq2seq` picks these paths when
`is_bart(generator)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rag.generation.search import unit_boundary, unit_rows

__all__ = ["is_bart", "bart_cross_kv", "BartStepDecoder", "rescore_packed"]


def is_bart(generator) -> bool:
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



def bart_cross_kv(generator, states: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per-layer cross-attention `(keys, values)` `(N, heads, src_len, head_dim)` of BART encoder states
    `(N, src_len, d_model)`, laid out as transformers' cache holds them (contiguous)."""
    n, src_len, _ = states.shape
    out = []
    for layer in generator.model.decoder.layers:
        attn = layer.encoder_attn
        out.append(tuple(proj(states).view(n, src_len, -1, attn.head_dim).transpose(1, 2).contiguous()
                         for proj in (attn.k_proj, attn.v_proj)))
    return out



class BartStepDecoder:
    """A search `Decoder` for BART (`step`, `reorder`): cross-attention folded per context.

    The rows of one context (its beams; for RAG-Token the beams of its question) are folded to
    `(contexts, rows_per_context)` and attend to that context's keys/values in place (`_cross_attend_rows`),
    so the keys/values are projected once per context and never copied to rows (transformers copies them to
    every row and again at every beam reorder). Self-attention and everything else run per row, as in BART.
    """

    def __init__(self, generator, states: Tensor, mask: Tensor, order: Tensor, per_context: int,
                 keep_cross_kv: bool = False):
        """states `(contexts, src_len, d_model)` / mask `(contexts, src_len)`: the encoded contexts the rows use;
        order `(rows,)`: the rows sorted (stably) by context, `per_context` rows each."""
        device = order.device
        self.generator = generator
        self.per_context = per_context
        # Rows sorted by context (stable) fold to (contexts, per_context); None when they already are.
        in_order = bool((order == torch.arange(order.numel(), device=device)).all())
        self.order = None if in_order else order
        self.inverse = None if in_order else torch.argsort(order)
        self.mask = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        self.kv = bart_cross_kv(generator, states)
        self.cross_kv = self.kv if keep_cross_kv else None
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
        self.self_kv = [(k[rows], v[rows]) for k, v in self.self_kv]



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


def rescore_packed(generator, context_mask: Tensor, sequences: Tensor, context_index: Tensor,
                   cross_kv: list[tuple[Tensor, Tensor]], lengths: Tensor, max_rows: int | None) -> Tensor:
    """Teacher-forced log-probs for BART: the (sequence, context) pairs of each context packed into one decoder sequence.

    Packing (block-diagonal causal self-attention, per-pair positions) computes only the `lengths[c]` scored
    targets of each pair, no padding to the longest, and uses each context's cross-attention keys/values in
    place. context_mask `(contexts, src_len)`: the encoder mask of the contexts `context_index` points to;
    lengths `(C,)`: targets to score per sequence (later ones are left 0). Returns `(C, K, T - 1)`.
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
    if max_rows is None:  # bound the (tokens, vocab) float32 logits to ~256 MiB (and the unit of work, where asked)
        max_rows = unit_rows(max(per_context, (256 << 20) // max(1, 4 * vocab * max(1, int(lengths.max())))))
    groups_per_chunk = max(1, max_rows // per_context)
    for lo in range(0, ctx_of.numel(), groups_per_chunk):
        unit_boundary()  # one chunk is one bounded unit of work
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
            mask = context_mask[span[0]:span[1]]
        else:
            kv = [(k[c], v[c]) for k, v in cross_kv]  # advanced indexing: see seq2seq.gather_rows
            mask = context_mask[c]
        hidden = _bart_packed_hidden(generator, ids, positions, allowed, kv, mask)[real]  # (tokens, d_model)
        logits = generator.lm_head(hidden) + generator.final_logits_bias[0]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[real][:, None]).squeeze(-1)
        out[pairs.gather(1, which)[real], positions[real]] = lp
    return out.view(n_cand, n_docs, width)


