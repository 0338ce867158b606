"""RetRobust with a decoder-only reader (Yoran et al. 2024): SmolLM2-135M-Instruct fine-tuned through the package's
:class:`~rag.training.causal_reader.CausalReaderModule` (what ``rag fit --config lightning_configs/retrobust_reader_smollm2.yaml``
runs), evaluated like ``examples/retrobust_demo.py`` (whose tables and Self-Ask evaluation it reuses).

Three readers, each fine-tuned for ``--steps`` steps of ``--batch`` demo training questions (``demo:train``) through a
Lightning ``Trainer`` with :class:`~rag.training.data.QADataModule`:

* **closed-book**: the prompt ``Question: q\\nAnswer:`` alone (NoRet);
* **top-1**: ``context_mixing`` with ``p_top1=1``, the question's top-1 passage before the prompt;
* **RetRobust**: the paper's mix (1/3 top-1, 1/3 low-ranked = ranks 5-9 of the top 10, 1/3 random).

The top-1 and RetRobust readers also learn to write Self-Ask lines (``--selfask-batch`` chains per step). The tables:
EM of known (training) and KB-only (test) questions under top-1, low-ranked and random passages, with the NLI back-off
(§2.1) over the closed-book reader's answers; then Self-Ask on two-hop test questions.

    OMP_NUM_THREADS=1 python examples/retrobust_causal_demo.py      # ~35 CPU-minutes on 1 thread

writes ``--out`` (``runs/retrobust_causal_demo``: the trained readers, reused when present) and ``--results``
(``benchmarks/results/retrobust_causal_demo.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "examples"):
    if str(p) not in sys.path:  # run from a checkout without installing; retrobust_demo is a sibling
        sys.path.insert(0, str(p))

from retrobust_demo import CONDITIONS, MIXES, READERS, TOP_K, evaluate_and_write  # noqa: E402

from rag.demo.kb import ensure_demo_kb  # noqa: E402
from rag.training.causal_reader import CausalReaderModule  # noqa: E402
from rag.training.context_mixing import ContextMixing  # noqa: E402
from rag.training.data import QADataModule  # noqa: E402
from rag.utils.io import atomic_write_json  # noqa: E402

logger = logging.getLogger("retrobust_causal_demo")
if set(CONDITIONS) != {"top-1", "low-ranked", "random"}:  # the readers below are trained for these three mixes
    raise RuntimeError(f"retrobust_demo.CONDITIONS changed to {sorted(CONDITIONS)}; update retrobust_causal_demo.py to match")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lm", default="smollm2", help="the decoder-only LM to fine-tune (directory or demo alias)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per reader")
    p.add_argument("--batch", type=int, default=4, help="QA pairs per step")
    p.add_argument("--selfask-batch", type=int, default=2, help="Self-Ask chain lines per step (top-1, RetRobust)")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (warm-up 10%%, linear decay)")
    p.add_argument("--doc-max-length", type=int, default=128, help="passage tokens read")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="tokens generated per answer or Self-Ask line (a follow-up question needs ~15)")
    p.add_argument("--n-known", type=int, default=50, help="known (training) questions evaluated")
    p.add_argument("--n-kb", type=int, default=50, help="KB-only (test) questions evaluated")
    p.add_argument("--n-multihop", type=int, default=20, help="two-hop test questions for Self-Ask")
    p.add_argument("--threshold", type=float, default=0.5, help="NLI entailment threshold (paper: 0.5)")
    p.add_argument("--max-steps", type=int, default=4, help="Self-Ask step limit")
    p.add_argument("--nli", default=None, help="NLI model directory (default: $RAG_CACHE/nli/minilm-snli)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/retrobust_causal_demo"))
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "retrobust_causal_demo.json")
    return p.parse_args(argv)


def make_reader(lm: str, kb, args, selfask: bool) -> CausalReaderModule:
    module = CausalReaderModule(lm=lm, knowledge_base=str(kb.path), doc_max_length=args.doc_max_length,
                                optimizer={"lr": args.lr, "warmup_ratio": 0.1}, selfask="demo" if selfask else None,
                                selfask_batch=args.selfask_batch,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    module.configure_model()
    return module


def ensure_reader(name: str, kb, args) -> tuple[CausalReaderModule, dict]:
    """The reader `name` from ``--out``, fine-tuned and exported first when absent."""
    import pytorch_lightning as pl

    path = args.out / name
    if (path / "training.json").is_file():
        module = make_reader(str(path), kb, args, selfask=False)
        return module.eval(), json.loads((path / "training.json").read_text())
    pl.seed_everything(args.seed, verbose=False)
    module = make_reader(args.lm, kb, args, selfask=name != "closed-book")
    mixing = None
    if name in MIXES:
        p1, pl_, pr = MIXES[name]
        mixing = ContextMixing(knowledge_base=str(kb.path), top_k=TOP_K, p_top1=p1, p_low=pl_, p_random=pr, seed=args.seed)
    data = QADataModule(train="demo:train", batch_size=args.batch, context_mixing=mixing)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0, enable_progress_bar=False,
                         enable_model_summary=False)
    t0 = time.process_time()
    trainer.fit(module, datamodule=data)
    kinds = data.train_pairs.context_kinds
    record = {"steps": trainer.global_step, "cpu_seconds": round(time.process_time() - t0, 1),
              "final_loss": round(float(trainer.callback_metrics.get("train/loss", float("nan"))), 4),
              "train_pairs": len(data.train_pairs), "selfask_examples": len(module._chains),
              "context_kinds": None if kinds is None else {k: kinds.count(k) for k in ("top1", "low", "random")}}
    module.export(path)
    atomic_write_json(path / "training.json", record)
    logger.info("%s: %s", name, record)
    del module, trainer  # the optimizer state (2x the weights) goes with the trainer; read the exported reader back
    return make_reader(str(path), kb, args, selfask=False).eval(), record


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "rag.generation.contexts", "pytorch_lightning", "lightning.pytorch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    kb = ensure_demo_kb(show_progress=False)
    readers, training = {}, {}
    for name in READERS:
        readers[name], training[name] = ensure_reader(name, kb, args)
    evaluate_and_write("examples/retrobust_causal_demo.py", readers, training, kb, args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
