"""`rag index build | merge | info | search`: build (whole or in shards), merge, inspect and query knowledge bases."""

from __future__ import annotations

import argparse
import itertools
import sys
import textwrap
from pathlib import Path
from typing import IO, Iterator, Optional

from rag.cli.passage_window import fit_to_window, load_tokenizer
from rag.knowledge.build import parse_memory
from rag.knowledge.documents import check_sources
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.index import IndexSpec, check_fits
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import is_knowledge_base
from rag.knowledge.passages import load_corpus
from rag.knowledge.ray_build import build_on_ray
from rag.knowledge.ray_pool import check_reachable
from rag.knowledge.retriever import DenseRetriever, default_query_encoder
from rag.knowledge.retriever_kinds import retriever_for_kind
from rag.knowledge.shards import merge_shards, parse_shard, shard_info, shard_passages
from rag.utils.devices import check_device
from rag.utils.errors import ConfigError, KnowledgeBaseError, RagError
from rag.utils.files import regular_file
from rag.utils.io import check_output_dir, to_json
from rag.utils.validate import check_strings


def add_parser(sub) -> None:
    p = sub.add_parser("index", help="build, inspect and query knowledge bases")
    isub = p.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    b = isub.add_parser("build", help="ingest a corpus, encode it and write a knowledge-base directory",
                        description="Ingest a corpus, split it into passages, encode them and write an immutable knowledge base.")
    b.add_argument("--corpus", required=True, nargs="+",
                   help="JSONL/CSV/TSV file(s), DPR psgs_w100.tsv, text file(s)/folder(s), or a saved `datasets` dir")
    b.add_argument("--encoder", required=True,
                   help="document encoder: a transformers dir or hub id; 'minilm' = the bundled all-MiniLM-L6-v2")
    b.add_argument("--index", default="hnsw",
                   help="index spec: flat | hnsw | hnsw_sq8 | ivf_pq, with options like 'hnsw:m=48,ef_search=256' "
                        "(default: hnsw)")
    b.add_argument("--out", required=True, help="knowledge-base directory to create")
    b.add_argument("--query-encoder", default=None,
                   help="encoder queries should use by default (e.g. the DPR question encoder paired with a DPR context encoder)")
    b.add_argument("--words-per-passage", type=int, default=100,
                   help="split documents into passages of this many words; 0 = keep documents whole (default: 100)")
    b.add_argument("--max-passage-tokens", type=int, default=None, metavar="N",
                   help="split passages further so each reader prompt (template, title, passage, a 32-token "
                        "question) fits N tokens")
    b.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --max-passage-tokens: the reader's tokenizer (default: the demo reader's)")
    b.add_argument("--min-tail-words", type=int, default=None,
                   help="a document's last piece shorter than this joins the passage before it instead of standing alone "
                        "(default: a fifth of --words-per-passage; 0 = never)")
    b.add_argument("--format", default="auto", help="corpus format: auto | jsonl | csv | tsv | psgs_w100 | text | dataset")
    b.add_argument("--title-field", default="title")
    b.add_argument("--text-field", default="text")
    b.add_argument("--id-field", default="id")
    b.add_argument("--encoding", default="utf-8", help="text encoding of corpus files")
    b.add_argument("--max-document-chars", type=int, default=None, metavar="N",
                   help="refuse a document, line or row longer than N characters (default 33554432); a corpus source must "
                        "be a regular file or a folder (never a device or pipe)")
    b.add_argument("--follow-symlinks", action="store_true",
                   help="read a corpus folder's symbolic links that point outside it (default: skip them with a warning)")
    b.add_argument("--pooling", default="auto", choices=["auto", "cls", "mean", "pooler"])
    b.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction,
                   help="L2-normalise embeddings (default: the encoder's own convention)")
    b.add_argument("--max-length", type=int, default=256, help="token limit per passage")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    b.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="autocast dtype for encoding")
    b.add_argument("--bm25", action="store_true", help="also store a BM25 index for sparse retrieval")
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing knowledge base at --out (atomically; never anything else)")
    b.add_argument("--shard", default=None, metavar="i/N",
                   help="encode only slice i of N of the corpus into --out (a shard, flat index); run i = 0..N-1 on several "
                        "processes or machines, then `rag index merge`")
    b.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse, before encoding, an index spec whose estimated build peak exceeds SIZE (e.g. 16G, 512M; "
                        "default: 80%% of RAM); encoding streams to disk in chunks, so the index is what must fit")
    b.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="encode on Ray workers (one shard each, then merged): join the cluster at ADDRESS (host:port, "
                        "ray://host:port, auto), or without ADDRESS a local Ray")
    b.add_argument("--workers", type=int, default=None, metavar="N", help="with --ray: the number of workers (shards); default 2")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_build)

    m = isub.add_parser("merge", help="merge the shards of `rag index build --shard i/N` into one knowledge base",
                        description="Verify every shard's checksums, check that they are the N slices of one corpus "
                                    "encoded by one "
                                    "encoder, and write one knowledge base (the same version id as a one-shot build).")
    m.add_argument("out", help="knowledge-base directory to create")
    m.add_argument("shards", nargs="+", help="the N shard directories (any order)")
    m.add_argument("--index", default=None,
                   help="index spec of the merged knowledge base (default: the --index the shards were built with)")
    m.add_argument("--bm25", action="store_true", help="also store a BM25 index for sparse retrieval")
    m.add_argument("--verify", default="full", choices=["full", "size", "none"],
                   help="how each shard is checked (default: every SHA-256)")
    m.add_argument("--overwrite", action="store_true",
                   help="replace an existing knowledge base at OUT (atomically; never anything else)")
    m.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse an index spec whose estimated build peak exceeds SIZE (e.g. 16G; default: 80%% of RAM)")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    m.set_defaults(func=cmd_merge)

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
    s.add_argument("--query-encoder", default=None,
                   help="override the query encoder recorded in the manifest (same identity, e.g. another path to it)")
    s.add_argument("--allow-encoder-change", action="store_true",
                   help="accept a --query-encoder with another identity than the one the knowledge base was built for (e.g. a "
                        "fine-tuned copy)")
    s.add_argument("--bm25", action="store_true", help="use the knowledge base's BM25 index instead of dense retrieval")
    s.add_argument("--json", action="store_true",
                   help="one JSON object per query: {query, kb_version, passages: [{id, title, text, score}]}")
    s.add_argument("--verify", default="full", choices=["full", "size", "none"])
    s.add_argument("--batch-size", type=int, default=32)
    s.set_defaults(func=cmd_search, trailing_positional="queries")  # queries may also follow the options


