"""REPLUG inference (Shi et al. 2023, §3): a frozen (black-box) LM reads each of the top-k documents separately and the k
outputs are mixed in probability space, p(y | x) = Σ_d λ(d, x) p(y | d ∘ x), λ = softmax(s(d, x) / retrieval_temperature).

The mixtures are :mod:`rag.generation.marginalize`'s (REPLUG's per-token ensemble is RAG-Token's marginal, its sequence
scoring RAG-Sequence's); this module only lays out the k inputs:

* perplexity / bits per byte of texts: :class:`~rag.models.ralm.model.InContextRALM` with ``RalmConfig(ensemble=K)``
  (``rag lm-eval --ensemble K``);
* answer options (multiple choice, MMLU-style): :func:`replug_score_options` over any
  :class:`~rag.models.replug.lm_scorer.LMScorer` (a local model or a completions endpoint);
* generation: :func:`replug_generate`, the next-token distributions ensembled at every step by
  :class:`~rag.generation.decoding.TokenMarginalDecoder` over one :class:`~rag.generation.causal.CausalLMDecoder` row (one
  KV cache) per (input, document), greedy / beam search / sampling.

REPLUG is reached one way, the ``ensemble=K`` option, and decoded one way, :func:`~rag.generation.decoding.token_marginal_search`
(RAG-Token's search): over a causal LM's ``doc ∘ [ctx] ∘ prompt`` windows (:func:`replug_answers`, In-Context RALM's
reader), or over a RAG model's K passages with its generator frozen (:func:`ensemble_over_rag`: RAG-Token, n_docs = K).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from rag.generation.answers import Answer, PassageProvenance, through_eos
from rag.generation.causal import CausalLMDecoder, CausalPrompts
from rag.generation.decoding import token_marginal_search
from rag.generation.marginalize import doc_log_prior, rag_sequence_log_likelihood, rag_token_log_likelihood
from rag.generation.prompts import left_pad
from rag.generation.search import GenerationConfig, config_token_id, resolve_spec
from rag.generators.load import check_generator_kind
from rag.models.ralm.generate import check_new_token_lengths, continuation_text
from rag.models.ralm.model import window_start
from rag.models.replug.lm_scorer import LMScorer, ScoreCache, check_text, document_logprobs
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_positive_int

__all__ = ["replug_weights", "replug_score_options", "replug_generate", "replug_search", "replug_answers", "ensemble_over_rag"]


def _check_docs(documents: Sequence[Sequence[str]], batch: int) -> int:
    if len(documents) != batch:
        raise RagError(f"{len(documents)} document lists for {batch} inputs; give the top-k documents of each input")
    ks = {len(d) for d in documents}
    if len(ks) != 1 or 0 in ks:
        raise ConfigError(f"every input needs the same number k >= 1 of documents; got {sorted(ks)}")
    return ks.pop()


def replug_weights(scores: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log λ(d, x) = log_softmax(s(d, x) / temperature) over the top-k, ``(batch, k)`` (§3.2)."""
    return doc_log_prior(torch.as_tensor(scores, dtype=torch.float64) if not isinstance(scores, Tensor) else scores,
                         temperature=temperature)


def replug_score_options(lm: LMScorer, question: str, options: Sequence[str], documents: Sequence[str], scores, *,
                         retrieval_temperature: float = 1.0, marginalization: Literal["token", "sequence"] = "token",
                         cache: Optional[ScoreCache] = None) -> Tensor:
    """Log-likelihood of each answer option under the REPLUG ensemble of `documents` (multiple choice, §6.2).

    Args:
        lm: any :class:`~rag.models.replug.lm_scorer.LMScorer` (local model or completions endpoint).
        question: the input x (with its few-shot examples, if any).
        options: the answer continuations y (start them with a space, e.g. ``" A"``).
        documents: the k retrieved documents' texts.
        scores: ``(k,)`` their retrieval scores.
        retrieval_temperature: λ = softmax(scores / retrieval_temperature).
        marginalization: ``token``: Σ_t log Σ_d λ_d p(y_t | d ∘ x, y_<t) (the per-token ensemble, as in generation);
            ``sequence``: log Σ_d λ_d p(y | d ∘ x). Equal for one-token options (the paper's answer letters).
        cache: a :class:`~rag.models.replug.lm_scorer.ScoreCache` (the (document, question, option) pairs are asked once).

    Returns:
        ``(n_options,)`` float64 log p(option | question); the prediction is its argmax.
    """
    check_text(question, "the question")
    if not options:
        raise ConfigError("no answer options; give at least one")
    if marginalization not in ("token", "sequence"):
        raise ConfigError(f"marginalization={marginalization!r}; choose 'token' or 'sequence'")
    k = len(documents)
    if k < 1:
        raise ConfigError("REPLUG needs k >= 1 documents; give at least one retrieved document")
    prior = replug_weights(torch.as_tensor(scores, dtype=torch.float64).reshape(1, -1), temperature=retrieval_temperature)
    if prior.shape[1] != k:
        raise RagError(f"{prior.shape[1]} scores for {k} documents; give one retrieval score per document")
    lps = document_logprobs(lm, [d for _ in options for d in documents], [question] * (k * len(options)),
                            [o for o in options for _ in documents], cache=cache)
    out = []
    for i in range(len(options)):
        rows = lps[i * k:(i + 1) * k]
        if len({len(r) for r in rows}) != 1:
            raise RagError(f"option {i} was tokenized to different lengths under different documents; the LM must tokenize the "
                           "continuation the same way after every document")
        target = torch.from_numpy(np.stack(rows))[None]  # (1, k, T)
        fn = rag_token_log_likelihood if marginalization == "token" else rag_sequence_log_likelihood
        out.append(fn(target, prior)[0])
    return torch.stack(out)


