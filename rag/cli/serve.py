"""`rag serve`: an HTTP server for a RAG model with a hot-swappable knowledge base (rag.serve.app)."""

from __future__ import annotations

import logging
import os
import sys

from rag.cli.generate import add_rerank_options, rerank_options
from rag.pipeline.api import load
from rag.retrobust.backoff import resolve_nli
from rag.retrobust.nli import validate_threshold
from rag.serve.app import check_admin_token, check_bind, check_distinct_secrets, create_app, serve
from rag.serve.limits import ServeLimits
from rag.utils.devices import check_device
from rag.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a RAG model over HTTP (generate, retrieve, knowledge-base hot swap)",
        description="Serve POST /generate, POST /retrieve, GET /health, the OpenAI-compatible /v1/chat/completions, "
                    "/v1/completions and /v1/models, a web page at /, and the token-protected POST /admin/swap and "
                    "POST /admin/swap_back, which replace the knowledge base without a restart (requests keep flowing). "
                    "One process; on any address but 127.0.0.1 it needs an API key (or --no-auth); put a TLS proxy in "
                    "front of it when it is reachable from other machines.",
    )
    p.add_argument("--model", default="demo", help="checkpoint directory, transformers RAG directory, or 'demo' (default)")
    p.add_argument("--kb", default=None, help="knowledge base to start with (default: the one the checkpoint references)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--admin-token-env", default="RAG_ADMIN_TOKEN", metavar="VAR",
                   help="environment variable holding the admin Bearer token (default: RAG_ADMIN_TOKEN); unset = admin "
                        "endpoints disabled")
    p.add_argument("--api-key-env", default="RAG_API_KEY", metavar="VAR",
                   help="environment variable holding the API key every route but the page needs as 'Authorization: Bearer "
                        "KEY' (default: RAG_API_KEY; the OpenAI client sends its api_key so); unset = no key needed on "
                        "127.0.0.1, required on any other --host")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the API key itself (visible to other users of this machine in the process list: prefer --api-key-env)")
    p.add_argument("--no-auth", action="store_true",
                   help="serve a non-loopback --host without an API key (refused otherwise)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of the OpenAI-compatible routes (default: --model's last path component)")
    p.add_argument("--kb-root", action="append", default=[], metavar="DIR",
                   help="directory /admin/swap may open knowledge bases from (repeatable; none = swaps disabled)")
    p.add_argument("--max-concurrency", type=int, default=1, help="model calls running at once (default: 1)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted (default: 1 MiB)")
    d = ServeLimits()
    p.add_argument("--max-n-docs", type=int, default=d.max_n_docs, metavar="N",
                   help=f"most passages per question a request may ask for (n_docs, k; default: {d.max_n_docs}); more: 422")
    p.add_argument("--max-beams", type=int, default=d.max_beams, metavar="N",
                   help=f"most beams a request may ask for (default: {d.max_beams}); more: 422")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, metavar="N",
                   help=f"most new tokens per answer a request may ask for (default: {d.max_new_tokens}); more: 422")
    p.add_argument("--max-batch", type=int, default=d.max_batch, metavar="N",
                   help=f"most questions per request (default: {d.max_batch}); more: 422")
    p.add_argument("--max-step-rows", type=int, default=d.max_step_rows, metavar="N",
                   help=f"most rows one decoding step of a request may run, passages x beams (default: {d.max_step_rows}); "
                        "one step is one unit of model work, so this bounds how long a cheap request waits; more: 422")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, metavar="N",
                   help=f"most prompt tokens one scoring request (/v1/completions with max_tokens 0) may send, all its "
                        f"prompts together (default: {d.max_prompt_tokens}); more: 400")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, metavar="SECONDS",
                   help=f"answer 504 to a request not done after this long, queueing included, and stop its work "
                        f"(default: {d.request_timeout:g}; 0: no limit)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="answer 408 to a client that has not sent its whole request body after this long (default: 30; "
                        "0: no limit)")
    p.add_argument("--max-queue", type=int, default=d.max_queue, metavar="N",
                   help=f"requests that may wait for a model slot; beyond them: 503 with Retry-After (default: {d.max_queue})")
    p.add_argument("--nli", nargs="?", const=True, default=None, metavar="MODEL",
                   help="load this NLI model once for the RetRobust back-off, applied to every /generate request unless it "
                        "sends \"nli\": false; no MODEL = the default model ($RAG_CACHE/nli/minilm-snli, `rag nli prepare`)")
    p.add_argument("--nli-threshold", type=float, default=0.5,
                   help="default entailment probability of the back-off (a request may send nli_threshold; default 0.5)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: where the checkpoint loads)")
    add_rerank_options(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    stage = rerank_options(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be between 0 and 65535")
    limits = ServeLimits(max_n_docs=args.max_n_docs, max_beams=args.max_beams, max_new_tokens=args.max_new_tokens,
                         max_batch=args.max_batch, max_prompt_tokens=args.max_prompt_tokens,
                         max_step_rows=args.max_step_rows,
                         request_timeout=args.request_timeout or None, max_queue=args.max_queue)
    token = os.environ.get(args.admin_token_env) or None
    if token is None:
        print(f"rag serve: ${args.admin_token_env} is not set: admin endpoints (swap) are disabled", file=sys.stderr)
    elif len(token) < 16:
        raise ConfigError(f"${args.admin_token_env} is only {len(token)} characters; use a random token of at least 16 "
                          "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    from pathlib import Path

    # Checked before the model loads (minutes for a large one).
    for option, value in (("--max-concurrency", args.max_concurrency), ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise ConfigError(f"{option} {value}: must be a positive integer")
    for root in args.kb_root:
        if not Path(root).is_dir():
            raise ConfigError(f"--kb-root {root}: no such directory; give an existing directory that holds the knowledge bases "
                              "/admin/swap may open")
    check_device(args.device)
    check_admin_token(token, f"${args.admin_token_env}")
    api_key, source = (args.api_key, "--api-key") if args.api_key else (os.environ.get(args.api_key_env) or None,
                                                                        f"${args.api_key_env}")
    if api_key is not None:
        check_admin_token(api_key, source)
        if len(api_key) < 16:
            raise ConfigError(f"{source} is only {len(api_key)} characters; use a random key of at least 16 "
                              "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    check_distinct_secrets(token, api_key, f"${args.admin_token_env}", source)
    if api_key is not None and args.no_auth:
        raise ConfigError(f"--no-auth serves without an API key, but {source} sets one: drop one of them")
    warning = check_bind(args.host, api_key is not None, args.no_auth)  # decided before the model loads, nothing bound
    if warning:
        print(f"rag serve: {warning}", file=sys.stderr)
    name = args.served_model_name or Path(os.fspath(args.model).rstrip("/")).name or "rag"
    nli = None
    if args.nli is not None:
        validate_threshold(args.nli_threshold, "--nli-threshold")
        nli = resolve_nli(args.nli)
    pipe = load(args.model, knowledge_base=args.kb, device=args.device, **stage)
    app = create_app(pipe, kb_roots=args.kb_root, admin_token=token, max_concurrency=args.max_concurrency,
                     max_body_bytes=args.max_body_bytes, limits=limits, nli=nli, nli_threshold=args.nli_threshold,
                     api_key=api_key, model_name=name, body_timeout=args.body_timeout or None)
    print(f"rag serve: knowledge base {pipe.kb_version} ({pipe.knowledge_base.path}); model id {name!r}; "
          f"http://{args.host}:{args.port}/ (page), /v1 (OpenAI API)", file=sys.stderr)
    serve(app, host=args.host, port=args.port, log_level=args.log_level, allow_unauthenticated=args.no_auth)
    return 0
