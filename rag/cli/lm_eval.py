"""`rag lm-eval`: perplexity of texts under a causal LM, with In-Context RALM retrieval (Ram et al. 2023) or without."""

from __future__ import annotations

import sys

from rag.cli.index import check_positive
from rag.cli.options import add_retrieval_temperature, retrieval_temperature
from rag.eval.perplexity import evaluate_perplexity, read_eval_texts
from rag.generators.load import load_generator
from rag.models.ralm.model import CausalScorer, InContextRALM, RalmConfig, open_retriever
from rag.models.ralm.rerank import LMReranker, PredictiveReranker
from rag.models.replug.lm_scorer import CompletionsLMScorer, RemoteCausalScorer
from rag.utils.devices import check_device
from rag.utils.errors import ConfigError
from rag.utils.io import to_json

DEFAULT_LM = "smollm2"


def add_parser(sub) -> None:
    p = sub.add_parser("lm-eval", help="perplexity (token, word, bits per byte) of texts under a causal LM, with In-Context RALM",
                       description="Evaluate a causal LM's perplexity on texts, retrieving a document every --stride tokens "
                                   "with the last --query-length tokens as query (In-Context RALM).")
    p.add_argument("--model", default=DEFAULT_LM, help=f"causal LM directory or name (default: {DEFAULT_LM}, the demo LM)")
    p.add_argument("--kb", default=None, help="knowledge-base directory (needed unless --retrieval none)")
    p.add_argument("--data", required=True,
                   help=".jsonl (field 'text', optional 'id'/'title'), a plain text file, or a datasets directory")
    p.add_argument("--text-field", default="text", help="JSON / dataset field holding the text")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N texts")
    p.add_argument("--stride", type=int, default=4, help="retrieval stride s: tokens between retrievals (default 4; "
                                                         "--retrieval none scores plain sliding windows and ignores it)")
    p.add_argument("--query-length", type=int, default=32, help="retrieval query length ℓ in tokens (default 32)")
    p.add_argument("--window-step", type=int, default=None, metavar="N",
                   help="--retrieval none: tokens each sliding window scores (default: half of --max-length, so every token "
                        "sees at least half a window of context and the LM reads the text about twice)")
    p.add_argument("--retrieval", choices=["bm25", "dense", "none"], default="bm25")
    p.add_argument("--rerank", choices=["none", "zero-shot", "trained"], default="none",
                   help="choose among the top --rerank-k documents: the LM's zero-shot reranking (§6.1) or a trained "
                        "reranker (§6.2)")
    p.add_argument("--rerank-model", default=None,
                   help="zero-shot: a (smaller) causal LM, default the --model itself; trained: the reranker directory")
    p.add_argument("--rerank-k", type=int, default=16, help="documents to rerank (default 16)")
    p.add_argument("--rerank-tokens", type=int, default=16, help="zero-shot: prefix tokens s' the reranker predicts (default 16)")
    p.add_argument("--ensemble", type=int, default=None, metavar="K",
                   help="REPLUG (Shi et al. 2023): read each chunk after each of its top-K documents separately and mix the K "
                        "next-token distributions with weights softmax(scores / --retrieval-temperature)")
    add_retrieval_temperature(p, "REPLUG: temperature of the retrieval-score weights λ = softmax(scores / T) (default 1)")
    p.add_argument("--random-docs", action="store_true",
                   help="REPLUG control: K random passages with equal weights instead of the top-K")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-docs (an integer >= 0)")
    p.add_argument("--max-length", type=int, default=None, help="the LM's window in tokens (default: min(model positions, 1024))")
    p.add_argument("--doc-max-length", type=int, default=256, help="retrieved documents are cut to this many tokens")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8; raise it on a GPU)")
    p.add_argument("--no-exclude-own", dest="exclude_own", action="store_false",
                   help="allow retrieving passages of the evaluated text's own document (leakage guard off)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--lm-endpoint", default=None, metavar="URL",
                   help="score with a black-box LM behind an OpenAI-compatible API root (e.g. http://127.0.0.1:8000/v1 of "
                        "`rag serve --model M`, or vLLM) instead of loading --model's weights; --model then names the LM's "
                        "tokenizer (and window), which the endpoint's LM must share")
    p.add_argument("--lm-endpoint-model", default=None, metavar="NAME", help="the model id the endpoint serves (GET /v1/models)")
    p.add_argument("--lm-api-key-env", default="RAG_LM_API_KEY", metavar="VAR",
                   help="environment variable holding the endpoint's API key, sent as a Bearer token (default: RAG_LM_API_KEY)")
    p.add_argument("--json", action="store_true", help="print one JSON object with perplexity, word_perplexity, bits_per_byte")
    p.set_defaults(func=cmd_lm_eval)