def check_positive(args, *names: str) -> None:
    """ConfigError naming the option unless each of `names` (attributes of `args`, e.g. ``batch_size``) is >= 1."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            option = f"-{name}" if len(name) == 1 else f"--{name.replace('_', '-')}"
            raise ConfigError(f"{option} {value}: must be a positive integer")


def _check_not_an_input(out: str, corpus: list[str]) -> None:
    """RagError when --out is one of the corpus sources, or contains or lies inside one: replacing it would destroy the input."""
    target = Path(out).resolve()
    for c in corpus:
        src = Path(c).resolve()
        if target == src or target in src.parents:
            raise ConfigError(f"--out {out} is or contains the corpus source {c}; writing the knowledge base there "
                              f"would destroy the "
                              "input — choose an --out outside every --corpus path")
        if src in target.parents:
            raise ConfigError(f"--out {out} lies inside the corpus folder {c}; the knowledge base's files would be "
                              f"mixed into the "
                              "input (and read as documents by a later build) — choose an --out outside every --corpus path")


def cmd_build(args) -> int:
    import torch

    # Everything checkable is checked before the corpus is read and encoded (hours on a large corpus).
    spec = IndexSpec.parse(args.index)
    shard = parse_shard(args.shard) if args.shard is not None else None
    check_positive(args, "batch_size", "max_length", "max_document_chars", "workers", "max_passage_tokens")
    if args.tokenizer is not None and args.max_passage_tokens is None:
        raise ConfigError(f"--tokenizer {args.tokenizer}: only means something with --max-passage-tokens N; add it or "
                          f"drop --tokenizer")
    tokenizer = load_tokenizer(args.tokenizer) if args.max_passage_tokens else None
    if tokenizer is not None:  # a window below the template is refused before the corpus is read
        fit_to_window([], args.max_passage_tokens, tokenizer, args.tokenizer or "smollm2")
    if args.max_memory is not None:
        parse_memory(args.max_memory)
    if args.workers is not None and args.ray is None:
        raise ConfigError(f"--workers {args.workers}: only means something with --ray; add --ray [ADDRESS] or drop --workers")
    if args.ray is not None and shard is not None:
        raise ConfigError("--ray with --shard: a Ray build makes and merges every shard itself; drop --shard")
    if args.ray:  # an address that does not answer fails now, naming it, not after the corpus is read
        check_reachable(args.ray, 5.0, ConfigError, "--ray")
    if args.words_per_passage < 0:
        raise ConfigError(f"--words-per-passage {args.words_per_passage}: must be 0 (keep documents whole) or a positive "
                          f"number of words")
    check_device(args.device)
    _check_not_an_input(args.out, args.corpus)
    check_output_dir(args.out, args.overwrite, replaces=is_knowledge_base, kind="knowledge base")
    if args.format != "dataset":  # a dataset name may be a hub id; files and folders are checked before the encoder loads
        check_sources(args.corpus)

    encoder = TextEncoder(args.encoder, pooling=args.pooling, normalize=args.normalize, max_length=args.max_length,
                          role="context")
    if args.query_encoder:  # the pair must share a vector space of one dimension; found out now, not at the first search
        qdim = TextEncoder(args.query_encoder, pooling=args.pooling, normalize=args.normalize, role="question").dim
        if qdim != encoder.dim:
            raise ConfigError(f"--query-encoder {args.query_encoder} embeds into dimension {qdim}, but --encoder "
                              f"{args.encoder} into "
                              f"{encoder.dim}; name the query encoder trained with this document encoder (e.g. a DPR pair)")
    corpus = args.corpus if len(args.corpus) > 1 else args.corpus[0]
    passages = load_corpus(
        corpus, words_per_passage=args.words_per_passage or None, min_tail_words=args.min_tail_words, format=args.format,
        title_field=args.title_field,
        text_field=args.text_field, id_field=args.id_field, encoding=args.encoding, show_progress=not args.quiet,
        follow_symlinks=args.follow_symlinks,
        **({} if args.max_document_chars is None else {"max_document_chars": args.max_document_chars}),
    )
    build_info = {"corpus": [str(c) for c in args.corpus], "words_per_passage": args.words_per_passage,
                  "min_tail_words": args.min_tail_words}
    if tokenizer is not None:
        passages, build_info["passage_tokens"] = fit_to_window(passages, args.max_passage_tokens, tokenizer, args.tokenizer
                                                               or "smollm2")
    if args.ray is not None:
        kb = build_on_ray(passages, encoder, args.out, workers=args.workers or 2, address=args.ray or None, index=spec,
                          batch_size=args.batch_size, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype
                          else None,
                          query_encoder=args.query_encoder, bm25=args.bm25, show_progress=not args.quiet,
                          overwrite=args.overwrite, build_info=build_info, max_memory=args.max_memory,
                          num_gpus=1.0 if args.device and args.device.startswith("cuda") else 0.0)
        print(f"built {kb.path} ({kb.served_version}) on {args.workers or 2} Ray workers: {len(kb)} passages, dim {kb.dim}, "
              f"index {kb.index_spec.kind}, {kb.manifest.build.get('encode_seconds', 0):.1f}s encoding (all workers) + "
              f"{kb.manifest.build['index_seconds']:.1f}s indexing")
        return 0
    if shard is not None:  # this slice, flat-indexed; `rag index merge` builds `spec` over all of them
        check_fits(spec, len(passages), encoder.dim)
        build_info["shard"] = shard_info(passages, shard, args.index)
        passages, spec = shard_passages(passages, shard), IndexSpec.parse("flat")
    kb = KnowledgeBase.build(
        passages, encoder, args.out, index=spec, batch_size=args.batch_size, device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None, query_encoder=args.query_encoder, bm25=args.bm25,
        show_progress=not args.quiet, overwrite=args.overwrite, build_info=build_info, max_memory=args.max_memory,
    )
    if shard is not None:
        print(f"built shard {shard} at {kb.path} ({kb.version}): {len(kb)} passages, rows {build_info['shard']['start']}–"
              f"{build_info['shard']['stop']} of {build_info['shard']['corpus_passages']}, "
              f"{kb.manifest.build.get('encode_seconds', 0):.1f}s encoding")
        return 0
    print(f"built {kb.path} ({kb.version}): {len(kb)} passages, dim {kb.dim}, index {kb.index_spec.kind}, "
          f"{kb.manifest.build.get('encode_seconds', 0):.1f}s encoding + {kb.manifest.build['index_seconds']:.1f}s indexing")
    return 0


def cmd_merge(args) -> int:
    for shard in args.shards:
        _check_not_an_input(args.out, [shard])
    kb = merge_shards(args.out, args.shards, index=args.index, bm25=args.bm25, verify=args.verify,
                      show_progress=not args.quiet, overwrite=args.overwrite, max_memory=args.max_memory)
    print(f"merged {len(args.shards)} shards into {kb.path} ({kb.served_version}): {len(kb)} passages, dim {kb.dim}, index "
          f"{kb.index_spec.kind}, {kb.manifest.build['index_seconds']:.1f}s indexing")
    if kb.unverified_inputs:
        print(f"  the shards were opened with --verify {args.verify}, so their content was not proven unaltered: the merged "
              "knowledge base is marked +unverified; merge with --verify full to serve it under its plain version")
    return 0


def cmd_info(args) -> int:
    kb = KnowledgeBase.open(args.kb, verify=args.verify)
    d = kb.describe()
    d["served_version"] = kb.served_version
    if args.json:
        print(to_json(d, indent=2, sort_keys=True))
        return 0
    enc = d["encoder"]
    lines = [
        f"knowledge base  {d['path']}",
        f"version         {kb.served_version}" + (f" (parent {d['parent']})" if d.get("parent") else ""),
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
    lines.append("build           " + ", ".join(f"{k}={v}" for k, v in d["build"].items()))
    total = sum(f["bytes"] for f in d["files"].values())
    lines.append(f"files           {len(d['files'])} files, {total / 1e6:.1f} MB, checksums "
                 + {"full": "verified", "size": "sizes verified", "none": "not verified"}[args.verify]
                 + ("; made from unverified inputs (build.unverified_inputs), so served as +unverified" if kb.unverified_inputs
                    else ""))
    print("\n".join(lines))
    return 0


def read_queries(args) -> Iterator[str]:
    """The queries of `rag index search` / `rag generate`: the arguments, else --file's lines, else stdin's lines
    (blank lines skipped). Every query must be UTF-8 text: the arguments are checked here, before anything is loaded
    (a blank argument is refused with the same message as :meth:`RagPipeline.generate`), lines as they are read."""
    if args.queries:
        queries = check_strings(args.queries, "questions")
        for i, q in enumerate(queries):
            _check_text(q, f"question {i + 1} (argument)")
        return iter(queries)
    if args.file:
        path = Path(args.file)
        regular_file(path, "--file: a text file with one query per line")  # a device or pipe may never end
        with path.open("rb") as f:  # a first pass, so that a bad byte is reported before anything is loaded
            for _ in _lines(f, f"--file {path}"):
                pass
        return _nonempty(_lines(path.open("rb"), f"--file {path}", close=True), f"--file {path}")
    if sys.stdin.isatty():
        raise RagError("no queries: give them as arguments, with --file FILE, or one per line on stdin")
    stream = getattr(sys.stdin, "buffer", None)
    return _nonempty(_lines(stream if stream is not None else sys.stdin, "stdin"), "stdin")


def _nonempty(queries: Iterator[str], where: str) -> Iterator[str]:
    """`queries`, after reading the first one now (before anything is loaded): RagError when there is none."""
    first = next(queries, None)
    if first is None:
        raise RagError(f"no queries: {where} holds no non-blank line; give one query per line")
    return itertools.chain([first], queries)


MAX_QUERY_CHARS = 1 << 20
"""Longest query line read (1 MiB): a file without line breaks is never read whole."""


def _lines(stream: IO, where: str, close: bool = False) -> Iterator[str]:
    """Non-blank lines of a byte (or text) stream as strings; RagError naming `where` and the line for non-UTF-8 bytes."""
    try:
        for n in itertools.count(1):
            raw = stream.readline(MAX_QUERY_CHARS + 1)
            if not raw:
                return
            if len(raw) > MAX_QUERY_CHARS and raw[-1:] not in ("\n", b"\n"):
                raise RagError(f"{where}: line {n} is longer than {MAX_QUERY_CHARS:,} characters; give one query per line")
            if isinstance(raw, bytes):
                try:
                    raw = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise RagError(f"{where}: line {n} is not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                   f"{e.start + 1}); "
                                   "queries must be UTF-8 — convert the input (e.g. `iconv -f latin1 -t utf-8`)") from None
            line = raw.rstrip("\r\n")
            if line.strip():
                yield _check_text(line, f"{where}: line {n}")
    finally:
        if close:
            stream.close()


def _check_text(q: str, where: str) -> str:
    if "\x00" in q:
        raise RagError(f"{where} contains a NUL byte: the input is binary, not text; give queries as UTF-8 text, one per line")
    try:
        q.encode("utf-8")
    except UnicodeEncodeError:
        raise RagError(f"{where} holds bytes that are not UTF-8 text; queries must be UTF-8 — convert the input "
                       "(e.g. `iconv -f latin1 -t utf-8`)") from None
    return q


def _query_encoder(kb, name: Optional[str], allow_change: bool):
    """The query encoder for `kb` (rag.knowledge.retriever.default_query_encoder), refusing an explicit `name` whose
    identity is not the one the knowledge base was built for unless `allow_change` (--allow-encoder-change)."""
    recorded = (kb.manifest.query_encoder or {}).get("name")
    expected = recorded or kb.encoder.get("name")
    same_name = name is None or name == expected or (Path(name).exists()
                                                     and Path(name).resolve() == Path(str(expected)).resolve())
    refuse = (f"{kb.path}: --query-encoder {name} is not the query encoder this knowledge base was built for ({expected}"
              "{detail}); queries embedded by another model land in another vector space, so their results would be "
              "meaningless even at the same dimension. Omit --query-encoder, or pass --allow-encoder-change if this encoder "
              "was trained for this index (e.g. a fine-tuned copy)")
    if not same_name and recorded and not allow_change:
        raise KnowledgeBaseError(refuse.format(detail=", recorded by --query-encoder at build time"))
    enc = default_query_encoder(kb, name)
    if not same_name and not recorded and not allow_change:
        fp = enc.identity().get("fingerprint")
        if fp != kb.encoder.get("fingerprint"):
            raise KnowledgeBaseError(refuse.format(detail=f", fingerprint {str(kb.encoder.get('fingerprint'))[:12]}; "
                                                          f"{name} has fingerprint {str(fp)[:12]}"))
    return enc


def cmd_search(args) -> int:
    check_positive(args, "k", "batch_size")
    queries = read_queries(args)
    kb = KnowledgeBase.open(args.kb, verify=args.verify)
    if args.k > len(kb):
        raise RagError(f"-k {args.k}: must be between 1 and the number of passages in {kb.path} ({len(kb)})")
    if args.bm25:
        retriever = retriever_for_kind("bm25", kb, build_missing=kb.bm25 is None)  # none stored: one built in memory
    else:
        retriever = DenseRetriever(kb, _query_encoder(kb, args.query_encoder, args.allow_encoder_change))
    batch: list[str] = []
    for query in queries:
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
            print(to_json({"query": query, "kb_version": retrieved.kb_version, "passages": hits}))
            continue
        print(f"\nquery: {query}")
        for rank, h in enumerate(hits, 1):
            print(f"{rank:>3}. {h['score']:8.4f}  {h['title']}  [{h['id']}]")
            body = h["text"] if len(h["text"]) <= 300 else h["text"][:297] + "..."
            print(textwrap.fill(body, width=width, initial_indent=" " * 15, subsequent_indent=" " * 15))
    sys.stdout.flush()
