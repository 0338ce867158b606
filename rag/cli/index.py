"""`rag index build | info | search`: build, inspect and query knowledge bases."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Iterator

from rag.errors import RagError


def add_parser(sub) -> None:
    p = sub.add_parser("index", help="build, inspect and query knowledge bases")
    isub = p.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    b = isub.add_parser("build", help="ingest a corpus, encode it and write a knowledge-base directory",
                        description="Ingest a corpus, split it into passages, encode them and write an immutable knowledge base.")
    b.add_argument("--corpus", required=True, nargs="+", help="JSONL/CSV/TSV file(s), DPR psgs_w100.tsv, text file(s)/folder(s), or a saved `datasets` dir")
    b.add_argument("--encoder", required=True, help="document encoder: a transformers dir or hub id; 'minilm' = the bundled all-MiniLM-L6-v2")
    b.add_argument("--index", default="hnsw", help="index spec: flat | hnsw | hnsw_sq8 | ivf_pq, with options like 'hnsw:m=48,ef_search=256' (default: hnsw)")
    b.add_argument("--out", required=True, help="knowledge-base directory to create")
    b.add_argument("--query-encoder", default=None, help="encoder queries should use by default (e.g. the DPR question encoder paired with a DPR context encoder)")
    b.add_argument("--words-per-passage", type=int, default=100, help="split documents into passages of this many words; 0 = keep documents whole (default: 100)")
    b.add_argument("--format", default="auto", help="corpus format: auto | jsonl | csv | tsv | psgs_w100 | text | dataset")
    b.add_argument("--title-field", default="title")
    b.add_argument("--text-field", default="text")
    b.add_argument("--id-field", default="id")
    b.add_argument("--encoding", default="utf-8", help="text encoding of corpus files")
    b.add_argument("--pooling", default="auto", choices=["auto", "cls", "mean", "pooler"])
    b.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction, help="L2-normalise embeddings (default: the encoder's own convention)")
    b.add_argument("--max-length", type=int, default=256, help="token limit per passage")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    b.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="autocast dtype for encoding")
    b.add_argument("--bm25", action="store_true", help="also store a BM25 index for sparse retrieval")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --out directory (atomically)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_build)

    i = isub.add_parser("info", help="print a knowledge base's manifest after verifying its checksums")
    i.add_argument("kb", help="knowledge-base directory")
    i.add_argument("--verify", default="full", choices=["full", "size", "none"])
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(func=cmd_info)

    s = isub.add_parser("search", help="retrieve passages for queries (arguments, --file, or one per line on stdin)")
    s.add_argument("kb", help="knowledge-base directory")
    s.add_argument("queries", nargs="*", help="query strings; none = read --file or stdin")
    s.add_argument("-k", type=int, default=5, help="passages per query (default: 5)")
    s.add_argument("--file", default=None, help="read queries from this file, one per line")
    s.add_argument("--query-encoder", default=None, help="override the query encoder recorded in the manifest")
    s.add_argument("--bm25", action="store_true", help="use the knowledge base's BM25 index instead of dense retrieval")
    s.add_argument("--json", action="store_true", help="one JSON object per query: {query, kb_version, passages: [{id, title, text, score}]}")
    s.add_argument("--verify", default="full", choices=["full", "size", "none"])
    s.add_argument("--batch-size", type=int, default=32)
    s.set_defaults(func=cmd_search)


def cmd_build(args) -> int:
    import torch

    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.passages import load_corpus

    corpus = args.corpus if len(args.corpus) > 1 else args.corpus[0]
    passages = load_corpus(
        corpus, words_per_passage=args.words_per_passage or None, format=args.format, title_field=args.title_field,
        text_field=args.text_field, id_field=args.id_field, encoding=args.encoding, show_progress=not args.quiet,
    )
    encoder = TextEncoder(args.encoder, pooling=args.pooling, normalize=args.normalize, max_length=args.max_length, role="context")
    kb = KnowledgeBase.build(
        passages, encoder, args.out, index=args.index, batch_size=args.batch_size, device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None, query_encoder=args.query_encoder, bm25=args.bm25,
        show_progress=not args.quiet, overwrite=args.overwrite,
        build_info={"corpus": [str(c) for c in args.corpus], "words_per_passage": args.words_per_passage},
    )
    print(f"built {kb.path} ({kb.version}): {len(kb)} passages, dim {kb.dim}, index {kb.index_spec.kind}, "
          f"{kb.manifest.build.get('encode_seconds', 0):.1f}s encoding + {kb.manifest.build['index_seconds']:.1f}s indexing")
    return 0


def cmd_info(args) -> int:
    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.open(args.kb, verify=args.verify)
    d = kb.describe()
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
        return 0
    enc = d["encoder"]
    lines = [
        f"knowledge base  {d['path']}",
        f"version         {d['version']}" + (f" (parent {d['parent']})" if d.get("parent") else ""),
        f"created         {d['created']}",
        f"passages        {d['count']:,}",
        f"embeddings      dim {d['dim']}, metric {d['metric']}",
        f"encoder         {enc.get('name')} ({enc.get('model_type', '?')}, pooling {enc.get('pooling')}, "
        f"normalize {enc.get('normalize')}, fingerprint {str(enc.get('fingerprint', ''))[:12]})",
    ]
    if d.get("query_encoder"):
        lines.append(f"query encoder   {d['query_encoder'].get('name')}")
    spec = ", ".join(f"{k}={v}" for k, v in d["index"].items() if k != "kind" and v is not None)
    lines.append(f"index           {d['index']['kind']} ({spec})")
    lines.append(f"build           " + ", ".join(f"{k}={v}" for k, v in d["build"].items()))
    total = sum(f["bytes"] for f in d["files"].values())
    lines.append(f"files           {len(d['files'])} files, {total / 1e6:.1f} MB, checksums "
                 + {"full": "verified", "size": "sizes verified", "none": "not verified"}[args.verify])
    print("\n".join(lines))
    return 0


def read_queries(args) -> Iterator[str]:
    if args.queries:
        yield from args.queries
        return
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            yield from (ln.rstrip("\n") for ln in f if ln.strip())
        return
    if sys.stdin.isatty():
        raise RagError("no queries: give them as arguments, with --file FILE, or one per line on stdin")
    yield from (ln.rstrip("\n") for ln in sys.stdin if ln.strip())


def cmd_search(args) -> int:
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder

    kb = KnowledgeBase.open(args.kb, verify=args.verify)
    if args.bm25:
        from rag.knowledge.bm25 import BM25Retriever

        retriever = BM25Retriever.from_knowledge_base(kb)
    else:
        retriever = DenseRetriever(kb, default_query_encoder(kb, args.query_encoder))
    batch: list[str] = []
    for query in read_queries(args):
        batch.append(query)
        if len(batch) == args.batch_size:
            _print_results(batch, retriever.retrieve(batch, args.k), args.json)
            batch = []
    if batch:
        _print_results(batch, retriever.retrieve(batch, args.k), args.json)
    return 0


def _print_results(queries, retrieved, as_json: bool) -> None:
    width = 100
    for b, query in enumerate(queries):
        hits = [
            {"id": p.id, "title": p.title, "text": p.text, "score": round(float(s), 4)}
            for p, s in zip(retrieved.passages[b], retrieved.scores[b].tolist())
        ]
        if as_json:
            print(json.dumps({"query": query, "kb_version": retrieved.kb_version, "passages": hits}, ensure_ascii=False))
            continue
        print(f"\nquery: {query}")
        for rank, h in enumerate(hits, 1):
            print(f"{rank:>3}. {h['score']:8.4f}  {h['title']}  [{h['id']}]")
            body = h["text"] if len(h["text"]) <= 300 else h["text"][:297] + "..."
            print(textwrap.fill(body, width=width, initial_indent=" " * 15, subsequent_indent=" " * 15))
    sys.stdout.flush()
