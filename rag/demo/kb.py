"""The demo knowledge base: the bundled Elements corpus encoded with the bundled MiniLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from rag.demo import load_demo_corpus
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.resolve import KnowledgeBaseSpec, open_knowledge_base
from rag.utils.checksums import Verify
from rag.utils.errors import RagError
from rag.utils.files import read_json
from rag.utils.io import cache_dir  # noqa: F401  (re-exported: rag.demo.kb.cache_dir)

DEFAULT_ENCODER = "minilm"
DEMO_CORPUS = "rag.demo (Elements database)"
"""The ``build.corpus`` of the demo knowledge base's manifest: what marks a knowledge base as the package's own cache."""
DEMO_KB_BUILD = 4
"""Bumped when the demo knowledge base is built differently (2: BM25 keeps one-character tokens such as "8" and "K";
3: and decimal numbers whole, "39.948"; 4: and counts a passage's title 3 times, ``bm25.TITLE_WEIGHT``);
a cached one from another build is rebuilt in place: it is a cache this package made (``build.demo_kb_build``)."""


def demo_kb_path() -> Path:
    """Where the demo knowledge base lives: ``<cache>/demo_kb`` (checkpoints refer to it by the name "demo")."""
    return cache_dir() / "demo_kb"


def ensure_demo_kb(path: Optional[str | os.PathLike] = None, *, encoder: str = DEFAULT_ENCODER, index: str = "hnsw",
                   bm25: bool = True, show_progress: bool = True):
    """Open the demo knowledge base at `path` (default `<cache>/demo_kb`), building it first if absent.

    Building takes a few seconds on a CPU (137 passages). The result is an ordinary
    knowledge-base directory, verified on open like any other.
    """
    path = Path(path) if path is not None else demo_kb_path()
    overwrite = False
    if (path / "manifest.json").is_file():
        kb = KnowledgeBase.open(path)
        if not _outdated(kb.manifest.build):
            return kb
        overwrite = True  # an older build of the demo knowledge base: ours to replace (atomically)
    return KnowledgeBase.build(
        load_demo_corpus(), TextEncoder(encoder, role="context"), path, index=index, bm25=bm25,
        show_progress=show_progress, overwrite=overwrite,
        build_info={"corpus": DEMO_CORPUS, "demo_kb_build": DEMO_KB_BUILD},
    )


KNOWLEDGE_BASE_NAMES = {"demo": lambda: ensure_demo_kb(show_progress=False)}
"""The knowledge bases a caller (``--kb``, ``knowledge_base=``, a YAML's ``knowledge_base``, a checkpoint's
``rag_config.json``) may name instead of a directory: "demo" is :func:`ensure_demo_kb`'s (built on first use)."""


def resolve_knowledge_base(spec: KnowledgeBaseSpec, *, verify: Verify = "full"):
    """An open KnowledgeBase as is, ``"demo"`` (:data:`KNOWLEDGE_BASE_NAMES`), or a knowledge-base directory opened
    with `verify`: :func:`rag.knowledge.resolve.open_knowledge_base` with this layer's names."""
    return open_knowledge_base(spec, verify=verify, names=KNOWLEDGE_BASE_NAMES)


def _outdated(build: dict) -> bool:
    """A manifest's ``build`` entry is the package's own demo cache from another build (rebuilt in place)."""
    return build.get("corpus") == DEMO_CORPUS and build.get("demo_kb_build", 1) != DEMO_KB_BUILD


def demo_kb_needs_build(path: Optional[str | os.PathLike] = None) -> bool:
    """Whether :func:`ensure_demo_kb` will build (no knowledge base at `path`, or the package's cache of another build),
    read from the manifest alone (its files are verified when opened)."""
    path = Path(path) if path is not None else demo_kb_path()
    if not (path / "manifest.json").is_file():
        return True
    try:
        manifest = read_json(path / "manifest.json", fix="rebuild it")
    except RagError:
        return False  # damaged: opening it names the problem
    build = manifest.get("build") if isinstance(manifest, dict) else None
    return isinstance(build, dict) and _outdated(build)
