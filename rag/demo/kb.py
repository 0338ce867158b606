"""The demo knowledge base: the bundled Elements corpus encoded with the bundled MiniLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from rag.utils.io import cache_dir  # noqa: F401  (re-exported: rag.demo.kb.cache_dir)

DEFAULT_ENCODER = "minilm"


def demo_kb_path() -> Path:
    """Where the demo knowledge base lives: ``<cache>/demo_kb`` (checkpoints refer to it by the name "demo")."""
    return cache_dir() / "demo_kb"


def ensure_demo_kb(path: Optional[str | os.PathLike] = None, *, encoder: str = DEFAULT_ENCODER, index: str = "hnsw",
                   bm25: bool = True, show_progress: bool = True):
    """Open the demo knowledge base at `path` (default `<cache>/demo_kb`), building it first if absent.

    Building takes a few seconds on a CPU (137 passages). The result is an ordinary
    knowledge-base directory, verified on open like any other.
    """
    from rag.demo import load_demo_corpus
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    path = Path(path) if path is not None else demo_kb_path()
    if (path / "manifest.json").is_file():
        return KnowledgeBase.open(path)
    return KnowledgeBase.build(
        load_demo_corpus(), TextEncoder(encoder, role="context"), path, index=index, bm25=bm25,
        show_progress=show_progress, build_info={"corpus": "rag.demo (Elements database)"},
    )
