"""Seconds per answer of a RAG model (the causal demo by default) after it is loaded, batch 1 and batch 8, with and
without sharing each prompt's KV cache.

What is timed is what ``rag generate`` does per batch: retrieval, the prompts (or contexts), decoding with the model's
stored settings, and each answer's provenance (:meth:`rag.pipeline.readers.RagReader.generate`'s path,
``generate_for_questions`` + ``answers_with_provenance``). Loading (the base LM, its checksums, the adapter, the
knowledge base) is timed once, apart. "shared": each (question, passage) prompt is prefilled once and every decoder
row and rescoring pair starts from a copy of its KV cache; "not shared": each of them prefills its prompt again, the
layout transformers' beam search uses (:class:`rag.generation.causal.CausalPrompts`).

    python benchmarks/causal_rag_bench.py                                   # checkpoints/demo_causal, 2 threads
    python benchmarks/causal_rag_bench.py --model checkpoints/demo --questions 16
    python benchmarks/causal_rag_bench.py --decoding thorough --marginalization sequence
    python benchmarks/causal_rag_bench.py --extractive both      # extractive decoding off and on, side by side

Questions: the held-out Elements test questions (``demo:test``), the first ``--questions`` of them, in batches of 1 and
8; the first batch of each setting is a warm-up and not counted. Writes ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "checkpoints" / "demo_causal"), help="model directory, or 'demo'")
    p.add_argument("--questions", type=int, default=24, help="questions timed per setting (after one warm-up batch)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--marginalization", default=None, choices=("sequence", "token"), help="default: the model's")
    p.add_argument("--decoding", default="fast", choices=("fast", "thorough"))
    p.add_argument("--num-beams", type=int, default=None, help="default: the model's stored setting")
    p.add_argument("--extractive", default="model", choices=("model", "on", "off", "both"),
                   help="extractive decoding: the model's stored setting, on, off, or both side by side")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "causal_rag_bench.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from rag.eval.qa_data import read_qa
    from rag.models.rag.generate import answers_with_provenance, generate_for_questions
    from rag.pipeline.api import load

    t0 = time.perf_counter()
    pipe = load(args.model)
    load_s = time.perf_counter() - t0
    reader, model = pipe.reader, pipe.model
    kind = "causal" if getattr(model, "is_causal", False) else "seq2seq"
    config = reader._generation_config(args.num_beams, None, 1, {})  # the model's stored settings, as rag generate uses them
    questions = [e.question for e in read_qa("demo:test")]
    extractive = {"model": (config.extractive,), "on": (True,), "off": (False,), "both": (False, True)}[args.extractive]
    results = []
    for batch, ext, share in [(b, e, s) for b in map(int, args.batch_sizes.split(",")) for e in extractive
                              for s in ((True, False) if kind == "causal" else (True,))]:
        cfg = dataclasses.replace(config, extractive=ext)

        def run(qs, share=share, cfg=cfg):
            found = generate_for_questions(model, qs, cfg, marginalization=args.marginalization, decoding=args.decoding,
                                           share_cache=share)
            return answers_with_provenance(model, qs, found.inputs, found.contexts, found.output, 1, found.marginalization)

        with torch.no_grad():
            run(questions[:batch])  # warm-up
            timed, start = questions[batch:batch + args.questions], time.perf_counter()
            for i in range(0, len(timed), batch):
                run(timed[i:i + batch])
            secs = time.perf_counter() - start
        results.append({"batch": batch, "extractive": ext, "kv_cache_shared": share, "questions": len(timed),
                        "seconds_per_answer": round(secs / len(timed), 3)})
        print(f"batch {batch:2d}  extractive {'on ' if ext else 'off'}  kv cache {'shared' if share else 'not shared':10s}  "
              f"{secs / len(timed):6.3f} s/answer  ({len(timed)} questions)", flush=True)
    report = {"model": args.model, "kind": kind, "load_seconds": round(load_s, 1), "threads": args.threads,
              "marginalization": args.marginalization or model.config.marginalization, "decoding": args.decoding,
              "generation": {k: v for k, v in vars(config).items() if v not in (None, 0, False)},
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_average": os.getloadavg(), "torch": torch.__version__},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"load {load_s:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
