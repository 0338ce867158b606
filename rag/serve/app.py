"""An HTTP server for a RAG model whose knowledge base can be hot-swapped while it serves.

Endpoints (JSON in, JSON out)::

    POST /generate         {"questions": [...], "n_docs"?, "num_beams"?, "marginalization"?, "decoding"?,
                            "max_new_tokens"?, "num_return_sequences"?, ...}             (a RAG model)
                           {"questions": [...], "stride"?, "query_length"?, "retrieval"?, ...}  (a causal LM)
                           {"questions": [...], "ensemble"?, "retrieval_temperature"?, ...}  (REPLUG; RAG: RAG-Token)
                           either with "nli"?, "nli_threshold"?: the RetRobust NLI back-off (server started with an NLI model)
                           -> {"kb_version", "answers": [Answer.to_dict(), ...]}
    POST /retrieve         {"questions": [...], "k"?} -> {"kb_version", "results": [[passage, ...], ...]}
    GET  /health           -> {"status": "ok", "kb_version", "kb_passages", "swaps", "history"}
    POST /admin/swap       {"path", "allow_encoder_change"?, "allow_metric_change"?}          (Bearer token; always verified
    fully) POST /admin/swap_back  {}                                                                      (Bearer token)
    POST /v1/chat/completions, POST /v1/completions, GET /v1/models   OpenAI-compatible (rag.serve.openai_routes)
    GET  /                 a web page: ask, see passages, posteriors, the RAG-Token heatmap; swap (rag.serve.page)

With an API key (``api_key``; ``rag serve`` requires one on a non-loopback address unless ``--no-auth``), every route
but the page needs ``Authorization: Bearer <key>`` (401 otherwise; compared in constant time).

Layout: :func:`create_app` validates its arguments into one :class:`~rag.serve.state.ServerState` and mounts a router
per concern over it: :mod:`rag.serve.auth` (API key, admin token), :mod:`rag.serve.model_routes` (health, generate,
retrieve), :mod:`rag.serve.openai_routes`, :mod:`rag.serve.admin` (swaps), :mod:`rag.serve.page`;
:mod:`rag.serve.handlers` turns every error into its response and :mod:`rag.serve.middleware` bounds bodies.

Design:

* **One model per process.** Model calls run in worker threads (``anyio.to_thread``) behind a
  capacity limiter (`max_concurrency`), so the event loop stays free: health checks, swaps and
  queued requests interleave with running model calls. Use one uvicorn worker: a swap changes the
  knowledge base of the model in *this* process.
* **Swaps never block requests.** ``/admin/swap`` opens and verifies the new knowledge base on its
  own thread and then changes one reference (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`);
  a request already running finishes on the version it started with and reports it in
  ``kb_version``. A failed swap answers 400 with the reason and the old version keeps serving.
* **Admin endpoints** need ``Authorization: Bearer <token>`` (401 when missing, 403 when wrong;
  compared in constant time). Without a configured token they are disabled (403).
* **Knowledge-base paths are confined** to the configured roots: the path (relative paths are
  taken relative to the first root) is resolved with symlinks and ``..`` before the check, so
  neither can escape (403). Existence is only reported for paths inside a root.
* **Bad requests get a 4xx with the reason, never a 500**: pydantic validation (types, ranges,
  unknown fields, non-finite numbers, strings that are not valid Unicode, malformed JSON) -> 422;
  a :class:`~rag.utils.errors.RagError` from the model (e.g. `k` larger than the knowledge base) -> 400;
  bodies over `max_body_bytes` -> 413. Every response body is serialisable (error echoes never
  carry the offending value), and messages to the unauthenticated endpoints name no server path.
* **Bounded requests** (:class:`~rag.serve.limits.ServeLimits`, run by :mod:`rag.serve.requests`): sizes over the limits
  -> 422 naming the limit; a request not done after ``request_timeout`` (queueing included) ->
  504; more than ``max_queue`` requests waiting for a model slot -> 503 with ``Retry-After``.
  Generation runs question by question on the model thread and stops at the next question once
  the client has disconnected or the time is up (a question already being decoded finishes
  first). The answers of one request still come from one knowledge-base version: if a swap lands
  between two of its questions, the request starts over on the new version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Iterator, Optional, Sequence, Union

from fastapi import FastAPI

import rag
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.retrobust.nli import NLIScorer, validate_threshold
from rag.serve.admin import PathRejected, admin_router, real_roots, resolve_kb_path
from rag.serve.auth import check_admin_token, check_distinct_secrets
from rag.serve.bodies import MAX_QUESTION_CHARS, GenerateRequest, RetrieveRequest, SwapRequest
from rag.serve.handlers import add_error_handlers
from rag.serve.limits import MAX_QUESTIONS, ServeLimits
from rag.serve.middleware import ApiKeyGate, BodyLimit
from rag.serve.model_routes import model_router
from rag.serve.openai_routes import openai_router
from rag.serve.page import page_router
from rag.serve.requests import RequestRunner
from rag.serve.responses import SafeJSONResponse
from rag.serve.scheduler import DEFAULT_QUANTUM, ModelTurns
from rag.serve.state import ServerState
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

logger = logging.getLogger(__name__)

__all__ = [
    "create_app",
    "check_admin_token",
    "check_distinct_secrets",
    "check_bind",
    "serve",
    "background_server",
    "resolve_kb_path",
    "PathRejected",
    "GenerateRequest",
    "RetrieveRequest",
    "SwapRequest",
    "ServeLimits",
    "MAX_QUESTIONS",
    "MAX_QUESTION_CHARS",
]


DEFAULT_BODY_TIMEOUT = 30.0
"""Seconds a client may take to send its request body (``rag serve --body-timeout``)."""

# ---------------------------------------------------------------------------- the app


def create_app(
    pipeline,
    *,
    kb_roots: Sequence[Union[str, os.PathLike]] = (),
    admin_token: Optional[str] = None,
    max_concurrency: int = 1,
    max_body_bytes: int = 1 << 20,
    limits: Optional[ServeLimits] = None,
    slot=None,
    nli=None,
    nli_threshold: float = 0.5,
    api_key: Optional[str] = None,
    model_name: str = "rag",
    fairness_quantum: float = DEFAULT_QUANTUM,
    body_timeout: Optional[float] = DEFAULT_BODY_TIMEOUT,
):
    """A FastAPI application serving `pipeline` (a :class:`rag.pipeline.api.RagPipeline`).

    Args:
        kb_roots: directories that ``/admin/swap`` may open knowledge bases from (none: swaps disabled).
        admin_token: the Bearer token of the admin endpoints (None or empty: admin disabled). A
            token that cannot be sent back in a header (whitespace at either end, or anything but
            printable ASCII) is refused.
        max_concurrency: model calls running at once, each on its own thread. The default 1 is
            the safe choice for models/tokenizers not audited for concurrent calls and costs little
            on CPU, where one call already uses every core; requests beyond it wait their turn
            without blocking the event loop (or swaps).
        max_body_bytes: larger request bodies are refused with 413.
        limits: per-request sizes, timeout and queue (:class:`~rag.serve.limits.ServeLimits`;
            default: its defaults).
        slot: the :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` to swap (default: one over
            the pipeline's model).
        nli: an :class:`~rag.retrobust.nli.NLIScorer` (loaded once, here) for the RetRobust back-off: requests get it unless
            they send ``"nli": false``; None: requests asking for it get 400. nli_threshold: its default threshold.
        api_key: the Bearer key every route but the page needs (None or empty: none needed; printable ASCII without
            spaces, as `admin_token`).
        model_name: the model id of the OpenAI-compatible routes (``GET /v1/models``; requests naming another get 404).
        body_timeout: seconds a client may take to send its request body (None: no limit); later: 408.
        fairness_quantum: seconds of model time a request may use before a request that has used less goes first
            (:class:`~rag.serve.scheduler.ModelTurns`; ``math.inf``: first come, first served).
    """
    if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
    limits = ServeLimits() if limits is None else limits
    if not isinstance(limits, ServeLimits):
        raise ConfigError(f"limits must be a rag.serve.limits.ServeLimits, got {type(limits).__name__}")
    check_admin_token(admin_token)
    check_admin_token(api_key, "api_key")
    check_distinct_secrets(admin_token, api_key)
    check_number(body_timeout, "body_timeout (rag serve --body-timeout, seconds)", above=0, allow_none=True, error=ConfigError)
    if nli is not None:
        if not isinstance(nli, NLIScorer):
            raise ConfigError(f"nli must be a rag.retrobust.nli.NLIScorer (load it once with NLIScorer.from_pretrained), got "
                              f"{type(nli).__name__}")
        nli_threshold = validate_threshold(nli_threshold)
    roots = real_roots(kb_roots)
    slot = slot if slot is not None else KnowledgeBaseSlot.for_model(pipeline)
    runner = RequestRunner(limits, max_concurrency, turns=ModelTurns(max_concurrency, quantum=fairness_quantum))
    state = ServerState(pipeline=pipeline, slot=slot, roots=roots, limits=limits, runner=runner,
                        admin_token=(admin_token or "").encode("ascii"), api_key=(api_key or "").encode("ascii"),
                        nli=nli, nli_threshold=nli_threshold, model_name=model_name)

    app = FastAPI(title="rag", version=rag.__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=SafeJSONResponse)
    app.state.pipeline = pipeline
    app.state.slot = slot
    app.state.limits = limits
    app.state.api_key = bool(state.api_key)  # whether one is needed (the key itself stays in the server state)
    add_error_handlers(app, state)
    app.include_router(model_router(state))
    app.include_router(admin_router(state))
    app.include_router(openai_router(state))
    app.include_router(page_router())

    wrapped = ApiKeyGate(BodyLimit(app, max_body_bytes, body_timeout), state)  # the key first, then the body
    wrapped.state = app.state  # convenient access for callers holding the wrapped app
    wrapped.fastapi = app
    return wrapped


# ---------------------------------------------------------------------------- running it


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: bool, no_auth: bool = False) -> Optional[str]:
    """What serving on `host` needs (issue #28): a loopback address needs nothing; any other address (``0.0.0.0``, a
    LAN address, a host name) needs an API key, unless `no_auth` says explicitly to serve without one. Returns the
    warning to print (None: nothing to say); raises ConfigError naming the fix when the bind is refused. Sends nothing."""
    if _is_loopback(host):
        return None
    if api_key:
        return f"serving on {host}: reachable from other machines (API key required); put TLS in front of it"
    if not no_auth:
        raise ConfigError(f"--host {host} is reachable from other machines, and the server has no API key: anyone reaching "
                          "the port could run the model and read the knowledge base. Set $RAG_API_KEY (or --api-key-env VAR) "
                          "to a random key of at least 16 characters, or pass --no-auth to serve without one")
    return (f"serving on {host} WITHOUT an API key (--no-auth): anyone who reaches the port can use /generate, /retrieve and "
            "/v1/*; put an authenticating TLS proxy in front of it")


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", freeze_gc: bool = True,
          allow_unauthenticated: bool = False) -> None:
    """Run `app` with uvicorn in this process (one worker; see module docstring) until interrupted.

    A non-loopback `host` needs an app with an API key, unless `allow_unauthenticated` (:func:`check_bind`; refused
    before anything is bound).

    `freeze_gc`: move every object alive now (the libraries and the loaded model) out of the
    cyclic garbage collector's view (``gc.freeze``) before serving: a full collection over them
    holds the GIL, which every in-flight request would feel, and a knowledge-base swap allocates
    enough to trigger one (docs/benchmarks.md, "Hot swap"). Knowledge bases are freed by
    reference counting, so swapped-out ones are still released.
    """
    import gc

    import uvicorn

    warning = check_bind(host, bool(getattr(app.state, "api_key", False)), allow_unauthenticated)
    if warning:
        logger.warning(warning)
    if freeze_gc:
        gc.collect()
        gc.freeze()
    uvicorn.run(app, host=host, port=port, workers=1, log_level=log_level, timeout_graceful_shutdown=30)


@contextlib.contextmanager
def background_server(app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                      startup_timeout: float = 30.0) -> Iterator[str]:
    """Run `app` on a background thread; yields its base URL (``port=0``: an ephemeral port).

    For tests and notebooks. The server stops (finishing in-flight requests) when the block exits.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rag-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server did not start on {host}:{bound_port}")
        time.sleep(0.01)
    try:
        yield f"http://{host if ':' not in host else f'[{host}]'}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
