"""In-Context RALM (Ram et al. 2023) on a real LM and real text: SmolLM2-135M-Instruct reading the Python library reference.

Corpus: the reStructuredText sources of the Python 3 library reference that Debian's ``python3-doc`` package installs
(``/usr/share/doc/python3.X/html/_sources/library/*.rst.txt``; Python Software Foundation License, see
``/usr/share/doc/python3-doc/copyright``); ``apt-get install python3-doc`` is the only package this needs, and nothing
is copied into the repository: the documents are read from the installed files (or from ``--corpus DIR``, any folder
of ``.rst.txt`` / ``.rst`` / ``.txt`` files).

Split (the paper's forbidden-titles rule, §4.3): ``--n-eval`` documents drawn with ``--seed`` are held out entirely;
the knowledge base (100-word passages, MiniLM dense index + BM25) holds every *other* document, and the leakage guard
(``exclude_own``) stays on. Each evaluated text is the first ``--text-tokens`` LM tokens of a held-out document's body.
The predictive reranker is trained on ``--n-train`` knowledge-base documents (never on held-out ones) with
``rag fit --config lightning_configs/ralm_reranker_smollm2.yaml``.

Measurements (Table 1, Figs. 5–6, §6 of the paper), every one through :class:`rag.models.ralm.model.InContextRALM`:
(a) no retrieval vs BM25 vs dense at ``--table-stride``; (b) the stride curve ``--strides`` at ``ℓ`` = 32 (BM25, Fig. 5);
(c) the query-length curve ``--query-lengths`` at ``--qlen-stride`` (BM25, Fig. 6); (d) reranking among BM25's top
``--rerank-k`` at ``--rerank-stride``: zero-shot with the same LM (and ``--small-lm`` if given) and the trained
predictive reranker. For each retrieval run: the fraction of evaluated token 4-/8-grams found in the document the LM
read (verbatim copying), and the perplexity on the tokens whose 4-gram is *not* in that document.

    apt-get install python3-doc && python -m rag lm prepare
    OMP_NUM_THREADS=1 python examples/ralm_demo.py --n-eval 6 --text-tokens 160     # ~25 CPU-minutes

writes ``--out`` (``runs/ralm_demo``: corpus JSONL files, the knowledge base, the reranker and its training examples)
and ``--results`` (``benchmarks/results/ralm_demo.json``) after every run, then ``--plot``
(``benchmarks/results/ralm_demo.png``).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from rag.eval.perplexity import paired_difference, per_text_records  # noqa: E402
from rag.knowledge.documents import Document  # noqa: E402
from rag.knowledge.passages import Passage, split_passages  # noqa: E402
from rag.models.ralm.model import EvalText, InContextRALM, RalmConfig, TextScore  # noqa: E402
from rag.utils.errors import ConfigError, CorpusError  # noqa: E402
from rag.utils.io import atomic_write_json, atomic_write_text  # noqa: E402

DEFAULT_CORPUS_GLOB = "/usr/share/doc/python3*/html/_sources/library"
APT_PACKAGES = ("python3-doc",)
SOURCE = "Python 3 library reference, reStructuredText sources (Debian python3-doc)"
LICENCE = "Python Software Foundation License Version 2 (/usr/share/doc/python3-doc/copyright)"
CONFIG = REPO / "lightning_configs" / "ralm_reranker_smollm2.yaml"

# ---------------------------------------------------------------------------- reStructuredText -> plain text

_DROP_BLOCK = re.compile(r"^\.\.\s+(index|module|moduleauthor|sectionauthor|currentmodule|testsetup|testcleanup|highlight|"
                         r"toctree|only|raw|include|impl-detail|versionadded|versionchanged|deprecated|audit-event|"
                         r"availability|seealso|productionlist|literalinclude|doctest|testcode|testoutput|c:[\w-]+)::")
_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
_ROLE = re.compile(r":[\w:.+-]+:`~?!?([^`<]*?)\s*(?:<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'*+#`:.])\1{2,}\s*$")


def rst_to_text(raw: str) -> tuple[str, str]:
    """``(title, body)`` of a reStructuredText document: directives that carry no prose (index entries, module
    metadata, toctrees, comments, ...) dropped with their indented blocks, roles and links reduced to their text,
    section underlines removed, whitespace collapsed. The title is the first section heading."""
    lines = raw.splitlines()
    out: list[str] = []
    title: Optional[str] = None
    skip_indent: Optional[int] = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if _UNDERLINE.match(line):
            continue
        if stripped.startswith(".."):
            m = _DIRECTIVE.match(stripped)
            if _DROP_BLOCK.match(stripped) or m is None:  # metadata directive, label (.. _x:), or comment
                skip_indent = indent
                continue
            name, arg = m.groups()
            if arg:  # .. function:: copyfileobj(fsrc, fdst) -> the signature
                out.append(arg)
            elif name in ("note", "warning", "important", "tip", "caution", "attention", "hint"):
                out.append(name.capitalize() + ":")
            continue
        if title is None and stripped and i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1]):
            title = stripped
            continue
        out.append(line)
    def clean(s):
        return " ".join(_LINK.sub(r"\1", _ROLE.sub(r"\1", s)).replace("``", "").replace("**", "").split())
    return clean(title or ""), clean("\n".join(out))


def find_corpus(corpus: Optional[str]) -> Path:
    """``--corpus`` or the installed library reference of ``python3-doc``."""
    if corpus:
        p = Path(corpus)
        if not p.exists():
            raise CorpusError(f"--corpus {p}: no such file or directory")
        return p
    found = sorted(glob.glob(DEFAULT_CORPUS_GLOB))
    if not found:
        raise CorpusError(f"no Python library reference under {DEFAULT_CORPUS_GLOB}; install it with "
                          f"`apt-get install {' '.join(APT_PACKAGES)}`, or pass --corpus DIR (a folder of "
                          f".rst.txt/.rst/.txt files)")
    return Path(found[-1])


def read_rst_documents(root: Path) -> list[Document]:
    """One :class:`Document` per ``.rst.txt`` / ``.rst`` / ``.txt`` file under `root` (id: the path relative to it)."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()
                                                 and p.name.endswith((".rst.txt", ".rst", ".txt")))
    docs = []
    for f in files:
        title, body = rst_to_text(f.read_text(encoding="utf-8", errors="replace"))
        rel = f.name if root.is_file() else str(f.relative_to(root))
        doc_id = re.sub(r"(\.rst)?(\.txt)?$", "", rel)
        if body:
            docs.append(Document(id=doc_id, title=title or doc_id, text=body, source=str(f)))
    if not docs:
        raise CorpusError(f"--corpus {root}: no non-empty .rst.txt/.rst/.txt document")
    return docs


