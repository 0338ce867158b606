"""REPLUG and REPLUG LSR (Shi et al. 2023) on a real LM and real text: SmolLM2-135M-Instruct reading the Python library reference.

Corpus and knowledge base: the recipe of ``examples/ralm_demo.py`` (whose reading, cleaning and knowledge-base code this
script imports): the reStructuredText sources of the Python 3 library reference from Debian's ``python3-doc``, 100-word
passages, MiniLM dense index + BM25. ``--n-eval`` documents are held out entirely (evaluation texts: their first
``--text-tokens`` tokens), ``--n-train`` further documents are held out too and give REPLUG LSR's training pairs
(x = ``--lsr-query-tokens`` tokens, y = the next ``--lsr-target-tokens``); the knowledge base holds every other document,
and the leakage guard (``exclude_own``) stays on.

Measurements, bits per byte and perplexity through :class:`rag.models.ralm.model.InContextRALM` (REPLUG:
``RalmConfig(ensemble=K)``, every ``--stride`` tokens the last 32 tokens query the retriever, the K documents are read separately
and the K next-token distributions mixed with λ = softmax(score / temperature)):
(a) no retrieval; REPLUG with dense (MiniLM) and BM25 retrieval for K in ``--ks`` (Table 1, Fig. 4);
(b) REPLUG LSR: the query encoder trained with ``rag fit --config lightning_configs/replug_lsr_smollm2.yaml`` from the frozen
    LM's signal (§4), then REPLUG with the trained query encoder for the same K;
(c) the control: K random passages with the same weighting (Fig. 4);
(d) the bundled Elements QA test questions (``rag.demo``): the same frozen LM as a causal reader prompted with
    ``Question: ...\\nAnswer:`` after each retrieved passage (dense top-K of the Elements knowledge base), greedy
    REPLUG generation (:func:`rag.models.replug.ensemble.replug_generate`) with K = 1 (top-1 only) vs ``--qa-k``: EM and F1.

    apt-get install python3-doc && python -m rag lm prepare
    OMP_NUM_THREADS=1 python examples/replug_demo.py          # see examples/README.md for the CPU time

writes ``--out`` (``runs/replug_demo``: corpus JSONL files, the knowledge bases, the trained query encoder) and
``--results`` (``benchmarks/results/replug_demo.json``) after every run, then ``--plot`` (``benchmarks/results/replug_demo.png``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from rag.eval.perplexity import paired_difference, per_text_records  # noqa: E402
from rag.models.ralm.model import EvalText, InContextRALM, RalmConfig  # noqa: E402
from rag.utils.errors import ConfigError, CorpusError  # noqa: E402
from rag.utils.io import atomic_write_json, atomic_write_text  # noqa: E402

CONFIG = REPO / "lightning_configs" / "replug_lsr_smollm2.yaml"


def _ralm_demo():
    """examples/ralm_demo.py as a module (the corpus reading and knowledge-base recipe live there, once)."""
    name = "rag_examples_ralm_demo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "ralm_demo.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def replug_settings(k: Optional[int], temperature: float, random_docs: bool = False) -> dict:
    """The REPLUG fields of :class:`RalmConfig` (the one place that names them): K documents per chunk, the temperature of
    λ = softmax(score / temperature), and the random-documents control."""
    if k is None:
        return {}
    return {"ensemble": k, "retrieval_temperature": temperature, "random_docs": random_docs}


# ---------------------------------------------------------------------------- data


def split_corpus(docs, tokenizer, *, n_eval: int, n_train: int, text_tokens: int, seed: int):
    """Held-out evaluation texts, held-out LSR training documents, and the knowledge-base documents (all others)."""
    first_tokens = _ralm_demo().first_tokens
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    evals, train, held = [], [], set()
    for i in order:
        if len(evals) >= n_eval and len(train) >= n_train:
            break
        text = first_tokens(tokenizer, docs[i].text, text_tokens)
        if text is None:
            continue
        if len(evals) < n_eval:
            evals.append(EvalText(text, docs[i].id, docs[i].title))
        else:
            train.append(docs[i])
        held.add(i)
    if len(evals) < n_eval or len(train) < n_train:
        raise CorpusError(f"only {len(evals) + len(train)} documents have {text_tokens} tokens; lower --n-eval / --n-train "
                          f"or --text-tokens")
    return evals, train, [d for i, d in enumerate(docs) if i not in held]


def lsr_pairs(tokenizer, docs, *, query_tokens: int, target_tokens: int, per_doc: int) -> list[dict]:
    """REPLUG LSR training pairs (§4): x = `query_tokens` tokens of a document, y = the `target_tokens` that follow;
    `per_doc` disjoint pairs per document, in QADataModule's JSONL fields (question, answers)."""
    out = []
    span = query_tokens + target_tokens
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        for j in range(min(per_doc, len(ids) // span)):
            x = tokenizer.decode(ids[j * span:j * span + query_tokens]).strip()
            y = tokenizer.decode(ids[j * span + query_tokens:(j + 1) * span]).strip()
            if x and y:
                out.append({"question": x, "answers": [y], "doc": d.id})
    return out


def write_pairs(path: Path, pairs: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(p) + "\n" for p in pairs))


# ---------------------------------------------------------------------------- measurements


class Runner:
    """Runs REPLUG settings on the evaluation texts and records each result (written after every run)."""

    def __init__(self, model, tokenizer, texts, args, results, results_path: Path):
        self.model, self.tokenizer, self.texts, self.args = model, tokenizer, texts, args
        self.results, self.results_path = results, results_path

    def run(self, method: str, retriever, k: Optional[int], *, temperature: float = 1.0, random_docs: bool = False) -> dict:
        from rag.eval.perplexity import perplexity_totals

        a = self.args
        name = method if k is None else f"{method} k={k}"
        cached = next((r for r in self.results["runs"] if r["name"] == name), None)
        if cached is not None:
            return cached
        # window_step: the no-retrieval baseline scores the same chunks of `stride` tokens as the retrieval runs
        cfg = RalmConfig(stride=a.stride, query_length=a.query_length, max_length=a.max_length, doc_max_length=a.doc_max_length,
                         batch_size=a.batch_size, seed=a.seed, window_step=a.stride,
                         **replug_settings(k, temperature, random_docs))
        ralm = InContextRALM(self.model, self.tokenizer, retriever, cfg)
        c0, w0 = time.process_time(), time.perf_counter()
        scores = list(ralm.score_texts(self.texts, progress=True))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        tot = perplexity_totals(scores)
        row = {"name": name, "method": method, "k": k, "temperature": temperature if k else None,
               "perplexity": tot.perplexity, "bits_per_byte": tot.bits_per_byte, "tokens": tot.tokens,
               "retrieved_chunks": tot.retrieved_chunks, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
               "per_text": per_text_records(scores)}
        self.results["runs"].append(row)
        atomic_write_json(self.results_path, self.results)
        print(f"{name}: ppl {tot.perplexity:.3f}  bpb {tot.bits_per_byte:.4f}  ({cpu:.0f} CPU-s)", flush=True)
        return row


def _val_metrics(run: Path) -> list[dict]:
    """The validation rows of the newest metrics.csv under `run`, in order."""
    import csv

    metrics = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not metrics:
        return []
    with open(metrics[-1], encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in r.items() if (k.startswith("val/") or k == "step") and v} for r in rows if r.get("val/loss")]


