"""Generic autoregressive search over a `Decoder`: greedy, beam search and sampling, with transformers' logits constraints.

A `Decoder` is anything with `step(tokens) -> scores` and `reorder(rows)`: a seq2seq decoder over encoded
contexts (`rag.generation.seq2seq`), a causal LM over a prompt (`rag.generation.causal`), or a mixture of
either over retrieved documents (`rag.generation.decoding.TokenMarginalDecoder`, RAG-Token / REPLUG). Searches
take explicit start tokens `(rows, S)`: a seq2seq decoder start token (S = 1) or a causal LM's (left-padded)
prompt; lengths (`max_length`, `min_length`) count them, as transformers' do.

The search follows the semantics of `transformers`' (v5) vectorized beam search exactly — candidate pool of
`2 * num_beams` continuations, length penalty `sum_logprob / generated_len ** length_penalty` with
`generated_len` counting EOS but not the start tokens, the same early-stopping heuristic and
`early_stopping in {True, False, "never"}`, the same -1e9 sentinels — so outputs are token-identical to
`generate(num_beams=...)` given bit-identical decoder scores. Greedy search and the logits constraints
(min length, no repeated n-grams, forced BOS / EOS) follow transformers' processors in the same order.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from rag.generation.options import GenerationConfig
from rag.utils.errors import ConfigError

__all__ = [
    "Decoder",
    "GenerationConfig",
    "SearchSpec",
    "Beams",
    "resolve_spec",
    "config_token_id",
    "greedy_search",
    "sample",
    "beam_search",
    "unit_hook",
    "unit_boundary",
    "unit_rows",
    "unit_cap",
]

# Score transformers' beam search uses for "impossible" entries. Kept identical (not -inf) because the
# bookkeeping adds it to real scores and the float32 rounding of those sums decides ties.
IMPOSSIBLE = -1.0e9


@runtime_checkable
class Decoder(Protocol):
    """Rows decoded one token at a time; row `i` of every call is the same hypothesis (until `reorder`)."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed the last token of every row, `(rows,)` int64; return next-token scores `(rows, vocab)` float32.

        Scores are logits or log-probs (searches normalise them with `log_softmax`, as transformers does).
        The first call receives the last start token; a decoder that holds a longer prompt feeds all of it then.
        """
        ...

    def reorder(self, rows: Tensor) -> None:
        """Make row `i` continue from row `rows[i]` (beam search; `rows` `(rows,)` int64)."""
        ...


@dataclass(frozen=True)
class SearchSpec:
    """A `GenerationConfig` with every token id and length resolved for one generator and start length."""

    cfg: GenerationConfig
    eos: int
    pad: int
    bos: int | None
    max_length: int
    """Total length limit, start tokens included."""
    min_length: int
    """EOS banned below this total length."""
    prompt_len: int = 1
    """Number of start tokens `S`."""
    allowed: Optional[Callable[[Tensor, int], Optional[Tensor]]] = None
    """Extra constraint: ``allowed(generated, vocab)`` with the tokens generated so far `(rows, n)` gives the tokens
    allowed next `(rows, vocab)` bool (None: all); extractive decoding (:class:`rag.generation.spans.PassageSpans`)."""

    @property
    def num_beams(self) -> int:
        return self.cfg.num_beams


def config_token_id(config: GenerationConfig, generator, name: str, required: bool) -> int | None:
    """Token id `name` from `config`, else the generator's `generation_config`, else its `config`."""
    value = getattr(config, name)
    for src in (getattr(generator, "generation_config", None), getattr(generator, "config", None)):
        if value is None and src is not None:
            value = getattr(src, name, None)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ConfigError(f"GenerationConfig.{name}: several ids {value} are not supported; pass one id explicitly")
        value = value[0]
    if value is None and required:
        raise ConfigError(f"GenerationConfig.{name} is not set and the generator config has none; pass it explicitly")
    return None if value is None else int(value)


