"""Recall@1 / @3 of dense (MiniLM), BM25 and hybrid (both fused: score fusion by default, or reciprocal rank fusion) retrieval on
question sets over one knowledge base, with the frozen query encoder the knowledge base names, and (``--model``) with the query
encoders of trained RAG models (RAG's Table 6: learned against frozen retrieval).

A passage is relevant when it is the question's element (the Elements sets name it in ``element``) or, for other data,
when it contains a gold answer (``rag.eval.metrics.has_answer``, SQuAD normalisation).

    python benchmarks/hybrid_recall.py                                       # the demo KB: demo:test, demo:natural, demo:dev
    python benchmarks/hybrid_recall.py --kb data/foldoc/kb --sets data/foldoc/test.jsonl,data/foldoc/val.jsonl
    python benchmarks/hybrid_recall.py --kb OLD_KB --rebuild-bm25    # an older knowledge base, with today's BM25 tokens
    python benchmarks/hybrid_recall.py --title-weight 1,2,3 --sets demo:dev --bm25-weight 0.5,1,2 --out A.json   # BM25's title
    weight python benchmarks/hybrid_recall.py --select A.json,B.json    # the setting chosen from those runs' question sets
    python benchmarks/hybrid_recall.py --kb data/foldoc/kb --sets data/foldoc/val.jsonl --model learned=RUN/rag/model \
        --model frozen=RUN/rag-frozen/model      # each model's own dense and fused retrieval (its β and fusion)

``--select`` applies one rule to every (title weight, β) the runs share: keep the settings whose fused recall is at
least that of the better single retriever (same title weight) on every set and count, then take the best mean fused
recall (ties: the smaller title weight, then the smaller β). Give it development sets only.

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
    p.add_argument("--title-weight", default=None,
                   help="index the passages again with BM25 counting each title this many times; a comma-separated list "
                        "sweeps it (implies --rebuild-bm25; default: the stored index's, or today's default when rebuilding)")
    p.add_argument("--select", default=None, help="comma-separated results of earlier runs: print the setting the rule "
                                                  "above chooses from their sets (no retrieval)")
    p.add_argument("--model", action="append", default=[], metavar="LABEL=DIR",
                   help="a trained RAG model directory (checksums verified): adds rows 'LABEL dense' and 'LABEL hybrid', "
                        "what the model retrieves with its query encoder (hybrid: its fusion and β); repeatable")
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


def select(paths: list[str]) -> dict:
    """The rule of the module docstring over the sets of the result files `paths`: every candidate's smallest margin
    over the better single retriever and mean fused recall, and the chosen one."""
    rows = {}
    for path in paths:
        for spec, row in json.loads(Path(path).read_text(encoding="utf-8"))["sets"].items():
            rows[f"{path}:{spec}"] = row
    names = set.intersection(*({n.rsplit(" R@", 1)[0] for n in row if " R@" in n} for row in rows.values()))
    out = []
    for name in sorted(n for n in names if "hybrid" in n and (n.startswith("title×") or n.startswith("hybrid"))):
        tag = name.split("hybrid")[0]  # "title×3 " or ""
        fused = [row[f"{name} R@{k}"] for row in rows.values() for k in (1, 3)]
        best = [max(row[f"dense R@{k}"], row[f"{tag}bm25 R@{k}"]) for row in rows.values() for k in (1, 3)]
        title = int(tag[len("title×"):]) if tag else None
        beta = float(name.split("β=")[1]) if "β=" in name else None
        out.append({"setting": name, "title_weight": title, "bm25_weight": beta,
                    "min_margin": round(min(f - b for f, b in zip(fused, best)), 1), "mean": round(sum(fused) / len(fused), 2)})
    feasible = [c for c in out if c["min_margin"] >= 0]
    chosen = max(feasible, key=lambda c: (c["mean"], -(c["title_weight"] or 0), -(c["bm25_weight"] or 0)), default=None)
    return {"sets": sorted(rows), "candidates": out, "chosen": chosen}


class ModelRetrieval:
    """What a RagModel itself retrieves (its query encoder, question length, fusion and β), as a retriever of `kind`."""

    def __init__(self, model, kind: str):
        self.model, self.kind = model, kind

    def retrieve(self, questions: list[str], k: int):
        import torch

        with torch.no_grad():
            return self.model.scoring.score(list(questions), k, retrieval=self.kind)[0]


def model_dirs(specs: list[str]) -> dict[str, str]:
    """``--model LABEL=DIR`` values -> {label: directory}."""
    out = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--model {spec!r}: give LABEL=DIR, e.g. learned=runs/x/rag/model")
        out[label] = path
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.select:
        result = select(args.select.split(","))
        print("| setting | smallest margin over the better retriever | mean fused recall |\n|---|---:|---:|")
        for c in result["candidates"]:
            print(f"| {c['setting']} | {c['min_margin']:+.1f} | {c['mean']:.2f} |")
        print("chosen:", result["chosen"] and result["chosen"]["setting"], "over", ", ".join(result["sets"]))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    from rag.knowledge.bm25 import TITLE_WEIGHT, BM25Index, BM25Retriever
    from rag.knowledge.hybrid import HybridRetriever
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder
    from rag.models.rag.model import RagModel

    if args.kb is None:
        from rag.demo.kb import ensure_demo_kb

        kb = ensure_demo_kb(show_progress=False)
    else:
        kb = KnowledgeBase.open(args.kb)
    encoder = default_query_encoder(kb)
    weights = [float(w) for w in args.bm25_weight.split(",")] if args.fusion == "score" else [None]
    dense = DenseRetriever(kb, encoder)
    rebuild = args.rebuild_bm25 or args.title_weight is not None
    if kb.bm25 is None and not rebuild:
        raise SystemExit(f"{kb.path}: has no BM25 index; build the knowledge base with --bm25, or pass --rebuild-bm25")
    titles = [TITLE_WEIGHT] if args.title_weight is None else [int(t) for t in args.title_weight.split(",")]
    retrievers = {"dense": dense}
    for t in titles:
        index = BM25Index.build(kb.all_passages(), title_weight=t, show_progress=False) if rebuild else kb.bm25
        bm25 = BM25Retriever(index, kb.get_passages, kb.served_version, knowledge_base=kb)
        tag = f"title×{index.title_weight} " if len(titles) > 1 else ""
        retrievers[f"{tag}bm25"] = bm25
        retrievers.update({(f"{tag}hybrid β={w}" if len(weights) > 1 else f"{tag}hybrid"): HybridRetriever(
            dense, bm25, fusion=args.fusion, rrf_k=args.rrf_k, **({} if w is None else {"bm25_weight": w})) for w in weights})
    dirs = model_dirs(args.model)
    for label, path in dirs.items():  # every file checked against the checksum the model recorded
        model = RagModel.from_pretrained(path, knowledge_base=kb)
        retrievers.update({f"{label} {kind}": ModelRetrieval(model, kind) for kind in ("dense", "hybrid")})
    report = {"kb": str(kb.path), "passages": len(kb), "bm25_token_pattern": index.token_pattern,
              "bm25_title_weight": [r.index.title_weight for n, r in retrievers.items() if n.endswith("bm25")],
              "fusion": args.fusion, **({"models": dirs} if dirs else {}),
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
