"""Reading a knowledge-base directory (layout: :mod:`rag.knowledge.knowledge_base`): its manifest, its files checked
against it, and its parts loaded (memory-mapped by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from rag.knowledge.bm25 import BM25Index
from rag.knowledge.index import read_index
from rag.knowledge.manifest import (
    BM25_DIR,
    EMBEDDINGS,
    INDEX,
    MANIFEST,
    PASSAGES,
    Manifest,
    check_arrow_files,
    check_finite,
    check_version,
    verify_kb_files,
)
from rag.utils.checksums import Verify
from rag.utils.errors import IntegrityError, KnowledgeBaseError
from rag.utils.files import read_json

__all__ = ["read_directory"]


def read_directory(path: Path, verify: Verify, *, mmap: bool = True, hash_nice: Optional[int] = None) -> tuple:
    """``(manifest, passages, embeddings, index, bm25)`` of the knowledge-base directory `path`, checked as
    :meth:`KnowledgeBase.open <rag.knowledge.knowledge_base.KnowledgeBase.open>` documents (`verify` "full", "size" or
    "none"); `bm25` is None when the directory has no BM25 index. A missing, damaged or inconsistent directory is a
    :class:`KnowledgeBaseError` / :class:`IntegrityError` naming the file and the fix."""
    import datasets  # heavy: only when a directory is opened

    if path.exists() and not path.is_dir():
        raise KnowledgeBaseError(f"{path} is a file, not a knowledge-base directory; give the directory `rag index "
                                 f"build --out` wrote")
    if not path.is_dir():
        raise KnowledgeBaseError(f"{path}: no such knowledge-base directory; build one with `rag index build --out {path} ...`")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise KnowledgeBaseError(f"{mpath}: missing; {path} is not a (complete) knowledge base — rebuild it with "
                                 f"`rag index build`")
    manifest = Manifest.from_dict(read_json(mpath, fix="the file is damaged — rebuild the knowledge base"), mpath)
    verify_kb_files(path, manifest, verify, hash_nice=hash_nice)
    check_arrow_files(path / PASSAGES)
    try:
        passages = datasets.load_from_disk(str(path / PASSAGES), keep_in_memory=not mmap)
    except Exception as e:  # datasets raises several types for damaged dirs
        raise IntegrityError(f"{path / PASSAGES}: cannot be read ({e}); rebuild the knowledge base") from e
    try:
        embeddings = np.load(path / EMBEDDINGS, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise IntegrityError(f"{path / EMBEDDINGS}: cannot be read ({e}); rebuild the knowledge base") from e
    index = read_index(path / INDEX, mmap=mmap)
    n = manifest.count
    if len(passages) != n or embeddings.shape != (n, manifest.dim) or index.ntotal != n or index.d < manifest.dim:
        raise IntegrityError(
            f"{path}: sizes disagree (manifest count={n}, dim={manifest.dim}; passages={len(passages)}, "
            f"embeddings={tuple(embeddings.shape)}, index ntotal={index.ntotal}); rebuild the knowledge base"
        )
    if verify != "none":
        check_finite(embeddings, path / EMBEDDINGS)
    if verify == "full":  # the id is recomputed from the verified content, never read from the manifest
        check_version(path, manifest, passages)
    bm25 = None
    if (path / BM25_DIR).is_dir():
        bm25 = BM25Index.load(path / BM25_DIR)
    return manifest, passages, embeddings, index, bm25
