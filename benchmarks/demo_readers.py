"""The demo readers side by side: exact match of each model directory on the held-out Elements test questions
(``demo:test``) and on the naturally phrased questions (``demo:natural``), loaded with ``rag.load`` and answered with
its stored decoding settings exactly as ``rag generate`` answers; also recall@1 / @3 of the passages it read, and
EM by question type.

    python benchmarks/demo_readers.py                                     # checkpoints/demo and checkpoints/demo_causal
    python benchmarks/demo_readers.py --models checkpoints/demo_causal --sets test,natural,dev

Writes ``--out`` (JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rag  # noqa: E402 (after the repository is on the path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=f"{REPO / 'checkpoints' / 'demo'},{REPO / 'checkpoints' / 'demo_causal'}")
    p.add_argument("--sets", default="test,natural")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--retrieval", default=None, choices=("dense", "bm25", "hybrid"), help="default: each model's own")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "demo_readers.json")
    return p.parse_args(argv)


def evaluate(pipe, name: str, batch_size: int, retrieval=None) -> dict:
    """EM (SQuAD normalisation, any gold answer), EM by type, recall@1/@3 of the passages answered from, seconds, and
    how many reader prompts were longer than the model's window and cut (``prompts_cut``)."""
    from rag.eval.metrics import exact_match
    from rag.eval.qa_data import read_qa
    from rag.utils.truncation import counting_cut_prompts

    records = [json.loads(line) for line in open(_path(name), encoding="utf-8")]
    examples = read_qa(f"demo:{name}")
    hits, by_type, r1, r3, rows = 0, defaultdict(list), 0, 0, []
    start = time.perf_counter()
    with counting_cut_prompts() as cut:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            extra = {"retrieval": retrieval} if retrieval else {}
            answers = pipe.generate([e.question for e in chunk], **extra)
            for e, rec, a in zip(chunk, records[i:i + batch_size], answers):
                ok = exact_match(a.text, list(e.answers))
                hits += ok
                by_type[rec.get("type", "?")].append(ok)
                titles = [p.title for p in a.passages]
                r1 += bool(titles[:1] and titles[0] == rec.get("element"))
                r3 += rec.get("element") in titles[:3]
                rows.append({"question": e.question, "answer": a.text, "gold": list(e.answers), "em": bool(ok)})
    n = len(examples)
    return {"n": n, "em": round(100 * hits / n, 1), "recall@1": round(100 * r1 / n, 1), "recall@3": round(100 * r3 / n, 1),
            "em_by_type": {t: round(100 * sum(v) / len(v), 1) for t, v in sorted(by_type.items())},
            "seconds_per_answer": round((time.perf_counter() - start) / n, 2), "prompts_cut": cut.to_dict(), "answers": rows}


def _path(name: str) -> Path:
    from rag.demo import qa_path

    return qa_path(name)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from rag.pipeline.api import load

    report = {}
    for model in args.models.split(","):
        pipe = load(model)
        report[model] = {name: evaluate(pipe, name, args.batch_size, args.retrieval) for name in args.sets.split(",")}
        del pipe
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    sets = args.sets.split(",")
    print("| model | " + " | ".join(f"{s} EM | {s} R@3" for s in sets) + " |")
    print("|---|" + "---:|---:|" * len(sets))
    for model, res in report.items():
        print(f"| {Path(model).name} | " + " | ".join(f"{res[s]['em']} | {res[s]['recall@3']}" for s in sets) + " |")
    for model, res in report.items():
        for s in sets:
            print(f"{Path(model).name} {s} by type: {res[s]['em_by_type']}")
            cut = res[s]["prompts_cut"]
            print(f"{Path(model).name} {s}: {cut['cut']} of {cut['prompts']} reader prompts cut to max_context_length "
                  f"{cut['max_context_length']}")
    return 0


if __name__ == "__main__":
    with rag.quiet("demo_readers"):  # what a rag command shows: no library's bars or warnings
        raise SystemExit(main())
