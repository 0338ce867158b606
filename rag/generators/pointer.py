"""A copy (pointer) head for the warm-started generator: emit a context token by pointing at it.

A small generator fine-tuned on a few hundred QA pairs learns slowly to *copy* an answer it has never
produced before (a symbol, a number, a year) out of the passage: it has to rebuild the token's
identity from the encoder's contextual states. A pointer-generator (See et al. 2017, "Get To The
Point") makes copying a first-class action. At decoder step ``t`` with final state ``h_t``,

    p(y_t) = g_t · softmax(W h_t)[y_t]  +  (1 - g_t) · Σ_{j : x_j = y_t} a_tj,
    a_t = softmax_j(q(h_t) · k(m_j) / sqrt(d)),   g_t = sigmoid(w · h_t + b),

over the context tokens ``x_j`` with encoder states ``m_j``: the model learns *where* to look, and the
copy itself needs no learning. The generator returns ``log p`` as its logits, so every consumer that
takes a log-softmax (RAG marginalisation, decoding) gets ``log p`` back unchanged.

To point, the head needs each context's token ids at every decoder step, including when only the
encoder outputs are passed around (our decoding, transformers' ``generate``, the encoder-output cache).
The encoder therefore returns its states with the token ids in :data:`ID_CHANNELS` trailing channels
(``id // 256`` and ``id % 256``: integers below 256 are exact in bfloat16 and float16 too), so anything
that stores, reorders, pads or caches encoder outputs keeps them aligned with the states without
knowing about them. :func:`split_memory` takes them back off.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor, nn

from rag.generation.kv_cache import cache_field, cache_kwarg, output_cache

ID_CHANNELS = 2
"""Trailing channels of the pointer encoder's output that carry the context token ids."""
_BASE = 256


def attach_ids(states: Tensor, input_ids: Tensor) -> Tensor:
    """Encoder states `(N, S, H)` + their token ids `(N, S)` -> memory `(N, S, H + ID_CHANNELS)`."""
    high, low = torch.div(input_ids, _BASE, rounding_mode="floor"), torch.remainder(input_ids, _BASE)
    return torch.cat([states, high.to(states.dtype)[..., None], low.to(states.dtype)[..., None]], dim=-1)


