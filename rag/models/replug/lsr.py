"""REPLUG LSR's loss (Shi et al. 2023, §4): the retriever's distribution over its top-k pulled toward the LM's preference.

Pure tensor function over ``(batch, k)`` retrieval scores and LM log-likelihoods; the document distributions are
:func:`rag.generation.marginalize.doc_log_prior` with a temperature::

    §4.1  P_R(d | x)    = softmax(s(d, x) / γ)            over the retrieved top-k
    §4.2  Q_LM(d | x, y) = softmax(log P_LM(y | d, x) / β)  (the LM frozen: no gradient)
    §4.3  L = 1/|B| Σ_x KL(P_R(· | x) ‖ Q_LM(· | x, y))

(The paper prints §4.1 as e^{γ s}; with its γ = β = 0.1 "temperature of the softmax" the scores are divided, as here.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rag.generation.marginalize import Reduction, _reduce, doc_log_prior
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number

__all__ = ["lsr_loss"]


def lsr_loss(doc_scores: Tensor, lm_loglik: Tensor, *, retrieval_temperature: float = 0.1, beta: float = 0.1,
             doc_mask: Optional[Tensor] = None,
             reduce: Reduction = "mean") -> Tensor:
    """KL(P_R ‖ Q_LM) of REPLUG LSR (§4.3), averaged over the batch.

    Args:
        doc_scores: ``(batch, k)`` retrieval scores s(d, x), differentiable into the retriever.
        lm_loglik: ``(batch, k)`` log P_LM(y | d, x) of the ground-truth continuation under each document (detached:
            the LM is a frozen black box).
        retrieval_temperature: γ > 0, temperature of the retrieval likelihood (the paper's γ; the same setting as
            REPLUG's and RAG's ``retrieval_temperature``).
        beta: β > 0, temperature of the LM likelihood.
        doc_mask: ``(batch, k)`` bool, False for documents that do not count.
        reduce: ``"mean"`` (the paper's 1/|B| Σ), ``"sum"`` or ``"none"`` for ``(batch,)``.

    Returns:
        scalar (or ``(batch,)``), ≥ 0; float32 for half-precision input.
    """
    for name, v in (("retrieval_temperature", retrieval_temperature), ("beta", beta)):
        check_number(v, f"{name} (the softmax temperature of REPLUG LSR, §4.1-4.2)", above=0, error=ConfigError)
    if doc_scores.shape != lm_loglik.shape:
        raise RagError(f"doc_scores {tuple(doc_scores.shape)} and lm_loglik {tuple(lm_loglik.shape)} must both be (batch, k)")
    if not bool(torch.isfinite(lm_loglik).all()):
        raise RagError("lm_loglik holds a non-finite value: an LM score is missing or broken; refusing to train on it")
    log_p = doc_log_prior(doc_scores, temperature=retrieval_temperature, doc_mask=doc_mask)  # (B, k) log P_R(d|x)
    log_q = doc_log_prior(lm_loglik.detach().to(log_p.dtype), temperature=beta, doc_mask=doc_mask)  # (B, k) log Q_LM(d|x,y)
    terms = log_p.exp() * (log_p - log_q)
    if doc_mask is not None:
        terms = torch.where(doc_mask.to(device=terms.device, dtype=torch.bool), terms, terms.new_zeros(()))
    return _reduce(terms.sum(-1), reduce)