def cmd_lm_eval(args) -> int:
    import torch

    # Every option is checked before the texts, the knowledge base and the LM are read.
    check_positive(args, "limit", "stride", "query_length", "window_step", "rerank_k", "rerank_tokens", "ensemble", "batch_size",
                   "doc_max_length", "max_length")
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: must be an integer >= 0")
    check_device(args.device)
    if args.rerank != "none" and args.retrieval == "none":
        raise ConfigError(f"--rerank {args.rerank} reranks retrieved documents; pass --retrieval bm25 or dense")
    if args.rerank == "trained" and not args.rerank_model:
        raise ConfigError("--rerank trained needs --rerank-model DIR (a reranker trained with `rag fit --config "
                          "lightning_configs/ralm_reranker_tiny.yaml`)")
    if args.ensemble is not None and (args.rerank != "none" or args.retrieval == "none"):
        raise ConfigError("--ensemble K (REPLUG) mixes the top-K retrieved documents: pass --retrieval bm25 or dense, "
                          "without --rerank")
    if args.lm_endpoint is not None and (args.rerank != "none" or not args.lm_endpoint_model):
        raise ConfigError("--lm-endpoint scores with a remote LM: give --lm-endpoint-model NAME, and no --rerank (it needs "
                          "local weights)")
    temperature = retrieval_temperature(args)
    cfg = RalmConfig(stride=args.stride, query_length=args.query_length, max_length=args.max_length,
                     doc_max_length=args.doc_max_length,
                     k=args.rerank_k, exclude_own=args.exclude_own, batch_size=args.batch_size, ensemble=args.ensemble,
                     retrieval_temperature=temperature, random_docs=args.random_docs, seed=args.seed,
                     window_step=args.window_step)
    cfg.check()
    texts = read_eval_texts(args.data, field=args.text_field, limit=args.limit)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    retriever = open_retriever(args.retrieval, args.kb)
    if args.lm_endpoint is not None:  # REPLUG's black-box setting: only the tokenizer is local
        import os

        lm = CompletionsLMScorer(args.lm_endpoint, args.lm_endpoint_model, api_key=os.environ.get(args.lm_api_key_env) or None,
                                 batch_size=args.batch_size)
        scorer = RemoteCausalScorer.from_pretrained(args.model, lm, max_length=args.max_length,
                                                    doc_max_length=args.doc_max_length,
                                                    batch_size=args.batch_size)
        ralm = InContextRALM(None, None, retriever, cfg, scorer=scorer)
        return _report(args, evaluate_perplexity(ralm, texts, progress=not args.json and sys.stderr.isatty() or args.verbose),
                       cfg, ralm)
    model, tok, _ = load_generator(args.model, kind="causal")
    reranker = None
    if args.rerank == "zero-shot":
        scorer = None
        if args.rerank_model:
            rm, rt, _ = load_generator(args.rerank_model, kind="causal")
            scorer = CausalScorer(rm.to(device), rt, max_length=args.max_length, doc_max_length=args.doc_max_length,
                                  batch_size=args.batch_size)
        reranker = LMReranker(scorer, rerank_tokens=args.rerank_tokens)
    elif args.rerank == "trained":
        reranker = PredictiveReranker.load(args.rerank_model).to(device)
    ralm = InContextRALM(model.to(device), tok, retriever, cfg, reranker)
    result = evaluate_perplexity(ralm, texts, progress=not args.json and sys.stderr.isatty() or args.verbose)
    return _report(args, result, cfg, ralm)


def _report(args, result, cfg, ralm) -> int:
    plain = args.retrieval == "none"  # plain sliding windows: no retrieval stride or query
    settings = {"model": str(args.model), "kb": args.kb, "retrieval": args.retrieval, "rerank": args.rerank,
                "rerank_model": args.rerank_model, "stride": None if plain else cfg.stride,
                "query_length": None if plain else cfg.query_length, "window_step": ralm.window_step if plain else None,
                "max_length": ralm.scorer.max_length, "doc_max_length": cfg.doc_max_length, "exclude_own": cfg.exclude_own,
                "ensemble": cfg.ensemble, "retrieval_temperature": cfg.retrieval_temperature, "random_docs": cfg.random_docs,
                "lm_endpoint": args.lm_endpoint}
    if args.json:
        print(to_json({**result.to_dict(), "settings": settings}))
    else:
        print(f"texts {result.texts}  tokens {result.tokens}  words {result.words}  bytes {result.bytes}  "
              f"retrieved chunks {result.retrieved_chunks}")
        print(f"perplexity {result.perplexity:.4f}  word perplexity {result.word_perplexity:.4f}  bits per byte "
              f"{result.bits_per_byte:.4f}")
    return 0
