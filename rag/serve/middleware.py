"""ASGI middleware of `rag serve` that acts before any route: the request-body size limit."""

from __future__ import annotations

import json

__all__ = ["BodyLimit"]


class BodyLimit:
    """ASGI middleware: answer 413 to request bodies over `limit` bytes (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        path = scope.get("path", "")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._reject(send, path)
        chunks, size = [], 0
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
        replay = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay_receive():
            nonlocal sent
            if not sent:
                sent = True
                return replay
            return await receive()

        return await self.app(scope, replay_receive, send)

    async def _reject(self, send, path: str = ""):
        message = "request body too large (limit %d bytes, --max-body-bytes)" % self.limit
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
                          if path.startswith("/v1/") else {"detail": message}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
