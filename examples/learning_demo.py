"""Learning demonstration: RAG vs RAG-Frozen vs closed-book on any corpus, each trained by
``lightning_configs/cpu_reader.yaml`` within its CPU budget (the paper's Table 1 / Table 6 comparison), as a thin script
over ``rag fit`` and ``rag test``.

    python examples/learning_demo.py --jobs 2 --out runs/learning_demo/elements          # the bundled Elements demo
    python examples/learning_demo.py --corpus data/foldoc/corpus.jsonl --train data/foldoc/train.jsonl \
        --val data/foldoc/val.jsonl --test data/foldoc/test.jsonl --jobs 2 --out runs/learning_demo/foldoc

``--corpus FILE`` builds the knowledge base first (``rag index build --encoder minilm --index flat``) into ``--kb``
(default ``OUT/kb``; an existing one is used as it is). Each system runs in its own directory under ``--out`` (``rag
fit`` then ``rag test`` on the last checkpoint, both with the config's settings plus the system's: RAG trains the query
encoder, RAG-Frozen keeps it fixed, closed-book reads no passage); arguments after ``--`` go to both (e.g.
``-- --trainer.max_steps 100``); ``--jobs 2`` runs two systems at once; a system whose directory already holds a tested
run is reused, not trained again. Writes ``results.json``, ``results.md`` (the table) and ``results.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "lightning_configs" / "cpu_reader.yaml"
SYSTEMS = {"rag": [], "rag-frozen": ["--model.rag.freeze_query_encoder", "true"], "closed-book": ["--model.closed_book", "true"]}
LABELS = {"rag": "RAG-Sequence", "rag-frozen": "RAG-Frozen", "closed-book": "closed-book"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=None, help="build --kb from this corpus first (when --kb does not exist)")
    p.add_argument("--kb", type=Path, default=None,
                   help="knowledge base (default: OUT/kb with --corpus, else the config's: the Elements demo)")
    p.add_argument("--train", default=None, help="training QA pairs (default: demo:train)")
    p.add_argument("--val", default=None, help="validation QA pairs (default: demo:dev)")
    p.add_argument("--test", default=None, help="test QA pairs (default: demo:test)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    p.add_argument("--jobs", type=int, default=1, help="systems trained at once (one CPU thread each)")
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


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["--config", str(CONFIG), "--trainer.enable_progress_bar", "false"]
    if args.kb is not None:
        out += ["--model.knowledge_base", str(args.kb.resolve()), "--model.build_knowledge_base_from", "null"]
    for split in ("train", "val", "test"):
        value = getattr(args, split)
        if value is not None:
            out += [f"--data.{split}", value if value.startswith("demo:") else str(Path(value).resolve())]
    return out


def last_metrics(run: Path, prefix: str) -> dict:
    """The last logged value of each `prefix` metric in the newest CSV log under `run` that has any (``rag fit`` and
    ``rag test`` each write one)."""
    logs = sorted(run.glob("runs/cpu_reader/logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
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


def trained_steps(run: Path) -> int:
    """Optimizer steps of the run's last checkpoint (memory-mapped: only the counter is read)."""
    import torch

    return int(torch.load(run / "runs/cpu_reader/checkpoints/last.ckpt", map_location="cpu", weights_only=True, mmap=True)["global_step"])


def summary(name: str, run: Path, test: dict) -> dict:
    return {"system": name, "steps": trained_steps(run),
            "cpu_minutes": round(last_metrics(run, "train/").get("train/cpu_minutes", float("nan")), 1), **test}


def run_system(name: str, args: argparse.Namespace) -> dict:
    run = (args.out / name).resolve()
    done = last_metrics(run, "test/")
    if done:  # tested by an earlier invocation: reuse (remove the directory to train again)
        print(f"{name}: reusing the finished run in {run}")
        return summary(name, run, done)
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = overrides(args) + SYSTEMS[name]
    for step, argv in (("fit", rag_command("fit", *common, *args.extra)),
                       ("test", rag_command("test", *common, "--ckpt_path", "runs/cpu_reader/checkpoints/last.ckpt",
                                            "--data.max_eval_examples", "100000", *args.extra))):  # every test question
        with open(run / f"{step}.log", "w") as log:
            if subprocess.run(argv, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"{name}: rag {step} failed; see {run / f'{step}.log'}")
    return summary(name, run, last_metrics(run, "test/"))


def markdown(results: list[dict]) -> str:
    lines = ["| system | steps | test EM | test F1 | recall@1 | recall@3 | training CPU-min |", "|---|---:|---:|---:|---:|---:|---:|"]
    def pct(r: dict, k: str) -> str:
        return f"{100 * r[k]:.1f}" if k in r else "–"

    for r in results:
        lines.append(f"| {LABELS[r['system']]} | {r['steps']:,} | {pct(r, 'test/em')} | {pct(r, 'test/f1')} | {pct(r, 'test/recall@1')} | "
                     f"{pct(r, 'test/recall@3')} | {r['cpu_minutes']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [LABELS[r["system"]] for r in results]
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
    args.out.mkdir(parents=True, exist_ok=True)
    if args.corpus is not None and not args.kb.exists():
        subprocess.run(rag_command("index", "build", "--corpus", str(args.corpus), "--encoder", "minilm", "--index", "flat",
                                   "--out", str(args.kb), "--quiet"), check=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: run_system(s, args), systems))
    from rag.utils.io import atomic_write_json, atomic_write_text

    atomic_write_json(args.out / "results.json", {"command": " ".join(["python", "examples/learning_demo.py", *(sys.argv[1:] if argv is None else argv)]),
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
