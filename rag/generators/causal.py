"""The causal (decoder-only) generator: GPT-2, Llama, SmolLM2, with or without LoRA (:mod:`rag.generators.base`).

For a decoder-only LM p(y | x, z) (RAG §2.1) is its likelihood of the answer tokens and EOS after the prompt of passage
z and question x (:mod:`rag.generation.prompts`); the prompt tokens themselves are never scored::

    row b·K + k:  [pad … pad] prompt(z_k, x_b)  y_b,1 … y_b,T-1     (left-padded prompts, positions cumsum(mask) - 1)
    logits at the last prompt position … the position of y_b,T-1  ──►  (B, K, T, V): position t predicts y_b,t

The LM head runs only at those T positions (``logits_to_keep``). Prompts are laid out in two left-padded segments,
header + passage, then the rest (:func:`~rag.generation.prompts.segmented_pad`), so decoding takes the first segment's
KV cache from this generator's :class:`~rag.generation.causal.PrefixCache`, which it owns and clears when the weights
may change (:meth:`CausalGenerator.clear_caches`).

In-Context RALM's layout (Ram et al. 2023) reads the same LM and tokenizer: ``doc ∘ [ctx] ∘ text``, the text tokenized
once into a stream behind a context token (BOS, else EOS: the text's first token is scored too) and each document
(:func:`doc_text`, cut to a length) tokenized once per generator (:meth:`CausalGenerator.stream`,
:meth:`CausalGenerator.document_ids`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from rag.generation.causal import CausalPrompts, PrefixCache, prompt_positions
from rag.generation.contexts import ContextTruncationWarning
from rag.generation.prompts import left_pad, segmented_pad, tokenize_answers, tokenize_prompts
from rag.generation.search import GenerationConfig
from rag.generators.base import GeneratorBase, GeneratorInputs
from rag.utils.errors import ConfigError
from rag.utils.truncation import note_cut_prompts

__all__ = ["CausalGenerator", "causal_logits", "doc_text", "prompt_ids", "PREFIX_CACHE_BYTES"]

PREFIX_CACHE_BYTES = 1 << 30
"""How much memory a generator's :class:`PrefixCache` of passage KV caches may hold."""


class _Probe:
    title, text = "t", "p"


def doc_text(p) -> str:
    """The text of a passage as In-Context RALM reads it before a text: title, newline, text (as the authors' code)."""
    return f"{p.title}\n{p.text}" if p.title else p.text


def prompt_ids(tokenizer, fmt, question: str, passages: Sequence) -> list[list[int]]:
    """The whole token ids of the prompt of `question` with each of `passages` in the :class:`PromptFormat` `fmt` (what
    :meth:`CausalGenerator.contexts` tokenizes, uncut)."""
    return tokenize_prompts(tokenizer, fmt, [question], [list(passages)], 1 << 30).ids


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


