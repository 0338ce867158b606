"""The one RAG answer-generation path: retrieve, encode the contexts once, decode with RAG-Token or RAG-Sequence.

`rag.pipeline.RagPipeline.generate` (answers with provenance) and `rag.training.modules.generate_answers`
(evaluation strings) both call `generate_for_questions`; what they do with the result differs, the decoding
dispatch does not. ``with_no_retrieval=True`` decodes, in the same batch, each question without a passage too (the
RetRobust back-off's second generation, Yoran et al. 2024 §2.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

from rag.errors import ConfigError
from rag.generation.decoding import (
    EncodedContexts,
    GenerationConfig,
    GenerationOutput,
    encode_contexts,
    rag_sequence_generate,
    rag_token_generate,
)

__all__ = ["RagGeneration", "generate_for_questions", "generate_closed_book", "no_retrieval_contexts", "unmasked_contexts"]


@dataclass(frozen=True)
class RagGeneration:
    """What one decoding call produced, with what it was decoded from.

    inputs: the model's `prepare_inputs` result (retrieved passages, `doc_scores` `(batch, n_docs)`, contexts);
    contexts: the encoded `(batch * n_docs)` contexts (reusable for rescoring, e.g. `teacher_forced_logprobs`);
    output: `batch * num_return_sequences` sequences, best first per question; marginalization: "token" | "sequence".
    no_retrieval: with ``with_no_retrieval``, the `batch * num_return_sequences` answers to the bare questions (decoded in
    the same call as `output`; their contexts are rows ``batch * n_docs`` on of `contexts`), else None.
    """

    inputs: object
    contexts: EncodedContexts
    output: GenerationOutput
    marginalization: str
    no_retrieval: Optional[GenerationOutput] = None


def no_retrieval_contexts(model, inputs) -> list:
    """``B·K`` generator inputs without a passage: the model's prefix + each question, as its retrieval contexts carry it
    (so a transformers checkpoint's round-tripped question), K copies per question (row ``b·K + k``).

    RAG's marginal over K identical contexts with a uniform prior is the generator's own ``p(y | x)``: decoding these
    rows is the generator on the bare question, in the batch shape the RAG decoders take.
    """
    from rag.generation.contexts import Context

    fmt = model.context_format
    sep = fmt.doc_sep.replace("  ", " ")
    strings = list(inputs.context_strings)
    k = inputs.doc_scores.shape[1]
    out = []
    for b in range(inputs.doc_scores.shape[0]):
        c = strings[b * k]
        question = c.question_part.removeprefix(sep) if isinstance(c, Context) else str(c)
        out.extend([Context(fmt.prefix + question, len(fmt.prefix))] * k)
    return out


def _split_rows(out: GenerationOutput, n: int) -> tuple[GenerationOutput, GenerationOutput]:
    """`out`'s first `n` rows and the rest, as two outputs."""
    def part(sl):
        return GenerationOutput(out.sequences[sl], out.scores[sl], out.log_likelihood[sl],
                                None if out.doc_posteriors is None else out.doc_posteriors[sl])

    return part(slice(0, n)), part(slice(n, None))


@torch.no_grad()
def generate_closed_book(model, questions: Sequence[str], config: GenerationConfig) -> GenerationOutput:
    """The generator's answers to the bare questions (the model's prefix + question, no passage, nothing retrieved): the
    closed-book baseline of Lewis et al. 2020, Table 1. One context per question with prior 1, so RAG-Token decoding
    over it is the generator's own beam / greedy search on ``p(y | x)``."""
    from rag.generation.contexts import Context, tokenize_contexts

    fmt = model.context_format
    enc = tokenize_contexts(model.generator_tokenizer, [Context(fmt.prefix + q, len(fmt.prefix)) for q in questions],
                            model.config.max_context_length, truncation=model.config.effective_truncation, padding="longest")
    device = next(model.generator.parameters()).device
    contexts = encode_contexts(model.generator, enc["input_ids"].to(device), enc["attention_mask"].to(device))
    return rag_token_generate(model.generator, contexts, torch.zeros(len(questions), 1, device=device), config)


@torch.no_grad()
def generate_for_questions(model, questions: Sequence[str], config: GenerationConfig, *, n_docs: Optional[int] = None,
                           marginalization: Optional[Literal["sequence", "token"]] = None,
                           decoding: Literal["thorough", "fast"] = "thorough",
                           with_no_retrieval: bool = False) -> RagGeneration:
    """Decode answers to `questions` with a `RagModel`-like `model` (`prepare_inputs`, `generator`, `config`).

    marginalization: "token" (RAG-Token: greedy / beam over the marginal transition) or "sequence"
    (RAG-Sequence: per-passage search, then `decoding` = "thorough" or "fast" rescoring, Lewis et al. 2020 §2.5);
    None: the model's own. n_docs: passages per question (None: the model's). With
    ``model.config.mask_padded_contexts`` False, RAG-Sequence's per-passage search runs on `unmasked_contexts`
    (transformers' behaviour); rescoring and the returned `contexts` stay masked. with_no_retrieval: also decode every
    question without retrieval (:func:`no_retrieval_contexts`, uniform prior) in the same batch: ``2B`` rows, one call.
    """
    marg = marginalization or model.config.marginalization
    if marg not in ("sequence", "token"):
        raise ConfigError(f"marginalization={marg!r}; choose 'sequence' or 'token'")
    inputs = model.prepare_inputs(list(questions), n_docs=n_docs)
    generator = model.generator
    ids, mask, doc_scores = inputs.context_input_ids, inputs.context_attention_mask, inputs.doc_scores
    if with_no_retrieval:
        from rag.generation.contexts import tokenize_contexts

        enc = tokenize_contexts(model.generator_tokenizer, list(inputs.context_strings) + no_retrieval_contexts(model, inputs),
                                model.config.max_context_length, truncation=model.config.effective_truncation, padding="longest")
        ids, mask = enc["input_ids"].to(ids.device), enc["attention_mask"].to(mask.device)
        doc_scores = torch.cat([doc_scores, torch.zeros_like(doc_scores)])
    contexts = encode_contexts(generator, ids, mask)
    if marg == "token":
        out = rag_token_generate(generator, contexts, model.retrieval_logits(doc_scores), config)
    else:
        search = None
        if not model.config.mask_padded_contexts:  # transformers' per-passage search (set by the hf_compat import)
            search = unmasked_contexts(generator, model.generator_tokenizer, ids, mask, model.config.max_context_length)
        out = rag_sequence_generate(generator, contexts, model.retrieval_logits(doc_scores), config, decoding=decoding,
                                    search_contexts=search)
    bare = None
    if with_no_retrieval:
        out, bare = _split_rows(out, len(questions) * config.num_return_sequences)
    return RagGeneration(inputs=inputs, contexts=contexts, output=out, marginalization=marg, no_retrieval=bare)


@torch.no_grad()
def unmasked_contexts(generator, tokenizer, context_input_ids: Tensor, context_attention_mask: Tensor,
                      width: int) -> EncodedContexts:
    """The contexts as transformers' ``RagSequenceForGeneration.generate`` searches each passage: every context's
    tokens padded to `width` (its ``max_combined_length``; with the tokenizer's pad token, on its padding side, as
    ``RagRetriever`` pads) and encoded with NO attention mask, so the encoder and the decoder's cross-attention
    attend to the pads. context_input_ids / context_attention_mask `(N, L)` with `L <= width`; returns
    `(N, width)` encodings (all-ones mask) for ``rag_sequence_generate(search_contexts=...)``."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(context_input_ids, context_attention_mask)]
    padded = tokenizer.pad({"input_ids": rows}, padding="max_length", max_length=max(width, context_input_ids.shape[1]),
                           return_attention_mask=False, return_tensors="pt")["input_ids"].to(context_input_ids.device)
    return encode_contexts(generator, padded, torch.ones_like(padded))
