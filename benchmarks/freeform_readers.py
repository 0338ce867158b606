"""Readers side by side on free-form questions and on the trained kinds: EM, token F1 and gold-in-answer
(:func:`rag.eval.metrics.gold_in_answer`) of each model, through ``rag.evaluate`` (each answers with its stored
settings, as ``rag generate`` does), with recall of the passages read.

A model is a directory (``checkpoints/demo_causal``, a ``rag fit`` export) or ``base:DIR``: the same pipeline with its
LoRA adapter switched off (every ``lora_B`` zero, so the generator is exactly the base LM it names), the *zero-shot
base reader* read through the same template, retrieval and decoding. A set is a ``demo:`` name or a JSONL file;
``--kb`` gives the knowledge base a file's questions are asked of (default: each model's own).

    python benchmarks/freeform_readers.py --models checkpoints/demo_causal,base:checkpoints/demo_causal \\
        --sets demo:freeform,demo:test,demo:natural --out runs/freeform
    python benchmarks/freeform_readers.py --models checkpoints/demo_causal,base:checkpoints/demo_causal \\
        --sets benchmarks/data/foldoc_freeform.jsonl --kb data/foldoc/kb --out runs/freeform_foldoc

Each (model, set) is a results directory under ``--out`` (resumed when killed); ``--out/summary.json`` holds the
table's numbers, which it prints as Markdown.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rag  # noqa: E402 (after the repository is on the path)
from rag.utils.io import atomic_write_json  # noqa: E402

METRICS = ("gold_in_answer", "em", "f1", "recall@1", "answer_recall@3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="checkpoints/demo_causal,base:checkpoints/demo_causal")
    p.add_argument("--sets", default="demo:freeform,demo:test,demo:natural")
    p.add_argument("--kb", default=None, help="knowledge base for every set (default: each model's own)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def open_model(spec: str, kb=None):
    """The pipeline of `spec` (see the module docstring); ``base:DIR`` with every LoRA ``B`` matrix zeroed."""
    base = spec.startswith("base:")
    pipe = rag.load(spec[len("base:"):] if base else spec, knowledge_base=kb)
    if base:
        zeroed = 0
        with torch.no_grad():
            for name, param in pipe.reader.model.named_parameters():
                if "lora_B" in name:
                    param.zero_()
                    zeroed += 1
        if not zeroed:
            raise SystemExit(f"{spec}: the model has no LoRA adapter to switch off")
    return pipe


def _slug(text: str) -> str:
    """`text` as one file name: every run of other characters than letters, digits, ``_.-`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    table: dict = {}
    for spec in args.models.split(","):
        pipe = open_model(spec, args.kb)
        for data in args.sets.split(","):
            out = args.out / f"{_slug(spec)}__{_slug(Path(data).stem)}"
            s = rag.evaluate(pipe, data, out, ks=(1, 3), batch_size=args.batch_size, progress=False)
            table.setdefault(spec, {})[data] = {**{m: round(100 * s["metrics"][m], 1) for m in METRICS if m in s["metrics"]},
                                                "n": s["questions"],
                                                "cut_prompts": s.get("cut_prompts", {}).get("cut")}
        del pipe
    atomic_write_json(args.out / "summary.json", table)
    sets = args.sets.split(",")
    print("| model | " + " | ".join(f"{Path(d).stem} GIA / EM" for d in sets) + " |")
    print("|---|" + "---:|" * len(sets))
    for spec, row in table.items():
        print(f"| {spec} | " + " | ".join(f"{row[d]['gold_in_answer']} / {row[d]['em']}" for d in sets) + " |")
    return 0


if __name__ == "__main__":
    with rag.quiet("freeform_readers"):  # what a rag command shows: no library's bars or warnings
        raise SystemExit(main())
