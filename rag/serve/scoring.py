"""Prompt log-probs of a causal LM as OpenAI's completions API returns them (``echo: true, logprobs: N, max_tokens: 0``).

This is the server side of REPLUG's black-box setting (Shi et al. 2023, §3: the LM only returns "log-probs of given
tokens given a prompt"): :class:`~rag.models.replug.lm_scorer.CompletionsLMScorer` sends ``prompt + continuation`` and
keeps the log-probs of the tokens whose ``text_offset`` lies in the continuation.
"""

from __future__ import annotations

from typing import Union

import torch

from rag.serve.requests import RequestRefused

__all__ = ["score_prompt", "window_of"]


def window_of(model) -> int:
    """The LM's window in tokens (positions)."""
    cfg = model.config
    return int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 1024)


def _context_id(tokenizer) -> int:
    ctx = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if ctx is None:
        raise RequestRefused("the LM's tokenizer has neither a BOS nor an EOS token to read a text prompt after", 400, param="prompt")
    return int(ctx)


@torch.no_grad()
def score_prompt(model, tokenizer, prompt: Union[str, list[int]], *, top: int = 0) -> dict:
    """``{"text", "tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of one prompt.

    A text prompt is tokenized without special tokens and read after the tokenizer's BOS (else EOS) token, as
    :class:`~rag.models.replug.lm_scorer.LocalLMScorer` reads a prompt: every token, the first included, gets
    ``log p(token | context token, tokens before it)``; ``text_offset[t]`` is the character where token ``t`` starts
    (where the one before it ends, so a token's leading space belongs to it). A token-id prompt is read as given: its
    first token has no context (log-prob None); offsets count each token's decoded text. `top`: the `top` most likely
    tokens per position with their log-probs (0: none). One forward pass; a prompt longer than the window is refused.
    """
    if isinstance(prompt, str):
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=bool(getattr(tokenizer, "is_fast", False)))
        ids = list(enc["input_ids"])
        if "offset_mapping" in enc:
            ends = [int(end) for _, end in enc["offset_mapping"]]
            offsets = [0] + ends[:-1]
        else:  # a slow tokenizer: where each prefix's decoded text ends
            offsets = [len(tokenizer.decode(ids[:t])) for t in range(len(ids))]
        context, first, text = [_context_id(tokenizer)] + ids, 1, prompt
    else:
        vocab = len(tokenizer)
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise RequestRefused(f"token id {bad[0]} is outside the LM's vocabulary of {vocab}", 400, param="prompt")
        ids = list(prompt)
        pieces = [tokenizer.decode([t]) for t in ids]
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        context, first, text = ids, 0, tokenizer.decode(ids)
    window = window_of(model)
    if len(context) > window:
        raise RequestRefused(f"the prompt has {len(context)} tokens (with its context token); this LM reads at most {window}: "
                             "shorten it", 400, param="prompt")
    tokens = [tokenizer.decode([t]) for t in ids]
    logprobs: list = [None] * len(ids)
    tops: list = [None] * len(ids)
    if len(context) > 1:
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([context], device=device)).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1)  # row t: the distribution of context[t + 1]
        target = torch.tensor(context[1:], device=device)
        values = lp.gather(1, target[:, None]).squeeze(1).double().cpu().tolist()
        best = torch.topk(lp, top, dim=-1) if top else None
        for t in range(len(ids)):
            row = t - 1 + first  # context index of token t, minus one
            if row < 0:
                continue
            logprobs[t] = values[row]
            if best is not None:
                tops[t] = {tokenizer.decode([int(i)]): float(v) for v, i in zip(best.values[row].tolist(), best.indices[row].tolist())}
    return {"text": text, "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
