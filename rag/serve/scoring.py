"""Prompt log-probs of a causal LM as OpenAI's completions API returns them (``echo: true, logprobs: N, max_tokens: 0``).

This is the server side of REPLUG's black-box setting (Shi et al. 2023, §3: the LM only returns "log-probs of given
tokens given a prompt"): :class:`~rag.models.replug.lm_scorer.CompletionsLMScorer` sends ``prompt + continuation`` and
keeps the log-probs of the tokens whose ``text_offset`` lies in the continuation.

A prompt is read in windows of :data:`SCORE_WINDOW` tokens, each continuing the KV cache of the ones before it (the
same log-probs as one pass, up to float rounding): each window is one unit of work, so a cheap request overtakes a long
prompt between two of its windows, and one window's logits, ``SCORE_WINDOW x vocab`` floats, bound its memory beside
the cache. The server caps the prompt tokens of one request (``--max-prompt-tokens``).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from rag.generation.kv_cache import cache_kwarg, output_cache
from rag.serve.requests import RequestRefused

__all__ = ["score_prompt", "prepare_prompt", "PreparedPrompt", "window_of", "SCORE_WINDOW"]

SCORE_WINDOW = 256
"""Prompt tokens per forward pass (and per unit of work) when scoring."""


def window_of(model) -> int:
    """The LM's window in tokens (positions)."""
    cfg = model.config
    return int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 1024)


def _context_id(tokenizer) -> int:
    ctx = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if ctx is None:
        raise RequestRefused("the LM's tokenizer has neither a BOS nor an EOS token to read a text prompt after", 400,
                             param="prompt")
    return int(ctx)


class PreparedPrompt:
    """A tokenized prompt: `context` (the ids fed to the LM, a text prompt's BOS/EOS first), `ids` (the prompt's own
    tokens), `first` (1 when `context` starts with that added token), `text` and each token's `offsets`."""

    def __init__(self, context: list[int], ids: list[int], first: int, text: str, offsets: list[int]):
        self.context, self.ids, self.first, self.text, self.offsets = context, ids, first, text, offsets


def prepare_prompt(model, tokenizer, prompt: Union[str, list[int]]) -> PreparedPrompt:
    """Tokenize `prompt` as :func:`score_prompt` reads it; 400 when a token id is outside the vocabulary or the prompt
    is longer than the LM's window."""
    if isinstance(prompt, str):
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=bool(getattr(tokenizer, "is_fast", False)))
        ids = list(enc["input_ids"])
        if "offset_mapping" in enc:
            ends = [int(end) for _, end in enc["offset_mapping"]]
            offsets = [0] + ends[:-1]
        else:  # a slow tokenizer: where each prefix's decoded text ends
            offsets = [len(tokenizer.decode(ids[:t])) for t in range(len(ids))]
        prepared = PreparedPrompt([_context_id(tokenizer)] + ids, ids, 1, prompt, offsets)
    else:
        vocab = len(tokenizer)
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise RequestRefused(f"token id {bad[0]} is outside the LM's vocabulary of {vocab}", 400, param="prompt")
        ids = list(prompt)
        offsets, at = [], 0
        for t in ids:
            offsets.append(at)
            at += len(tokenizer.decode([t]))
        prepared = PreparedPrompt(ids, ids, 0, tokenizer.decode(ids), offsets)
    window = window_of(model)
    if len(prepared.context) > window:
        raise RequestRefused(f"the prompt has {len(prepared.context)} tokens (with its context token); this LM reads at most "
                             f"{window}: shorten it", 400, param="prompt")
    return prepared


@torch.no_grad()
def score_prompt(model, tokenizer, prompt: Union[str, list[int], PreparedPrompt], *, top: int = 0,
                 window: int = SCORE_WINDOW, unit: Optional[Callable[[], None]] = None) -> dict:
    """``{"text", "tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of one prompt.

    A text prompt is tokenized without special tokens and read after the tokenizer's BOS (else EOS) token, as
    :class:`~rag.models.replug.lm_scorer.LocalLMScorer` reads a prompt: every token, the first included, gets
    ``log p(token | context token, tokens before it)``; ``text_offset[t]`` is the character where token ``t`` starts
    (where the one before it ends, so a token's leading space belongs to it). A token-id prompt is read as given: its
    first token has no context (log-prob None); offsets count each token's decoded text. `top`: the `top` most likely
    tokens per position with their log-probs (0: none). `window` tokens per forward pass, each continuing the cache of
    the ones before; `unit` is called between two windows (the server's unit boundary). A prompt longer than the LM's
    window is refused.
    """
    p = prompt if isinstance(prompt, PreparedPrompt) else prepare_prompt(model, tokenizer, prompt)
    context, ids, first = p.context, p.ids, p.first
    tokens = [tokenizer.decode([t]) for t in ids]
    logprobs: list = [None] * len(ids)
    tops: list = [None] * len(ids)
    values: list[float] = []  # values[r]: log p(context[r + 1] | context[:r + 1])
    best_values: list[list[float]] = []
    best_ids: list[list[int]] = []
    if len(context) > 1:
        device = next(model.parameters()).device
        cache = None
        for lo in range(0, len(context) - 1, window):
            if lo and unit is not None:
                unit()
            hi = min(lo + window, len(context) - 1)  # rows lo..hi-1 predict context[lo + 1..hi]
            last = hi == len(context) - 1
            fed = context[lo:] if last else context[lo:hi]  # the last window feeds the last token too (as one pass)
            out = model(input_ids=torch.tensor([fed], device=device), use_cache=not last, return_dict=True,
                        **({} if cache is None else cache_kwarg(model, cache)))
            cache = None if last else output_cache(out)
            lp = torch.log_softmax(out.logits[0, :hi - lo].float(), -1)
            target = torch.tensor(context[lo + 1:hi + 1], device=device)
            values += lp.gather(1, target[:, None]).squeeze(1).double().cpu().tolist()
            if top:
                best = torch.topk(lp, top, dim=-1)
                best_values += best.values.tolist()
                best_ids += best.indices.tolist()
            del out, lp
        for t in range(len(ids)):
            row = t - 1 + first  # context index of token t, minus one
            if row < 0:
                continue
            logprobs[t] = values[row]
            if top:
                tops[t] = {tokenizer.decode([int(i)]): float(v) for v, i in zip(best_values[row], best_ids[row])}
    return {"text": p.text, "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": p.offsets}
