"""Responses of `rag serve` that always serialise, and error messages fit for unauthenticated clients."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rag.utils.io import json_safe  # the one JSON sanitiser (also the CLI's --json output)

__all__ = ["SafeJSONResponse", "json_safe", "redact_paths", "validation_errors", "ROUTE_NAMES"]

ROUTE_NAMES = frozenset({"/generate", "/retrieve", "/health", "/admin/swap", "/admin/swap_back", "/v1/models",
                         "/v1/chat/completions", "/v1/completions", "/static"})
"""The server's own routes: messages name them (``GET /v1/models``), and path redaction leaves them as they are."""


class SafeJSONResponse(JSONResponse):
    """A JSON response that cannot fail to serialise (see :func:`json_safe`): the server's
    default, so that no handler — error handlers included — can turn a 4xx into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


# An absolute POSIX path: a "/" at the start of a word followed by path characters.
_ABS_PATH = re.compile(r"(?<![\w.~/-])/(?:[^\s'\"`,;:()\[\]{}<>]+)")


def redact_paths(message: str, known: Sequence[str]) -> str:
    """`message` without server paths: each of `known` (e.g. the knowledge base's directory, as
    given and resolved; relative ones too) and any other absolute path becomes ``<server path>``; the server's route
    names (:data:`ROUTE_NAMES`) stay."""
    for k in sorted({k for k in known if k and len(k) > 1 and k not in ROUTE_NAMES}, key=len, reverse=True):
        message = message.replace(k, "<server path>")
    return _ABS_PATH.sub(lambda m: m.group(0) if m.group(0).rstrip(".") in ROUTE_NAMES else "<server path>", message)


def validation_errors(exc: RequestValidationError) -> list[dict]:
    """pydantic's errors without the offending input or its context (which may be anything: NaN,
    a lone surrogate, a megabyte of text): where, what, and the error type."""
    return [{"loc": [x if isinstance(x, int) else str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")),
             "type": str(e.get("type", ""))} for e in exc.errors()]
