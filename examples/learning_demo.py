"""Learning demonstration: RAG vs RAG-Frozen vs closed-book on any corpus, each trained within a CPU budget by a reader
recipe (the paper's Table 1 / Table 6 comparison), as a thin script over ``rag fit`` and ``rag test``. Two recipes:
``seq2seq`` (``lightning_configs/cpu_reader.yaml``: a warm-started reader with a copy head) and ``causal``
(``lightning_configs/cpu_causal_reader.yaml``: SmolLM2-135M-Instruct with LoRA adapters, hybrid retrieval).

    python examples/learning_demo.py --jobs 2 --out runs/learning_demo/elements          # the bundled Elements demo
    python examples/learning_demo.py --readers causal,seq2seq --minutes 30 --out runs/learning_demo/readers
    python examples/learning_demo.py --corpus data/foldoc/corpus.jsonl --train data/foldoc/train.jsonl \
        --val data/foldoc/val.jsonl --test data/foldoc/test.jsonl --jobs 2 --out runs/learning_demo/foldoc

``--corpus FILE`` builds the knowledge base first (``rag index build --encoder minilm --index flat --bm25``) into
``--kb`` (default ``OUT/kb``; an existing one is used as it is). Each (recipe, system) runs in its own directory under
``--out`` (``OUT/SYSTEM`` for the seq2seq recipe alone, else ``OUT/READER/SYSTEM``): ``rag fit`` then ``rag test`` on
the last checkpoint, both with the recipe's config plus the system's settings (RAG trains the query encoder, RAG-Frozen
keeps it fixed, closed-book reads no passage), output under ``--trainer.default_root_dir RUN/out`` and the trained model
in ``RUN/model``; ``--minutes M`` gives every run the same CPU budget (default: each config's own); arguments after
``--`` go to both commands (e.g. ``-- --trainer.max_steps 100``); ``--jobs 2`` runs two at once (each on
``--threads`` threads); a run whose directory already holds a tested run is reused, not trained again. Writes
``results.json``, ``results.md`` (the table) and ``results.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"seq2seq": REPO / "lightning_configs" / "cpu_reader.yaml",
           "causal": REPO / "lightning_configs" / "cpu_causal_reader.yaml"}
CONFIG = CONFIGS["seq2seq"]
SYSTEMS = {"rag": [], "rag-frozen": ["--model.rag.freeze_query_encoder", "true"], "closed-book": ["--model.closed_book", "true"]}
LABELS = {"rag": "RAG-Sequence", "rag-frozen": "RAG-Frozen", "closed-book": "closed-book"}
READER_LABELS = {"seq2seq": "warm-start seq2seq + copy head", "causal": "SmolLM2-135M + LoRA"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=None, help="build --kb from this corpus first (when --kb does not exist)")
    p.add_argument("--kb", type=Path, default=None,
                   help="knowledge base (default: OUT/kb with --corpus, else the config's: the Elements demo)")
    p.add_argument("--train", default=None, help="training QA pairs (default: demo:train)")
    p.add_argument("--val", default=None, help="validation QA pairs (default: demo:dev)")
    p.add_argument("--test", default=None, help="test QA pairs (default: demo:test)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    p.add_argument("--readers", default="seq2seq", help=f"recipes, any of {', '.join(CONFIGS)}")
    p.add_argument("--minutes", type=float, default=None, help="the CPU budget of every run (default: each config's)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--out", type=Path, required=True)
    argv, extra = list(sys.argv[1:] if argv is None else argv), []
    if "--" in argv:  # the rest goes to rag fit / rag test
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    args.extra = extra
    if args.corpus is not None and args.kb is None:
        args.kb = args.out / "kb"
    return args


def rag_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rag", *args]


def run_config(reader: str, run: Path, minutes: Optional[float]) -> Path:
    """The recipe's config, with every CpuBudget set to `minutes` when given (written into the run directory)."""
    if minutes is None:
        return CONFIGS[reader]
    import yaml

    cfg = yaml.safe_load(CONFIGS[reader].read_text(encoding="utf-8"))
    for cb in cfg.get("trainer", {}).get("callbacks", []) or []:
        if isinstance(cb, dict) and cb.get("class_path", "").endswith("CpuBudget"):
            cb.setdefault("init_args", {})["minutes"] = float(minutes)
    out = run / "config.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return out


def overrides(args: argparse.Namespace, reader: str = "seq2seq", run: Optional[Path] = None) -> list[str]:
    config = CONFIG if run is None else run_config(reader, run, getattr(args, "minutes", None))
    out = ["--config", str(config), "--trainer.enable_progress_bar", "false"]
    if run is not None:  # every output of the run under its directory, whatever the config names
        out += ["--trainer.default_root_dir", str(run / "out"), "--model.export_dir", str(run / "model"),
                "--trainer.logger", json.dumps({"class_path": "pytorch_lightning.loggers.CSVLogger",
                                                "init_args": {"save_dir": str(run / "out"), "name": "logs"}})]
    if args.kb is not None:
        out += ["--model.knowledge_base", str(args.kb.resolve()), "--model.build_knowledge_base", "null"]
    for split in ("train", "val", "test"):
        value = getattr(args, split)
        if value is not None:
            out += [f"--data.{split}", value if value.startswith("demo:") else str(Path(value).resolve())]
    return out


