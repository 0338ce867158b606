"""The admin routes of `rag serve`: ``POST /admin/swap`` and ``POST /admin/swap_back`` (the admin token's).

A swap opens and verifies the new knowledge base fully on its own thread (one swap at a time), then changes one
reference (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`); a failed swap answers 400 and the old version keeps
serving. Paths are confined to the configured roots (:func:`resolve_kb_path`).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import anyio
from fastapi import APIRouter, Depends

from rag.serve.auth import admin_check
from rag.serve.bodies import SwapBackRequest, SwapRequest
from rag.serve.state import ServerState
from rag.utils.errors import ConfigError, RagError

logger = logging.getLogger(__name__)

__all__ = ["PathRejected", "resolve_kb_path", "real_roots", "admin_router"]


class PathRejected(RagError):
    """A knowledge-base path the server will not open; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


def real_roots(roots: Sequence[Union[str, os.PathLike]]) -> list[Path]:
    """The real paths of the knowledge-base roots; ConfigError naming a root that is not a directory."""
    out = []
    for r in roots:
        real = Path(os.path.realpath(os.fspath(r)))
        if not real.is_dir():
            raise ConfigError(f"--kb-root {r}: not a directory; create it or give an existing knowledge-base root")
        out.append(real)
    return out


def resolve_kb_path(raw: str, roots: Sequence[Path]) -> Path:
    """The real path of `raw` if it lies inside one of the (already real) `roots`.

    Relative paths are taken relative to the first root. Symlinks and ``..`` are resolved
    *before* the containment check, so neither can leave a root.

    Raises:
        PathRejected: 403 no roots / outside every root, 400 unusable string, 404 no such directory.
    """
    if not roots:
        raise PathRejected("knowledge-base swaps are disabled: the server was started without --kb-root", 403)
    if "\x00" in raw:
        raise PathRejected("path contains a NUL byte", 400)
    p = Path(raw)
    if not p.is_absolute():
        p = roots[0] / p
    real = Path(os.path.realpath(p))
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise PathRejected(f"{raw!r} is outside the configured knowledge-base roots", 403)
    if not real.is_dir():
        raise PathRejected(f"{raw!r}: no such knowledge-base directory under the configured roots", 404)
    return real


def admin_router(state: ServerState) -> APIRouter:
    """``/admin/swap`` and ``/admin/swap_back`` behind the admin token."""
    router = APIRouter(dependencies=[Depends(admin_check(state))])
    slot = state.slot

    @router.post("/admin/swap")
    async def swap(req: SwapRequest) -> dict:
        path = resolve_kb_path(req.path, state.roots)
        res = await anyio.to_thread.run_sync(
            functools.partial(slot.swap, path, allow_encoder_change=req.allow_encoder_change,
                              allow_metric_change=req.allow_metric_change, verify="full"),
            limiter=state.swap_limiter,
        )
        logger.warning("knowledge base swapped: %s -> %s (%s)", res.old_version, res.new_version, res.path)
        return res.to_dict()

    @router.post("/admin/swap_back")
    async def swap_back(req: Optional[SwapBackRequest] = None) -> dict:
        res = await anyio.to_thread.run_sync(functools.partial(slot.swap_back, verify="full"), limiter=state.swap_limiter)
        logger.warning("knowledge base swapped back: %s -> %s", res.old_version, res.new_version)
        return res.to_dict()

    return router
