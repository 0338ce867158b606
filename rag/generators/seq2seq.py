"""The seq2seq (encoder-decoder) generator: BART, T5, the warm-start reader (:mod:`rag.generators.base`).

A context is "title / text // question" (:mod:`rag.generation.contexts`); the encoder runs once per context and the
search and rescoring read its states (:class:`~rag.generation.seq2seq.EncodedContexts`). Targets are the tokenizer's
(BART ``<s> … </s>``, T5 ``… </s>``), decoded shifted right after the decoder start token; transformers' own label
convention is an adapter for imported checkpoints (:func:`~rag.generation.marginalize.hf_label_convention`, applied by
``RagModel.training_targets`` under ``hf_compat``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from rag.generation.buckets import DEFAULT_MAX_BUCKETS, length_buckets, run_in_buckets, take_bucket
from rag.generation.contexts import Context, ContextFormat, build_contexts, tokenize_contexts
from rag.generation.marginalize import shift_right
from rag.generation.seq2seq import EncodedContexts, encode_contexts
from rag.generators.base import GeneratorBase, GeneratorInputs
from rag.utils.errors import ConfigError
from rag.utils.truncation import note_cut_prompts

__all__ = ["Seq2SeqGenerator", "no_retrieval_contexts"]


def no_retrieval_contexts(fmt: ContextFormat, inputs) -> list:
    """``B·K`` generator inputs without a passage: `fmt`'s prefix + each question, as the retrieval contexts of `inputs`
    (a ``RagInputs``) carry it (so a transformers checkpoint's round-tripped question), K copies per question.

    RAG's marginal over K identical contexts with a uniform prior is the generator's own ``p(y | x)``: decoding these
    rows is the generator on the bare question, in the batch shape the RAG decoders take.
    """
    sep = fmt.doc_sep.replace("  ", " ")
    strings = list(inputs.context_strings)
    k = inputs.doc_scores.shape[1]
    out = []
    for b in range(inputs.doc_scores.shape[0]):
        c = strings[b * k]
        question = c.question_part.removeprefix(sep) if isinstance(c, Context) else str(c)
        out.extend([Context(fmt.prefix + question, len(fmt.prefix))] * k)
    return out


class Seq2SeqGenerator(GeneratorBase):
    """An encoder-decoder LM reading "title / text // question" contexts; transformers' RAG is over this family."""

    kind = "seq2seq"
    sequence_convention = "transformers"
    transformers_rag = True

    @property
    def decoder_start_token_id(self) -> Optional[int]:
        start = getattr(self.model.config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(getattr(self.model, "generation_config", None), "decoder_start_token_id", None)
        return start

    def check_tokens(self) -> None:
        if self.decoder_start_token_id is None:
            raise ConfigError("the generator config has no decoder_start_token_id; set generator.config.decoder_start_token_id")

    def _tokenize(self, strings, settings) -> tuple[Tensor, Tensor, int]:
        enc = tokenize_contexts(self.tokenizer, strings, settings.max_context_length, truncation=settings.effective_truncation,
                                padding="longest")
        return enc["input_ids"], enc["attention_mask"], int(enc["truncated"].sum())

    def contexts(self, questions: Sequence[str], passages: Optional[Sequence[Sequence]], settings) -> GeneratorInputs:
        fmt = self.context_format(settings)
        if passages is None:
            strings = [Context(fmt.prefix + q, len(fmt.prefix)) for q in questions]
        else:
            strings = build_contexts(list(questions), passages, fmt)
        ids, mask, n_truncated = self._tokenize(strings, settings)
        if passages is not None:
            note_cut_prompts(n_truncated, len(strings), settings.max_context_length)  # counted where a command asks
        return GeneratorInputs(ids, mask, n_truncated, strings, 0)

    def prompt_ids(self, question: str, passages: Sequence, settings) -> list[list[int]]:
        """The whole "title / text // question" context of `question` with each passage, special tokens included."""
        strings = build_contexts([question], [list(passages)], self.context_format(settings))
        return [list(r) for r in self.tokenizer([str(s) for s in strings], add_special_tokens=True,
                                                truncation=False)["input_ids"]]

    def loss_contexts(self, questions: Sequence[str], passages: Optional[Sequence], settings) -> GeneratorInputs:
        fmt = self.context_format(settings)
        if passages is None:
            strings = [fmt.prefix + q for q in questions]
        else:
            strings = [fmt.context(p.title, p.text, q) for q, p in zip(questions, passages)]
        return GeneratorInputs(*self._tokenize(strings, settings), strings, 0)

    def with_bare_rows(self, questions: Sequence[str], inputs, settings) -> tuple[Tensor, Tensor, int]:
        strings = list(inputs.context_strings) + no_retrieval_contexts(self.context_format(settings), inputs)
        ids, mask, _ = self._tokenize(strings, settings)
        return ids.to(inputs.context_input_ids.device), mask.to(inputs.context_attention_mask.device), 0

    def decoder(self, input_ids: Tensor, attention_mask: Tensor, share_cache: bool = True,
                prefix_width: int = 0) -> EncodedContexts:
        """The encoder states of every context, the encoder run once (`share_cache`, `prefix_width`: causal only)."""
        return encode_contexts(self.model, input_ids, attention_mask)

    def targets(self, targets: Sequence[str], settings) -> tuple[Tensor, Tensor]:
        enc = self.tokenizer(list(targets), padding=True, truncation=True, max_length=settings.max_target_length,
                             return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"].bool()

    def teacher_forced(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_docs: int, *,
                       decoder_input_ids: Optional[Tensor] = None, max_buckets: int = DEFAULT_MAX_BUCKETS) -> Tensor:
        """Every context row ``b·K + k`` decodes ``labels[b]`` (fed shifted right after the start token, or
        `decoder_input_ids` ``(B, T)``); the rows run in at most `max_buckets` length buckets, each padded to its own
        longest context (:mod:`rag.generation.buckets`), so the cost follows the real context tokens."""
        b, t = labels.shape
        if decoder_input_ids is None:
            decoder_input_ids = shift_right(labels, int(self.decoder_start_token_id), self.pad_token_id)  # (B, T)

        def run(bucket) -> Tensor:  # (n, T, V) for the bucket's rows
            out = self.model(
                input_ids=take_bucket(input_ids, bucket),
                attention_mask=take_bucket(attention_mask, bucket),
                decoder_input_ids=decoder_input_ids[bucket.rows // n_docs],  # row b*K + k decodes target b
                use_cache=False,
                return_dict=True,
            )
            return out.logits

        logits = run_in_buckets(run, length_buckets(attention_mask, max_buckets=max_buckets))  # (B·K, T, V)
        return logits.view(b, n_docs, t, -1)
