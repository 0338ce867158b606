"""`rag serve` is split by concern: each route lives in its concern's router, over one shared state object, and
create_app only validates its arguments and mounts the routers (issue 45, item 6)."""

from __future__ import annotations

import ast
import inspect

import rag
from rag.serve import app as app_module
from rag.serve.app import create_app
from rag.serve.state import ServerState

ROUTES = {"/health": "rag.serve.model_routes", "/generate": "rag.serve.model_routes", "/retrieve": "rag.serve.model_routes",
          "/admin/swap": "rag.serve.admin", "/admin/swap_back": "rag.serve.admin",
          "/v1/models": "rag.serve.openai_routes", "/v1/models/{model_id}": "rag.serve.openai_routes",
          "/v1/chat/completions": "rag.serve.openai_routes", "/v1/completions": "rag.serve.openai_routes",
          "/": "rag.serve.page", "/static/{name}": "rag.serve.page"}


def _routes(routes):
    """The routes with an endpoint, looking into included routers (FastAPI may keep them as included-router nodes)."""
    for r in routes:
        if hasattr(r, "endpoint") and hasattr(r, "path"):
            yield r
        elif hasattr(r, "original_router"):
            yield from _routes(r.original_router.routes)


def test_each_route_lives_in_its_concerns_router(serve_layout):
    app = create_app(rag.load(serve_layout["model"]), kb_roots=[serve_layout["root"]])
    served = {r.path: r.endpoint.__module__ for r in _routes(app.fastapi.routes)}
    assert {p: m for p, m in served.items() if p in ROUTES} == ROUTES
    assert set(served) == set(ROUTES), sorted(set(served) ^ set(ROUTES))


def test_create_app_builds_one_state_and_mounts_routers():
    tree = ast.parse(inspect.getsource(app_module.create_app))
    fn = tree.body[0]
    nested = [n.name for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fn]
    assert nested == [], f"create_app defines routes or helpers inline: {nested}"
    assert "ServerState" in inspect.getsource(app_module.create_app)
    assert ServerState.__module__ == "rag.serve.state"
