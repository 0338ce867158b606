"""Causal (decoder-only) LMs for search and scoring: a `Decoder` over left-padded prompts, generation, continuation log-probs.

Works with any transformers causal LM (GPT-2, Llama, ...: `model(input_ids=..., attention_mask=...,
position_ids=..., past_key_values=..., use_cache=True)` returning `logits` and a reorderable cache); put it in
eval mode first, nothing here changes its mode. This is the reader seam of In-Context RALM and REPLUG: the
same `rag.generation.search` runs on it, and `TokenMarginalDecoder` mixes several of its rows per token.

Prompts of different lengths are left-padded to one width `S` (`attention_mask` 0 on the pads), as
transformers' `generate` expects: positions are `cumsum(mask) - 1` (0 on pads), every new token attends to
all real prompt tokens, and the search sees start tokens `(rows, S)`. The prompt is prefilled in one forward
pass with the KV cache; each step then feeds one token per row. With these inputs the scores are
bit-identical to `model.generate(...)`, so greedy and beam search are token-identical to it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from rag.generation.kv_cache import cache_kwarg, output_cache
from rag.generation.prompts import left_pad
from rag.generation.search import (
    GenerationConfig,
    SearchSpec,
    beam_search,
    config_token_id,
    greedy_search,
    resolve_spec,
    sample,
    unit_boundary,
    unit_cap,
    unit_rows,
)
from rag.generation.seq2seq import _dynamic_cache, gather_rows
from rag.utils.errors import RagError

__all__ = ["CausalLMDecoder", "CausalPrompts", "PrefixCache", "causal_generate", "continuation_logprobs", "prompt_positions",
           "causal_teacher_forced"]


def prompt_positions(attention_mask: Tensor) -> Tensor:
    """Position ids `(rows, S)` of left-padded rows: `cumsum(mask) - 1`, 0 on pads (transformers' convention)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def _check_prompt(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise RagError(f"prompt input_ids must be (rows, prompt_len >= 1), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise RagError(f"prompt attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if not bool(attention_mask[:, -1].all()):
        raise RagError("prompts must be left-padded (attention_mask 1 on every row's last token); tokenize with "
                       "padding_side='left'")
    return attention_mask


class PrefixCache:
    """The KV caches of prompt prefixes that do not depend on the question (the chat header, the title and the passage:
    ``RagModelConfig.prompt_template`` puts the passage before the question), kept by their exact token ids, least
    recently used dropped past `max_bytes`. A passage read for one question is then prefilled once and only the
    question's tail (a few dozen tokens) runs for the next question that retrieves it.

    Keys are token ids, so a hit is exact; the caches are only valid for the weights they were computed with:
    :meth:`clear` whenever those change (``RagModel.train()`` does).
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple, list[tuple[Tensor, Tensor]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def lookup(self, model, prefixes: list[tuple]) -> list[list[tuple[Tensor, Tensor]]]:
        """Per prefix (a tuple of token ids, non-empty) its per-layer ``(keys, values)`` ``(heads, len, head_dim)``; the
        missing ones are prefilled in one batch first."""
        with self._lock:
            found = {p: self._entries[p] for p in set(prefixes) if p in self._entries}
            for p in found:
                self._entries.move_to_end(p)
        missing = sorted(set(prefixes) - set(found), key=len)
        self.hits += len(prefixes) - sum(p in missing for p in prefixes)
        self.misses += len(missing)
        if missing:
            device = next(model.parameters()).device
            ids, mask = (t.to(device) for t in left_pad([list(p) for p in missing], 0))
            out = model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask, position_ids=prompt_positions(mask),
                        use_cache=True, return_dict=True)
            layers = getattr(output_cache(out), "layers", None)
            if layers is None:
                raise RagError("the model's cache has no per-layer keys and values to keep; use CausalPrompts "
                               "without a PrefixCache")
            width = ids.shape[1]
            for i, p in enumerate(missing):
                kv = [(layer.keys[i, :, width - len(p):].clone(), layer.values[i, :, width - len(p):].clone())
                      for layer in layers]
                found[p] = kv
                self._store(p, kv)
        return [found[p] for p in prefixes]

    def _store(self, key: tuple, kv: list[tuple[Tensor, Tensor]]) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = kv
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in old)


UNIT_TOKENS = 512
"""Prompt tokens (rows x width) one prefill forward runs inside a serving unit hook: a unit of work of its own."""


@dataclass
class CausalPrompts:
    """`N` left-padded prompts of a causal generator, the causal counterpart of seq2seq's `EncodedContexts`: row
    `b * n_docs + k` is question `b` with its `k`-th passage (`rag.generation.prompts`).

    With `share_cache` (default) each prompt is prefilled once (:meth:`prefill`, memoised) and every decoder row, beam
    and rescoring pair reading it starts from a copy of its KV cache; without, each of them prefills its prompt again
    (the layout transformers' beam search uses; `benchmarks/causal_rag_bench.py` compares the two).
    """

    input_ids: Tensor
    """`(N, S)` token ids, left-padded (or two left-padded segments, see `prefix_width`)."""
    attention_mask: Tensor
    """`(N, S)` 1 on real tokens."""
    share_cache: bool = True
    prefix_width: int = 0
    """The first `prefix_width` columns are a segment of question-independent prefixes (left-padded within it), the rest
    the rest of each prompt (left-padded within it); 0: one left-padded segment."""
    prefix_cache: PrefixCache | None = None
    """Where the prefixes' KV caches are kept across calls (with `share_cache` and `prefix_width`); None: none kept."""
    _prefilled: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_prompt(self.input_ids, self.attention_mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def last_tokens(self) -> Tensor:
        """`(N,)` every prompt's last token: the start token of its search."""
        return self.input_ids[:, -1]

    # The contexts protocol the RAG decoders read (rag.generation.decoding.DecodingContexts).
    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def search_spec(self, config: GenerationConfig, generator) -> SearchSpec:
        """The search spec of a continuation: one start token, the last prompt token (lengths count only it, so
        `max_length` = 1 + the generated tokens, as for a seq2seq generator); the pad id defaults to EOS."""
        eos = config_token_id(config, generator, "eos_token_id", True)
        return resolve_spec(config, generator, prompt_len=1, pad_fallback=eos)

    def start_tokens(self, config: GenerationConfig, generator, rows: Tensor) -> Tensor:
        """`(len(rows), 1)` start tokens of the searches of prompts `rows`: their last tokens."""
        return self.last_tokens[rows][:, None]

    def check_shared_start(self, start: Tensor, n_docs: int) -> None:
        """RagError unless the `n_docs` prompts of each question end with its start token `start` `(batch, 1)`."""
        if not bool((self.last_tokens.view(start.shape[0], n_docs) == start).all()):
            raise RagError("RAG-Token decoding of a causal generator needs the K prompts of a question to end with the same "
                           "token (build them with rag.generation.prompts.tokenize_prompts)")

    def decoder(self, generator, context_of_row: Tensor, keep_cross_kv: bool = False) -> "CausalLMDecoder":
        """A search `Decoder` whose row `i` continues prompt `context_of_row[i]` from a copy of its KV cache."""
        return CausalLMDecoder(generator, prompts=self, prompt_of_row=context_of_row)

    def teacher_forced(self, generator, sequences: Tensor, context_index: Tensor, max_rows: int | None = None,
                       cross_kv=None, eos: int | None = None) -> Tensor:
        """`log p(y_t | prompt, y_<t)` `(C, K, T - 1)` after these prompts (:func:`causal_teacher_forced`)."""
        return causal_teacher_forced(generator, self, sequences, context_index, max_rows=max_rows, eos=eos)

    def prefill(self, model) -> tuple[object, Tensor]:
        """The KV cache of every prompt and the next-token logits `(N, vocab)` float32 after it (computed once). Inside a
        serving unit hook that asks for small units (:func:`~rag.generation.search.unit_rows`), the prompts run
        :data:`UNIT_TOKENS` tokens' worth of rows at a time, a unit boundary between two chunks."""
        chunk = len(self) if unit_cap() is None else max(1, UNIT_TOKENS // max(1, self.input_ids.shape[1]))
        if self._prefilled is None and chunk < len(self):
            self._prefilled = self._prefill_in_chunks(model, chunk)
        if self._prefilled is None:
            if self.prefix_cache is not None and self.prefix_width and self.share_cache:
                self._prefilled = self._prefill_after_prefixes(model)
                return self._prefilled
            mask = None if bool(self.attention_mask.all()) else self.attention_mask.long()
            out = model(input_ids=self.input_ids, attention_mask=mask, position_ids=prompt_positions(self.attention_mask),
                        use_cache=True, return_dict=True)
            self._prefilled = (output_cache(out), out.logits[:, -1, :].float())
        return self._prefilled

    def _prefill_after_prefixes(self, model) -> tuple[object, Tensor]:
        """The prefill with every prefix's KV cache from `prefix_cache`: only the columns after `prefix_width` run."""
        width, mask = self.prefix_width, self.attention_mask.long()
        prefixes = [tuple(row[m.bool()].tolist()) for row, m in zip(self.input_ids[:, :width], mask[:, :width])]
        rows = [i for i, p in enumerate(prefixes) if p]
        found = dict(zip(rows, self.prefix_cache.lookup(model, [prefixes[i] for i in rows]))) if rows else {}
        n_layers = len(next(iter(found.values()))) if found else 0
        layers = []
        for layer in range(n_layers):
            k0, v0 = found[rows[0]][layer]
            keys = k0.new_zeros((len(prefixes), k0.shape[0], width, k0.shape[2]))  # pads: masked, never attended
            values = v0.new_zeros((len(prefixes), v0.shape[0], width, v0.shape[2]))
            for i in rows:
                k, v = found[i][layer]
                keys[i, :, width - k.shape[1]:], values[i, :, width - v.shape[1]:] = k, v
            layers.append((keys, values))
        if not layers:  # no prefix at all: the plain prefill
            self.prefix_width = 0
            return self.prefill(model)
        out = model(input_ids=self.input_ids[:, width:], attention_mask=mask, position_ids=prompt_positions(mask)[:, width:],
                    use_cache=True, return_dict=True, **cache_kwarg(model, _dynamic_cache(layers)))
        return output_cache(out), out.logits[:, -1, :].float()

    def _prefill_in_chunks(self, model, chunk: int) -> tuple[object, Tensor]:
        """:meth:`prefill` of `chunk` prompts at a time (each chunk a unit of work), the caches joined along the rows."""
        parts = []
        for lo in range(0, len(self), chunk):
            if lo:
                unit_boundary()
            part = replace(self, input_ids=self.input_ids[lo:lo + chunk], attention_mask=self.attention_mask[lo:lo + chunk],
                           _prefilled=None)
            cache, logits = part.prefill(model)  # at most `chunk` prompts: one forward
            layers = getattr(cache, "layers", None)
            if layers is None:
                raise RagError(f"the model returned a cache of type {type(cache).__name__} whose rows cannot be joined")
            parts.append(([(layer.keys, layer.values) for layer in layers], logits))
        layers = [(torch.cat([kv[i][0] for kv, _ in parts]), torch.cat([kv[i][1] for kv, _ in parts]))
                  for i in range(len(parts[0][0]))]
        return _dynamic_cache(layers), torch.cat([logits for _, logits in parts])

    def gathered_cache(self, model, rows: Tensor):
        """A new cache holding the prefilled prompts `rows` `(R,)` (a copy: decoding it leaves the prompts' own intact)."""
        cache, _ = self.prefill(model)
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise RagError(f"the model returned a cache of type {type(cache).__name__} whose rows cannot be copied; "
                           "use CausalPrompts(share_cache=False)")
        return _dynamic_cache([(gather_rows(layer.keys, rows), gather_rows(layer.values, rows)) for layer in layers])


class CausalLMDecoder:
    """A search `Decoder` (`step`, `reorder`) over a causal LM continuing `input_ids` `(rows, S)`.

    The first `step` prefills the whole prompt (its argument must be the prompt's last tokens); later steps
    feed one token per row with the KV cache. `reorder` moves the cache rows (beam search).

    With `prompt_of_row` `(rows,)`, `input_ids` / `attention_mask` (or `prompts`) hold `N` distinct prompts and row `i`
    continues prompt `prompt_of_row[i]`: each prompt is prefilled once and its cache copied to its rows (beams, or
    RAG-Token's questions x documents), unless `prompts.share_cache` is False.
    """

    def __init__(self, model, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, *,
                 prompt_of_row: Tensor | None = None, prompts: CausalPrompts | None = None):
        if prompts is not None and prompt_of_row is None:
            prompt_of_row = torch.arange(len(prompts), device=prompts.input_ids.device)
        if prompt_of_row is not None:
            if prompts is None:
                prompts = CausalPrompts(input_ids, _check_prompt(input_ids, attention_mask))
            if not prompts.share_cache:  # every row prefills its own copy of its prompt
                input_ids, attention_mask = prompts.input_ids[prompt_of_row], prompts.attention_mask[prompt_of_row]
                prompts = prompt_of_row = None
            else:
                input_ids, attention_mask = prompts.input_ids, prompts.attention_mask
        mask = _check_prompt(input_ids, attention_mask)
        self.model = model
        self.prompts, self.prompt_of_row = prompts, prompt_of_row
        if prompt_of_row is not None:
            input_ids, mask = input_ids[prompt_of_row], mask[prompt_of_row]
        self.input_ids = input_ids
        # transformers drops an all-ones mask (no padding); keep the same inputs so the kernels match.
        self.mask = None if bool(mask.all()) else mask.long()
        positions = prompt_positions(mask)
        self.positions = positions
        self.next_position = positions[:, -1:] + 1
        self.cache = None

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` `(rows,)`; return next-token logits `(rows, vocab)` in float32."""
        if self.cache is None:
            if not torch.equal(tokens, self.input_ids[:, -1]):
                raise RagError("the first step of a CausalLMDecoder must feed the prompt's last tokens "
                               "(search from start tokens = the decoder's input_ids)")
            if self.prompts is not None:
                _, logits = self.prompts.prefill(self.model)
                self.cache = self.prompts.gathered_cache(self.model, self.prompt_of_row)
                return logits[self.prompt_of_row]
            out = self.model(input_ids=self.input_ids, attention_mask=self.mask, position_ids=self.positions,
                             use_cache=True, return_dict=True)
        else:
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
            out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_position,
                             **cache_kwarg(self.model, self.cache), use_cache=True, return_dict=True)
            self.next_position = self.next_position + 1
        self.cache = output_cache(out)
        return out.logits[:, -1, :].float()

    def reorder(self, rows: Tensor) -> None:
        """Make row `i` continue from row `rows[i]`."""
        if not hasattr(self.cache, "reorder_cache"):
            raise RagError(f"the model returned a cache of type {type(self.cache).__name__} that cannot be "
                           "reordered for beam search; use num_beams=1 or a transformers Cache")
        self.cache.reorder_cache(rows)
        if self.mask is not None:
            self.mask = self.mask[rows]
        self.next_position = self.next_position[rows]


@torch.no_grad()
def causal_generate(model, input_ids: Tensor, attention_mask: Tensor | None = None,
                    config: GenerationConfig = GenerationConfig(),
                    rng: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Continue left-padded prompts `(batch, S)` with greedy / beam search or sampling (`config.do_sample`).

    Returns sequences `(batch * num_return_sequences, T)` — prompt included, pad after EOS, as
    `model.generate` returns them — and their scores `(batch * num_return_sequences,)`: the log-likelihood of
    the generated tokens (greedy, sampling) or the length-penalised beam score. Lengths count the prompt
    (`max_length`), or not (`max_new_tokens`), as in transformers. The pad id defaults to EOS when the model
    has none (as `generate` does).
    """
    mask = _check_prompt(input_ids, attention_mask)
    prompt_len = input_ids.shape[1]
    eos = config_token_id(config, model, "eos_token_id", True)
    spec = resolve_spec(config, model, prompt_len=prompt_len, pad_fallback=eos)
    beams = config.num_beams
    if beams == 1:
        if config.num_return_sequences != 1:
            raise RagError("num_return_sequences > 1 needs beam search (num_beams >= num_return_sequences)")
        decoder = CausalLMDecoder(model, input_ids, mask)
        if config.do_sample:
            return sample(decoder, input_ids, spec, rng)
        return greedy_search(decoder, input_ids, spec)
    if config.num_return_sequences > beams:
        raise RagError(f"num_return_sequences={config.num_return_sequences} exceeds num_beams={beams}")
    # Every beam row prefills its prompt, as transformers' beam search does (same kernels, same rounding).
    decoder = CausalLMDecoder(model, input_ids.repeat_interleave(beams, 0), mask.repeat_interleave(beams, 0))
    found = beam_search(decoder, input_ids, spec)
    seqs, scores, _ = found.crop(config.num_return_sequences)
    return seqs.reshape(-1, seqs.shape[-1]), scores.reshape(-1)


@torch.no_grad()
def continuation_logprobs(model, input_ids: Tensor, attention_mask: Tensor | None, continuation: Tensor,
                          continuation_mask: Tensor | None = None) -> Tensor:
    """Teacher-forced `log p(c_t | prompt, c_<t)` of given continuations, one forward pass.

    input_ids / attention_mask `(rows, S)`: left-padded prompts; continuation `(rows, T)` right-padded with
    `continuation_mask` `(rows, T)` (None: all real). Returns `(rows, T)` float32 log-probs, 0 where the
    continuation is padding. (REPLUG / In-Context RALM score `log p(y | z ∘ x)` this way.)
    """
    mask = _check_prompt(input_ids, attention_mask)
    if continuation.dim() != 2 or continuation.shape[0] != input_ids.shape[0]:
        raise RagError(f"continuation must be (rows={input_ids.shape[0]}, T), got shape {tuple(continuation.shape)}")
    cmask = torch.ones_like(continuation) if continuation_mask is None else continuation_mask
    if cmask.shape != continuation.shape:
        raise RagError(f"continuation_mask {tuple(cmask.shape)} must match continuation {tuple(continuation.shape)}")
    full_mask = torch.cat([mask.long(), cmask.long()], dim=1)
    ids = torch.cat([input_ids, continuation], dim=1)
    logits = model(input_ids=ids, attention_mask=full_mask, position_ids=prompt_positions(full_mask),
                   return_dict=True).logits
    prompt_len, width = input_ids.shape[1], continuation.shape[1]
    scoring = logits[:, prompt_len - 1:prompt_len - 1 + width].float()  # the distribution of each c_t
    lp = torch.log_softmax(scoring, -1).gather(-1, continuation[:, :, None]).squeeze(-1)
    return lp.masked_fill(cmask == 0, 0.0)


@torch.no_grad()
def causal_teacher_forced(model, prompts: CausalPrompts, sequences: Tensor, context_index: Tensor,
                          max_rows: int | None = None, eos: int | None = None) -> Tensor:
    """`log p(y_t | prompt, y_<t)` of every sequence after each of its prompts: the causal `teacher_forced_logprobs`.

    sequences `(C, T)` start with their prompts' common last token (the start token of the search) and continue with the
    scored tokens; context_index `(C, K)` holds rows of `prompts`. Returns `(C, K, T - 1)`: entry `t` scores
    `sequences[:, t + 1]`, 0 after the first `eos` target when `eos` is given. With `prompts.share_cache` each pair
    starts from a copy of its prompt's prefilled KV cache and the LM runs only on the sequence's tokens; else every pair
    runs its whole prompt again. At most `max_rows` pairs per forward (None: 32, or fewer inside a serving unit hook:
    :func:`~rag.generation.search.unit_rows`); each forward is one unit of work (:func:`~rag.generation.search.unit_boundary`)."""
    n_cand, n_docs = context_index.shape
    if sequences.shape[0] != n_cand or sequences.shape[1] < 2:
        raise RagError(f"sequences {tuple(sequences.shape)} must be (C, T >= 2) with C = {n_cand} rows of context_index")
    rows = context_index.reshape(-1)
    cand = torch.arange(n_cand, device=sequences.device).repeat_interleave(n_docs)
    width = sequences.shape[1] - 1
    if eos is None:
        length = torch.full((n_cand,), width, dtype=torch.long, device=sequences.device)
    else:
        is_eos = (sequences[:, 1:] == eos).long()
        length = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, width)  # targets up to the first EOS
    lengths = length[cand]
    lengths, order = torch.sort(lengths, descending=True, stable=True)
    batch = unit_rows(32) if max_rows is None else max_rows
    out = torch.zeros(n_cand * n_docs, width, dtype=torch.float32, device=sequences.device)
    for lo in range(0, rows.shape[0], batch):
        unit_boundary()  # one chunk is one bounded unit of work
        pick = order[lo:lo + batch]
        n = int(lengths[lo:lo + batch].max())
        seq, ctx = sequences[cand[pick]], rows[pick]
        target = seq[:, 1:n + 1]
        if prompts.share_cache:
            _, first = prompts.prefill(model)
            logits = [first[ctx][:, None, :]]
            if n > 1:
                mask = prompts.attention_mask[ctx].long()
                full = torch.cat([mask, mask.new_ones(mask.shape[0], n - 1)], dim=1)
                pos = prompt_positions(mask)[:, -1:] + torch.arange(1, n, device=mask.device)
                step = model(input_ids=seq[:, 1:n], attention_mask=full, position_ids=pos, use_cache=True, return_dict=True,
                             **cache_kwarg(model, prompts.gathered_cache(model, ctx)))
                logits.append(step.logits.float())
            logits = torch.cat(logits, dim=1)
        else:
            ids = torch.cat([prompts.input_ids[ctx], seq[:, 1:n]], dim=1)
            mask = torch.cat([prompts.attention_mask[ctx].long(), torch.ones_like(seq[:, 1:n])], dim=1)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=prompt_positions(mask),
                           return_dict=True).logits[:, -n:].float()
        lp = torch.log_softmax(logits, -1).gather(-1, target[:, :, None]).squeeze(-1)
        out[pick, :n] = lp.masked_fill(torch.arange(n, device=lp.device) >= lengths[lo:lo + batch, None], 0.0)
    return out.view(n_cand, n_docs, width)
