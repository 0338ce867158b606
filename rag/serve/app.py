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
    POST /admin/swap       {"path", "allow_encoder_change"?, "allow_metric_change"?}          (Bearer token; always verified fully)
    POST /admin/swap_back  {}                                                                      (Bearer token)
    POST /v1/chat/completions, POST /v1/completions, GET /v1/models   OpenAI-compatible (rag.serve.openai_routes)
    GET  /                 a web page: ask, see passages, posteriors, the RAG-Token heatmap; swap (rag.serve.page)

With an API key (``api_key``; ``rag serve`` requires one on a non-loopback address unless ``--no-auth``), every route
but the page needs ``Authorization: Bearer <key>`` (401 otherwise; compared in constant time).

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
import functools
import hmac
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Annotated, Iterator, Literal, Optional, Sequence, Union

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag.generation.options import GenerationOptions, option_specs
from rag.serve.limits import MAX_N_DOCS, MAX_QUESTIONS, ServeLimits
from rag.serve.openai_routes import OpenAIRoutes, openai_error
from rag.serve.openai_schema import option_request_field
from rag.serve.page import add_page_routes
from rag.serve.requests import RequestRunner, generate_one_version
from rag.serve.responses import SafeJSONResponse, redact_paths, validation_errors
from rag.serve.scheduler import DEFAULT_QUANTUM, ModelTurns
from rag.utils.errors import ConfigError, RagError

logger = logging.getLogger(__name__)

__all__ = [
    "create_app",
    "check_admin_token",
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

MAX_QUESTION_CHARS = 4096
"""Longest question accepted (characters; the tokenizer truncates further)."""
MAX_PATH_CHARS = 4096


def _unicode(s: str) -> str:
    """Refuse strings that are not valid Unicode text: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no tokenizer, file system or UTF-8 response can take."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate at character {e.start}; send valid Unicode text") from None
    return s


Question = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUESTION_CHARS, strip_whitespace=False),
                     AfterValidator(_unicode)]


# ---------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    # strict: "3" is not 3 and 1 is not true; unknown fields are an error, not silently ignored;
    # NaN and +-Infinity (which Python's JSON parser accepts) are not numbers a request may carry.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _GenerateFields(_Body):
    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    nli: Optional[bool] = None
    """The RetRobust NLI back-off (needs a server started with ``rag serve --nli``); default: on when it was."""
    nli_threshold: Optional[float] = Field(None, ge=0.0, le=1.0)
    """Entailment probability the back-off needs (default: the server's, 0.5 unless set)."""

    @model_validator(mode="after")
    def _consistent(self):
        try:  # the schema's own cross-field checks (num_return_sequences <= num_beams, ...)
            GenerationOptions(**self.options())
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    def options(self) -> dict:
        """The generation options the request set (the rest: the model's stored defaults)."""
        return self.model_dump(exclude={"questions", "nli", "nli_threshold"}, exclude_unset=True)


GenerateRequest = create_model(
    "GenerateRequest", __base__=_GenerateFields, __module__=__name__,
    __doc__="Body of ``POST /generate``: questions, the generation options of "
            ":class:`~rag.generation.options.GenerationOptions` (unset: the model's defaults), and the NLI back-off.",
    **{name: option_request_field(spec) for name, spec in option_specs().items()})


class RetrieveRequest(_Body):
    """Body of ``POST /retrieve``."""

    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    k: int = Field(5, ge=1, le=MAX_N_DOCS)


class SwapRequest(_Body):
    """Body of ``POST /admin/swap``: a knowledge-base directory inside a configured root."""

    path: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_unicode)]
    allow_encoder_change: bool = False
    allow_metric_change: bool = False
    verify: Literal["full"] = "full"
    """Always "full": a swapped-in knowledge base is served under its version id only after every file's
    SHA-256 matched (``"size"`` is refused with 422; size-only checks stay a local choice of
    :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` / ``KnowledgeBase.open``)."""


class SwapBackRequest(_Body):
    """Body of ``POST /admin/swap_back`` (may be omitted); re-opened knowledge bases are verified fully."""

    verify: Literal["full"] = "full"


# ---------------------------------------------------------------------------- paths


