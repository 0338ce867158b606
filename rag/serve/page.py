"""The web page of `rag serve` (``GET /``): plain HTML, JavaScript and CSS shipped as package data, no build step.

Ask a question; see the answer, its passages with prior p(z|x) and posterior p(z|x,y) as bars, the RAG-Token
per-token document posterior p(z|x,y_t) as a heatmap (Lewis et al. 2020, Figure 2) and the knowledge-base version;
with the admin token (typed into the page, kept in memory only) swap the knowledge base and back.

The page fetches only from its own server (``/generate``, ``/health``, ``/admin/...``) and inserts every text it shows
with ``textContent`` (never as HTML), so a passage holding ``<script>`` or ``<img onerror=…>`` stays text. Its
responses carry a Content-Security-Policy that allows scripts, styles and requests from this server only, no inline
script, no framing.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

__all__ = ["page_router", "PAGE_FILES", "CSP"]

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'")
"""The Content-Security-Policy of the page and its files."""

PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "style.css": "text/css; charset=utf-8"}
"""The files of ``rag/serve/static`` the server sends (nothing else under it is reachable)."""

_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def _read(name: str) -> bytes:
    return resources.files("rag.serve").joinpath("static", name).read_bytes()


def page_router() -> APIRouter:
    """``GET /`` (the page) and ``GET /static/{name}`` for the names of :data:`PAGE_FILES` (read once, here); no key
    needed: the page sends the API key typed into it with its requests."""
    router = APIRouter()
    files = {name: _read(name) for name in PAGE_FILES}

    def send(name: str) -> Response:
        return Response(files[name], media_type=PAGE_FILES[name], headers=_HEADERS)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return send("index.html")

    @router.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in files or name == "index.html":
            return Response(b"not found", status_code=404, media_type="text/plain", headers=_HEADERS)
        return send(name)

    return router
