"""rag: end-to-end differentiable retrieval-augmented generation.

Public API (everything else is internal and may change):

- :class:`~rag.knowledge.passages.Passage`, :func:`~rag.knowledge.passages.load_corpus`
- :class:`~rag.knowledge.encoders.TextEncoder`
- :class:`~rag.knowledge.index.IndexSpec`
- :class:`~rag.knowledge.knowledge_base.KnowledgeBase`
- :class:`~rag.knowledge.retriever.DenseRetriever`, :class:`~rag.knowledge.bm25.BM25Retriever`,
  :class:`~rag.knowledge.types.Retrieved`, the :class:`~rag.knowledge.types.Retriever` and
  :class:`~rag.knowledge.types.Reranker` protocols
- :class:`~rag.models.rag.model.RagModel`, :class:`~rag.models.rag.model.RagModelConfig`
- :func:`~rag.pipeline.api.load`, :class:`~rag.pipeline.api.RagPipeline`, :class:`~rag.pipeline.api.Answer`
- :func:`~rag.eval.runner.evaluate` (`rag evaluate`)
- :func:`~rag.utils.quiet.quiet`: a block that shows what a `rag` command shows (no third-party bars or warnings)
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Passage": "rag.knowledge.passages",
    "load_corpus": "rag.knowledge.passages",
    "TextEncoder": "rag.knowledge.encoders",
    "IndexSpec": "rag.knowledge.index",
    "KnowledgeBase": "rag.knowledge.knowledge_base",
    "DenseRetriever": "rag.knowledge.retriever",
    "Retrieved": "rag.knowledge.types",
    "Retriever": "rag.knowledge.types",
    "Reranker": "rag.knowledge.types",
    "BM25Retriever": "rag.knowledge.bm25",
    "RagError": "rag.utils.errors",
    "RagModel": "rag.models.rag.model",
    "RagModelConfig": "rag.models.rag.model",
    "RagPipeline": "rag.pipeline.api",
    "Answer": "rag.pipeline.api",
    "load": "rag.pipeline.api",
    "evaluate": "rag.eval.runner",
    "quiet": "rag.utils.quiet",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    # Lazy imports keep `import rag` (and `rag --help`) fast: torch, faiss and
    # transformers load only when something that needs them is touched.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rag' has no attribute {name!r}")
