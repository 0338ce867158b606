"""Recall@1 / @3 of dense (MiniLM), BM25 and hybrid (both fused: score fusion by default, or reciprocal rank fusion) retrieval on question sets
over one knowledge base, with the frozen query encoder the knowledge base names.

A passage is relevant when it is the question's element (the Elements sets name it in ``element``) or, for other data,
when it contains a gold answer (``rag.eval.metrics.has_answer``, SQuAD normalisation).

    python benchmarks/hybrid_recall.py                                       # the demo KB: demo:test, demo:natural, demo:dev
    python benchmarks/hybrid_recall.py --kb data/foldoc/kb --sets data/foldoc/test.jsonl,data/foldoc/val.jsonl
    python benchmarks/hybrid_recall.py --kb OLD_KB --rebuild-bm25    # an older knowledge base, with today's BM25 tokens

Writes ``--out`` (JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kb", default=None, help="knowledge base with a BM25 index (default: the demo knowledge base)")
    p.add_argument("--sets", default="demo:test,demo:natural,demo:dev", help="comma-separated QA files or demo:SPLIT")
    p.add_argument("--fusion", choices=("score", "rrf"), default="score")
    p.add_argument("--bm25-weight", default="0.5", help="β of score fusion; a comma-separated list sweeps it")
    p.add_argument("--rrf-k", type=int, default=60)
    p.add_argument("--rebuild-bm25", action="store_true",
                   help="index the knowledge base's passages again with today's BM25 defaults (e.g. its token pattern) "
                        "instead of reading its stored BM25 index")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "hybrid_recall.json")
    return p.parse_args(argv)


def records(spec: str) -> list[dict]:
    from rag.demo import qa_path

    path = qa_path(spec[5:]) if spec.startswith("demo:") else Path(spec)
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def relevant(passage, record: dict) -> bool:
    from rag.eval.metrics import has_answer

    if "element" in record:
        return passage.title == record["element"]
    return has_answer(passage, record["answers"])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from rag.knowledge.bm25 import BM25Index, BM25Retriever
    from rag.knowledge.hybrid import HybridRetriever
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder

    if args.kb is None:
        from rag.demo.kb import ensure_demo_kb

        kb = ensure_demo_kb(show_progress=False)
    else:
        kb = KnowledgeBase.open(args.kb)
    encoder = default_query_encoder(kb)
    weights = [float(w) for w in args.bm25_weight.split(",")] if args.fusion == "score" else [None]
    dense = DenseRetriever(kb, encoder)
    if kb.bm25 is None and not args.rebuild_bm25:
        raise SystemExit(f"{kb.path}: has no BM25 index; build the knowledge base with --bm25, or pass --rebuild-bm25")
    bm25_index = BM25Index.build(kb.all_passages(), show_progress=False) if args.rebuild_bm25 else kb.bm25
    bm25 = BM25Retriever(bm25_index, kb.get_passages, kb.served_version, knowledge_base=kb)
    hybrids = {(f"hybrid β={w}" if len(weights) > 1 else "hybrid"): HybridRetriever(
        dense, bm25, fusion=args.fusion, rrf_k=args.rrf_k, **({} if w is None else {"bm25_weight": w})) for w in weights}
    retrievers = {"dense": dense, "bm25": bm25, **hybrids}
    report = {"kb": str(kb.path), "passages": len(kb), "bm25_token_pattern": bm25_index.token_pattern, "fusion": args.fusion,
              **({"rrf_k": args.rrf_k} if args.fusion == "rrf" else {"bm25_weight": weights}), "sets": {}}
    for spec in args.sets.split(","):
        recs = records(spec)
        questions = [r["question"] for r in recs]
        row = {"n": len(recs)}
        for name, retriever in retrievers.items():
            found = retriever.retrieve(questions, 3)
            for k in (1, 3):
                hits = sum(any(relevant(p, r) for p in ps[:k]) for ps, r in zip(found.passages, recs))
                row[f"{name} R@{k}"] = round(100 * hits / len(recs), 1)
        report["sets"][spec] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    cols = [f"{n} R@{k}" for n in retrievers for k in (1, 3)]
    print("| set | n | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for spec, row in report["sets"].items():
        print(f"| {spec} | {row['n']} | " + " | ".join(str(row[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