def first_tokens(tokenizer, text: str, n: int) -> Optional[str]:
    """The text of the first `n` tokens of `text` (None if it is shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n]) if len(ids) >= n else None


def split_corpus(docs: list[Document], tokenizer, *, n_eval: int, n_train: int, text_tokens: int, seed: int):
    """Held-out evaluation texts (whole documents excluded from the knowledge base), the knowledge-base documents, and
    training texts for the predictive reranker drawn from the knowledge-base documents."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    held, evals, train = set(), [], []
    for i in order:
        if len(evals) >= n_eval:
            break
        text = first_tokens(tokenizer, docs[i].text, text_tokens)
        if text is not None:
            held.add(i)
            evals.append(EvalText(text, docs[i].id, docs[i].title))
    if len(evals) < n_eval:
        raise CorpusError(f"only {len(evals)} documents have {text_tokens} tokens; lower --n-eval or --text-tokens")
    kb_docs = [d for i, d in enumerate(docs) if i not in held]
    for i in order:
        if len(train) >= n_train:
            break
        if i not in held:
            text = first_tokens(tokenizer, docs[i].text, text_tokens)
            if text is not None:
                train.append(EvalText(text, docs[i].id, docs[i].title))
    return evals, kb_docs, train


def write_jsonl(path: Path, texts: list[EvalText]) -> None:
    atomic_write_text(path, "".join(json.dumps({"id": t.id, "title": t.title, "text": t.text}) + "\n" for t in texts))


