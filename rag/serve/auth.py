"""Who may call what on `rag serve`: the API key of every route but the page, the admin token of ``/admin/*``.

Both secrets are compared in constant time (``hmac.compare_digest``). A missing or malformed ``Authorization`` header
is 401 (with ``WWW-Authenticate: Bearer``); a wrong admin token is 403; admin routes without a configured token are
disabled (403).
"""

from __future__ import annotations

import hmac
from typing import Callable, Optional

from fastapi import HTTPException, Request

from rag.serve.state import ServerState
from rag.utils.errors import ConfigError

__all__ = ["check_admin_token", "check_distinct_secrets", "api_key_check", "api_key_matches", "needs_api_key", "admin_check"]

PUBLIC_PREFIXES = ("/static/",)
"""Routes (besides ``/``) that need no API key: the page's files."""


def check_admin_token(token: Optional[str], source: str = "admin_token") -> None:
    """Refuse an admin token that no request could match: one with whitespace at either end (a
    whitespace-only token included: the header's token is stripped) or with characters other than
    printable ASCII (HTTP headers cannot carry them reliably). None or "" disables admin."""
    if not token:
        return
    if token != token.strip() or not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"{source}: the admin token must be printable ASCII without spaces (whitespace-only, padded or "
                          "non-ASCII tokens can never match a request); use e.g. `python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))'`")


def check_distinct_secrets(admin_token: Optional[str], api_key: Optional[str], admin_source: str = "admin_token",
                           key_source: str = "api_key") -> None:
    """Refuse one secret for both roles: every client holding the API key could then swap the knowledge base."""
    if admin_token and api_key and hmac.compare_digest(admin_token.encode("utf-8"), api_key.encode("utf-8")):
        raise ConfigError(f"{admin_source} and {key_source} are the same secret: every API client could use the admin "
                          "routes; give the admin token its own random value")


def needs_api_key(path: str) -> bool:
    """Whether route `path` needs the API key: all but the page (``/``, ``/static/*``) and ``/admin/*`` (its token)."""
    return not (path == "/" or path.startswith(PUBLIC_PREFIXES) or path.startswith("/admin/"))


def api_key_matches(state: ServerState, header: str) -> bool:
    """Whether the ``Authorization`` header value `header` carries the API key (none configured: always)."""
    key = state.api_key
    if not key:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), key)


def api_key_check(state: ServerState) -> Callable[[Request], None]:
    """The dependency of every route but the page: 401 unless the request carries the API key (none configured: open).
    :class:`~rag.serve.middleware.ApiKeyGate` checks the same before the body is read."""

    def public(request: Request) -> None:
        if not api_key_matches(state, request.headers.get("authorization") or ""):
            raise HTTPException(401, "this server needs an API key: send 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})

    return public


def admin_check(state: ServerState) -> Callable[[Request], None]:
    """The dependency of ``/admin/*``: 403 when admin is disabled or the token is wrong, 401 when it is missing."""

    def admin(request: Request) -> None:
        token = state.admin_token
        if not token:
            raise HTTPException(403, "admin endpoints are disabled: start the server with an admin token (--admin-token-env)")
        header = request.headers.get("authorization")
        if not header:
            raise HTTPException(401, "missing 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise HTTPException(401, "the Authorization header must be 'Bearer <token>'", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode("utf-8"), token):
            raise HTTPException(403, "invalid admin token")

    return admin