def resolve_spec(config: GenerationConfig, generator, prompt_len: int = 1, pad_fallback: int | None = None) -> SearchSpec:
    """Resolve `config` against `generator` for start tokens of length `prompt_len`.

    `pad_fallback`: pad id when neither the config nor the generator has one (causal LMs: their EOS, as
    transformers' generate does).
    """
    eos = config_token_id(config, generator, "eos_token_id", True)
    pad = config_token_id(config, generator, "pad_token_id", pad_fallback is None)
    max_length = config.length_limit(prompt_len)
    if max_length <= prompt_len:
        raise ConfigError(f"GenerationConfig.max_length={max_length} leaves no room after {prompt_len} start tokens; "
                          f"raise max_length or use max_new_tokens")
    min_length = max(config.min_length, prompt_len + config.min_new_tokens if config.min_new_tokens > 0 else 0)
    return SearchSpec(cfg=config, eos=eos, pad=pad_fallback if pad is None else pad,
                      bos=config_token_id(config, generator, "bos_token_id", False),
                      max_length=max_length, min_length=min_length, prompt_len=prompt_len)


# ----------------------------------------------------------------------------------------------------------
# Units of work: a caller (rag serve) can act between decoding steps without the decoders knowing it

_units = threading.local()


@contextlib.contextmanager
def unit_hook(hook: Callable[[Optional[Tensor]], None], *, max_rows: Optional[int] = None) -> Iterator[None]:
    """Call `hook` at every unit boundary of the decoding this thread runs inside the block: before each search step
    (with the tokens generated so far, `(rows, n)` int64, in greedy search and sampling; None in beam search) and
    between the chunks of a teacher-forced rescoring pass (None).

    The hook may raise to abandon the decoding (``rag serve``: a request past its deadline or whose client left), or
    block (the server hands the model to another request between two units). `max_rows`: chunked passes whose chunk
    size is automatic take at most this many rows per chunk (:func:`unit_rows`), so that no unit runs long. Nothing is
    called outside the block.
    """
    previous = getattr(_units, "hook", None), getattr(_units, "max_rows", None)
    _units.hook, _units.max_rows = hook, max_rows
    try:
        yield
    finally:
        _units.hook, _units.max_rows = previous


def unit_rows(default: int) -> int:
    """Rows per chunk of a chunked pass whose size is automatic: `default`, or fewer inside a :func:`unit_hook` that
    asks for smaller units (the results do not depend on it beyond float rounding; only how the work is cut)."""
    cap = getattr(_units, "max_rows", None)
    return default if cap is None else max(1, min(default, cap))


def unit_cap() -> Optional[int]:
    """The rows per chunk this thread's :func:`unit_hook` asks for; None outside one (or when it asks for none)."""
    return getattr(_units, "max_rows", None)


def unit_boundary(generated: Optional[Tensor] = None) -> None:
    """A point between two bounded units of decoding work: runs this thread's :func:`unit_hook`, if any."""
    hook = getattr(_units, "hook", None)
    if hook is not None:
        hook(generated)


# ----------------------------------------------------------------------------------------------------------
# Logits processing (same semantics and order as transformers' processors for these options)


def _constraints(seqs: Tensor, vocab: int, spec: SearchSpec) -> tuple[Tensor | None, int | None]:
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
    if spec.allowed is not None:
        allowed = spec.allowed(seqs[:, spec.prompt_len:], vocab)
        if allowed is not None:
            banned = ~allowed if banned is None else banned | ~allowed
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


def _warp(scores: Tensor, cfg: GenerationConfig) -> Tensor:
    """Sampling warpers in transformers' order: temperature, top-k, top-p (each keeps at least one token)."""
    if cfg.temperature != 1.0:
        scores = scores / cfg.temperature
    if 0 < cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - cfg.top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return scores


# ----------------------------------------------------------------------------------------------------------
# Searches