def train_lsr(args, out: Path, kb_path: Path) -> dict:
    """``rag validate`` (the retriever before training), then ``rag fit --config lightning_configs/replug_lsr_smollm2.yaml``
    on the training pairs; the exported query encoder's directory, the validation metrics before, after every epoch
    and at the end, and with ``--lsr-doc-encoder`` the last refreshed knowledge base."""
    from rag.cli import main as rag_main

    run, export = out / "lsr_run", out / "lsr_query_encoder"
    overrides = ["--model.init_args.lm", args.model, "--model.init_args.knowledge_base", str(kb_path),
                 "--model.init_args.k", str(args.lsr_k), "--model.init_args.export_dir", str(export),
                 "--model.init_args.max_question_length", str(args.lsr_query_tokens * 2),
                 "--data.init_args.train", str(out / "lsr_train.jsonl"), "--data.init_args.val", str(out / "lsr_val.jsonl"),
                 "--trainer.default_root_dir", str(run), "--trainer.logger.init_args.save_dir", str(run),
                 "--trainer.max_epochs", str(args.lsr_epochs)]
    if args.lsr_lr is not None:
        overrides += ["--model.init_args.optimizer.lr", str(args.lsr_lr)]
    if args.lsr_seed is not None:
        overrides += ["--seed_everything", str(args.lsr_seed)]
    if args.lsr_beta is not None:
        overrides += ["--model.init_args.beta", str(args.lsr_beta)]
    if args.lsr_lm_batch_size is not None:
        overrides += ["--model.init_args.lm_batch_size", str(args.lsr_lm_batch_size)]
    if args.device != "cpu":
        overrides += ["--trainer.accelerator", "gpu"]  # the LSR module moves its frozen LM to the trainer's device
    if args.lsr_doc_encoder:
        refresh = {"class_path": "rag.training.callbacks.IndexRefresh",
                   "init_args": {"every": args.lsr_refresh_every, "output_dir": str(run / "index_refresh"), "keep": 1}}
        overrides += ["--model.init_args.train_doc_encoder", "true", "--trainer.callbacks", json.dumps([refresh])]
    before = out / "lsr_before"
    c0, w0 = time.process_time(), time.perf_counter()
    if rag_main(["validate", "--config", str(args.lsr_config), *overrides, "--trainer.default_root_dir", str(before),
                 "--trainer.logger.init_args.save_dir", str(before)]) != 0:
        raise ConfigError("REPLUG LSR validation before training failed (see the messages above)")
    val_before = _val_metrics(before)
    if rag_main(["fit", "--config", str(args.lsr_config), *overrides]) != 0:
        raise ConfigError("REPLUG LSR training failed (see the messages above)")
    info = {"cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1), "export_dir": str(export),
            "config": str(args.lsr_config), "overrides": overrides, "train_pairs": _count_lines(out / "lsr_train.jsonl"),
            "val_pairs": _count_lines(out / "lsr_val.jsonl")}
    if val_before:
        info["val_before"] = {k: v for k, v in val_before[-1].items() if k != "step"}
    val = _val_metrics(run)
    if val:
        info["steps"] = int(max(r.get("step", 0) for r in val)) + 1
        info["val_first"] = {k: v for k, v in val[0].items() if k != "step"}
        info["val_last"] = {k: v for k, v in val[-1].items() if k != "step"}
        info["val_by_epoch"] = val
    if args.lsr_doc_encoder:
        refreshed = sorted((run / "index_refresh").glob("step-*/kb"))
        if not refreshed:
            raise ConfigError(f"--lsr-doc-encoder: no refreshed knowledge base under {run / 'index_refresh'}; lower "
                              "--lsr-refresh-every below the number of training steps")
        info["knowledge_base"], info["index_refreshes"] = str(refreshed[-1]), refreshed[-1].parent.name
    return info