def split_memory(memory: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`attach_ids`: `(states (N, S, H), token ids (N, S) long)`."""
    ids = memory[..., -2].round().long() * _BASE + memory[..., -1].round().long()
    return memory[..., :-ID_CHANNELS], ids


def copy_log_probs(vocab_logits: Tensor, gate_logits: Tensor, copy_scores: Tensor, source_ids: Tensor,
                   source_mask: Optional[Tensor] = None) -> Tensor:
    """Log-probabilities of the pointer-generator mixture (module docstring), computed in float32.

    Args:
        vocab_logits: `(N, T, V)` the language-model head's logits.
        gate_logits: `(N, T, 1)` logit of `g_t`, the probability of generating from the vocabulary.
        copy_scores: `(N, T, S)` pointer attention scores over the context tokens.
        source_ids: `(N, S)` the context token ids (in `[0, V)`).
        source_mask: `(N, S)` 1 on real context tokens, 0 on padding (None: all real).

    Returns:
        `(N, T, V)` `log p(y_t = v)`; each row log-sums to 0.
    """
    scores = copy_scores.float()
    if source_mask is not None:
        scores = scores.masked_fill(~source_mask.bool()[:, None, :], float("-inf"))
    attention = scores.softmax(-1)  # (N, T, S)
    index = source_ids[:, None, :].expand(-1, scores.shape[1], -1)
    p_copy = torch.zeros(vocab_logits.shape, dtype=torch.float32, device=vocab_logits.device).scatter_add_(-1, index, attention)
    gate = gate_logits.float()
    log_generate = torch.nn.functional.logsigmoid(gate) + vocab_logits.float().log_softmax(-1)
    log_copy = torch.nn.functional.logsigmoid(-gate) + p_copy.clamp_min(1e-30).log()  # clamp: no 0 * inf gradient
    return torch.logaddexp(log_generate, log_copy)


def continuation_matches(source_ids: Tensor, previous_ids: Tensor, ignore: tuple[int, ...] = ()) -> Tensor:
    """Where pointing at context token ``j`` would continue a copy: ``x_{j-1} == y_{t-1}``.

    Args:
        source_ids: `(N, S)` the context token ids.
        previous_ids: `(N, T)` the token before each decoder step (the decoder's input ids).
        ignore: previous tokens that continue nothing (decoder start, padding).

    Returns:
        `(N, T, S)` float 1.0 where the context token before ``j`` is the previous output token, else 0.0.
    """
    before = torch.full_like(source_ids, -1)
    before[:, 1:] = source_ids[:, :-1]
    match = before[:, None, :] == previous_ids[:, :, None]
    for token in ignore:
        match &= (previous_ids != token)[:, :, None]
    return match.float()


def bigram_continuation_matches(source_ids: Tensor, history: Tensor, steps: int, ignore: tuple[int, ...] = ()) -> Tensor:
    """Where pointing at context token ``j`` would continue a copy of the last *two* output tokens:
    ``x_{j-2} == y_{t-2}`` and ``x_{j-1} == y_{t-1}``.

    A frequent token ("of", "the") occurs in several places of a passage, so :func:`continuation_matches` marks a
    position after each of them; only the true continuation of the span being copied also matches the token before.

    Args:
        source_ids: `(N, S)` the context token ids.
        history: `(N, L)` the decoder's input ids so far (``L >= steps``); its last `steps` columns are the tokens
            before the decoder steps scored now, the column before them (if any) is the token before those.
        steps: `T`, the decoder steps scored now (with a KV cache 1).
        ignore: tokens that continue nothing (decoder start, padding, end): a pair containing one matches nothing.

    Returns:
        `(N, T, S)` float 1.0 where the two context tokens before ``j`` are the two previous output tokens, else 0.0.
    """
    if history.shape[1] < steps:
        raise ValueError(f"the decoder history holds {history.shape[1]} tokens, fewer than the {steps} steps scored")
    previous = history[:, history.shape[1] - steps:]  # y_{t-1}
    before_previous = torch.full_like(previous, -1)  # y_{t-2}; -1 (matches nothing) where there is none
    known = min(steps, history.shape[1] - 1)
    if known > 0:
        before_previous[:, steps - known:] = history[:, history.shape[1] - known - 1:history.shape[1] - 1]
    one_before, two_before = torch.full_like(source_ids, -1), torch.full_like(source_ids, -1)
    one_before[:, 1:] = source_ids[:, :-1]
    two_before[:, 2:] = source_ids[:, :-2]
    match = (one_before[:, None, :] == previous[:, :, None]) & (two_before[:, None, :] == before_previous[:, :, None])
    for token in ignore:
        match &= ((previous != token) & (before_previous != token))[:, :, None]
    return match.float()


CONTINUATION_INIT = 3.0
"""Initial continuation bias: a context token that follows the previous output token starts e^3 ≈ 20x likelier to be
pointed at than one with the same attention score (Adam moves a bias by about the learning rate per step, so the
starting value is what a short run keeps)."""
BIGRAM_INIT = 3.0
"""Initial bigram continuation bias (on top of the unigram one): the context token that continues the last two output
tokens starts e^3 ≈ 20x likelier to be pointed at than another one that follows only the last token (a frequent token
elsewhere in the passage)."""


@functools.lru_cache(maxsize=None)
def pointer_encoder_class(base: type) -> type:
    """`base` (a transformers encoder class) whose ``last_hidden_state`` carries the input ids
    (:func:`attach_ids`)."""

    class PointerEncoder(base):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            if input_ids is None:
                raise ValueError("the pointer generator's encoder needs input_ids (it copies context tokens), not inputs_embeds")
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            out.last_hidden_state = attach_ids(out.last_hidden_state, input_ids)
            return out

    PointerEncoder.__name__ = PointerEncoder.__qualname__ = f"Pointer{base.__name__}"
    return PointerEncoder


@functools.lru_cache(maxsize=None)
def pointer_model_class() -> type:
    """The pointer-generator ``EncoderDecoderModel`` subclass (defined lazily: transformers loads on use)."""
    from transformers import EncoderDecoderModel
    from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

    class PointerEncoderDecoderModel(EncoderDecoderModel):
        """``EncoderDecoderModel`` + copy head. Its encoder must be a :func:`pointer_encoder_class` one;
        ``logits`` are the mixture's log-probabilities (:func:`copy_log_probs`)."""

        def __init__(self, config=None, encoder=None, decoder=None):
            super().__init__(config=config, encoder=encoder, decoder=decoder)
            d, e = self.decoder.config.hidden_size, self.encoder.config.hidden_size
            self.copy_query = nn.Linear(d, d)
            self.copy_key = nn.Linear(e, d)
            self.copy_gate = nn.Linear(d, 1)
            self.copy_continue: Optional[nn.Linear] = None
            self.copy_continue_bigram: Optional[nn.Linear] = None

        @property
        def needs_copy_history(self) -> bool:
            """True when a decoding step needs the tokens before its input (the bigram continuation bias): with a KV
            cache pass them as ``copy_history`` `(N, L)`, the decoder input ids so far, the step's own input last."""
            return self.copy_continue_bigram is not None

        def add_continuation(self, bigram: bool = False) -> None:
            """Add the copy-continuation bias: the pointer score of context token ``j`` gains ``c(h_t) = w · h_t + b``
            where ``x_{j-1}`` is the previous output token (:func:`continuation_matches`), so once the head starts
            copying a span it tends to go on copying it in order instead of jumping between look-alike tokens
            (CopyNet's selective read, Gu et al. 2016, reduced to a token match). `w` starts at 0, `b` at
            :data:`CONTINUATION_INIT`.

            With `bigram` the score also gains ``c2(h_t) = w2 · h_t + b2`` (`w2` at 0, `b2` at :data:`BIGRAM_INIT`) where
            ``x_{j-2} x_{j-1}`` are the last two output tokens (:func:`bigram_continuation_matches`): the true
            continuation of a span beats the token after another occurrence of a frequent previous token."""
            d = self.decoder.config.hidden_size
            self.copy_continue = nn.Linear(d, 1)
            with torch.no_grad():
                self.copy_continue.weight.zero_()
                self.copy_continue.bias.fill_(CONTINUATION_INIT)
            if bigram:
                self.copy_continue_bigram = nn.Linear(d, 1)
                with torch.no_grad():
                    self.copy_continue_bigram.weight.zero_()
                    self.copy_continue_bigram.bias.fill_(BIGRAM_INIT)

        def copy_scores(self, h: Tensor, states: Tensor) -> Tensor:
            """Pointer scores `(N, T, S)` = q(h_t) · k(m_j) / sqrt(d), with k(m) = W_k m + b_k applied on the
            query side, ((q W_k) · m_j + q · b_k): the states `(N, S, e)` are never projected, so a decoding
            step costs `T x e` instead of `S x e x d` per row (the states are the same at every step)."""
            q = self.copy_query(h)  # (N, T, d)
            scores = (q @ self.copy_key.weight) @ states.transpose(1, 2) + (q @ self.copy_key.bias)[..., None]
            return scores / math.sqrt(h.shape[-1])

        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            """transformers' ``generate``: its inputs, plus the decoder ids so far as ``copy_history`` (bigram bias)."""
            inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
            if self.needs_copy_history:
                inputs["copy_history"] = input_ids
            return inputs

        def forward(self, input_ids=None, attention_mask=None, encoder_outputs=None, labels=None, copy_history=None, **kwargs):
            """transformers' forward, the logits being the mixture's log-probabilities; `copy_history` `(N, L)`: the
            decoder input ids so far (the last ones the ``decoder_input_ids`` of this call), needed by the bigram
            continuation bias when a KV cache holds the earlier steps (ignored otherwise)."""
            if encoder_outputs is None:
                encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            memory = encoder_outputs[0]
            states, source_ids = split_memory(memory)
            cfg = self.config
            if labels is not None and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
                from transformers.models.encoder_decoder.modeling_encoder_decoder import shift_tokens_right

                kwargs["decoder_input_ids"] = shift_tokens_right(labels, cfg.pad_token_id, cfg.decoder_start_token_id)
            kwargs["decoder_output_hidden_states"] = True
            past = kwargs.pop("cache", None)
            past = kwargs.pop("past_key_values", None) if past is None else past
            if past is not None:
                kwargs.update(cache_kwarg(EncoderDecoderModel, past))
            cached = past.get_seq_length() if hasattr(past, "get_seq_length") else 0  # before the forward extends it
            out = super().forward(attention_mask=attention_mask, encoder_outputs=BaseModelOutput(last_hidden_state=states),
                                  **kwargs)
            h = out.decoder_hidden_states[-1]  # (N, T, d): the state the LM head reads
            scores = self.copy_scores(h, states)
            if self.copy_continue is not None:
                previous = kwargs.get("decoder_input_ids")
                if previous is None:
                    raise ValueError("the copy-continuation head needs decoder_input_ids (or labels), not decoder_inputs_embeds")
                ignore = (cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id)
                steps = h.shape[1]
                match = continuation_matches(source_ids, previous[:, -steps:], ignore)  # (N, T, S); with a cache T is 1
                scores = scores + self.copy_continue(h) * match.to(scores.dtype)
                if self.copy_continue_bigram is not None:
                    history = self._copy_history(copy_history, previous, steps, cached)
                    pair = bigram_continuation_matches(source_ids, history, steps, ignore)
                    scores = scores + self.copy_continue_bigram(h) * pair.to(scores.dtype)
            logits = copy_log_probs(out.logits, self.copy_gate(h), scores, source_ids, attention_mask)
            loss = None
            if labels is not None:
                loss = nn.functional.nll_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
            return Seq2SeqLMOutput(loss=loss, logits=logits, **{cache_field(): output_cache(out)},
                                   encoder_last_hidden_state=memory)

        @staticmethod
        def _copy_history(copy_history: Optional[Tensor], previous: Tensor, steps: int, cached: int) -> Tensor:
            """The decoder ids so far `(N, L)` for the bigram bias: `copy_history` (checked against this call's
            input), else this call's input, which is the whole history only when no KV cache holds earlier steps
            (`cached`: the steps the cache held before this call)."""
            if copy_history is None:
                if cached:
                    raise ValueError(f"the bigram copy-continuation head decodes with a KV cache of {cached} steps but was "
                                     "given only the newest decoder token; pass copy_history (the decoder input ids so far)")
                return previous
            if copy_history.shape[0] != previous.shape[0] or copy_history.shape[1] < steps \
                    or not torch.equal(copy_history[:, -steps:], previous[:, -steps:]):
                raise ValueError(f"copy_history {tuple(copy_history.shape)} must end with this call's decoder_input_ids "
                                 f"{tuple(previous.shape)}")
            return copy_history

    return PointerEncoderDecoderModel
