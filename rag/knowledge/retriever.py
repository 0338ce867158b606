"""Dense retrieval: a query encoder over a knowledge base's index (the ``Retriever`` protocol of :mod:`rag.knowledge.types`).

A retriever maps a batch of B queries to the top-k passages of a knowledge base.
Dense retrieval also returns the stored embeddings of the retrieved passages so
that RAG can recompute ``doc_scores = q · doc_embeds`` in torch: the only path by
which gradients reach the query encoder (Lewis et al. 2020, §2.2/§2.4).
"""

from __future__ import annotations

from typing import Optional

import torch

from rag.knowledge.encoders import TextEncoder, check_fingerprint
from rag.knowledge.types import Retrieved
from rag.utils.errors import KnowledgeBaseError

__all__ = ["DenseRetriever", "check_compatible", "default_query_encoder"]


def check_compatible(kb, query_dim: int, space: Optional[str], *, allow_encoder_change: bool = False) -> None:
    """Raise KnowledgeBaseError unless queries of `query_dim` in embedding `space` can search `kb`.

    `space` is the fingerprint of the document encoder a model was paired with (the
    knowledge base records its own); a different one means the index vectors live in
    another space, which only `allow_encoder_change=True` accepts (e.g. after a
    deliberate document-encoder update).
    """
    if kb.dim != query_dim:
        raise KnowledgeBaseError(
            f"{kb.path}: holds dim={kb.dim} vectors from {kb.encoder.get('name')}, but the query encoder outputs "
            f"dim={query_dim}; use a query encoder of the same dimension or rebuild the knowledge base with a matching encoder"
        )
    kb_space = kb.encoder.get("fingerprint")
    if space is not None and kb_space != space and not allow_encoder_change:
        raise KnowledgeBaseError(
            f"{kb.path}: was encoded by {kb.encoder.get('name')} (fingerprint {str(kb_space)[:12]}), not by the document "
            f"encoder this retriever was paired with (fingerprint {space[:12]}); pass allow_encoder_change=True "
            f"(--allow-encoder-change) if the change is deliberate"
        )


class DenseRetriever:
    """Query encoder + knowledge base: maximum inner product search over passage embeddings.

    The knowledge base is held by reference and read once per call, so replacing
    it (:meth:`set_knowledge_base`) never affects a call already running.
    """

    def __init__(self, knowledge_base, query_encoder, *, allow_encoder_change: bool = False):
        check_compatible(knowledge_base, query_encoder.dim, None)
        self.query_encoder = query_encoder
        self._kb = knowledge_base
        self.space = knowledge_base.encoder.get("fingerprint")
        self.allow_encoder_change = allow_encoder_change

    @property
    def knowledge_base(self):
        return self._kb

    @property
    def kb_version(self) -> str:
        """Version id of the knowledge base serving now."""
        return self._kb.served_version

    def set_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None) -> None:
        """Validate `kb` against the query encoder, then switch to it (one reference assignment)."""
        allow = self.allow_encoder_change if allow_encoder_change is None else allow_encoder_change
        check_compatible(kb, self.query_encoder.dim, self.space, allow_encoder_change=allow)
        self._kb = kb

    def search(self, query_embeds: torch.Tensor, k: int) -> Retrieved:
        """Retrieve for `(B, D)` query vectors already computed by the caller (e.g. with gradients)."""
        kb = self._kb
        scores, rows = kb.search(query_embeds, k)
        rows_t = torch.from_numpy(rows)
        return Retrieved(
            rows=rows_t,
            scores=torch.from_numpy(scores),
            passages=kb.get_passages(rows),
            doc_embeds=kb.get_embeddings(rows_t),
            kb_version=kb.served_version,
        )

    @torch.no_grad()
    def retrieve(self, queries, k: int, *, batch_size: int = 64, show_progress: bool = False) -> Retrieved:
        """Encode `queries` (B strings) and return their top-k passages."""
        q = self.query_encoder.encode(list(queries), batch_size=batch_size, show_progress=show_progress)
        return self.search(torch.from_numpy(q), k)


def default_query_encoder(kb, name: Optional[str] = None):
    """The encoder to embed queries for `kb`: `name` if given, else the manifest's query encoder,
    else its document encoder — loaded with the pooling/normalisation the knowledge base recorded.

    When the document encoder itself is used, its weights must still match the
    fingerprint recorded at build time (otherwise queries and passages would be
    embedded by different models).
    """
    doc = kb.encoder
    if name is None and kb.manifest.query_encoder:
        name = kb.manifest.query_encoder.get("name")
    same_as_doc = name is None or name == doc.get("name")
    enc = TextEncoder(
        name or doc["name"],
        pooling=doc.get("pooling", "auto"),
        normalize=doc.get("normalize"),
        max_length=doc.get("max_length", 256),
        role="question",
    )
    if same_as_doc and doc.get("fingerprint"):
        check_fingerprint(enc, doc["fingerprint"], lambda found: (
            f"{kb.path}: the encoder {doc['name']} now has different weights (fingerprint "
            f"{found[:12]}) than when this knowledge base was built ({doc['fingerprint'][:12]}); "
            f"rebuild the knowledge base, or name the intended query encoder explicitly"), error=KnowledgeBaseError)
    return enc
