"""The rerank stage's two options, ``--rerank K --reranker DIR`` (``rerank=`` / ``reranker=``), checked before anything
loads; importing this module loads no model library, so the CLI checks them at once."""

from __future__ import annotations

from typing import Any, Optional

from rag.utils.errors import ConfigError
from rag.utils.validate import check_positive_int

__all__ = ["check_stage_options"]


def check_stage_options(candidates: Optional[int], reranker: Any) -> bool:
    """Whether the stage is asked for (both given; False: neither), before anything loads.

    Raises:
        ConfigError: one given without the other, or K not a positive integer.
    """
    if candidates is None and reranker is None:
        return False
    if reranker is None:
        raise ConfigError(f"--rerank {candidates} (rerank=) needs the cross-encoder that rescores the candidates: "
                          "add --reranker DIR (reranker=DIR)")
    if candidates is None:
        raise ConfigError("--reranker (reranker=) is used with --rerank K (rerank=K), the candidates it rescores: add --rerank K")
    check_positive_int(candidates, "rerank (--rerank, candidates rescored)", error=ConfigError)
    return True