def ensure_kb(out: Path, kb_docs: list[Document], *, encoder: str, words_per_passage: int):
    """The knowledge base (flat MiniLM index + BM25) over `kb_docs`, built once per document set and reused."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    passages = list(split_passages(kb_docs, words_per_passage))
    key = hashlib.sha256(json.dumps([encoder, words_per_passage,
                                     [(p.id, p.title, p.text) for p in passages]]).encode()).hexdigest()
    path, stamp = out / "kb", out / "kb_key.txt"
    t0 = time.process_time()
    if path.is_dir() and stamp.is_file() and stamp.read_text() == key:
        return path, passages, 0.0
    KnowledgeBase.build(passages, TextEncoder(encoder), path, index="flat", bm25=True, overwrite=True, show_progress=True)
    atomic_write_text(stamp, key)
    return path, passages, time.process_time() - t0


# ---------------------------------------------------------------------------- measurements


def ngram_stats(ralm: InContextRALM, scores: list[TextScore], passages: dict[str, Passage], ns=(4, 8)) -> dict:
    """Per evaluated token in a retrieved chunk: does its n-gram (ending at it, text tokens) occur in the document the
    LM read for that chunk? Returns the fraction for each n, and a mask per text of tokens whose 4-gram is new."""
    s = ralm.config.stride
    hits = {n: [0, 0] for n in ns}
    novel: list[list[bool]] = []
    for sc in scores:
        toks = sc.tokens.tolist()
        mask = [False] * len(toks)
        for j, pid in enumerate(sc.doc_ids):
            if pid is None:
                continue
            doc = ralm.scorer.doc_tokens([passages[pid]])[0]
            grams = {n: {tuple(doc[i:i + n]) for i in range(len(doc) - n + 1)} for n in ns}
            for t in range(j * s, min((j + 1) * s, len(toks))):
                for n in ns:
                    if t + 1 >= n:
                        found = tuple(toks[t + 1 - n:t + 1]) in grams[n]
                        hits[n][0] += found
                        hits[n][1] += 1
                        if n == 4:
                            mask[t] = not found
        novel.append(mask)
    ralm.scorer.clear_cache()
    return {"overlap": {f"{n}gram": (h / max(1, c)) for n, (h, c) in hits.items()}, "novel_mask": novel}


def masked_ppl(scores: list[TextScore], masks: list[list[bool]]) -> tuple[Optional[float], int]:
    """Perplexity over the tokens a mask keeps (None if it keeps none)."""
    nll, n = 0.0, 0
    for sc, m in zip(scores, masks):
        for lp, keep in zip(sc.token_logprobs.tolist(), m):
            if keep:
                nll -= lp
                n += 1
    return (math.exp(nll / n) if n else None), n


class Runner:
    """Runs In-Context RALM settings on the evaluation texts and records each result (written after every run)."""

    def __init__(self, model, tokenizer, texts, passages, args, results, results_path: Path):
        self.model, self.tokenizer, self.texts, self.args = model, tokenizer, texts, args
        self.passages = {p.id: p for p in passages}
        self.results, self.results_path = results, results_path
        self.scores: dict[str, list[TextScore]] = {}

    def run(self, name: str, group: str, retriever, retrieval: str, *, stride: int, query_length: int = 32,
            reranker=None, rerank: str = "none", k: int = 1) -> dict:
        from rag.eval.perplexity import perplexity_totals

        a = self.args
        cached = next((r for r in self.results["runs"] if r["name"] == name), None)
        if cached is not None:
            if group not in cached["groups"]:
                cached["groups"].append(group)
                atomic_write_json(self.results_path, self.results)
            return cached
        # window_step: the no-retrieval baseline scores the same chunks of `stride` tokens as the retrieval runs
        cfg = RalmConfig(stride=stride, query_length=query_length, max_length=a.max_length, doc_max_length=a.doc_max_length,
                         k=k, batch_size=a.batch_size, window_step=stride)
        ralm = InContextRALM(self.model, self.tokenizer, retriever, cfg, reranker)
        c0, w0 = time.process_time(), time.perf_counter()
        scores = list(ralm.score_texts(self.texts, progress=True))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        tot = perplexity_totals(scores)
        row = {"name": name, "groups": [group], "retrieval": retrieval, "stride": stride,
               "query_length": query_length if retriever is not None else None, "rerank": rerank, "k": k if reranker else 1,
               "perplexity": tot.perplexity, "word_perplexity": tot.word_perplexity, "bits_per_byte": tot.bits_per_byte,
               "tokens": tot.tokens, "retrieved_chunks": tot.retrieved_chunks, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
               # per evaluated text: (id, nats, bytes): paired intervals between settings are computed from these
               "per_text": per_text_records(scores)}
        if retriever is not None:
            st = ngram_stats(ralm, scores, self.passages)
            row["overlap"] = st["overlap"]
            ppl_new, n_new = masked_ppl(scores, st["novel_mask"])
            ppl_none, _ = masked_ppl(self.scores["none"], st["novel_mask"]) if "none" in self.scores else (None, 0)
            row["novel_4gram_tokens"] = n_new
            row["novel_4gram_perplexity"] = ppl_new
            row["novel_4gram_perplexity_no_retrieval"] = ppl_none
        self.scores[name] = scores
        self.results["runs"].append(row)
        atomic_write_json(self.results_path, self.results)
        print(f"[{group}] {name}: ppl {tot.perplexity:.3f}  bpb {tot.bits_per_byte:.4f}  ({cpu:.0f} CPU-s)", flush=True)
        return row


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``LABEL=ARGS`` (ARGS: extra ``rag fit`` options, shell-quoted) -> (label, args); a bare ``LABEL``: no extra args."""
    import shlex

    label, _, extra = spec.partition("=")
    label = label.strip()
    if not re.fullmatch(r"[\w.+-]+", label):
        raise ConfigError(f"--train-variant {spec!r}: the label before '=' must be letters, digits, '.', '+', '-' or '_' "
                          "(it names the run and the reranker's folder), e.g. soft2='--model.init_args.loss soft_label'")
    return label, shlex.split(extra)


