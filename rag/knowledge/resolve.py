"""Which knowledge base a caller means: an open ``KnowledgeBase``, a knowledge-base directory, or a well-known name.

The one resolver of the package's ``knowledge_base=`` / ``--kb`` / ``model.knowledge_base`` values. The names a layer
knows are passed in (``names``): this layer knows none, :mod:`rag.demo.kb` adds ``"demo"`` (the bundled Elements
knowledge base, built on first use), and every caller above it resolves through
:func:`rag.demo.kb.resolve_knowledge_base`. A name wins over a directory of the same name (``./demo`` names the folder).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Union

from rag.knowledge.knowledge_base import KnowledgeBase, Verify
from rag.utils.errors import ConfigError

__all__ = ["KnowledgeBaseSpec", "open_knowledge_base"]

KnowledgeBaseSpec = Union[KnowledgeBase, str, os.PathLike]


def open_knowledge_base(spec: KnowledgeBaseSpec, *, verify: Verify = "full",
                        names: Optional[Mapping[str, Callable[[], KnowledgeBase]]] = None) -> KnowledgeBase:
    """`spec` itself if it is an open KnowledgeBase; ``names[spec]()`` if it is one of `names`; else the directory it
    names, opened with `verify` (``"full"``: every file hashed; ``"size"``/``"none"`` serve as ``<version>+unverified``).

    Raises:
        ConfigError: `spec` is neither a KnowledgeBase nor a path.
        KnowledgeBaseError / IntegrityError: the directory is not a (sound) knowledge base.
    """
    if isinstance(spec, KnowledgeBase):
        return spec
    if isinstance(spec, str) and names and spec in names:
        return names[spec]()
    if isinstance(spec, (str, os.PathLike)):
        return KnowledgeBase.open(spec, verify=verify)
    known = f", or one of {sorted(names)}" if names else ""
    raise ConfigError(f"knowledge_base must be a KnowledgeBase or a knowledge-base directory{known}; "
                      f"got {type(spec).__name__}")
