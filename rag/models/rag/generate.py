"""The one RAG answer-generation path: retrieve, encode the contexts once, decode with RAG-Token or RAG-Sequence.

`rag.pipeline.api.RagPipeline.generate` (answers with provenance) and `rag.training.modules.generate_answers`
(evaluation strings) both call `generate_for_questions`; what they do with the result differs, the decoding
dispatch does not. ``with_no_retrieval=True`` decodes, in the same batch, each question without a passage too (the
RetRobust back-off's second generation, Yoran et al. 2024 §2.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

from rag.generation.answers import Answer, PassageProvenance, through_eos
from rag.generation.decoding import (
    EncodedContexts,
    GenerationConfig,
    GenerationOutput,
    encode_contexts,
    rag_sequence_generate,
    rag_token_generate,
    teacher_forced_logprobs,
)
from rag.generation.detokenize import decode_answer, lowercases, restore_case
from rag.generation.options import FALLBACK_DEFAULTS
from rag.generation.spans import PassageSpans, TokenTexts
from rag.generators import seq2seq
from rag.utils.errors import ConfigError

__all__ = ["RagGeneration", "generate_for_questions", "answers_with_provenance", "closed_book_answers", "generate_closed_book",
           "no_retrieval_contexts", "unmasked_contexts"]


@dataclass(frozen=True)
class RagGeneration:
    """What one decoding call produced, with what it was decoded from.

    inputs: the model's `prepare_inputs` result (retrieved passages, `doc_scores` `(batch, n_docs)`, contexts);
    contexts: the encoded `(batch * n_docs)` contexts, or a causal generator's prompts with their prefilled KV caches
    (reusable for rescoring, e.g. `teacher_forced_logprobs`);
    output: `batch * num_return_sequences` sequences, best first per question; marginalization: "token" | "sequence".
    no_retrieval: with ``with_no_retrieval``, the `batch * num_return_sequences` answers to the bare questions (decoded in
    the same call as `output`; their contexts are rows ``batch * n_docs`` on of `contexts`), else None.
    """

    inputs: object
    contexts: object
    output: GenerationOutput
    marginalization: str
    no_retrieval: Optional[GenerationOutput] = None


def no_retrieval_contexts(model, inputs) -> list:
    """``B·K`` generator inputs without a passage: the model's prefix + each question, as its retrieval contexts carry it
    (so a transformers checkpoint's round-tripped question), K copies per question (row ``b·K + k``).

    RAG's marginal over K identical contexts with a uniform prior is the generator's own ``p(y | x)``: decoding these
    rows is the generator on the bare question, in the batch shape the RAG decoders take.
    """
    return seq2seq.no_retrieval_contexts(model.context_format, inputs)


def _split_rows(out: GenerationOutput, n: int) -> tuple[GenerationOutput, GenerationOutput]:
    """`out`'s first `n` rows and the rest, as two outputs."""
    def part(sl):
        return GenerationOutput(out.sequences[sl], out.scores[sl], out.log_likelihood[sl],
                                None if out.doc_posteriors is None else out.doc_posteriors[sl])

    return part(slice(0, n)), part(slice(n, None))


def decoding_config(model, config: GenerationConfig) -> GenerationConfig:
    """`config` with what the model's generator needs (a causal generator's EOS: its tokenizer's, which every trained
    answer ends with)."""
    return model.lm.decoding_config(config)


def decoding_contexts(model, ids: Tensor, mask: Tensor, share_cache: bool = True, prefix_width: int = 0):
    """What decoding reads for context rows ``(N, L)``: encoder states (seq2seq, encoder run once) or the prompts whose
    KV caches every decoder row copies (causal; the first `prefix_width` columns are question-independent prefixes whose
    caches the generator keeps across calls)."""
    return model.lm.decoder(ids, mask, share_cache, prefix_width)


@torch.no_grad()
def generate_closed_book(model, questions: Sequence[str], config: GenerationConfig) -> GenerationOutput:
    """The generator's answers to the bare questions (the model's prefix + question, no passage, nothing retrieved): the
    closed-book baseline of Lewis et al. 2020, Table 1. One context per question with prior 1, so RAG-Token decoding
    over it is the generator's own beam / greedy search on ``p(y | x)``."""
    device = next(model.generator.parameters()).device
    ids, mask, _, _, _ = model.lm.contexts(list(questions), None, model.config)
    contexts = decoding_contexts(model, ids.to(device), mask.to(device))
    return rag_token_generate(model.generator, contexts, torch.zeros(len(questions), 1, device=device),
                              decoding_config(model, config))


@torch.no_grad()
def generate_for_questions(model, questions: Sequence[str], config: GenerationConfig, *, n_docs: Optional[int] = None,
                           marginalization: Optional[Literal["sequence", "token"]] = None,
                           decoding: Optional[Literal["thorough", "fast"]] = None,
                           with_no_retrieval: bool = False, share_cache: bool = True,
                           retrieval: Optional[str] = None) -> RagGeneration:
    """Decode answers to `questions` with a `RagModel`-like `model` (`prepare_inputs`, `generator`, `config`).

    marginalization: "token" (RAG-Token: greedy / beam over the marginal transition) or "sequence"
    (RAG-Sequence: per-passage search, then `decoding` = "thorough" or "fast" rescoring, Lewis et al. 2020 §2.5;
    None: the generation options' default); None: the model's own. n_docs: passages per question (None: the model's). With
    ``model.config.mask_padded_contexts`` False, RAG-Sequence's per-passage search runs on `unmasked_contexts`
    (transformers' behaviour); rescoring and the returned `contexts` stay masked. with_no_retrieval: also decode every
    question without retrieval (:func:`no_retrieval_contexts`, uniform prior) in the same batch: ``2B`` rows, one call.
    share_cache: a causal generator prefills each prompt once and its decoder rows and rescoring pairs copy that KV cache
    (False: every row prefills its prompt again; for measuring what sharing saves). retrieval: ``dense`` | ``bm25`` |
    ``hybrid`` for this call (None: the model's configured retrieval).
    """
    marg = marginalization or model.config.marginalization
    decoding = FALLBACK_DEFAULTS["decoding"] if decoding is None else decoding
    if marg not in ("sequence", "token"):
        raise ConfigError(f"marginalization={marg!r}; choose 'sequence' or 'token'")
    inputs = model.prepare_inputs(list(questions), n_docs=n_docs, **({"retrieval": retrieval} if retrieval else {}))
    generator = model.generator
    config = decoding_config(model, config)
    ids, mask, doc_scores = inputs.context_input_ids, inputs.context_attention_mask, inputs.doc_scores
    width = inputs.prefix_width
    if with_no_retrieval:  # K rows per question without a passage after the retrieval rows, uniform prior
        ids, mask, width = model.lm.with_bare_rows(list(questions), inputs, model.config)
        doc_scores = torch.cat([doc_scores, torch.zeros_like(doc_scores)])
    contexts = decoding_contexts(model, ids, mask, share_cache, width)
    spans = None
    if config.extractive:  # answers are spans of the passages read; the no-retrieval rows read none
        passages = inputs.retrieved.passages
        read = [(p.title, p.text) for ps in passages for p in ps]
        asked = [q for q, ps in zip(questions, passages) for _ in ps]  # an answer does not start with a question word
        pad = [None] * (len(contexts) - len(read))
        spans = PassageSpans(token_texts(model), read + pad, asked + [""] * len(pad))
    if marg == "token":
        out = rag_token_generate(generator, contexts, model.retrieval_logits(doc_scores), config, spans=spans)
    else:
        search = None
        if not model.config.mask_padded_contexts:  # transformers' per-passage search (set by the hf_compat import)
            search = unmasked_contexts(generator, model.generator_tokenizer, ids, mask, model.config.max_context_length)
        # the generator's convention: transformers' get_nll (seq2seq parity) or Eq. 1 literally (a causal reader, whose
        # pad is EOS, would lose the prior of every one-token answer under get_nll)
        out = rag_sequence_generate(generator, contexts, model.retrieval_logits(doc_scores), config, decoding=decoding,
                                    search_contexts=search, spans=spans, convention=model.lm.sequence_convention)
    bare = None
    if with_no_retrieval:
        out, bare = _split_rows(out, len(questions) * config.num_return_sequences)
    return RagGeneration(inputs=inputs, contexts=contexts, output=out, marginalization=marg, no_retrieval=bare)


def token_texts(model) -> TokenTexts:
    """The generator tokenizer's :class:`TokenTexts`, built on first use and kept by its generator (extractive decoding)."""
    return model.lm.token_texts()


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


def closed_book_answers(model, questions: Sequence[str], out: GenerationOutput, n_ret: int, kb_version: str) -> list[Answer]:
    """Answers decoded without a passage: text, log p(y|x), tokens; no passages."""
    tok = model.generator_tokenizer
    special = set(tok.all_special_ids)
    uncased = lowercases(tok)
    answers = []
    for r in range(out.sequences.shape[0]):
        question = questions[r // n_ret]
        ids = [t for t in out.sequences[r, 1:].tolist() if t not in special]
        text = decode_answer(tok, ids)
        if uncased:  # take the casing from the question, the only text read
            text = restore_case(text, [question])
        answers.append(Answer(question, text, float(out.log_likelihood[r]), kb_version, [],
                              tokens=tok.convert_ids_to_tokens(ids),
                              token_ids=through_eos(out.sequences[r].tolist(), tok.eos_token_id)))
    return answers


def answers_with_provenance(model, questions: Sequence[str], inputs, contexts, out: GenerationOutput, n_ret: int,
                            marg: str) -> list[Answer]:
    """One :class:`Answer` per returned sequence with its passages' prior p(z|x) and posterior p(z|x,y) and, for
    RAG-Token, the per-token document posterior (Figure 2), from one teacher-forced pass on the stored encoder states."""
    tok = model.generator_tokenizer
    batch, k = inputs.doc_scores.shape
    log_prior = torch.log_softmax(model.retrieval_logits(inputs.doc_scores).float(), dim=1)
    prior = log_prior.exp()
    seqs = out.sequences
    rows = torch.arange(batch, device=seqs.device).repeat_interleave(n_ret)
    # Per-token, per-passage log p(y_t|x,z,y_<t) of every returned answer: one teacher-forced pass
    # on the stored encoder states (no re-encoding). Gives RAG-Token's Figure-2 posteriors and,
    # for RAG-Token answers, the sequence-level posterior p(z|x,y) ∝ p(z|x) Π_t p(y_t|x,z,y_<t).
    token_lp = None
    if seqs.shape[1] >= 2 and (marg == "token" or out.doc_posteriors is None):
        ctx = rows[:, None] * k + torch.arange(k, device=seqs.device)
        token_lp = teacher_forced_logprobs(model.generator, contexts, seqs, ctx)  # (R, K, T-1)
    special = set(tok.all_special_ids)
    uncased = lowercases(tok)
    answers = []
    for r in range(seqs.shape[0]):
        b = int(rows[r])
        ids = seqs[r, 1:].tolist()
        keep = [t for t in range(len(ids)) if ids[t] not in special]
        text = decode_answer(tok, [ids[t] for t in keep])
        tokens = token_post = None
        if out.doc_posteriors is not None:
            post = out.doc_posteriors[r].tolist()
        elif token_lp is not None:
            real = torch.tensor(keep, dtype=torch.long, device=seqs.device)
            seq_terms = log_prior[b] + token_lp[r][:, real].sum(-1)
            post = torch.softmax(seq_terms, 0).tolist()
        else:
            post = [float("nan")] * k
        if uncased:  # take the answer's casing from the passages it was read from, best first
            order = sorted(range(k), key=lambda j: -(post[j] if not math.isnan(post[j]) else prior[b, j].item()))
            text = restore_case(text,
                                [f"{inputs.retrieved.passages[b][j].title} {inputs.retrieved.passages[b][j].text}"
                                 for j in order])
        if marg == "token" and token_lp is not None and keep:
            real = torch.tensor(keep, dtype=torch.long, device=seqs.device)
            per_tok = log_prior[b][:, None] + token_lp[r][:, real]  # (K, T)
            token_post = torch.softmax(per_tok, dim=0).T.tolist()  # (T, K)
            tokens = tok.convert_ids_to_tokens([ids[t] for t in keep])
        score = float(out.log_likelihood[r])
        passages = [
            PassageProvenance(p.id, p.title, p.text, float(s), float(pr), None if math.isnan(po) else float(po))
            for p, s, pr, po in zip(inputs.retrieved.passages[b], inputs.doc_scores[b].tolist(), prior[b].tolist(), post)
        ]
        answers.append(Answer(questions[b], text, score, inputs.retrieved.kb_version, passages, tokens, token_post,
                              through_eos(seqs[r].tolist(), tok.eos_token_id)))
    return answers
