"""Marginalizing over retrieved documents: RAG-Sequence and RAG-Token likelihoods and losses.

Pure tensor functions, independent of the generator: a seq2seq model (RAG), a
decoder-only LM (REPLUG, In-Context RALM) or anything else that yields, for each of
the K retrieved documents, log-probabilities of the target tokens.

Shapes (B = batch, K = documents per input, T = target length, V = vocabulary):

* ``token_logprobs`` ``(B, K, T, V)``: log p_θ(· | x, z_k, y_<t), normalised over V.
  Position t is the distribution of ``target[:, t]`` (targets are already aligned;
  see :func:`hf_shift_targets` / :func:`shift_right` for the two conventions).
* ``target_logprobs`` ``(B, K, T)``: the same, gathered at the target tokens
  (:func:`gather_target_logprobs`); functions that need only these take only these.
* ``doc_log_prior`` ``(B, K)``: log p_η(z_k | x) (:func:`doc_log_prior`).
* ``target`` ``(B, T)`` int64 and ``mask`` ``(B, T)`` bool, True where a position is scored.

Equations (Lewis et al. 2020, §2.1)::

    Eq. 1  RAG-Sequence  p(y|x) = Σ_z p_η(z|x) Π_t p_θ(y_t | x, z, y_<t)
    Eq. 2  RAG-Token     p(y|x) = Π_t Σ_z p_η(z|x) p_θ(y_t | x, z, y_<t)

Both are computed in log space with ``logsumexp`` over documents. Half-precision
inputs are promoted to float32 before any sum.

Label smoothing (``epsilon``) follows the fairseq / transformers definition:
``loss = (1 - ε)·NLL + (ε / V)·S`` where S is minus the sum over scored positions of
the summed log-probabilities of every vocabulary entry (for K = 1 this is exactly
``torch.nn.functional.cross_entropy(..., label_smoothing=ε)``). For RAG-Token S uses
the marginal distribution of Eq. 2; for RAG-Sequence S is a logsumexp over documents
of ``V·log p(z|x) + Σ_t Σ_v log p_θ(v | x, z, y_<t)``.

Compatibility with transformers (``hf_compat=True``)
----------------------------------------------------
``RagSequenceForGeneration.get_nll`` and ``RagTokenForGeneration.get_nll`` (transformers
4.x - 5.x) are reproduced exactly (to float rounding) by ``hf_compat=True`` together with
``target = hf_shift_targets(labels, pad_token_id)`` and ``pad_token_id`` /
``bos_token_id`` of the generator. Their behaviour differs from the default here in
these ways, the first two of which are defects:

1. **Target convention / single-token targets.** transformers feeds ``labels`` to the
   decoder unshifted and scores ``labels[:, 1:]``, so ``labels[:, 0]`` is never scored
   and must be the decoder start token. Labels that do not begin with it (e.g. a T5
   tokenizer's ``[y_1, ..., </s>]``) silently lose their first real token, and labels
   of a single token (``[y]``, a class label) leave nothing to score: the RAG-Token
   loss is exactly 0 and the RAG-Sequence loss exactly ``-log K`` (0 for K = 1,
   negative otherwise), with no gradient at all.
   Default here: the decoder gets ``shift_right(labels, decoder_start_token_id)`` and
   the target is ``labels`` itself, so every label token, including a single one, is
   scored.
2. **RAG-Sequence document prior attached to target position 1.** transformers adds
   log p(z|x) to the log-probabilities of the *second* target position before masking
   padding. When that position is padding (a row whose target has exactly one scored
   token, e.g. ``labels = [start, y]``) or absent (T = 1), the prior silently vanishes:
   the "loss" becomes ``-log Σ_z p_θ(y|x,z)`` (a sum of K probabilities, not a mixture;
   it can be negative) and no gradient reaches ``doc_scores`` - the retriever stops
   learning on exactly the length-one targets the paper uses for classification
   (§2.1). Default here: the prior enters each document's sequence score once.
3. ``exclude_bos_score`` (RAG-Sequence only in transformers) drops target position 0
   only when *every* row of the batch starts with ``bos_token_id``, and only from the
   likelihood term (the smoothing term still counts it). Default here: per row, from
   both terms, and RAG-Token supports it too. transformers' RAG-Token ignores the flag;
   so does ``rag_token_nll(hf_compat=True)``.

Outside these cases the default and ``hf_compat=True`` give the same numbers.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number

__all__ = [
    "Reduction",
    "doc_log_prior",
    "target_mask",
    "gather_target_logprobs",
    "target_logprobs_from_logits",
    "sequence_log_likelihoods",
    "rag_sequence_log_likelihood",
    "rag_token_log_likelihood",
    "token_marginal_logprobs",
    "token_marginal_target_logprobs",
    "rag_sequence_nll",
    "rag_token_nll",
    "rag_nll_from_logits",
    "hf_shift_targets",
    "shift_right",
]

Reduction = Literal["mean", "sum", "none"]


# ----------------------------------------------------------------------------- helpers


def _promote(x: Tensor) -> Tensor:
    """Half-precision floats to float32 (sums over T and V are inaccurate in 16 bits)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_dims(name: str, x: Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise RagError(f"`{name}` must have shape {layout}; got {tuple(x.shape)}.")


def _check_prior(target_like: Tensor, prior: Tensor, what: str) -> None:
    _check_dims("doc_log_prior", prior, 2, "(batch, n_docs)")
    if tuple(prior.shape) != tuple(target_like.shape[:2]):
        raise RagError(
            f"`doc_log_prior` has shape {tuple(prior.shape)} but `{what}` has (batch, n_docs) = "
            f"{tuple(target_like.shape[:2])}; they must agree (one prior per retrieved document)."
        )


def _check_mask(mask: Tensor | None, batch: int, length: int) -> None:
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise RagError(f"`mask` must have shape (batch, tgt_len) = {(batch, length)}; got {tuple(mask.shape)}.")


def _reduce(loss: Tensor, reduce: Reduction) -> Tensor:
    if reduce == "none":
        return loss
    if reduce == "sum":
        return loss.sum()
    if reduce == "mean":
        return loss.mean()
    raise ConfigError(f"reduce={reduce!r} is not one of 'mean', 'sum', 'none'.")


def _check_epsilon(epsilon: float) -> None:
    if not 0.0 <= epsilon < 1.0:
        raise ConfigError(f"label smoothing epsilon={epsilon} must be in [0, 1).")


def _scored_mask(target: Tensor, mask: Tensor | None, pad_token_id: int | None, ignore_index: int | None) -> Tensor:
    if mask is not None:
        _check_mask(mask, target.shape[0], target.shape[1])
        return mask.to(torch.bool) & (target >= 0)
    return target_mask(target, pad_token_id=pad_token_id, ignore_index=ignore_index)


def _bos_rows(target: Tensor, bos_token_id: int | None) -> Tensor:
    """(B,) bool: rows whose first target token is BOS (all False without a BOS id or tokens)."""
    if bos_token_id is None or target.shape[1] == 0:
        return torch.zeros(target.shape[0], dtype=torch.bool, device=target.device)
    return target[:, 0].eq(bos_token_id)


# ----------------------------------------------------------------------------- building blocks


def doc_log_prior(doc_scores: Tensor, *, temperature: float = 1.0, doc_mask: Tensor | None = None) -> Tensor:
    """Retrieval scores to document log-priors: log p_η(z|x) = log_softmax over the K docs (RAG §2.2).

    With a `temperature` τ this is REPLUG's document weight λ (Eq. 1 of Shi et al. 2023) and its LSR
    retrieval likelihood P_R(d|x) = softmax(s(d, x) / γ) (§4.1): ``log_softmax(doc_scores / τ)``.

    Args:
        doc_scores: ``(batch, n_docs)`` retrieval logits, e.g. ``q · d(z)`` (differentiable).
        temperature: τ > 0 dividing the scores (1: the plain softmax, computed exactly as without it).
        doc_mask: ``(batch, n_docs)`` bool, False for documents that do not count (padding of a short
            retrieval, a filtered passage); they get log-prior ``-inf`` and the rest renormalise.
            Every row needs at least one True.

    Returns:
        ``(batch, n_docs)`` log-probabilities; float32 for half-precision input.
    """
    _check_dims("doc_scores", doc_scores, 2, "(batch, n_docs)")
    check_number(temperature, "temperature", above=0, error=ConfigError)
    scores = _promote(doc_scores)
    if temperature != 1.0:
        # Shifted by the row maximum first (softmax is shift-invariant) and divided in float64 (a τ such as 1e-300 is 0 in
        # float32): the best document's scaled score is 0, the others (s - max) / τ <= 0, so a tiny τ gives -inf (weight
        # 0), never 0/0 or inf - inf = NaN; as τ -> 0 the prior tends to one-hot on the best document (ties split evenly).
        finite = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
        top = finite.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min).detach()
        scores = ((scores - top).double() / temperature).to(scores.dtype)
    if doc_mask is not None:
        if tuple(doc_mask.shape) != tuple(doc_scores.shape):
            raise RagError(f"`doc_mask` must have the shape of `doc_scores` {tuple(doc_scores.shape)}; got "
                           f"{tuple(doc_mask.shape)}.")
        doc_mask = doc_mask.to(device=scores.device, dtype=torch.bool)
        if not bool(doc_mask.any(dim=-1).all()):
            raise RagError("`doc_mask` leaves a row without any document; every input needs at least one document that counts.")
        scores = scores.masked_fill(~doc_mask, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def target_mask(target: Tensor, *, pad_token_id: int | None = None, ignore_index: int | None = -100) -> Tensor:
    """Which target positions are scored: not ``pad_token_id`` and not ``ignore_index`` (or any negative id).

    Args:
        target: ``(batch, tgt_len)`` token ids.

    Returns:
        ``(batch, tgt_len)`` bool, True where the position counts.
    """
    mask = target >= 0
    if ignore_index is not None:
        mask &= target.ne(ignore_index)
    if pad_token_id is not None:
        mask &= target.ne(pad_token_id)
    return mask


def gather_target_logprobs(token_logprobs: Tensor, target: Tensor) -> Tensor:
    """Pick each document's log-probability of the target tokens.

    Args:
        token_logprobs: ``(batch, n_docs, tgt_len, vocab)`` log-probabilities.
        target: ``(batch, tgt_len)`` token ids; negative ids (``ignore_index``) read
            entry 0 and must be masked by the caller.

    Returns:
        ``(batch, n_docs, tgt_len)`` log p_θ(y_t | x, z, y_<t).
    """
    _check_dims("token_logprobs", token_logprobs, 4, "(batch, n_docs, tgt_len, vocab)")
    b, k, t, _ = token_logprobs.shape
    if tuple(target.shape) != (b, t):
        raise RagError(f"`target` must have shape (batch, tgt_len) = {(b, t)}; got {tuple(target.shape)}.")
    index = target.clamp_min(0).unsqueeze(1).expand(b, k, t).unsqueeze(-1)
    return token_logprobs.gather(-1, index).squeeze(-1)


def target_logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Each document's log-probability of the target tokens straight from generator logits:
    ``logit[y_t] - logsumexp(logits)``, without materialising a ``(B, K, T, V)`` log-softmax.

    Args:
        logits: ``(batch, n_docs, tgt_len, vocab)`` unnormalised scores (any float dtype).
        labels: ``(batch, tgt_len)`` target ids; negative ids read entry 0 and must be masked by the caller.

    Returns:
        ``(batch, n_docs, tgt_len)`` float32 log p_θ(y_t | x, z, y_<t) (as :func:`gather_target_logprobs`
        of the log-softmax, up to float rounding).
    """
    _check_dims("logits", logits, 4, "(batch, n_docs, tgt_len, vocab)")
    b, k, t, _ = logits.shape
    if tuple(labels.shape) != (b, t):
        raise RagError(f"`labels` must have shape (batch, tgt_len) = {(b, t)}; got {tuple(labels.shape)}.")
    index = labels.clamp_min(0).unsqueeze(1).expand(b, k, t).unsqueeze(-1)
    return logits.gather(-1, index).squeeze(-1).float() - torch.logsumexp(logits.float(), dim=-1)


def sequence_log_likelihoods(target_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-document sequence log-likelihoods log p_θ(y | x, z) = Σ_t log p_θ(y_t | x, z, y_<t).

    The quantity REPLUG's LM-supervised retrieval and RAG-Sequence "thorough" decoding need.

    Args:
        target_logprobs: ``(batch, n_docs, tgt_len)``.
        mask: ``(batch, tgt_len)`` bool, True where scored (None: every position).

    Returns:
        ``(batch, n_docs)``.
    """
    _check_dims("target_logprobs", target_logprobs, 3, "(batch, n_docs, tgt_len)")
    lp = _promote(target_logprobs)
    if mask is not None:
        _check_mask(mask, lp.shape[0], lp.shape[2])
        # `where`, not multiply: a masked -inf must not turn into nan.
        lp = torch.where(mask.unsqueeze(1), lp, lp.new_zeros(()))
    return lp.sum(-1)


def rag_sequence_log_likelihood(target_logprobs: Tensor, doc_log_prior: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Eq. 1 (RAG-Sequence): log Σ_z p_η(z|x) Π_t p_θ(y_t | x, z, y_<t).

    Args:
        target_logprobs: ``(batch, n_docs, tgt_len)`` gathered target log-probabilities.
        doc_log_prior: ``(batch, n_docs)`` log p_η(z|x).
        mask: ``(batch, tgt_len)`` bool, True where scored (None: every position).

    Returns:
        ``(batch,)`` log p(y|x).
    """
    _check_dims("target_logprobs", target_logprobs, 3, "(batch, n_docs, tgt_len)")
    _check_prior(target_logprobs, doc_log_prior, "target_logprobs")
    per_doc = sequence_log_likelihoods(target_logprobs, mask)
    return torch.logsumexp(per_doc + _promote(doc_log_prior), dim=1)


def rag_token_log_likelihood(target_logprobs: Tensor, doc_log_prior: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Eq. 2 (RAG-Token): Σ_t log Σ_z p_η(z|x) p_θ(y_t | x, z, y_<t).

    Args:
        target_logprobs: ``(batch, n_docs, tgt_len)`` gathered target log-probabilities.
        doc_log_prior: ``(batch, n_docs)`` log p_η(z|x).
        mask: ``(batch, tgt_len)`` bool, True where scored (None: every position).

    Returns:
        ``(batch,)`` log p(y|x).
    """
    return token_marginal_target_logprobs(target_logprobs, doc_log_prior, mask=mask).sum(-1)


def token_marginal_target_logprobs(target_logprobs: Tensor, doc_log_prior: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Per-token mixture of Eq. 2 at the target tokens: log Σ_z p_η(z|x) p_θ(y_t | x, z, y_<t).

    REPLUG's ensemble of one text token (Shi et al. 2023, §3.2: p(y|x, D') = Σ_d λ(d, x) p(y | d ∘ x)),
    computed in probability space (``logsumexp`` of log-prior + log-prob), not by averaging logits.

    Args:
        target_logprobs: ``(batch, n_docs, tgt_len)`` gathered target log-probabilities.
        doc_log_prior: ``(batch, n_docs)`` log p_η(z|x) (REPLUG: log λ).
        mask: ``(batch, tgt_len)`` bool, True where scored (None: every position).

    Returns:
        ``(batch, tgt_len)`` log p(y_t | x, y_<t); 0 where `mask` is False.
    """
    _check_dims("target_logprobs", target_logprobs, 3, "(batch, n_docs, tgt_len)")
    _check_prior(target_logprobs, doc_log_prior, "target_logprobs")
    lp = _promote(target_logprobs)
    if mask is not None:
        _check_mask(mask, lp.shape[0], lp.shape[2])
        # Mask before the logsumexp too: a padded position whose log-probs are all -inf
        # would otherwise give a nan gradient even though it is excluded.
        lp = torch.where(mask.unsqueeze(1), lp, lp.new_zeros(()))
    per_token = torch.logsumexp(lp + _promote(doc_log_prior).unsqueeze(-1), dim=1)  # (B, T)
    if mask is not None:
        per_token = torch.where(mask, per_token, per_token.new_zeros(()))
    return per_token


def token_marginal_logprobs(token_logprobs: Tensor, doc_log_prior: Tensor) -> Tensor:
    """RAG-Token's next-token distribution: log Σ_z p_η(z|x) p_θ(· | x, z, y_<t) (inner sum of Eq. 2).

    Used for the RAG-Token loss with label smoothing and, one step at a time, by decoding.

    Args:
        token_logprobs: ``(batch, n_docs, ..., vocab)``, e.g. ``(B, K, T, V)`` or one
            decoding step ``(B, K, V)``.
        doc_log_prior: ``(batch, n_docs)``.

    Returns:
        ``token_logprobs`` without the document axis: ``(B, T, V)`` or ``(B, V)``;
        normalised over the vocabulary.
    """
    if token_logprobs.dim() < 3:
        raise RagError(f"`token_logprobs` must have shape (batch, n_docs, ..., vocab); got {tuple(token_logprobs.shape)}.")
    _check_prior(token_logprobs, doc_log_prior, "token_logprobs")
    prior = _promote(doc_log_prior).reshape(*doc_log_prior.shape, *([1] * (token_logprobs.dim() - 2)))
    return torch.logsumexp(_promote(token_logprobs) + prior, dim=1)


# ----------------------------------------------------------------------------- losses


def rag_sequence_nll(
    token_logprobs: Tensor,
    target: Tensor,
    doc_log_prior: Tensor,
    *,
    mask: Tensor | None = None,
    pad_token_id: int | None = None,
    ignore_index: int | None = -100,
    epsilon: float = 0.0,
    reduce: Reduction = "mean",
    exclude_bos_score: bool = False,
    bos_token_id: int | None = None,
    hf_compat: bool = False,
) -> Tensor:
    """RAG-Sequence loss: −log p(y|x) of Eq. 1, optionally label-smoothed.

    Args:
        token_logprobs: ``(batch, n_docs, tgt_len, vocab)`` per-document log-probabilities,
            position t predicting ``target[:, t]``.
        target: ``(batch, tgt_len)`` target ids.
        doc_log_prior: ``(batch, n_docs)`` log p_η(z|x), differentiable w.r.t. the retriever.
        mask: ``(batch, tgt_len)`` bool, True where scored; default: ``target_mask(target,
            pad_token_id=..., ignore_index=...)``.
        pad_token_id, ignore_index: target ids that are not scored (when `mask` is None).
        epsilon: label smoothing ε in [0, 1).
        reduce: ``"mean"`` / ``"sum"`` over the batch, or ``"none"`` for ``(batch,)``.
        exclude_bos_score: do not score a first target token equal to `bos_token_id`
            (a no-op when `bos_token_id` is None, e.g. T5).
        bos_token_id: the generator's BOS id.
        hf_compat: reproduce ``transformers.RagSequenceForGeneration.get_nll`` exactly,
            defects included (see the module docstring).

    Returns:
        scalar, or ``(batch,)`` for ``reduce="none"``; float32 for half-precision input.
    """
    _check_epsilon(epsilon)
    lp_all = _promote(token_logprobs)
    target_lp = gather_target_logprobs(lp_all, target)  # (B, K, T)
    _check_prior(target_lp, doc_log_prior, "token_logprobs")
    prior = _promote(doc_log_prior)
    scored = _scored_mask(target, mask, pad_token_id, ignore_index)  # (B, T)
    b, _, t = target_lp.shape
    vocab = lp_all.shape[-1]
    positions = torch.arange(t, device=target.device)

    if hf_compat:
        # Prior added to the scores of target position 1, then padding zeroed: it survives
        # only in rows whose position 1 exists and is scored.
        prior_on = scored[:, 1] if t > 1 else torch.zeros(b, dtype=torch.bool, device=target.device)
        prior_ll = torch.where(prior_on.unsqueeze(1), prior, prior.new_zeros(()))
        ll_mask, smooth_mask = scored, scored
        if exclude_bos_score and bos_token_id is not None and t > 0 and bool(_bos_rows(target, bos_token_id).all()):
            ll_mask = scored & (positions > 0)  # dropped from the likelihood only
        prior_smooth = prior_ll
    else:
        ll_mask = scored
        if exclude_bos_score:
            ll_mask = scored & ~((positions == 0).unsqueeze(0) & _bos_rows(target, bos_token_id).unsqueeze(1))
        smooth_mask = ll_mask
        prior_ll = prior_smooth = prior

    ll = torch.logsumexp(sequence_log_likelihoods(target_lp, ll_mask) + prior_ll, dim=1)  # (B,)
    loss = -ll
    if epsilon > 0:
        vocab_sums = lp_all.sum(-1)  # (B, K, T): Σ_v log p_θ(v | x, z, y_<t)
        smooth = torch.logsumexp(sequence_log_likelihoods(vocab_sums, smooth_mask) + vocab * prior_smooth, dim=1)
        loss = (1.0 - epsilon) * loss - (epsilon / vocab) * smooth
    return _reduce(loss, reduce)


def rag_token_nll(
    token_logprobs: Tensor,
    target: Tensor,
    doc_log_prior: Tensor,
    *,
    mask: Tensor | None = None,
    pad_token_id: int | None = None,
    ignore_index: int | None = -100,
    epsilon: float = 0.0,
    reduce: Reduction = "mean",
    exclude_bos_score: bool = False,
    bos_token_id: int | None = None,
    hf_compat: bool = False,
) -> Tensor:
    """RAG-Token loss: −log p(y|x) of Eq. 2, optionally label-smoothed.

    Without smoothing only the gathered target log-probabilities are marginalized
    (no ``(B, K, T, V)`` temporary); smoothing needs the full marginal distribution.

    Args: as :func:`rag_sequence_nll`. With ``hf_compat=True`` (reproducing
        ``transformers.RagTokenForGeneration.get_nll``) `exclude_bos_score` is ignored,
        as transformers' RAG-Token ignores it.

    Returns:
        scalar, or ``(batch,)`` for ``reduce="none"``.
    """
    _check_epsilon(epsilon)
    target_lp = gather_target_logprobs(token_logprobs, target)
    _check_prior(target_lp, doc_log_prior, "token_logprobs")
    scored = _scored_mask(target, mask, pad_token_id, ignore_index)
    if exclude_bos_score and not hf_compat:
        first = torch.arange(target.shape[1], device=target.device) == 0
        scored = scored & ~(first.unsqueeze(0) & _bos_rows(target, bos_token_id).unsqueeze(1))

    if epsilon == 0:
        return _reduce(-rag_token_log_likelihood(target_lp, doc_log_prior, mask=scored), reduce)

    marginal = token_marginal_logprobs(token_logprobs, doc_log_prior)  # (B, T, V)
    vocab = marginal.shape[-1]
    ll = marginal.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    zero = marginal.new_zeros(())
    ll = torch.where(scored, ll, zero).sum(-1)
    smooth = torch.where(scored, marginal.sum(-1), zero).sum(-1)
    loss = -(1.0 - epsilon) * ll - (epsilon / vocab) * smooth
    return _reduce(loss, reduce)


def rag_nll_from_logits(
    logits: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    doc_scores: Tensor,
    *,
    marginalization: Literal["sequence", "token"],
    label_smoothing: float = 0.0,
    reduce: Reduction = "mean",
    exclude_bos_score: bool = False,
    bos_token_id: int | None = None,
    pad_token_id: int | None = None,
    hf_compat: bool = False,
    temperature: float = 1.0,
    doc_mask: Tensor | None = None,
) -> Tensor:
    """The RAG loss −log p(y|x) (Eq. 1 or Eq. 2) from generator logits and retrieval scores.

    Without label smoothing (and outside `hf_compat`) only the target tokens' log-probabilities are
    computed (:func:`target_logprobs_from_logits`) instead of a ``(B, K, T, V)`` log-softmax; smoothing
    and `hf_compat` take the full distribution through :func:`rag_sequence_nll` / :func:`rag_token_nll`.

    Args:
        logits: ``(batch, n_docs, tgt_len, vocab)`` generator logits, position t predicting ``labels[:, t]``.
        labels: ``(batch, tgt_len)`` target ids; label_mask: ``(batch, tgt_len)``, True on real tokens.
        doc_scores: ``(batch, n_docs)`` retrieval logits (prior: :func:`doc_log_prior` with `temperature`, `doc_mask`).
        marginalization: ``"sequence"`` (Eq. 1) or ``"token"`` (Eq. 2).
        label_smoothing, reduce, exclude_bos_score, bos_token_id, hf_compat: as :func:`rag_sequence_nll`
            (under `hf_compat` transformers masks ``target == pad_token_id``, which for right-padded
            targets is `label_mask`).

    Returns:
        scalar, or ``(batch,)`` for ``reduce="none"``.
    """
    if marginalization not in ("sequence", "token"):
        raise ConfigError(f"marginalization={marginalization!r}; choose 'sequence' or 'token'.")
    prior = doc_log_prior(doc_scores, temperature=temperature, doc_mask=doc_mask)  # (B, K) log p(z|x)
    if label_smoothing == 0.0 and not hf_compat:
        target_lp = target_logprobs_from_logits(logits, labels)  # (B, K, T)
        mask = label_mask.bool()
        if exclude_bos_score and bos_token_id is not None:
            # per row, as rag_sequence_nll's default exclude_bos_score
            mask = mask.clone()
            mask[:, 0] &= labels[:, 0].ne(bos_token_id)
        ll_fn = rag_sequence_log_likelihood if marginalization == "sequence" else rag_token_log_likelihood
        return _reduce(-ll_fn(target_lp, prior, mask=mask), reduce)  # (B,) before reduction

    nll_fn = rag_sequence_nll if marginalization == "sequence" else rag_token_nll
    return nll_fn(
        torch.log_softmax(logits.float(), dim=-1), labels, prior,
        mask=None if hf_compat else label_mask.bool(),
        pad_token_id=pad_token_id,
        epsilon=label_smoothing,
        reduce=reduce,
        exclude_bos_score=exclude_bos_score,
        bos_token_id=bos_token_id,
        hf_compat=hf_compat,
    )


# ----------------------------------------------------------------------------- target conventions


def hf_shift_targets(labels: Tensor, pad_token_id: int) -> Tensor:
    """transformers' RAG convention: the decoder reads ``labels`` and predicts ``labels[:, 1:]``.

    Returns the aligned target ``(batch, tgt_len)``: ``labels`` shifted left with
    `pad_token_id` appended. ``labels[:, 0]`` (the decoder start token) is never scored.
    Use with ``hf_compat=True`` and ``decoder_input_ids = labels``.
    """
    _check_dims("labels", labels, 2, "(batch, tgt_len)")
    pad = labels.new_full((labels.shape[0], 1), pad_token_id)
    return torch.cat([labels[:, 1:], pad], dim=1)


def shift_right(labels: Tensor, decoder_start_token_id: int, pad_token_id: int) -> Tensor:
    """The default convention: decoder inputs for ``target = labels`` (every label token is scored).

    ``decoder_start_token_id`` followed by ``labels[:, :-1]``; ``ignore_index`` (negative)
    entries become `pad_token_id`. Same as BART's/T5's own shift for ``labels=``.

    Returns:
        ``(batch, tgt_len)`` decoder input ids.
    """
    _check_dims("labels", labels, 2, "(batch, tgt_len)")
    if labels.shape[1] == 0:
        return labels.clone()
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted < 0, pad_token_id)


def hf_label_convention(labels: Tensor, label_mask: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' RAG convention for ``labels`` as its docs and fine-tuning script give them for BART
    (``tokenizer(text_target=answer).input_ids`` = ``<s> … </s>``): the labels themselves are the decoder
    input, and position t is scored against ``labels[:, t + 1]`` (a pad is appended at the end), so the
    first label (``<s>``) is fed, never scored. ``RagSequenceForGeneration`` / ``RagTokenForGeneration``::

        decoder_input_ids = labels;  target = cat(labels[:, 1:], pad)

    Args:
        labels: ``(batch, tgt_len)`` tokenized targets; label_mask: ``(batch, tgt_len)`` True on real tokens.

    Returns:
        ``(decoder_input_ids, target, target_mask)``, each ``(batch, tgt_len)``.
    """
    _check_dims("labels", labels, 2, "(batch, tgt_len)")
    pad = labels.new_full((labels.shape[0], 1), pad_token_id)
    target = torch.cat([labels[:, 1:], pad], dim=1)
    mask = torch.cat([label_mask[:, 1:], torch.zeros_like(label_mask[:, :1])], dim=1)
    return labels.masked_fill(labels < 0, pad_token_id), target, mask