def train_reranker(args, out: Path, kb_path: Path, train_path: Path, label: Optional[str] = None,
                   extra: tuple[str, ...] = ()) -> dict:
    """``rag fit --config lightning_configs/ralm_reranker_smollm2.yaml`` on the training texts, with the `extra` options
    of a ``--train-variant`` named `label` (None: the config as it is); returns the exported reranker's directory and the
    first and last validation metrics. Every variant reads the LM's scoring from one examples file."""
    import csv

    from rag.cli import main as rag_main

    suffix = f"_{label}" if label else ""
    run = out / f"reranker_run{suffix}"
    export = out / f"reranker{suffix}"
    overrides = ["--data.init_args.texts", str(train_path), "--data.init_args.knowledge_base", str(kb_path),
                 "--data.init_args.lm", args.model, "--data.init_args.k", str(args.rerank_k),
                 "--data.init_args.stride", str(args.rerank_stride), "--data.init_args.max_length", str(args.max_length),
                 "--data.init_args.doc_max_length", str(args.doc_max_length),
                 "--data.init_args.chunks_per_text", str(args.chunks_per_text),
                 "--data.init_args.examples_file", str(out / "reranker_examples.json"),  # a rerun reuses the LM's scoring
                 "--trainer.default_root_dir", str(run), "--trainer.logger.init_args.save_dir", str(run),
                 "--trainer.max_epochs", str(args.train_epochs), "--model.init_args.export_dir", str(export),
                 "--data.init_args.lm_batch_size", str(args.batch_size),
                 *(["--trainer.accelerator", "gpu"] if args.device == "cuda" else []), *extra]
    c0 = time.process_time()
    if rag_main(["fit", "--config", str(args.train_config), *overrides]) != 0:
        raise ConfigError(f"training the predictive reranker{f' {label!r}' if label else ''} failed (see the messages above)")
    info = {"cpu_s": round(time.process_time() - c0, 1), "export_dir": str(export), "config": str(args.train_config),
            "overrides": overrides, "texts": str(train_path), **({"label": label, "extra": list(extra)} if label else {})}
    metrics = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if metrics:
        rows = list(csv.DictReader(open(metrics[-1], encoding="utf-8")))
        val = [{k: float(v) for k, v in r.items() if k.startswith("val/") and v} for r in rows if r.get("val/loss")]
        if val:
            best = min(range(len(val)), key=lambda i: val[i]["val/loss"])
            info.update(val_first=val[0], val_last=val[-1], val_best={"epoch": best + 1, **val[best]})
    return info


