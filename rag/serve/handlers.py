"""The error responses of `rag serve`: every failure is a 4xx with the reason (a 500 only for a bug, logged).

``{"detail": ...}`` on the server's own routes, OpenAI's error object on ``/v1/*``; messages to routes other than
``/admin/*`` name no server path (:meth:`~rag.serve.state.ServerState.message_for`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag.serve.openai_routes import openai_error
from rag.serve.responses import SafeJSONResponse, validation_errors
from rag.serve.state import ServerState
from rag.utils.errors import RagError

logger = logging.getLogger(__name__)

__all__ = ["error_response", "add_error_handlers"]


def error_response(path: str, detail, status: int, headers=None, param=None) -> SafeJSONResponse:
    """``{"detail": ...}``, or OpenAI's error object on the OpenAI-compatible routes (`path` under ``/v1/``)."""
    if path.startswith("/v1/"):
        return openai_error(detail if isinstance(detail, str) else "; ".join(
            f"{'.'.join(map(str, e['loc'][1:] or e['loc']))}: {e['msg']}" for e in detail), status, param=param, headers=headers)
    return SafeJSONResponse({"detail": detail}, status_code=status, headers=headers)


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Validation errors -> 422 (400 on ``/v1/``), HTTP errors as raised, a :class:`RagError` -> its ``status`` (400),
    anything else -> 500 naming only the exception's type."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = validation_errors(exc)
        loc = errors[0]["loc"][1:] if errors else []
        return error_response(request.url.path, errors, 422, param=".".join(map(str, loc)) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        return error_response(path, state.message_for(path, str(exc.detail)), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(RagError)
    async def _rag_error(request: Request, exc: RagError):
        path = request.url.path
        return error_response(path, state.message_for(path, str(exc)), getattr(exc, "status", 400),
                              getattr(exc, "headers", None), getattr(exc, "param", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug, not the client's fault; the worker lives on
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, f"internal error ({type(exc).__name__}); see the server log", 500)
