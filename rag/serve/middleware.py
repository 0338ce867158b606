"""ASGI middleware of `rag serve` that acts before any route: the API key first, then the request body's size and
read deadline."""

from __future__ import annotations

import json
from typing import Optional

import anyio

from rag.serve.auth import api_key_matches, needs_api_key
from rag.serve.handlers import error_response
from rag.serve.state import ServerState

__all__ = ["BodyLimit", "ApiKeyGate"]


class ApiKeyGate:
    """ASGI middleware: with an API key configured, a request to a route that needs it (every route but the page's and
    the admin routes, which have their own token) and does not carry it is answered 401 before its body is read or
    validated."""

    def __init__(self, app, state: ServerState):
        self.app, self.server = app, state  # not .state: create_app sets that to the FastAPI state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.server.api_key and needs_api_key(scope.get("path", "")):
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not api_key_matches(self.server, given):
                response = error_response(scope.get("path", ""), "this server needs an API key: send 'Authorization: "
                                          "Bearer <key>'", 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: answer 413 to request bodies over `limit` bytes (declared or streamed), and 408 to a body not
    received in full within `timeout` seconds of the request's start (a stalled client holds no socket longer)."""

    def __init__(self, app, limit: int, timeout: Optional[float] = None):
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        path = scope.get("path", "")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._reject(send, path)
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body = message.get("body", b"")
                    size += len(body)
                    if size > self.limit:
                        return await self._reject(send, path)
                    chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self._reject(send, path, 408, f"request body not received within {self.timeout:g} s "
                                                        "(--body-timeout); send it at once")
        replay = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay_receive():
            nonlocal sent
            if not sent:
                sent = True
                return replay
            return await receive()

        return await self.app(scope, replay_receive, send)

    async def _reject(self, send, path: str = "", status: int = 413, message: Optional[str] = None):
        message = message or "request body too large (limit %d bytes, --max-body-bytes)" % self.limit
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
                          if path.startswith("/v1/") else {"detail": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 408:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