# ---------------------------------------------------------------------------- report


def fmt(x: float) -> str:
    return f"{x:.2f}"


def paired_rows(results: dict) -> list[tuple[tuple[str, str], dict]]:
    """The comparisons the paper's §6 findings rest on, each paired by text (:func:`paired_difference`): every
    reranker against BM25's own top 1 and against each other, and each query length against ℓ = 32."""
    runs = results["runs"]
    rerank = [r for r in runs if "rerank" in r["groups"] and r["retrieval"] == "bm25"]
    plain = next((r for r in rerank if r["rerank"] == "none"), None)
    rerankers = [r for r in rerank if r["rerank"] != "none"]
    pairs = [(plain, r) for r in rerankers if plain] + [(a, b) for i, a in enumerate(rerankers) for b in rerankers[i + 1:]]
    qlen = sorted((r for r in runs if "qlen" in r["groups"]), key=lambda r: r["query_length"])
    q32 = next((r for r in qlen if r["query_length"] == 32), None)
    pairs += [(q32, r) for r in qlen if q32 and r is not q32]
    out = []
    for a, b in pairs:
        d = paired_difference(a.get("per_text"), b.get("per_text"))
        if d is not None:
            out.append(((a["name"], b["name"]), d))
    return out


def markdown(results: dict) -> str:
    runs = results["runs"]
    by = {r["name"]: r for r in runs}
    s = results["settings"]
    lines = [f"Evaluation: {s['n_eval']} held-out documents x {s['text_tokens']} tokens = "
             f"{runs[0]['tokens'] if runs else 0} tokens; "
             f"window {s['max_length']} tokens, documents cut to {s['doc_max_length']}.", ""]

    def table(title: str, rows: list[dict]) -> None:
        lines.extend([f"**{title}**", "",
                      "| setting | perplexity | bits/byte | 4-gram in doc | 8-gram in doc | ppl, new 4-grams (none → "
                      "this) | CPU s |",
                      "|---|---:|---:|---:|---:|---:|---:|"])
        for r in rows:
            ov = r.get("overlap") or {}
            o4 = f"{100 * ov['4gram']:.1f}%" if ov else ""
            o8 = f"{100 * ov['8gram']:.1f}%" if ov else ""
            new = (f"{fmt(r['novel_4gram_perplexity_no_retrieval'])} → {fmt(r['novel_4gram_perplexity'])}"
                   if r.get("novel_4gram_perplexity") and r.get("novel_4gram_perplexity_no_retrieval") else "")
            lines.append(f"| {r['name']} | {fmt(r['perplexity'])} | {r['bits_per_byte']:.3f} | {o4} | {o8} | {new} | "
                         f"{r['cpu_s']:.0f} |")
        lines.append("")

    for title, group in (("(a) Retrieval (Table 1)", "table"), ("(b) Stride, BM25, ℓ = 32 (Fig. 5)", "stride"),
                         ("(c) Query length, BM25 (Fig. 6)", "qlen"),
                         ("(d) Reranking BM25's top k (§6: Table 1 rows, Table 3)", "rerank")):
        rows = [r for r in runs if group in r["groups"]]
        if group in ("stride", "qlen", "rerank") and "none" in by:
            rows = [by["none"]] + [r for r in rows if r["name"] != "none"]
        if rows:
            table(title, rows)
    diffs = paired_rows(results)
    if diffs:
        lines.extend(["**Paired differences** (bits/byte of the second setting minus the first on the same texts; 95% "
                      "bootstrap interval over the evaluated texts; texts the second predicts better)", "",
                      "| comparison | Δ bits/byte | 95% interval | texts better |", "|---|---:|---:|---:|"])
        for (a, b), d in diffs:
            lines.append(f"| {a} → {b} | {d['delta_bpb']:+.4f} | [{d['low']:+.4f}, {d['high']:+.4f}] | "
                         f"{d['texts_better']}/{d['texts']} |")
        lines.append("")
    trainings = results.get("reranker_trainings") or ([results["reranker_training"]] if results.get("reranker_training") else [])
    for tr in trainings:
        if not tr.get("val_last"):
            continue
        v0, v1 = tr.get("val_first", {}), tr["val_last"]
        what = f"Predictive reranker training {tr['label']!r} ({' '.join(tr['extra']) or 'the config'})" if tr.get("label") \
            else "Predictive reranker training"
        vb = tr.get("val_best")
        lines.append(f"{what} ({tr['cpu_s']:.0f} CPU s): val/loss {v0.get('val/loss', float('nan')):.3f} → "
                     f"{v1.get('val/loss', float('nan')):.3f}, val/top1 {v1.get('val/top1', float('nan')):.2f}, "
                     f"val/loglik_gain {v1.get('val/loglik_gain', float('nan')):+.3f} nats per stride"
                     + (f"; lowest val/loss after epoch {vb['epoch']} ({vb['val/loss']:.3f}, val/loglik_gain "
                        f"{vb.get('val/loglik_gain', float('nan')):+.3f})." if vb else "."))
    return "\n".join(lines) + "\n"


