"""`rag demo`: the embedded default — the bundled corpus and model, offline."""

from __future__ import annotations

from rag.cli.index import _print_results

DEFAULT_QUESTIONS = [
    "which element did Henry Cavendish discover?",
    "what is the atomic number of argon?",
    "what element is essential for bones and teeth?",
]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="build the demo knowledge base (if needed) and answer questions from it",
                       description="Runs the embedded default: the Elements demo corpus, encoded with the bundled all-MiniLM-L6-v2.")
    p.add_argument("questions", nargs="*", help=f"questions (default: {len(DEFAULT_QUESTIONS)} examples)")
    p.add_argument("--kb", default=None, help="where the demo knowledge base lives (default: $RAG_CACHE/demo_kb or ~/.cache/rag/demo_kb)")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from rag.demo.kb import ensure_demo_kb
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder

    kb = ensure_demo_kb(args.kb)
    if not args.json:
        print(f"demo knowledge base: {kb.path} ({kb.version}, {len(kb)} passages, {kb.index_spec.kind})")
    questions = args.questions or DEFAULT_QUESTIONS
    retriever = DenseRetriever(kb, default_query_encoder(kb))
    _print_results(questions, retriever.retrieve(questions, args.k), args.json)
    return 0