@torch.no_grad()
def replug_generate(model, tokenizer, inputs: Sequence[str], documents: Sequence[Sequence[str]], scores, *,
                    retrieval_temperature: float = 1.0, config: GenerationConfig = GenerationConfig(),
                    rng: Optional[torch.Generator] = None, doc_max_length: int = 256) -> tuple[Tensor, Tensor]:
    """REPLUG generation with a causal LM: at every step the next-token distributions of the k prompts ``d ∘ x`` are mixed,
    Σ_d λ(d, x) p(· | d ∘ x, y_<t), and the search (greedy, beam, or sampling with ``config.do_sample``) runs on the mixture.

    Each (input, document) row keeps its own KV cache (:class:`~rag.generation.causal.CausalLMDecoder`; the prompts are
    prefilled once, in one batch); :class:`~rag.generation.decoding.TokenMarginalDecoder` mixes them per step.

    Args:
        inputs: B input texts x.
        documents: B lists of k document texts (cut to `doc_max_length` tokens).
        scores: ``(B, k)`` retrieval scores; retrieval_temperature: λ = softmax(scores / retrieval_temperature)
            (``config.temperature`` is the sampling temperature of the mixed distribution).

    Returns:
        sequences ``(B * num_return_sequences, T)`` — x's tokens (left-padded, after the BOS/EOS context token) followed by
        the generated ones — and their scores (log-likelihood under the mixture, or the length-penalised beam score).
    """
    check_generator_kind(model, "causal", "replug_generate")
    for x in inputs:
        check_text(x, "an input text")
    b = len(inputs)
    k = _check_docs(documents, b)
    prior = replug_weights(torch.as_tensor(scores, dtype=torch.float32).reshape(b, -1), temperature=retrieval_temperature).float()
    if prior.shape[1] != k:
        raise RagError(f"scores have {prior.shape[1]} columns for {k} documents per input")
    ctx = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = config_token_id(config, model, "eos_token_id", True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    x_tok = [[ctx] + list(t) for t in tokenizer(list(inputs), add_special_tokens=False)["input_ids"]]
    flat_docs = [d for ds in documents for d in ds]
    d_tok = tokenizer(flat_docs, add_special_tokens=False, truncation=True,
                      max_length=doc_max_length)["input_ids"] if flat_docs else []
    # the context token separates document and input, as In-Context RALM's windows do
    windows = [[list(d_tok[i * k + j]) + x_tok[i] for j in range(k)] for i in range(b)]
    return replug_search(model, x_tok, windows, prior, config, pad=pad, rng=rng)


@torch.no_grad()
def replug_search(model, streams: Sequence[Sequence[int]], windows: Sequence[Sequence[Sequence[int]]], log_prior: Tensor,
                  config: GenerationConfig, *, pad: int, rng: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """The search of :func:`replug_generate` on token ids: B input streams, each read after k documents.

    Args:
        streams: B token lists x (the ctx token first); the returned sequences start with them (left-padded).
        windows: B lists of k token lists ``d ∘ x`` (each ending with its stream's last token), one KV cache each.
        log_prior: ``(B, k)`` log λ(d, x).
        config: greedy, beam search (``num_beams``) or sampling (``do_sample``, `rng`); pad: the padding id.

    Returns:
        ``(B * num_return_sequences, T)`` sequences and their scores, as :func:`replug_generate`.
    """
    b, k = log_prior.shape
    if len(windows) != b or any(len(w) != k for w in windows):
        raise RagError(f"windows must be {b} lists of {k} token lists, one per (input, document)")
    eos = config_token_id(config, model, "eos_token_id", True)
    start, _ = left_pad([list(s) for s in streams], pad)
    spec = resolve_spec(config, model, prompt_len=start.shape[1], pad_fallback=eos)
    dev = next(model.parameters()).device
    ids, mask = left_pad([list(w) for ws in windows for w in ws], pad)  # prompts (input, document), each prefilled once
    prompts = CausalPrompts(ids.to(dev), mask.to(dev))
    # decoder rows (input, beam, document): every beam of an input continues the k prompts of that input
    rows = (torch.arange(b, device=dev)[:, None, None] * k + torch.arange(k, device=dev)).expand(b, config.num_beams, k)
    decoder = CausalLMDecoder(model, prompts=prompts, prompt_of_row=rows.reshape(-1))
    seqs, scores, _ = token_marginal_search(decoder, start.to(dev), log_prior.float().to(dev), spec, rng)
    return seqs, scores


def replug_answers(ralm, prompts: list[str], config, rng, kb_version: str) -> list[Answer]:
    """REPLUG generation (:func:`~rag.models.replug.ensemble.replug_search`): windows ``doc ∘ stream`` laid out as In-Context
    RALM's first segment (the prefix cut from the left to fit the window with all new tokens), one retrieval call."""
    from dataclasses import replace

    scorer, cfg = ralm.scorer, ralm.config
    tok = scorer.tokenizer
    check_new_token_lengths(config)
    streams = [scorer.stream(p) for p in prompts]
    ql = cfg.query_length
    queries = tok.batch_decode([s[max(1, len(s) - ql):] for s in streams])
    found = ralm.retriever.retrieve(queries, cfg.ensemble)
    if found.kb_version != kb_version:  # cannot happen: the call's retriever serves one pinned version
        raise RuntimeError(f"REPLUG retrieval read knowledge base {found.kb_version}, not the pinned {kb_version}")
    log_prior = replug_weights(found.scores.float(), temperature=cfg.retrieval_temperature)  # (B, K) log λ
    docs = scorer.doc_tokens([p for ps in found.passages for p in ps])
    k, L, new = cfg.ensemble, scorer.max_length, config.max_new_tokens
    if max(map(len, docs)) + new + 1 > L:
        raise ConfigError(f"REPLUG generation reads every document, at least one prompt token and all {new} new tokens in one "
                          f"window of {L} tokens (--max-length); lower --max-new-tokens or --doc-max-length "
                          f"({cfg.doc_max_length})")
    windows = [[docs[i * k + j] + s[window_start(len(s), len(s) + new, len(docs[i * k + j]), L):] for j in range(k)]
               for i, s in enumerate(streams)]
    eos = tok.eos_token_id if config.eos_token_id is None else config.eos_token_id
    config = replace(config, eos_token_id=eos, pad_token_id=scorer.pad_id if config.pad_token_id is None else config.pad_token_id)
    seqs, scores = replug_search(scorer.model, streams, windows, log_prior.to(scorer.device), config, pad=scorer.pad_id, rng=rng)
    width = max(map(len, streams))
    n_ret = config.num_return_sequences
    lam = log_prior.exp()
    answers = []
    for row in range(seqs.shape[0]):
        i = row // n_ret
        gen = through_eos(seqs[row, width:].tolist(), eos)
        passages = [PassageProvenance(p.id, p.title, p.text, float(sc), float(w))
                    for p, sc, w in zip(found.passages[i], found.scores[i].tolist(), lam[i].tolist())]
        answers.append(Answer(prompts[i], continuation_text(tok, streams[i], gen), float(scores[row]), kb_version, passages,
                              tokens=tok.convert_ids_to_tokens(gen)))
    return answers


def ensemble_over_rag(ensemble, n_docs: Optional[int], marginalization: Optional[str]) -> tuple[int, str]:
    """REPLUG's ``ensemble=K`` for a RAG model: RAG-Token over K passages, ``(n_docs, "token")`` — the next-token
    distributions mixed with the retrieval prior at every step is RAG-Token's marginal (Eq. 2) with a frozen generator."""
    check_positive_int(ensemble, "ensemble (--ensemble, documents mixed per step)", error=ConfigError)
    if marginalization == "sequence":
        raise ConfigError("ensemble= (--ensemble, REPLUG) with a RAG model is RAG-Token decoding over K passages; it cannot be "
                          "combined with marginalization='sequence' (--marginalization sequence): drop one of them")
    if n_docs is not None and n_docs != ensemble:
        raise ConfigError(f"ensemble={ensemble} (--ensemble) with a RAG model means n_docs={ensemble} with RAG-Token decoding; "
                          f"it contradicts n_docs={n_docs} (--n-docs): pass only one of them")
    return ensemble, "token"
