"""The human-readable parts of a results directory: ``results.md`` (the summary as Markdown tables) and ``plots/``
(matplotlib, Agg backend): ``recall_at_k.png`` (recall over the cut-offs: by gold provenance and by answer string),
``by_category.png`` (EM and F1 per question category, when the set has categories) and ``score_histograms.png``
(per-question F1 and answer log-probability, or, for a retriever alone, nDCG and top-1 retrieval score)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from rag.eval.ranking import ordered_metrics as _ordered  # noqa: E402
from rag.utils.io import atomic_write_bytes, atomic_write_text  # noqa: E402

__all__ = ["write_report", "markdown"]


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def markdown(summary: dict) -> str:
    """The summary as Markdown: one table of every metric (percent), one per category."""
    s = summary["settings"]
    lines = [f"# rag evaluate: {s['model']} on {s['data']}", "",
             f"{summary['questions']} questions; knowledge base {s['kb_version']}; cut-offs {s['ks']}; seed {s['seed']}"
             + (f"; limit {s['limit']}" if s.get("limit") else ""), ""]
    metrics = summary["metrics"]
    names = _ordered(list(metrics))
    lines += ["| metric | value (%) |", "|---|---|"] + [f"| {n} | {_pct(metrics[n])} |" for n in names]
    cats = summary.get("by_category") or {}
    if cats:
        cols = [n for n in ("em", "f1", "gold_in_answer", "answer_recall@1", "recall@1") if any(n in c for c in cats.values())]
        lines += ["", "| category | questions | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for c, vals in cats.items():
            lines.append(f"| {c} | {vals['questions']} | " + " | ".join(_pct(vals.get(n)) for n in cols) + " |")
    judge = s.get("faithfulness")
    if judge:
        lines += ["", f"Faithfulness: NLI model {judge['model']}, a passage supports an answer at P(entailment) >= "
                      f"{judge['threshold']:g}; supported_top / supported_cited / supported_any: the answers supported by "
                      "their top-posterior passage / a passage they cite / any passage read."]
    note = (summary.get("provenance") or {}).get("note")
    if note:
        lines += ["", f"Provenance: {note}."]
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def write_report(out: Path, summary: dict, records: Sequence[dict]) -> list[Path]:
    """Write ``results.md`` and the plots into `out`; returns the plot paths."""
    atomic_write_text(out / "results.md", markdown(summary))
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    metrics, ks = summary["metrics"], summary["settings"]["ks"]
    written = []
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for family, label in (("recall", "gold provenance"), ("answer_recall", "answer string in passage")):
        pts = [(k, metrics[f"{family}@{k}"]) for k in ks if f"{family}@{k}" in metrics]
        if pts:
            ax.plot([k for k, _ in pts], [100 * v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (passages retrieved)")
    ax.set_ylabel("recall@k (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    ax.set_title(f"recall@k, {summary['questions']} questions", fontsize=9)
    _save(fig, plots / "recall_at_k.png")
    written.append(plots / "recall_at_k.png")
    cats = summary.get("by_category") or {}
    if cats and any("em" in v for v in cats.values()):
        names = list(cats)
        fig, ax = plt.subplots(figsize=(max(4, 0.7 * len(names) + 2), 3.4))
        width = 0.4
        for i, m in enumerate(("em", "f1")):
            ax.bar([j + (i - 0.5) * width for j in range(len(names))], [100 * cats[c].get(m, 0) for c in names],
                   width, label=m.upper())
        ax.set_xticks(range(len(names)), [f"{c}\n(n={cats[c]['questions']})" for c in names], fontsize=7, rotation=30)
        ax.set_ylabel("%")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        ax.set_title("EM and F1 by category", fontsize=9)
        _save(fig, plots / "by_category.png")
        written.append(plots / "by_category.png")
    answered = [r for r in records if r.get("answer") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    if answered:
        left = [r["scores"].get("f1", 0.0) for r in answered]
        right = [r["answer_score"] for r in answered if r["answer_score"] is not None]
        titles = ("token F1 per question", "answer log p(y|x)")
    else:
        k = max(ks)
        name = next((n for n in (f"ndcg@{k}", f"answer_recall@{k}") if n in metrics), None)
        left = [r["scores"].get(name, 0.0) for r in records] if name else []
        right = [r["retrieved"][0]["score"] for r in records if r["retrieved"]]
        titles = (f"{name} per question" if name else "(no per-question score)", "top-1 retrieval score")
    for ax, values, title in zip(axes, (left, right), titles):
        if values:
            ax.hist(values, bins=20)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("questions")
    _save(fig, plots / "score_histograms.png")
    written.append(plots / "score_histograms.png")
    return written
