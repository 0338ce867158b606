"""The one RAG answer-generation path: retrieve, encode the contexts once, decode with RAG-Token or RAG-Sequence.

`rag.pipeline.RagPipeline.generate` (answers with provenance) and `rag.training.modules.generate_answers`
(evaluation strings) both call `generate_for_questions`; what they do with the result differs, the decoding
dispatch does not.
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

__all__ = ["RagGeneration", "generate_for_questions", "unmasked_contexts"]


@dataclass(frozen=True)
class RagGeneration:
    """What one decoding call produced, with what it was decoded from.

    inputs: the model's `prepare_inputs` result (retrieved passages, `doc_scores` `(batch, n_docs)`, contexts);
    contexts: the encoded `(batch * n_docs)` contexts (reusable for rescoring, e.g. `teacher_forced_logprobs`);
    output: `batch * num_return_sequences` sequences, best first per question; marginalization: "token" | "sequence".
    """

    inputs: object
    contexts: EncodedContexts
    output: GenerationOutput
    marginalization: str


@torch.no_grad()
def generate_for_questions(model, questions: Sequence[str], config: GenerationConfig, *, n_docs: Optional[int] = None,
                           marginalization: Optional[Literal["sequence", "token"]] = None,
                           decoding: Literal["thorough", "fast"] = "thorough") -> RagGeneration:
    """Decode answers to `questions` with a `RagModel`-like `model` (`prepare_inputs`, `generator`, `config`).

    marginalization: "token" (RAG-Token: greedy / beam over the marginal transition) or "sequence"
    (RAG-Sequence: per-passage search, then `decoding` = "thorough" or "fast" rescoring, Lewis et al. 2020 §2.5);
    None: the model's own. n_docs: passages per question (None: the model's). With
    ``model.config.mask_padded_contexts`` False, RAG-Sequence's per-passage search runs on `unmasked_contexts`
    (transformers' behaviour); rescoring and the returned `contexts` stay masked.
    """
    marg = marginalization or model.config.marginalization
    if marg not in ("sequence", "token"):
        raise ConfigError(f"marginalization={marg!r}; choose 'sequence' or 'token'")
    inputs = model.prepare_inputs(list(questions), n_docs=n_docs)
    generator = model.generator
    contexts = encode_contexts(generator, inputs.context_input_ids, inputs.context_attention_mask)
    if marg == "token":
        out = rag_token_generate(generator, contexts, model.retrieval_logits(inputs.doc_scores), config)
    else:
        search = None
        if not model.config.mask_padded_contexts:  # transformers' per-passage search (set by the hf_compat import)
            search = unmasked_contexts(generator, model.generator_tokenizer, inputs.context_input_ids,
                                       inputs.context_attention_mask, model.config.max_context_length)
        out = rag_sequence_generate(generator, contexts, model.retrieval_logits(inputs.doc_scores), config, decoding=decoding,
                                    search_contexts=search)
    return RagGeneration(inputs=inputs, contexts=contexts, output=out, marginalization=marg)


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
