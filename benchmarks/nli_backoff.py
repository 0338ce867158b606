"""The RetRobust NLI back-off (Yoran et al. 2024, §2.1) on the bundled demo RAG model: EM with retrieval, without, and
with the back-off, on relevant and on irrelevant retrieval.

Questions: the Elements dev + test splits (202 questions about elements no training question names). Two knowledge
bases: the demo one (every element's passage: retrieval is relevant) and one without the held-out elements' passages
(only the training elements': every retrieved passage is irrelevant, the paper's "random retrieval" failure). For each,
one batched call per batch generates with and without retrieval (``generate_with_and_without_retrieval``) and the NLI
model picks (``rag.retrobust.backoff.choose_answers``), so the three EMs come from the same generations.

    python benchmarks/nli_backoff.py --nli $RAG_CACHE/nli/minilm-snli [--threshold 0.5] [--out
    benchmarks/results/nli_backoff.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import rag
from rag.demo import load_demo_corpus, load_demo_qa
from rag.eval.metrics import ExactMatch, exact_match
from rag.retrobust.backoff import choose_answers
from rag.retrobust.nli import NLIScorer, validate_threshold
from rag.utils.io import atomic_write_json


def irrelevant_kb(path: Path, held_out: set[str]):
    """The demo corpus without the held-out elements' passages (MiniLM, flat index), built once."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    if (path / "manifest.json").is_file():
        return KnowledgeBase.open(path)
    passages = [p for p in load_demo_corpus() if p.title not in held_out]
    return KnowledgeBase.build(passages, TextEncoder("minilm", role="context"), path, index="flat", show_progress=False)


def evaluate(pipe, scorer, rows, threshold: float, batch_size: int) -> dict:
    metrics = {name: ExactMatch() for name in ("retrieval", "no_retrieval", "backoff")}
    kept = 0
    kept_right = {"retrieval_right": 0, "retrieval_wrong": 0}  # kept retrieval answers that are right / wrong
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        questions, golds = [r["question"] for r in batch], [r["answers"] for r in batch]
        with_r, without = pipe.reader.generate_with_and_without_retrieval(questions, max_new_tokens=16)
        chosen = choose_answers(scorer, with_r, without, threshold)
        for name, answers in (("retrieval", with_r), ("no_retrieval", without), ("backoff", chosen)):
            metrics[name].update([a.text for a in answers], golds)
        for a, c, g in zip(with_r, chosen, golds):
            kept += c.answered_with == "retrieval"
            if c.answered_with == "retrieval":
                kept_right["retrieval_right" if exact_match(a.text, g) else "retrieval_wrong"] += 1
    out = {f"em_{k}": round(float(m.compute()), 4) for k, m in metrics.items()}
    return {**out, "kept_retrieval": round(kept / len(rows), 4), **kept_right, "n": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nli", required=True, help="NLI model directory (e.g. $RAG_CACHE/nli/minilm-snli)")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--work", default="runs/nli_backoff", help="where the irrelevant knowledge base is built")
    ap.add_argument("--out", default="benchmarks/results/nli_backoff.json")
    args = ap.parse_args()
    threshold = validate_threshold(args.threshold, "--threshold")
    rows = load_demo_qa("dev") + load_demo_qa("test")
    scorer = NLIScorer.from_pretrained(args.nli)
    held_out = {r["element"] for r in rows}
    results = {"nli": args.nli, "threshold": threshold, "questions": "elements dev + test", "settings": {}}
    t0 = time.process_time()
    for name, kb in (("relevant (demo knowledge base)", None),
                     ("irrelevant (held-out elements' passages removed)",
                      irrelevant_kb(Path(args.work) / "kb_without_held_out", held_out))):
        pipe = rag.load("demo", knowledge_base=kb)
        results["settings"][name] = evaluate(pipe, scorer, rows, threshold, args.batch_size)
        print(name, json.dumps(results["settings"][name]))
    results["cpu_seconds"] = round(time.process_time() - t0, 1)
    atomic_write_json(Path(args.out), results)
    print(f"wrote {args.out} ({results['cpu_seconds']} CPU-s)")


if __name__ == "__main__":
    main()