def _check_start(start: Tensor, spec: SearchSpec) -> None:
    if start.dim() != 2 or start.shape[1] != spec.prompt_len:
        raise ConfigError(f"start tokens must be (rows, {spec.prompt_len}) as resolved in the SearchSpec, "
                          f"got shape {tuple(start.shape)}")


def _one_token_search(decoder: Decoder, start: Tensor, spec: SearchSpec, rng: torch.Generator | None,
                      sampled: bool) -> tuple[Tensor, Tensor]:
    _check_start(start, spec)
    seqs = start
    rows = start.shape[0]
    running = torch.ones(rows, dtype=torch.bool, device=start.device)
    loglik = torch.zeros(rows, dtype=torch.float32, device=start.device)
    while True:
        unit_boundary(seqs[:, spec.prompt_len:])
        logits = decoder.step(seqs[:, -1])
        banned, forced = _constraints(seqs, logits.shape[-1], spec)
        if sampled:
            probs = torch.softmax(_warp(_apply(logits, banned, forced), spec.cfg), -1)
            token = torch.multinomial(probs, 1, generator=rng).squeeze(1)
        else:
            token = _apply(logits, banned, forced).argmax(-1)
        logp = _apply(torch.log_softmax(logits, -1), banned, forced).gather(1, token[:, None]).squeeze(1)
        loglik = loglik + torch.where(running, logp, torch.zeros_like(logp))
        token = torch.where(running, token, torch.full_like(token, spec.pad))
        seqs = torch.cat([seqs, token[:, None]], dim=1)
        running = running & (token != spec.eos) & (seqs.shape[1] < spec.max_length)
        if not bool(running.any()):
            return seqs, loglik


def greedy_search(decoder: Decoder, start: Tensor, spec: SearchSpec) -> tuple[Tensor, Tensor]:
    """Greedy search from `start` `(rows, S)`; returns sequences `(rows, T)` (start tokens included, pad after
    EOS) and their log-likelihoods `(rows,)` (forced tokens count log 1 = 0)."""
    return _one_token_search(decoder, start, spec, None, sampled=False)