def _count_lines(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def elements_qa(model, tokenizer, args, out: Path) -> dict:
    """(d): the frozen LM as a causal reader on the Elements QA test questions, REPLUG greedy generation over the dense
    top-K of the Elements knowledge base, K = 1 (top-1 only) vs K = ``--qa-k``: EM and F1."""
    from rag.demo import load_demo_qa
    from rag.demo.kb import ensure_demo_kb
    from rag.eval.metrics import exact_match, token_f1
    from rag.generation.search import GenerationConfig
    from rag.knowledge.retriever_kinds import retriever_for_kind
    from rag.models.ralm.model import doc_text
    from rag.models.replug.ensemble import replug_generate

    kb = ensure_demo_kb(out / "elements_kb", encoder=args.encoder, index="flat", bm25=False, show_progress=False)
    dense = retriever_for_kind("dense", kb)
    qa = load_demo_qa("test")[:args.qa_n]
    prompts = [f"Question: {r['question']}\nAnswer:" for r in qa]
    ks = sorted({1, args.qa_k})
    top = dense.retrieve([r["question"] for r in qa], max(ks))
    cfg = GenerationConfig(max_new_tokens=args.qa_new_tokens, num_beams=1)
    res = {"reader": f"{args.model} (frozen causal LM), prompt 'Question: q\\nAnswer:' after each passage, greedy",
           "retrieval": "dense (MiniLM) over the Elements knowledge base", "questions": len(qa), "temperature": args.temperature,
           "runs": []}
    for k in ks:
        preds = []
        c0 = time.process_time()
        for lo in range(0, len(qa), args.batch_size):
            xs = prompts[lo:lo + args.batch_size]
            docs = [[doc_text(p) for p in top.passages[i][:k]] for i in range(lo, lo + len(xs))]
            sc = [list(map(float, top.scores[i][:k])) for i in range(lo, lo + len(xs))]
            seqs, _ = replug_generate(model, tokenizer, xs, docs, sc, retrieval_temperature=args.temperature, config=cfg,
                                      doc_max_length=args.doc_max_length)
            width = 1 + max(len(t) for t in tokenizer(xs, add_special_tokens=False)["input_ids"])
            for row in seqs[:, width:].tolist():
                text = tokenizer.decode(row, skip_special_tokens=True)
                preds.append(text.strip().split("\n")[0].strip())
        em = sum(exact_match(p, r["answers"]) for p, r in zip(preds, qa)) / len(qa)
        f1 = sum(token_f1(p, r["answers"]) for p, r in zip(preds, qa)) / len(qa)
        res["runs"].append({"k": k, "name": "top-1 only" if k == 1 else f"REPLUG k={k}", "em": em, "f1": f1,
                            "cpu_s": round(time.process_time() - c0, 1),
                            "examples": [{"question": r["question"], "gold": r["answers"], "prediction": p}
                                         for p, r in list(zip(preds, qa))[:5]]})
        print(f"Elements QA k={k}: EM {em:.3f}  F1 {f1:.3f}", flush=True)
    return res


# ---------------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    runs = results["runs"]
    s = results["settings"]
    none = next((r for r in runs if r["method"] == "none"), None)
    methods = [m for m in ("REPLUG dense", "REPLUG LSR", "REPLUG BM25", "random docs") if any(r["method"] == m for r in runs)]
    ks = sorted({r["k"] for r in runs if r["k"] is not None})
    lines = [f"Evaluation: {s['n_eval']} held-out documents x {s['text_tokens']} tokens = "
             f"{none['tokens'] if none else '?'} tokens; "
             f"stride {s['stride']}, query {s['query_length']} tokens, window {s['max_length']}, passages cut to "
             f"{s['doc_max_length']} tokens.", "",
             "**Bits per byte (perplexity) of held-out text vs k**", "",
             "| method | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    if none:
        lines.append(f"| no retrieval | {none['bits_per_byte']:.3f} ({none['perplexity']:.2f})" + " |" * len(ks))
    for m in methods:
        by = {r["k"]: r for r in runs if r["method"] == m}
        cells = [f"{by[k]['bits_per_byte']:.3f} ({by[k]['perplexity']:.2f})" if k in by else "" for k in ks]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    diffs = [(r["name"], paired_difference(none.get("per_text"), r.get("per_text"))) for r in runs if none and r is not none]
    diffs = [(name, d) for name, d in diffs if d is not None]
    if diffs:
        lines += [f"**Against no retrieval, on the same {diffs[0][1]['texts']} held-out texts** (Δ bits per byte, 95% "
                  "bootstrap interval over texts; texts predicted better)", "",
                  "| setting | Δ bpb | 95% interval | texts better |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {d['delta_bpb']:+.4f} | [{d['low']:+.4f}, {d['high']:+.4f}] | {d['texts_better']} / {d['texts']} |"
                  for name, d in diffs]
        lines.append("")
    tr = results.get("lsr_training")
    if tr and tr.get("val_last"):
        v0, v1 = tr.get("val_before", tr.get("val_first", {})), tr["val_last"]
        when = "before training" if "val_before" in tr else "after the first epoch"
        lines.append(f"REPLUG LSR training ({tr.get('steps', '?')} steps, {tr['cpu_s']:.0f} CPU s; held-out pairs, {when} → "
                     f"after): val/loss "
                     f"{v0.get('val/loss', math.nan):.3f} → {v1.get('val/loss', math.nan):.3f}, val/top1_agreement "
                     f"{v0.get('val/top1_agreement', math.nan):.2f} → {v1.get('val/top1_agreement', math.nan):.2f}, "
                     f"val/replug_loglik "
                     f"{v0.get('val/replug_loglik', math.nan):.2f} → {v1.get('val/replug_loglik', math.nan):.2f} nats.")
        lines.append("")
    qa = results.get("elements_qa")
    if qa:
        lines += [f"**Elements QA, {qa['questions']} test questions, reader: {qa['reader']}**", "",
                  "| setting | EM | F1 | CPU s |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['em']:.3f} | {r['f1']:.3f} | {r['cpu_s']:.0f} |" for r in qa["runs"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for m, style in (("REPLUG dense", "o-"), ("REPLUG LSR", "s-"), ("REPLUG BM25", "^-"), ("random docs", "x--")):
        pts = sorted((r["k"], r["bits_per_byte"]) for r in runs if r["method"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=m)
    none = next((r for r in runs if r["method"] == "none"), None)
    if none:
        ax.axhline(none["bits_per_byte"], color="gray", ls=":", label="no retrieval")
    ax.set_xlabel("k (documents ensembled)")
    ax.set_ylabel("bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{results['settings']['model_name']}, held-out Python library docs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(results: dict, results_path: Path, plot_path: Optional[str]) -> None:
    """Write the markdown table into the results and the plot; print the table."""
    results["markdown"] = markdown(results)
    atomic_write_json(results_path, results)
    if plot_path:
        plot(results, Path(plot_path))
    print(results["markdown"])


# ---------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None,
                   help="folder of .rst.txt/.rst/.txt documents (default: the python3-doc library reference)")
    p.add_argument("--model", default="smollm2", help="causal LM (default: the demo LM; `python -m rag lm prepare` first)")
    p.add_argument("--encoder", default="minilm", help="dense encoder of the knowledge bases")
    p.add_argument("--out", default="runs/replug_demo")
    p.add_argument("--results", default="benchmarks/results/replug_demo.json")
    p.add_argument("--plot", default="benchmarks/results/replug_demo.png")
    p.add_argument("--n-eval", type=int, default=4, help="held-out documents evaluated")
    p.add_argument("--text-tokens", type=int, default=192, help="LM tokens evaluated per held-out document")
    p.add_argument("--ks", default="1,2,4,8,10", help="documents ensembled (REPLUG's k)")
    p.add_argument("--stride", type=int, default=32, help="tokens between retrievals")
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128, help="the LM's window of text tokens + passage")
    p.add_argument("--doc-max-length", type=int, default=64, help="passage tokens")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.1, help="λ = softmax(dense score / T) (= LSR's γ)")
    p.add_argument("--bm25-temperature", type=float, default=1.0, help="λ = softmax(BM25 score / T)")
    p.add_argument("--words-per-passage", type=int, default=100)
    p.add_argument("--n-train", type=int, default=16, help="held-out documents giving LSR's training pairs")
    p.add_argument("--n-val", type=int, default=4, help="further held-out documents giving LSR's validation pairs (the "
                   "before / after measurements of the retriever)")
    p.add_argument("--lsr-pairs-per-doc", type=int, default=3)
    p.add_argument("--lsr-query-tokens", type=int, default=32)
    p.add_argument("--lsr-target-tokens", type=int, default=32)
    p.add_argument("--lsr-k", type=int, default=8, help="documents per training input (paper: 20)")
    p.add_argument("--lsr-epochs", type=int, default=3)
    p.add_argument("--lsr-lr", type=float, default=None, help="query-encoder learning rate (default: the config's)")
    p.add_argument("--lsr-beta", type=float, default=None,
                   help="β of Q_LM = softmax(log P_LM(y | d, x) / β) (default: the config's, "
                   "the paper's 0.1)")
    p.add_argument("--lsr-seed", type=int, default=None, help="seed_everything of the LSR training (default: the config's, 1234)")
    p.add_argument("--lsr-lm-batch-size", type=int, default=None, help="(document, input) pairs per LM call in LSR training")
    p.add_argument("--lsr-config", default=str(CONFIG))
    p.add_argument("--lsr-doc-encoder", action="store_true", help="train the document encoder too, the index re-encoded "
                   "and swapped in every --lsr-refresh-every steps (REPLUG §4.4's refresh; IndexRefresh)")
    p.add_argument("--lsr-refresh-every", type=int, default=20, help="steps between index refreshes (--lsr-doc-encoder)")
    p.add_argument("--qa-n", type=int, default=100, help="Elements QA test questions")
    p.add_argument("--qa-k", type=int, default=4)
    p.add_argument("--qa-new-tokens", type=int, default=8)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: bm25,lsr,random,qa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the LM runs: cpu or cuda (LSR training then runs on the GPU too)")
    p.add_argument("--prepare-only", action="store_true", help="write the corpus split, the LSR pairs and the knowledge base "
                   "into --out, then stop (prepare on one machine, measure on another with the same options)")
    p.add_argument("--report", action="store_true", help="only rewrite the table and the plot from --results (no runs)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import torch

    from rag.generators.load import load_generator
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder
    from rag.models.ralm.model import open_retriever

    args = parse_args(argv)
    rd = _ralm_demo()
    skip = {s for s in args.skip.split(",") if s}
    out, results_path = Path(args.out), Path(args.results)
    if args.report:
        results = json.loads(results_path.read_text(encoding="utf-8"))
        report(results, results_path, args.plot)
        return results
    ks = [int(x) for x in args.ks.split(",")]
    if args.device == "cuda" and not args.prepare_only and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: torch {torch.__version__} sees no CUDA device here; use --device cpu, or "
                          f"--prepare-only "
                          "here and the measurement on the GPU machine")
    out.mkdir(parents=True, exist_ok=True)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    c_start, w_start = time.process_time(), time.perf_counter()
    root = rd.find_corpus(args.corpus)
    model, tok, _ = load_generator(args.model, kind="causal")
    model.eval()
    docs = rd.read_rst_documents(root)
    evals, train_docs, kb_docs = split_corpus(docs, tok, n_eval=args.n_eval, n_train=args.n_train + args.n_val,
                                              text_tokens=args.text_tokens,
                                              seed=args.seed)
    rd.write_jsonl(out / "eval.jsonl", evals)
    pair_kw = dict(query_tokens=args.lsr_query_tokens, target_tokens=args.lsr_target_tokens, per_doc=args.lsr_pairs_per_doc)
    write_pairs(out / "lsr_train.jsonl", lsr_pairs(tok, train_docs[:args.n_train], **pair_kw))
    write_pairs(out / "lsr_val.jsonl", lsr_pairs(tok, train_docs[args.n_train:], **pair_kw))
    kb_path, passages, kb_cpu = rd.ensure_kb(out, kb_docs, encoder=args.encoder, words_per_passage=args.words_per_passage)
    if args.prepare_only:
        print(f"prepared {out}: {len(evals)} evaluation texts, {len(passages)} passages in {kb_path}", flush=True)
        return {}
    model.to(args.device)  # after --prepare-only: preparing needs only the tokenizer, on any machine
    settings = dict(vars(args))
    settings.update(model_name="SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
                    torch_threads=torch.get_num_threads(),
                    device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    results = {"settings": settings,
               "corpus": {"source": rd.SOURCE if args.corpus is None else str(root), "path": str(root), "documents": len(docs),
                          "kb_documents": len(kb_docs), "kb_passages": len(passages), "kb_build_cpu_s": round(kb_cpu, 1),
                          "held_out": [{"id": t.id, "title": t.title} for t in evals],
                          "lsr_documents": [d.id for d in train_docs]},
               "runs": []}
    atomic_write_json(results_path, results)
    runner = Runner(model, tok, evals, args, results, results_path)
    torch.manual_seed(args.seed)
    dense = open_retriever("dense", kb_path)

    with torch.no_grad():
        runner.run("none", None, None)
        for k in ks:
            runner.run("REPLUG dense", dense, k, temperature=args.temperature)
        if "random" not in skip:
            for k in ks:
                runner.run("random docs", dense, k, temperature=args.temperature, random_docs=True)
        if "bm25" not in skip:
            bm25 = open_retriever("bm25", kb_path)
            for k in ks:
                runner.run("REPLUG BM25", bm25, k, temperature=args.bm25_temperature)
    if "lsr" not in skip:
        results["lsr_training"] = train_lsr(args, out, kb_path)
        atomic_write_json(results_path, results)
        # only the query encoder trained: the index is unchanged; with the document encoder: the last refreshed index
        lsr_kb = KnowledgeBase.open(results["lsr_training"].get("knowledge_base", kb_path))
        lsr = DenseRetriever(lsr_kb, default_query_encoder(lsr_kb, results["lsr_training"]["export_dir"]),
                             allow_encoder_change=args.lsr_doc_encoder)
        with torch.no_grad():
            for k in ks:
                runner.run("REPLUG LSR", lsr, k, temperature=args.temperature)
    if "qa" not in skip:
        with torch.no_grad():
            results["elements_qa"] = elements_qa(model, tok, args, out)
    results["total_cpu_s"] = round(time.process_time() - c_start, 1)
    results["total_wall_s"] = round(time.perf_counter() - w_start, 1)
    report(results, results_path, args.plot)
    atomic_write_text(out / "results.md", results["markdown"])
    return results


if __name__ == "__main__":
    main()
