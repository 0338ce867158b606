"""Build a knowledge base on demand: ``ensure_knowledge_base(path, source, encoder)`` builds it once, then reuses it.

Training configs (``model.build_knowledge_base``) and examples use it so that a first run builds its
knowledge base from a corpus (or the bundled demo corpus) and later runs open the same directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from rag.demo import load_demo_corpus
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import MANIFEST
from rag.knowledge.passages import load_corpus
from rag.utils.errors import ConfigError, CorpusError

logger = logging.getLogger(__name__)

__all__ = ["ensure_knowledge_base"]


def ensure_knowledge_base(path: str | os.PathLike, source: str, encoder: str, *, query_encoder: Optional[str] = None,
                          index: str = "flat", words_per_passage: Optional[int] = 100, show_progress: bool = True,
                          bm25: bool = False, option: str = "model.build_knowledge_base.corpus") -> Path:
    """Build a knowledge base at `path` from `source` unless one is already there.

    `source`: ``"demo"`` (the bundled Elements corpus, one passage per entry) or a
    corpus path for :func:`rag.knowledge.passages.load_corpus`. `encoder` embeds the
    passages (a DPR *context* encoder, or a shared encoder such as ``minilm``);
    `query_encoder` is recorded in the manifest as the encoder queries should use; `bm25` also stores a BM25 index
    (BM25 and hybrid retrieval need one). A corpus that cannot be read (missing, empty) is a :class:`CorpusError` whose
    one line starts with `option`, the setting that named it.
    Safe against a concurrent build of the same path (the first one wins).
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"{path} exists but is not a knowledge base (no {MANIFEST}); remove it or choose another path")
    if source == "demo":
        passages = load_demo_corpus()
    else:
        try:
            passages = load_corpus(source, words_per_passage=words_per_passage, show_progress=show_progress)
        except CorpusError as e:
            raise CorpusError(f"{option} {source}: {e}") from None
    logger.info("building knowledge base %s from %s (%d passages) with %s", path, source, len(passages), encoder)
    enc = TextEncoder(encoder, role="context")
    try:
        KnowledgeBase.build(passages, enc, path, index=index, query_encoder=query_encoder, show_progress=show_progress,
                            overwrite=path.exists(), build_info={"corpus": source}, bm25=bm25)
    except FileExistsError:
        if not (path / MANIFEST).is_file():
            raise
    return path