def sample(decoder: Decoder, start: Tensor, spec: SearchSpec, rng: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Ancestral sampling from `start` `(rows, S)` with the config's temperature / top-k / top-p.

    `rng`: a seeded `torch.Generator` on the decoder's device makes the draw reproducible (None: torch's global
    generator). Returns sequences `(rows, T)` and their log-likelihoods `(rows,)` under the model with the
    constraints (min length, n-grams, forced tokens) but without the sampling warpers.
    """
    return _one_token_search(decoder, start, spec, rng, sampled=True)


@dataclass
class Beams:
    """Finished hypotheses of a beam search, best first: `items` inputs, `num_beams` slots each."""

    sequences: Tensor  # (items, beams, max_length)
    scores: Tensor  # (items, beams) length-penalised
    loglik: Tensor  # (items, beams) raw, -inf where no finished hypothesis
    gen_len: Tensor  # (items, beams) generated tokens (bookkeeping length, as transformers crops by it)
    prompt_len: int = 1

    def crop(self, keep: int) -> tuple[Tensor, Tensor, Tensor]:
        """First `keep` beams of every item, cropped to the longest of them: `(items, keep, T)`, scores, loglik."""
        width = self.prompt_len + int(self.gen_len[:, :keep].max())
        return self.sequences[:, :keep, :width], self.scores[:, :keep], self.loglik[:, :keep]


def _take(t: Tensor, idx: Tensor) -> Tensor:
    """Select along dim 1 of `t` `(items, n, ...)` with `idx` `(items, m)`."""
    return torch.take_along_dim(t, idx.view(idx.shape + (1,) * (t.dim() - 2)), dim=1)


def beam_search(decoder: Decoder, start: Tensor, spec: SearchSpec) -> Beams:
    """Beam search over `items` independent inputs with `spec.num_beams` beams each.

    start `(items, S)`: the start tokens of each input; the decoder holds `items * num_beams` rows
    (item-major) that all begin with them. `decoder.reorder` receives, for every new row, the flat index of
    the row it continues. Bookkeeping mirrors transformers' vectorized beam search (same candidate pool, -1e9
    sentinels, length penalty and stopping heuristic), which makes the outputs token-identical to it.
    """
    _check_start(start, spec)
    cfg = spec.cfg
    items, prompt = start.shape
    device = start.device
    beams, max_len, lp = cfg.num_beams, spec.max_length, float(cfg.length_penalty)
    pool = 2 * beams  # continuations kept per item: enough to refill the beam if `beams` of them end in EOS
    in_top = torch.arange(pool, device=device) < beams
    run_seq = torch.full((items, beams, max_len), spec.pad, dtype=torch.long, device=device)
    run_seq[:, :, :prompt] = start[:, None, :]
    run_score = torch.zeros(items, beams, dtype=torch.float32, device=device)
    run_score[:, 1:] = IMPOSSIBLE  # all beams start identical: expand only the first one
    fin_seq = run_seq.clone()
    fin_score = torch.full((items, beams), IMPOSSIBLE, dtype=torch.float32, device=device)
    fin_ll = torch.full((items, beams), -math.inf, dtype=torch.float32, device=device)
    fin_len = torch.zeros(items, beams, dtype=torch.long, device=device)
    fin_done = torch.zeros(items, beams, dtype=torch.bool, device=device)
    can_improve = torch.ones(items, 1, dtype=torch.bool, device=device)
    item_offset = torch.arange(items, device=device)[:, None] * beams
    cur = prompt
    while True:
        unit_boundary(None)
        logits = decoder.step(run_seq[:, :, cur - 1].reshape(-1))
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
        alive_score = cand_score + ends.to(torch.float32) * IMPOSSIBLE
        keep = torch.topk(alive_score, beams).indices
        run_seq, run_score, run_src = _take(cand_seq, keep), _take(alive_score, keep), _take(cand_src, keep)

        # Finished hypotheses: merge candidates that just ended (only from the top `beams`) into the pool.
        generated = cur + 1 - prompt
        ended_now = ends & in_top[None, :]
        merged_new = cand_score / (generated ** lp)
        merged_new += (fin_done.all(-1, keepdim=True) & (cfg.early_stopping is True)).to(torch.float32) * IMPOSSIBLE
        merged_new += (~can_improve).to(torch.float32) * IMPOSSIBLE
        merged_new += (~ended_now) * IMPOSSIBLE
        merged = torch.cat([fin_score, merged_new], dim=1)
        best = torch.topk(merged, beams).indices
        fin_seq = _take(torch.cat([fin_seq, cand_seq], 1), best)
        fin_score = _take(merged, best)
        fin_done = _take(torch.cat([fin_done, ended_now], 1), best)
        new_ll = torch.where(ended_now, cand_score, torch.full_like(cand_score, -math.inf))
        fin_ll = _take(torch.cat([fin_ll, new_ll], 1), best)
        fin_len = _take(torch.cat([fin_len, torch.full_like(cand_src, generated)], 1), best)

        cur += 1
        if cfg.early_stopping == "never" and lp > 0.0:
            best_len = max_len - prompt
        else:
            best_len = cur - prompt
        best_running = run_score[:, :1] / (best_len ** lp)
        worst_finished = torch.where(fin_done, fin_score.min(1, keepdim=True).values, IMPOSSIBLE)
        can_improve = can_improve & (best_running > worst_finished).any(-1, keepdim=True)
        all_full = bool(fin_done.all()) and cfg.early_stopping is True
        if not bool(can_improve.any()) or all_full or bool(ends.all()):
            return Beams(fin_seq, fin_score, fin_ll, fin_len, prompt)
        decoder.reorder((item_offset + run_src).reshape(-1))
