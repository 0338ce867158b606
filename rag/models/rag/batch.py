"""The batches a RagModel passes between its stages: ``RagInputs`` (tokenized contexts + doc scores) and ``RagOutput``.

:meth:`RagModel.prepare_inputs <rag.models.rag.model.RagModel.prepare_inputs>` builds a :class:`RagInputs`
(what the generator and decoding need); :meth:`RagModel.forward <rag.models.rag.model.RagModel.forward>`
returns a :class:`RagOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rag.knowledge.types import Retrieved

__all__ = ["RagInputs", "RagOutput"]


@dataclass
class RagInputs:
    """Everything the generator needs for a batch of B questions and K passages each.

    Row ``b * K + k`` of the context tensors is question b joined with its k-th passage.
    """

    context_input_ids: torch.Tensor
    """(B·K, L) generator input ids, padded to the longest context (L ≤ max_context_length)."""
    context_attention_mask: torch.Tensor
    """(B·K, L) 1 for real tokens."""
    doc_scores: torch.Tensor
    """(B, K) retrieval logits: q · doc_embeds (dense, differentiable) or BM25 scores."""
    retrieved: Retrieved
    """The retrieved passages (rows, stored scores, passages, doc_embeds, kb_version)."""
    n_truncated: int
    """How many of the B·K contexts were truncated to fit max_context_length."""
    context_strings: list[str] = field(default_factory=list)
    """The B·K context strings given to the generator tokenizer."""
    prefix_width: int = 0
    """Causal generators: the width of the question-independent prompt segment (header + passage) at the left of the
    context tensors (:func:`rag.generation.prompts.segmented_pad`); 0 for seq2seq contexts."""


@dataclass
class RagOutput:
    """Result of :meth:`RagModel.forward`."""

    loss: torch.Tensor
    """Scalar (reduce_loss) or (B,) per-example negative marginal log-likelihood."""
    doc_scores: torch.Tensor
    """(B, K) q · doc_embeds, recomputed in torch (differentiable into the query encoder)."""
    retrieved: Retrieved
    """The passages marginalised over."""
    n_truncated: int
    """Contexts truncated this call."""
