"""Make the bundled demo RAG model, ``checkpoints/demo`` (what ``rag demo``, ``rag generate`` and
``rag.load("demo")`` use), then check it by loading it back the way users do.

The model is the RAG-Frozen system of ``examples/elements_recipe.py`` (same generator recipe, reading
practice, optimiser, schedule and CPU budget): a RAG-Sequence model whose query encoder is the bundled
all-MiniLM-L6-v2, kept frozen so the checkpoint references it by name and weights fingerprint instead of
carrying its ~90 MB, and whose generator is :mod:`rag.generators.warm_start`'s (frozen MiniLM encoder,
referenced the same way, + a trained 2-layer decoder with a copy head: the only weights stored). The knowledge base is
rebuilt from the bundled corpus on first use.

    python checkpoints/make_demo.py              # 5 CPU-min pre-training (cached) + 10 CPU-min fine-tuning + evaluation

Prints held-out EM/F1/recall of the *reloaded* checkpoint (the numbers ``checkpoints/README.md`` reports)
and writes them to ``checkpoints/demo/eval.json``, which ``tests/test_demo_model.py`` holds the checkpoint to.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (REPO, REPO / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import elements_recipe as demo  # noqa: E402  (examples/elements_recipe.py: the training recipe)


def evaluate_checkpoint(path: Path, kb_path=None, splits=("dev", "test")) -> dict:
    """Held-out metrics of the checkpoint at `path`, loaded with :func:`rag.load`."""
    from rag.demo.kb import ensure_demo_kb
    from rag.pipeline.api import load
    from rag.training.data import read_qa

    kb = ensure_demo_kb(kb_path, show_progress=False)
    pipe = load(path, knowledge_base=kb.path)
    cfg = demo.DemoConfig()
    return {s: {k: v for k, v in demo.evaluate(pipe.model, "rag-frozen", read_qa(f"demo:{s}"), cfg).items() if k != "samples"}
            for s in splits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=demo.DemoConfig.minutes,
                    help="CPU fine-tuning budget (after the shared pre-training)")
    ap.add_argument("--out", type=Path, default=HERE / "demo", help="checkpoint directory (replaced)")
    ap.add_argument("--check-only", action="store_true", help="only evaluate the existing checkpoint at --out")
    args = ap.parse_args(argv)
    if not args.check_only:
        with tempfile.TemporaryDirectory() as runs:
            code = demo.main(["--systems", "rag-frozen", "--minutes", str(args.minutes), "--save-frozen", str(args.out),
                              "--out", runs])
        if code:
            return code
    report = {"checkpoint": str(args.out),
              "bytes": sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()),
              "eval": evaluate_checkpoint(args.out)}
    from rag.utils.io import atomic_write_json

    atomic_write_json(args.out / "eval.json", report["eval"])  # what tests/test_demo_model.py checks the checkpoint against
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