def short(name: str) -> str:
    """A run's name as a plot label: what reranks it, or BM25 alone."""
    m = re.search(r"(zero-shot|predictive) rerank top-\d+ \(([^)]*)\)", name)
    return f"{m.group(1)} ({m.group(2)})" if m else "BM25 top-1"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    none = next((r["perplexity"] for r in runs if r["name"] == "none"), None)
    diffs = [(names, d) for names, d in paired_rows(results) if "rerank" in names[1]]
    curves = [(group, key, label) for group, key, label in (
        ("stride", "stride", "retrieval stride s (ℓ = 32)"),
        ("qlen", "query_length", f"query length ℓ (s = {results['settings']['qlen_stride']})"))
        if any(group in r["groups"] for r in runs)]  # a skipped measurement gets no empty panel
    widths = [4.5] * len(curves) + ([7.0] if diffs else []) or [4.5]  # the comparisons' long labels need room
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), max(3.4, 1.5 + 0.28 * len(diffs))), dpi=90, squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    axes = list(axes[0])
    for ax, (group, key, label) in zip(axes, curves):
        pts = sorted((r[key], r["perplexity"]) for r in runs if group in r["groups"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="BM25 In-Context RALM")
        if none is not None:
            ax.axhline(none, color="gray", ls="--", label="no retrieval")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("token perplexity")
        ax.grid(alpha=0.3)
    if curves:
        axes[0].legend(fontsize=8)
    if diffs:  # reranking: the paired difference of each comparison, with its interval
        ax = axes[-1]
        ys = list(range(len(diffs)))
        mids = [d["delta_bpb"] for _, d in diffs]
        ax.errorbar(mids, ys,
                    xerr=[[m - d["low"] for m, (_, d) in zip(mids, diffs)], [d["high"] - m for m, (_, d) in zip(mids, diffs)]],
                    fmt="o", capsize=3)
        ax.axvline(0, color="gray", ls="--")
        ax.set_yticks(ys, [f"{short(a)} → {short(b)}" for (a, b), _ in diffs], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("Δ bits/byte, 95% interval (< 0: better)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['settings']['model_name']} on held-out Python library docs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None,
                   help=f"folder of .rst.txt/.rst/.txt documents (default: {DEFAULT_CORPUS_GLOB}, from python3-doc)")
    p.add_argument("--model", default="smollm2", help="causal LM (default: the demo LM; `python -m rag lm prepare` first)")
    p.add_argument("--small-lm", default=None,
                   help="a smaller causal LM for zero-shot reranking (paper: GPT-2 110M); default none")
    p.add_argument("--encoder", default="minilm", help="dense encoder of the knowledge base")
    p.add_argument("--out", default="runs/ralm_demo", help="work folder (corpus JSONL, knowledge base, reranker)")
    p.add_argument("--results", default="benchmarks/results/ralm_demo.json")
    p.add_argument("--plot", default="benchmarks/results/ralm_demo.png")
    p.add_argument("--n-eval", type=int, default=6, help="held-out documents evaluated (the evaluation set size)")
    p.add_argument("--text-tokens", type=int, default=160, help="LM tokens evaluated per held-out document")
    p.add_argument("--n-train", type=int, default=24, help="knowledge-base documents the predictive reranker trains on")
    p.add_argument("--chunks-per-text", type=int, default=3, help="training prefixes per training text")
    p.add_argument("--train-epochs", type=int, default=3)
    p.add_argument("--train-config", default=str(CONFIG))
    p.add_argument("--train-variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="train and evaluate a predictive reranker with these extra `rag fit` options, e.g. "
                        "soft2='--model.init_args.loss soft_label --model.init_args.temperature 2' (a bare LABEL: none); "
                        "repeatable, one reranker each, all from the LM's one scoring. Without it: one reranker, the "
                        "config as it is")
    p.add_argument("--words-per-passage", type=int, default=100)
    p.add_argument("--max-length", type=int, default=256, help="the LM's window (paper: 1024)")
    p.add_argument("--doc-max-length", type=int, default=128, help="document tokens (paper: 256)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--table-stride", type=int, default=4)
    p.add_argument("--strides", default="64,32,16,8,4,2")
    p.add_argument("--query-lengths", default="8,16,32,64,128")
    p.add_argument("--qlen-stride", type=int, default=16)
    p.add_argument("--rerank-stride", type=int, default=16)
    p.add_argument("--rerank-k", type=int, default=4, help="BM25 candidates reranked (paper: 16)")
    p.add_argument("--rerank-tokens", type=int, default=16, help="zero-shot: prefix tokens s' the reranker predicts")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: dense,stride,qlen,rerank,train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the LM runs (evaluation, zero-shot reranking, collecting the reranker's examples) and the "
                        "reranker trains")
    p.add_argument("--prepare-only", action="store_true", help="write the corpus split and the knowledge base into --out, then "
                   "stop (prepare on one machine, measure on another with the same options and --corpus)")
    p.add_argument("--report", action="store_true", help="only rewrite the table and the plot from --results (no runs)")
    return p.parse_args(argv)


def report(results: dict, results_path: Path, plot_path: Optional[str]) -> None:
    """Write the markdown table into the results and the plot; print the table."""
    results["markdown"] = markdown(results)
    atomic_write_json(results_path, results)
    if plot_path:
        plot(results, Path(plot_path))
    print(results["markdown"])


def main(argv=None) -> dict:
    import torch

    from rag.generators.load import load_generator
    from rag.models.ralm.model import CausalScorer, open_retriever
    from rag.models.ralm.rerank import LMReranker, PredictiveReranker

    args = parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    variants = [parse_variant(v) for v in args.train_variant]
    if len({label for label, _ in variants}) < len(variants):
        raise ConfigError("--train-variant: two variants share a label; give each its own")
    out, results_path = Path(args.out), Path(args.results)
    if args.report:
        results = json.loads(results_path.read_text(encoding="utf-8"))
        report(results, results_path, args.plot)
        return results
    if args.device == "cuda" and not args.prepare_only and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: torch {torch.__version__} sees no CUDA device here; use --device cpu, or "
                          f"--prepare-only "
                          "here and the measurement on the GPU machine")
    out.mkdir(parents=True, exist_ok=True)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    c_start = time.process_time()
    root = find_corpus(args.corpus)
    model, tok, _ = load_generator(args.model, kind="causal")
    docs = read_rst_documents(root)
    evals, kb_docs, train = split_corpus(docs, tok, n_eval=args.n_eval, n_train=args.n_train, text_tokens=args.text_tokens,
                                         seed=args.seed)
    write_jsonl(out / "eval.jsonl", evals)
    write_jsonl(out / "train.jsonl", train)
    kb_path, passages, kb_cpu = ensure_kb(out, kb_docs, encoder=args.encoder, words_per_passage=args.words_per_passage)
    if args.prepare_only:
        print(f"prepared {out}: {len(evals)} evaluation texts, {len(train)} training texts, {len(passages)} "
              f"passages in {kb_path}",
              flush=True)
        return {}
    model.to(args.device)
    settings = {k: v for k, v in vars(args).items()}
    settings.update(model_name="SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
                    torch_threads=torch.get_num_threads(),
                    device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    results = {"settings": settings,
               "corpus": {"source": SOURCE if args.corpus is None else str(root), "licence": LICENCE if args.corpus is None
                          else None,
                          "apt_packages": list(APT_PACKAGES), "path": str(root), "documents": len(docs),
                          "kb_documents": len(kb_docs),
                          "kb_passages": len(passages), "kb_build_cpu_s": round(kb_cpu, 1),
                          "held_out": [{"id": t.id, "title": t.title} for t in evals]},
               "runs": []}
    atomic_write_json(results_path, results)
    bm25, dense = open_retriever("bm25", kb_path), None if "dense" in skip else open_retriever("dense", kb_path)
    runner = Runner(model, tok, evals, passages, args, results, results_path)
    torch.manual_seed(args.seed)

    runner.run("none", "table", None, "none", stride=args.table_stride)
    runner.run(f"BM25 s={args.table_stride} ℓ=32", "table", bm25, "bm25", stride=args.table_stride)
    if dense is not None:
        runner.run(f"dense s={args.table_stride} ℓ=32", "table", dense, "dense", stride=args.table_stride)
    if "stride" not in skip:
        for s in (int(x) for x in args.strides.split(",")):
            runner.run(f"BM25 s={s} ℓ=32", "stride", bm25, "bm25", stride=s)
    if "qlen" not in skip:
        for q in (int(x) for x in args.query_lengths.split(",")):
            runner.run(f"BM25 s={args.qlen_stride} ℓ={q}", "qlen", bm25, "bm25", stride=args.qlen_stride, query_length=q)
    if "rerank" not in skip:
        rs, k = args.rerank_stride, args.rerank_k
        runner.run(f"BM25 s={rs} ℓ=32", "rerank", bm25, "bm25", stride=rs)
        runner.run(f"BM25 s={rs} ℓ=32, zero-shot rerank top-{k} (same LM)", "rerank", bm25, "bm25", stride=rs,
                   reranker=LMReranker(None, rerank_tokens=args.rerank_tokens), rerank="zero-shot", k=k)
        if args.small_lm:
            sm, st, _ = load_generator(args.small_lm, kind="causal")
            sm.to(args.device)
            scorer = CausalScorer(sm, st, max_length=min(args.max_length, 1024), doc_max_length=args.doc_max_length,
                                  batch_size=args.batch_size)
            runner.run(f"BM25 s={rs} ℓ=32, zero-shot rerank top-{k} ({args.small_lm})", "rerank", bm25, "bm25", stride=rs,
                       reranker=LMReranker(scorer, rerank_tokens=args.rerank_tokens), rerank="zero-shot-small", k=k)
        if "train" not in skip:
            for label, extra in variants or [(None, [])]:
                info = train_reranker(args, out, kb_path, out / "train.jsonl", label, tuple(extra))
                if label is None:
                    results["reranker_training"] = info
                else:
                    results.setdefault("reranker_trainings", []).append(info)
                atomic_write_json(results_path, results)
                tag = f"trained, {label}" if label else "trained"
                runner.run(f"BM25 s={rs} ℓ=32, predictive rerank top-{k} ({tag})", "rerank", bm25, "bm25", stride=rs,
                           reranker=PredictiveReranker.load(info["export_dir"]).to(args.device), rerank=tag, k=k)
    results["total_cpu_s"] = round(time.process_time() - c_start, 1)
    report(results, results_path, args.plot)
    atomic_write_text(out / "results.md", results["markdown"])
    return results


if __name__ == "__main__":
    main()
