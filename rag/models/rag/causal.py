"""RAG over a causal (decoder-only) generator: the prompts, targets and teacher-forced logits :class:`RagModel` uses
when its generator is a decoder-only LM (GPT-2, Llama, SmolLM2), so that both kinds share one model class, one loss
(:func:`rag.generation.marginalize.rag_nll_from_logits`) and one decoding path (:mod:`rag.generation.decoding`).

For a decoder-only generator p(y | x, z) (RAG §2.1) is the LM's likelihood of the answer tokens and EOS after the
prompt of passage z and question x (:mod:`rag.generation.prompts`); the prompt tokens themselves are never scored::

    row b·K + k:  [pad … pad] prompt(z_k, x_b)  y_b,1 … y_b,T-1     (left-padded prompts, positions cumsum(mask) - 1)
    logits at the last prompt position … the position of y_b,T-1  ──►  (B, K, T, V): position t predicts y_b,t

The LM head runs only at those T positions (``logits_to_keep``), so the logits cost B·K·T·V, not B·K·(S+T)·V.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from rag.generation.causal import CausalPrompts, PrefixCache, prompt_positions
from rag.generation.prompts import segmented_pad, tokenize_answers, tokenize_prompts
from rag.utils.errors import ConfigError
from rag.utils.truncation import note_cut_prompts

__all__ = ["causal_prompts", "causal_targets", "causal_logits", "decoding_prompts", "prefix_cache"]


def _pad_id(model) -> int:
    tok = model.generator_tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


def causal_prompts(model, questions: Sequence[str], passages: Optional[Sequence[Sequence]]
                   ) -> tuple[Tensor, Tensor, int, list[str], int]:
    """Prompt ids and mask ``(B·K, S)`` (``(B, S)`` closed-book, `passages` None), the number of prompts shortened to
    ``config.max_context_length``, the prompt strings, and the width of the question-independent prefix segment: the
    prompts are laid out in two left-padded segments (:func:`rag.generation.prompts.segmented_pad`), header + passage,
    then the rest, so decoding can take the first segment's KV cache from the model's :class:`PrefixCache`."""
    cfg = model.config
    found = tokenize_prompts(model.generator_tokenizer, cfg.prompt_format, list(questions), passages, cfg.max_context_length)
    ids, mask, width = segmented_pad(found.ids, found.prefix_lengths or [0] * len(found.ids), _pad_id(model))
    counted = passages is not None and note_cut_prompts(sum(found.truncated), len(found.ids), cfg.max_context_length)
    if any(found.truncated) and not counted:  # counted: the command reports the total once
        import warnings

        from rag.generation.contexts import ContextTruncationWarning

        warnings.warn(f"{sum(found.truncated)} generator prompts are longer than max_context_length={cfg.max_context_length} "
                      "tokens; their passages were shortened so the question is kept (raise max_context_length to keep "
                      "whole passages)", ContextTruncationWarning, stacklevel=3)
    return ids, mask, int(sum(found.truncated)), found.strings, width


def answer_prefix(model) -> str:
    """The text before an answer (a space after a prompt ending in a visible character, e.g. ``Answer:`` without a chat
    template), from the model's prompt format."""
    cfg = model.config
    sample = tokenize_prompts(model.generator_tokenizer, cfg.prompt_format, ["q"], [[_Probe()]], 1 << 20)
    return sample.answer_prefix


class _Probe:
    title, text = "t", "p"


def causal_targets(model, targets: Sequence[str]) -> tuple[Tensor, Tensor]:
    """The scored target ids ``(B, T)`` (answer tokens and EOS, right-padded) and their mask ``(B, T)`` bool."""
    fmt = model.config.prompt_format
    cached = getattr(model, "_answer_prefix", None)
    if cached is None or cached[0] != fmt:
        cached = model._answer_prefix = (fmt, answer_prefix(model))
    prefix = cached[1]
    return tokenize_answers(model.generator_tokenizer, targets, prefix, model.config.max_target_length)


def causal_logits(generator, prompt_ids: Tensor, prompt_mask: Tensor, labels: Tensor, n_docs: int) -> Tensor:
    """Teacher-forced logits ``(B, K, T, V)`` of the targets `labels` ``(B, T)`` after each of the ``B·K`` left-padded
    prompts ``(B·K, S)``: position t is the distribution of ``labels[:, t]``. One forward pass over the B·K rows; the
    LM head only at the T scored positions. Targets are right-padded: a pad is fed only after a row's EOS, where causal
    attention keeps it from every scored position before it, so pads need no mask."""
    b, t = labels.shape
    rows = prompt_ids.shape[0]
    if rows != b * n_docs:
        raise ConfigError(f"{rows} prompts for {b} targets and {n_docs} passages each; expected {b * n_docs}")
    fed = labels[:, :-1].repeat_interleave(n_docs, 0)  # the last target (EOS) is scored, never fed
    ids = torch.cat([prompt_ids, fed], 1)
    mask = torch.cat([prompt_mask.long(), torch.ones_like(fed)], 1)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=prompt_positions(mask), use_cache=False, return_dict=True)
    try:
        logits = generator(**kw, logits_to_keep=t).logits
    except TypeError:  # an LM without logits_to_keep: full logits, then the last T positions
        logits = generator(**kw).logits
    return logits[:, -t:].reshape(b, n_docs, t, -1)


PREFIX_CACHE_BYTES = 1 << 30
"""How much memory a model's :class:`PrefixCache` of passage KV caches may hold (SmolLM2-135M: ~46 KB per token, so
the demo's 137 passages take ~0.7 GB)."""


def prefix_cache(model) -> Optional[PrefixCache]:
    """The model's cache of question-independent prompt prefixes (created on first use); None in training mode, where
    the weights change between calls (``RagModel.train()`` clears it)."""
    if model.training:
        return None
    cache = getattr(model, "_prefix_cache", None)
    if cache is None:
        cache = model._prefix_cache = PrefixCache(PREFIX_CACHE_BYTES)
    return cache


def decoding_prompts(model, ids: Tensor, mask: Tensor, share_cache: bool = True, prefix_width: int = 0) -> CausalPrompts:
    """The prompts as decoding reads them: each prefilled once per call and its KV cache shared by its decoder rows and
    rescoring pairs, the passage prefixes' caches kept across calls (unless `share_cache` is False)."""
    return CausalPrompts(ids, mask, share_cache=share_cache, prefix_width=prefix_width if share_cache else 0,
                         prefix_cache=prefix_cache(model) if share_cache else None)
