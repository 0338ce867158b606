"""The one state object every router of `rag serve` shares: the model, its knowledge-base slot, limits, runner, secrets.

:func:`rag.serve.app.create_app` validates its arguments and builds one :class:`ServerState`; the routers
(:mod:`rag.serve.auth`, :mod:`rag.serve.model_routes`, :mod:`rag.serve.openai_routes`, :mod:`rag.serve.admin`,
:mod:`rag.serve.page`) and the error handlers (:mod:`rag.serve.handlers`) read it and hold no state of their own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import anyio

from rag.serve.limits import ServeLimits
from rag.serve.requests import RequestRunner
from rag.serve.responses import redact_paths
from rag.utils.errors import RagError

__all__ = ["ServerState"]


class ServerState:
    """What the routes share. `admin_token` / `api_key`: the secrets as bytes (``b""``: admin disabled / no key
    needed); `roots`: the real knowledge-base roots of swaps; `swap_limiter`: one swap at a time."""

    def __init__(self, *, pipeline, slot, roots: list[Path], limits: ServeLimits, runner: RequestRunner,
                 admin_token: bytes, api_key: bytes, nli, nli_threshold: float, model_name: str):
        self.pipeline, self.slot, self.roots, self.limits, self.runner = pipeline, slot, roots, limits, runner
        self.admin_token, self.api_key = admin_token, api_key
        self.nli, self.nli_threshold, self.model_name = nli, nli_threshold, model_name
        self.swap_limiter = anyio.CapacityLimiter(1)

    def server_paths(self) -> list[str]:
        """The knowledge bases' directories (which may be relative) and the roots, as given and resolved;
        :func:`~rag.serve.responses.redact_paths` also removes any other absolute path."""
        slot = self.slot
        paths = [getattr(slot.current, "path", None)] + [h.get("path") for h in slot.history]
        out = [os.fspath(r) for r in self.roots]
        for p in paths:
            if isinstance(p, (str, os.PathLike)):
                out += [os.fspath(p), os.path.realpath(p), os.path.abspath(p)]
        return out

    def message_for(self, path: str, message: str) -> str:
        """`message` as a client of route `path` may read it: server paths redacted except on the admin routes."""
        return message if path.startswith("/admin/") else redact_paths(message, self.server_paths())

    def nli_options(self, requested: Optional[bool], threshold: Optional[float]) -> dict:
        """The RetRobust back-off options of a request: on when asked, or by default when the server has an NLI model."""
        nli = self.nli
        if not (requested if requested is not None else nli is not None):
            return {}
        if nli is None:
            raise RagError("this server has no NLI model for the back-off: start it with `rag serve --nli [MODEL]`, "
                           "or drop \"nli\" from the request")
        return {"nli": nli, "nli_threshold": self.nli_threshold if threshold is None else threshold}
