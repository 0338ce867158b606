"""Benchmark: how much a background index refresh slows training down.

Trains the tiny CPU recipe with a trainable document encoder
(``lightning_configs/tiny_cpu_refresh.yaml``: tiny BART + MiniLM query encoder, MiniLM document
encoder trained end to end via ``rag.train_doc_encoder``, demo knowledge base) for ``--steps``
optimizer steps, with an :class:`~rag.training.callbacks.IndexRefresh` that starts a background
rebuild at each step of ``--refresh-at``. Every training step is timed and classified:

* **idle**: no refresh running during the step;
* **in flight**: a rebuild process was running while the step computed;
* **start** / **swap**: the step that saved the document-encoder snapshot and spawned the worker,
  and the step after which the new knowledge base was swapped in (their extra cost is reported
  separately: it is paid once per refresh, on the training thread).

Per step, wall time and the trainer process's CPU time are recorded: if a step's CPU time stays
the same while its wall time grows, the slowdown is CPU contention (scheduling), not extra work.

Reported: steps/s idle vs in flight and their ratio (the slowdown while a refresh runs), median step
times, refresh durations, snapshot and swap costs. Idle and in-flight steps interleave within one
run, so a change in the machine's background load affects both alike; load averages are recorded,
because the CPU may be shared with other work.

Example::

    .venv/bin/python benchmarks/refresh_bench.py                       # tiny DPR encoders, build at nice 0
    .venv/bin/python benchmarks/refresh_bench.py --worker-nice 10      # IndexRefresh's default priority
    .venv/bin/python benchmarks/refresh_bench.py --encoders minilm --batch-size 8 --steps 40   # the YAML's MiniLM

The build runs at normal priority by default here (``--worker-nice 0``): the worst case for training.
With IndexRefresh's default ``worker_nice=10`` on a machine that is already oversubscribed, the build
gets so little CPU that it may not finish within the run (training then barely slows down, and the
index simply refreshes late).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from rag.training.callbacks import IndexRefresh  # noqa: E402
from rag.utils.io import atomic_write_json  # noqa: E402


class StepTimer(pl.Callback):
    """Wall time of every training step (batch start -> after every callback's batch end, the
    refresh's poll/snapshot/swap included), and the refresh state around it."""

    def __init__(self, refresh: IndexRefresh):
        self.refresh = refresh
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self._busy = self.refresh.in_flight
        self._started = self.refresh.started
        self._done = self.refresh.swaps + self.refresh.failures

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dt, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
        self.rows.append({
            "step": trainer.global_step, "seconds": dt, "cpu_seconds": cpu, "busy": self._busy,
            "started": self.refresh.started > self._started,
            "finished": self.refresh.swaps + self.refresh.failures > self._done,
        })


def tiny_dpr_knowledge_base(root: Path) -> tuple[str, str]:
    """Random DPR question/context encoders the size of the tiny generator, and the demo corpus encoded
    by the context encoder (built once under `root`)."""
    from rag.demo import load_demo_corpus
    from rag.generators.tiny import sample_texts, save, tiny_dpr, train_wordpiece_tokenizer
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    q_dir, c_dir, kb_dir = root / "dpr_q", root / "dpr_c", root / "kb"
    if not (kb_dir / "manifest.json").is_file():
        tok = train_wordpiece_tokenizer(list(sample_texts()), vocab_size=1500)
        for kind, d, seed in (("question", q_dir, 1), ("context", c_dir, 2)):
            save(tiny_dpr(tok, kind, d_model=128, layers=2, heads=4, ffn=256, seed=seed), tok, d)
        KnowledgeBase.build(load_demo_corpus(), TextEncoder(str(c_dir), role="context"), kb_dir, index="flat",
                            query_encoder=str(q_dir), show_progress=False, overwrite=True)
    return str(q_dir), str(kb_dir)


def rate(rows: list[dict]) -> dict:
    secs = [r["seconds"] for r in rows]
    if not secs:
        return {"steps": 0}
    cpu = [r["cpu_seconds"] for r in rows]
    return {"steps": len(secs), "steps_per_s": round(len(secs) / sum(secs), 3),
            "median_step_s": round(statistics.median(secs), 4),
            "p90_step_s": round(sorted(secs)[int(0.9 * (len(secs) - 1))], 4),
            "median_step_cpu_s": round(statistics.median(cpu), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "lightning_configs" / "tiny_cpu_refresh.yaml"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--refresh-at", default="20,220", help="comma-separated steps at which a refresh starts")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the statistics")
    ap.add_argument("--worker-nice", type=int, default=0,
                    help="0: the build competes at normal priority (worst case for training)")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="trainer torch threads (0: torch default). 1 by default: on 2 shared cores, 2 threads made "
                         "tiny-model steps ~8x slower (OpenMP threads waiting on each other)")
    ap.add_argument("--batch-size", type=int, default=4, help="training batch size (overrides the config)")
    ap.add_argument("--rerank", type=int, default=0, help="rag.rerank_candidates (0: none, overrides the config)")
    ap.add_argument("--encoders", choices=("tiny-dpr", "minilm"), default="tiny-dpr",
                    help="tiny-dpr: the config with random DPR query/document encoders of the tiny generator's size "
                         "(d_model 128, 2 layers) over the demo corpus; minilm: the config as written (MiniLM encoders)")
    ap.add_argument("--out", default=str(HERE / "results" / "refresh_bench.json"))
    args = ap.parse_args()

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rag.training.callbacks").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        torch.set_num_threads(args.threads)
    from rag.cli.train import make_cli

    os.chdir(ROOT)  # the config's relative paths (.cache/demo_kb, runs/...) are relative to the repo root
    import tempfile

    import yaml

    cfg = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
    cfg["data"]["init_args"]["batch_size"] = args.batch_size
    cfg["model"]["init_args"]["rag"]["rerank_candidates"] = args.rerank or None
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"].get("callbacks", []) if not c["class_path"].endswith("IndexRefresh")]
    overrides = {"data.batch_size": args.batch_size, "model.rag.rerank_candidates": args.rerank or None}
    if args.encoders == "tiny-dpr":
        q_dir, kb_dir = tiny_dpr_knowledge_base(ROOT / ".cache" / "refresh_bench")
        cfg["model"]["init_args"].update(question_encoder=q_dir, knowledge_base=kb_dir, build_knowledge_base=None)
        overrides.update({"model.question_encoder": "tiny DPR (d_model 128, 2 layers)", "model.knowledge_base": kb_dir})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    cli = make_cli(["--config", f.name], run=False)
    os.unlink(f.name)
    module, data = cli.model, cli.datamodule
    module.prepare_data()  # builds the demo knowledge base / tiny generator once (not timed)

    steps = sorted({int(s) for s in args.refresh_at.split(",") if s.strip()})
    schedule = ",".join(f"{s}-{s + 1}:1" for s in steps)
    out_dir = ROOT / "runs" / "refresh_bench"
    refresh = IndexRefresh(every=schedule, output_dir=str(out_dir), worker_nice=args.worker_nice,
                           worker_threads=args.worker_threads, at_train_end="wait", keep=1)
    timer = StepTimer(refresh)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[refresh, timer], default_root_dir=str(out_dir))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()

    rows = timer.rows[args.warmup:]
    idle = [r for r in rows if not r["busy"] and not r["started"] and not r["finished"]]
    busy = [r for r in rows if r["busy"] and not r["finished"]]
    start_rows = [r for r in rows if r["started"]]
    swap_rows = [r for r in rows if r["finished"]]
    idle_r, busy_r = rate(idle), rate(busy)
    median_idle = idle_r.get("median_step_s", float("nan"))
    result = {
        "benchmark": "refresh_bench",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other work, no GPU used",
        "load_average_before_after": [round(x, 2) for x in load_before + load_after],
        "config": os.path.relpath(args.config, ROOT), "encoders": args.encoders, "overrides": overrides,
        "trainer_torch_threads": torch.get_num_threads(),
        "worker": {"nice": args.worker_nice, "threads": args.worker_threads},
        "knowledge_base_passages": len(module.model.knowledge_base),
        "steps": args.steps, "wall_seconds": round(wall, 1),
        "idle": idle_r,
        "refresh_in_flight": busy_r,
        "slowdown_ratio_in_flight_vs_idle": round(busy_r["steps_per_s"] / idle_r["steps_per_s"], 3) if busy and idle else None,
        "refresh_start_step_extra_s": [round(r["seconds"] - median_idle, 3) for r in start_rows],
        "swap_step_extra_s": [round(r["seconds"] - median_idle, 3) for r in swap_rows],
        "refreshes": [{k: h[k] for k in ("step", "ok", "seconds") if k in h} | (
            {"swap_lock_s": round(h["swap"]["commit_seconds"], 6)} if h.get("ok") else {"error": h.get("error", "")[:200]})
            for h in refresh.history],
        "timeline": [[r["step"], round(r["seconds"], 3), round(r["cpu_seconds"], 3),
                      "start" if r["started"] else "swap" if r["finished"] else "in_flight" if r["busy"] else "idle"]
                     for r in timer.rows],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