def last_metrics(run: Path, prefix: str) -> dict:
    """The last logged value of each `prefix` metric in the newest CSV log under `run` that has any (``rag fit`` and
    ``rag test`` each write one)."""
    logs = sorted(run.glob("**/logs/version_*/metrics.csv"), key=lambda p: (p.stat().st_mtime, int(p.parent.name.split("_")[1])))
    for log in reversed(logs):
        found: dict = {}
        with open(log, encoding="utf-8") as f:
            for row in csv.DictReader(f):
                for k, v in row.items():
                    if k.startswith(prefix) and v not in ("", None):
                        found[k] = float(v)
        if found:
            return found
    return {}


def last_checkpoint(run: Path) -> Path:
    """The run's ``last.ckpt`` (wherever its config's ModelCheckpoint put it under the run directory)."""
    found = sorted(run.glob("**/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{run}: rag fit wrote no last.ckpt; see {run / 'fit.log'}")
    return found[-1]


def trained_steps(run: Path) -> int:
    """Optimizer steps of the run's last checkpoint (memory-mapped: only the counter is read)."""
    import torch

    return int(torch.load(last_checkpoint(run), map_location="cpu", weights_only=True, mmap=True)["global_step"])


def summary(name: str, run: Path, test: dict, reader: str = "seq2seq") -> dict:
    return {"reader": reader, "system": name, "steps": trained_steps(run),
            "cpu_minutes": round(last_metrics(run, "train/").get("train/cpu_minutes", float("nan")), 1), **test}


def run_system(name: str, args: argparse.Namespace, reader: str = "seq2seq") -> dict:
    readers = [r for r in args.readers.split(",") if r]
    run = (args.out / name if readers == ["seq2seq"] else args.out / reader / name).resolve()
    done = last_metrics(run, "test/")
    if done:  # tested by an earlier invocation: reuse (remove the directory to train again)
        print(f"{reader} {name}: reusing the finished run in {run}")
        return summary(name, run, done, reader)
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    common = overrides(args, reader, run) + SYSTEMS[name]
    with open(run / "fit.log", "w") as log:
        if subprocess.run(rag_command("fit", *common, *args.extra), cwd=run, env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{reader} {name}: rag fit failed; see {run / 'fit.log'}")
    test = rag_command("test", *common, "--ckpt_path", str(last_checkpoint(run)), "--data.max_eval_examples", "100000",
                       *args.extra)  # every test question
    with open(run / "test.log", "w") as log:
        if subprocess.run(test, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{reader} {name}: rag test failed; see {run / 'test.log'}")
    return summary(name, run, last_metrics(run, "test/"), reader)


def markdown(results: list[dict]) -> str:
    lines = ["| reader | system | steps | test EM | test F1 | recall@1 | recall@3 | training CPU-min |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    def pct(r: dict, k: str) -> str:
        return f"{100 * r[k]:.1f}" if k in r else "–"

    for r in results:
        lines.append(f"| {READER_LABELS[r.get('reader', 'seq2seq')]} | {LABELS[r['system']]} | {r['steps']:,} | "
                     f"{pct(r, 'test/em')} | "
                     f"{pct(r, 'test/f1')} | {pct(r, 'test/recall@1')} | {pct(r, 'test/recall@3')} | {r['cpu_minutes']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [LABELS[r["system"]] + ("" if r.get("reader", "seq2seq") == "seq2seq" else "\n(causal)") for r in results]
    for i, metric in enumerate(("test/em", "test/f1")):
        ax.bar([x + 0.4 * i for x in range(len(results))], [100 * r.get(metric, 0) for r in results], width=0.4,
               label=metric.split("/")[1].upper())
    ax.set_xticks([x + 0.2 for x in range(len(results))], names)
    ax.set_ylabel("%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    readers = [r for r in args.readers.split(",") if r]
    if not readers or any(r not in CONFIGS for r in readers):
        sys.exit(f"--readers: {args.readers!r}; choose from {list(CONFIGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.corpus is not None and not args.kb.exists():
        subprocess.run(rag_command("index", "build", "--corpus", str(args.corpus), "--encoder", "minilm", "--index", "flat",
                                   "--bm25", "--out", str(args.kb), "--quiet"), check=True)
    runs = [(r, s) for r in readers for s in systems]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda rs: run_system(rs[1], args, rs[0]), runs))
    from rag.utils.io import atomic_write_json, atomic_write_text

    atomic_write_json(args.out / "results.json",
                      {"command": " ".join(["python", "examples/learning_demo.py", *(sys.argv[1:] if argv is None else argv)]),
                                                  "results": results})
    table = markdown(results)
    atomic_write_text(args.out / "results.md", table)
    plot(results, args.out / "results.png")
    print(table)
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    raise SystemExit(main())