class CausalGenerator(GeneratorBase):
    """A decoder-only LM reading prompts "passage, question, answer header" (its chat template, or a plain layout).

    transformers has no RAG over this family; RAG-Sequence takes Eq. 1 literally (transformers' ``get_nll`` would drop
    the document prior of every one-token answer, the pad id being EOS).
    """

    kind = "causal"
    sequence_convention = "paper"
    transformers_rag = False
    decoder_only = True

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self._prefix_cache: Optional[PrefixCache] = None
        self._answer_prefix: Optional[tuple] = None  # (prompt format, the text before an answer)
        self._documents: dict[tuple, list[int]] = {}  # (passage id, title, text, max length) -> document ids

    def check_tokens(self) -> None:
        if getattr(self.tokenizer, "eos_token_id", None) is None:
            raise ConfigError("the causal generator's tokenizer has no EOS token, which ends every answer; set "
                              "tokenizer.eos_token and save it again")

    @property
    def _pad_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def contexts(self, questions: Sequence[str], passages: Optional[Sequence[Sequence]], settings) -> GeneratorInputs:
        """Prompt ids and mask ``(B·K, S)`` (``(B, S)`` closed-book), in two left-padded segments (see the module)."""
        found = tokenize_prompts(self.tokenizer, settings.prompt_format, list(questions), passages, settings.max_context_length)
        ids, mask, width = segmented_pad(found.ids, found.prefix_lengths or [0] * len(found.ids), self._pad_id)
        counted = passages is not None and note_cut_prompts(sum(found.truncated), len(found.ids), settings.max_context_length)
        if any(found.truncated) and not counted:  # counted: the command reports the total once
            warnings.warn(f"{sum(found.truncated)} generator prompts are longer than max_context_length="
                          f"{settings.max_context_length} tokens; their passages were shortened so the question is kept "
                          "(raise max_context_length to keep whole passages)", ContextTruncationWarning, stacklevel=3)
        return GeneratorInputs(ids, mask, int(sum(found.truncated)), found.strings, width)

    def loss_contexts(self, questions: Sequence[str], passages: Optional[Sequence], settings) -> GeneratorInputs:
        return self.contexts(questions, None if passages is None else [[p] for p in passages], settings)

    def prompt_ids(self, question: str, passages: Sequence, settings) -> list[list[int]]:
        """The whole prompt of `question` with each passage (:func:`prompt_ids`)."""
        return prompt_ids(self.tokenizer, settings.prompt_format, question, passages)

    def with_bare_rows(self, questions: Sequence[str], inputs, settings) -> tuple[Tensor, Tensor, int]:
        ids, mask, doc_scores = inputs.context_input_ids, inputs.context_attention_mask, inputs.doc_scores
        k = doc_scores.shape[1]
        bare = self.contexts(questions, None, settings)
        rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)] + [r[m.bool()].tolist()
                                                                    for r, m in zip(bare.input_ids, bare.attention_mask)
                                                                    for _ in range(k)]
        ids, mask = (t.to(doc_scores.device) for t in left_pad(rows, self.pad_token_id))
        return ids, mask, 0

    @property
    def prefix_cache(self) -> Optional[PrefixCache]:
        """The KV caches of question-independent prompt prefixes (created on first use), or None before."""
        return self._prefix_cache

    def _kept_prefixes(self) -> Optional[PrefixCache]:
        if self.model.training:  # the weights change between calls
            return None
        if self._prefix_cache is None:
            self._prefix_cache = PrefixCache(PREFIX_CACHE_BYTES)
        return self._prefix_cache

    def decoder(self, input_ids: Tensor, attention_mask: Tensor, share_cache: bool = True,
                prefix_width: int = 0) -> CausalPrompts:
        """The prompts as decoding reads them: each prefilled once per call and its KV cache shared by its decoder rows
        and rescoring pairs, the passage prefixes' caches kept across calls (unless `share_cache` is False)."""
        return CausalPrompts(input_ids, attention_mask, share_cache=share_cache,
                             prefix_width=prefix_width if share_cache else 0,
                             prefix_cache=self._kept_prefixes() if share_cache else None)

    def decoding_config(self, config: GenerationConfig) -> GenerationConfig:
        """`config` with EOS set to the tokenizer's (the token every trained answer ends with) when it names none."""
        if config.eos_token_id is None:
            return replace(config, eos_token_id=int(self.tokenizer.eos_token_id))
        return config

    def answer_prefix(self, settings) -> str:
        """The text before an answer (a space after a prompt ending in a visible character, e.g. ``Answer:`` without a
        chat template), from the prompt format."""
        fmt = settings.prompt_format
        if self._answer_prefix is None or self._answer_prefix[0] != fmt:
            sample = tokenize_prompts(self.tokenizer, fmt, ["q"], [[_Probe()]], 1 << 20)
            self._answer_prefix = (fmt, sample.answer_prefix)
        return self._answer_prefix[1]

    def targets(self, targets: Sequence[str], settings) -> tuple[Tensor, Tensor]:
        """The answer tokens and EOS, right-padded ``(B, T)``, and their mask."""
        return tokenize_answers(self.tokenizer, targets, self.answer_prefix(settings), settings.max_target_length)

    def teacher_forced(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_docs: int, *,
                       decoder_input_ids: Optional[Tensor] = None, max_buckets: int = 1) -> Tensor:
        """Prompt ∘ answer, one pass over the ``B·K`` rows (:func:`causal_logits`)."""
        return causal_logits(self.model, input_ids, attention_mask, labels, n_docs)

    def clear_caches(self) -> None:
        if self._prefix_cache is not None:
            self._prefix_cache.clear()

    # ------------------------------------------------------------------ the doc ∘ [ctx] ∘ text layout
    def check_layout_tokens(self) -> None:
        """ConfigError unless the tokenizer has a context token (BOS or EOS) and a pad (pad or EOS)."""
        tok = self.tokenizer
        if (tok.bos_token_id is None and tok.eos_token_id is None) or (tok.pad_token_id is None and tok.eos_token_id is None):
            raise ConfigError("the LM's tokenizer has neither a pad/BOS nor an EOS token; set tokenizer.eos_token (or "
                              "pad_token) and save it again")

    @property
    def context_token_id(self) -> int:
        """The token before a text (BOS, else EOS)."""
        tok = self.tokenizer
        return int(tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)

    @property
    def padding_id(self) -> int:
        """The id right- or left-padded rows are filled with (pad, else EOS)."""
        return self._pad_id

    def stream(self, text: str) -> list[int]:
        """``[ctx] + tokens(text)``: the text tokenized once, without special tokens."""
        return [self.context_token_id] + list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def document_ids(self, passages: Iterable, max_length: int) -> list[list[int]]:
        """Token ids of each passage (:func:`doc_text`, cut to `max_length` tokens), tokenized once and kept until
        :meth:`clear_documents`."""
        passages = list(passages)
        keys = [(p.id, p.title, p.text, int(max_length)) for p in passages]
        new = list({k: p for k, p in zip(keys, passages) if k not in self._documents}.items())
        if new:
            enc = self.tokenizer([doc_text(p) for _, p in new], add_special_tokens=False, truncation=True,
                                 max_length=int(max_length))["input_ids"]
            for (key, _), ids in zip(new, enc):
                self._documents[key] = list(ids)
        return [self._documents[k] for k in keys]

    def clear_documents(self) -> None:
        self._documents.clear()