class PathRejected(RagError):
    """A knowledge-base path the server will not open; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


def _real_roots(roots: Sequence[Union[str, os.PathLike]]) -> list[Path]:
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


# ---------------------------------------------------------------------------- helpers


def _retrieve(pipeline, questions: list[str], k: int) -> dict:
    """Top-k passages with scores and priors, plus the one knowledge-base version they came from
    (:meth:`rag.pipeline.api.RagPipeline.retrieve`: one call reads the knowledge base once)."""
    hits = pipeline.retrieve(questions, k=k)
    versions = {h.kb_version for h in hits}
    if len(versions) != 1:  # cannot happen: one retrieval call reads one knowledge base
        raise RuntimeError(f"one retrieval call returned passages from several knowledge bases: {sorted(versions)}")
    return {"kb_version": hits[0].kb_version, "results": [[p.__dict__ for p in h.passages] for h in hits]}


class _BodyLimit:
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
        fairness_quantum: seconds of model time a request may use before a request that has used less goes first
            (:class:`~rag.serve.scheduler.ModelTurns`; ``math.inf``: first come, first served).
    """
    import anyio

    from rag.knowledge.hotswap import KnowledgeBaseSlot

    if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
    limits = ServeLimits() if limits is None else limits
    if not isinstance(limits, ServeLimits):
        raise ConfigError(f"limits must be a rag.serve.limits.ServeLimits, got {type(limits).__name__}")
    check_admin_token(admin_token)
    check_admin_token(api_key, "api_key")
    if nli is not None:
        from rag.retrobust.nli import NLIScorer, validate_threshold

        if not isinstance(nli, NLIScorer):
            raise ConfigError(f"nli must be a rag.retrobust.nli.NLIScorer (load it once with NLIScorer.from_pretrained), got "
                              f"{type(nli).__name__}")
        nli_threshold = validate_threshold(nli_threshold)
    roots = _real_roots(kb_roots)
    slot = slot if slot is not None else KnowledgeBaseSlot.for_model(pipeline)
    token = (admin_token or "").encode("ascii")
    key = (api_key or "").encode("ascii")
    runner = RequestRunner(limits, max_concurrency, turns=ModelTurns(max_concurrency, quantum=fairness_quantum))
    swap_limiter = anyio.CapacityLimiter(1)

    import rag

    app = FastAPI(title="rag", version=rag.__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=SafeJSONResponse)
    app.state.pipeline = pipeline
    app.state.slot = slot
    app.state.limits = limits
    app.state.api_key = bool(key)  # whether one is needed (the key itself stays in this closure)

    def server_paths() -> list[str]:
        """The knowledge bases' directories (which may be relative) and the roots, as given and resolved;
        :func:`_redact` also removes any other absolute path."""
        paths = [getattr(slot.current, "path", None)] + [h.get("path") for h in slot.history]
        out = [os.fspath(r) for r in roots]
        for p in paths:
            if isinstance(p, (str, os.PathLike)):
                out += [os.fspath(p), os.path.realpath(p), os.path.abspath(p)]
        return out

    def message_for(request: Request, message: str) -> str:
        return message if request.url.path.startswith("/admin/") else redact_paths(message, server_paths())

    def error(request: Request, detail, status: int, headers=None, param=None):
        """``{"detail": ...}``, or OpenAI's error object on the OpenAI-compatible routes."""
        if request.url.path.startswith("/v1/"):
            return openai_error(detail if isinstance(detail, str) else "; ".join(
                f"{'.'.join(map(str, e['loc'][1:] or e['loc']))}: {e['msg']}" for e in detail), status, param=param, headers=headers)
        return SafeJSONResponse({"detail": detail}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = validation_errors(exc)
        loc = errors[0]["loc"][1:] if errors else []
        return error(request, errors, 422, param=".".join(map(str, loc)) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error(request, message_for(request, str(exc.detail)), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(RagError)
    async def _rag_error(request: Request, exc: RagError):
        return error(request, message_for(request, str(exc)), getattr(exc, "status", 400), getattr(exc, "headers", None),
                     getattr(exc, "param", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug, not the client's fault; the worker lives on
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error(request, f"internal error ({type(exc).__name__}); see the server log", 500)

    def public(request: Request) -> None:
        """The API key of every route but the page (none configured: open)."""
        if not key:
            return
        scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"), key):
            raise HTTPException(401, "this server needs an API key: send 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})

    def nli_options(requested: Optional[bool], threshold: Optional[float]) -> dict:
        """The RetRobust back-off options of a request: on when asked, or by default when the server has an NLI model."""
        if not (requested if requested is not None else nli is not None):
            return {}
        if nli is None:
            raise RagError("this server has no NLI model for the back-off: start it with `rag serve --nli [MODEL]`, "
                           "or drop \"nli\" from the request")
        return {"nli": nli, "nli_threshold": nli_threshold if threshold is None else threshold}

    def admin(request: Request) -> None:
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

    guarded = [Depends(public)]

    @app.get("/health", dependencies=guarded)
    async def health() -> dict:
        kb = slot.current
        return {"status": "ok", "kb_version": kb.served_version, "kb_passages": len(kb), "swaps": slot.swap_count,
                "history": [h["version"] for h in slot.history], "reader": pipeline.kind, "model": model_name,
                "nli": nli is not None, "admin": bool(token), "requests": runner.counters.snapshot()}

    @app.post("/generate", dependencies=guarded)
    async def generate(req: GenerateRequest, request: Request) -> SafeJSONResponse:
        kw = req.options()  # unset: the model's stored defaults
        runner.check_generation(kw, len(req.questions))
        kw.update(nli_options(req.nli, req.nli_threshold))
        answers = await runner.run(request.receive,
                                   lambda work: generate_one_version(pipeline, req.questions, kw, work, runner.counters))
        # All answers come from one knowledge-base version (see generate_one_version).
        return SafeJSONResponse({"kb_version": answers[0].kb_version if answers else slot.version,
                                 "answers": [a.to_dict() for a in answers]})

    @app.post("/retrieve", dependencies=guarded)
    async def retrieve(req: RetrieveRequest, request: Request) -> SafeJSONResponse:
        runner.check_within("max_batch", len(req.questions), "len(questions)")
        runner.check_within("max_n_docs", req.k, "k")
        return SafeJSONResponse(await runner.run(request.receive, lambda work: _retrieve(pipeline, req.questions, req.k)))

    @app.post("/admin/swap", dependencies=[Depends(admin)])
    async def swap(req: SwapRequest) -> dict:
        path = resolve_kb_path(req.path, roots)
        res = await anyio.to_thread.run_sync(
            functools.partial(slot.swap, path, allow_encoder_change=req.allow_encoder_change,
                              allow_metric_change=req.allow_metric_change, verify="full"),
            limiter=swap_limiter,
        )
        logger.warning("knowledge base swapped: %s -> %s (%s)", res.old_version, res.new_version, res.path)
        return res.to_dict()

    @app.post("/admin/swap_back", dependencies=[Depends(admin)])
    async def swap_back(req: Optional[SwapBackRequest] = None) -> dict:
        res = await anyio.to_thread.run_sync(functools.partial(slot.swap_back, verify="full"), limiter=swap_limiter)
        logger.warning("knowledge base swapped back: %s -> %s", res.old_version, res.new_version)
        return res.to_dict()

    v1 = OpenAIRoutes(pipeline, runner, model_name=model_name, nli_options=nli_options)
    app.get("/v1/models", dependencies=guarded)(v1.models)
    app.get("/v1/models/{model_id}", dependencies=guarded)(v1.model)
    app.post("/v1/chat/completions", dependencies=guarded)(v1.chat)
    app.post("/v1/completions", dependencies=guarded)(v1.completions)
    add_page_routes(app)

    wrapped = _BodyLimit(app, max_body_bytes)
    wrapped.state = app.state  # convenient access for callers holding the wrapped app
    wrapped.fastapi = app
    return wrapped


def check_admin_token(token: Optional[str], source: str = "admin_token") -> None:
    """Refuse an admin token that no request could match: one with whitespace at either end (a
    whitespace-only token included: the header's token is stripped) or with characters other than
    printable ASCII (HTTP headers cannot carry them reliably). None or "" disables admin."""
    if not token:
        return
    if token != token.strip() or not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"{source}: the admin token must be printable ASCII without spaces (whitespace-only, padded or "
                          "non-ASCII tokens can never match a request); use e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")


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

    `freeze_gc`: move every object alive now (the libraries and the loaded model, ~10^5-10^6
    objects) out of the cyclic garbage collector's view (``gc.freeze``) before serving. A full
    collection over them holds the GIL for 50-300 ms on a CPU, which every in-flight request
    would feel — and a knowledge-base swap allocates enough to trigger one
    (benchmarks/swap_bench.py measures it). Knowledge bases are freed by reference counting,
    so swapped-out ones are still released.
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
