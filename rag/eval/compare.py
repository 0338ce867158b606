"""`rag evaluate --compare RUN_A RUN_B`: two complete results directories on the same questions, compared.

For every metric both runs scored: B's mean minus A's over the questions both hold, with a 95% paired bootstrap
interval (:func:`rag.eval.bootstrap.paired_mean_difference`: questions resampled with replacement); the same per
question category; and the questions that flipped (exact match, or for retrieval-only runs the first recall metric,
wrong in A and right in B, or the reverse).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rag.eval.bootstrap import paired_mean_difference
from rag.eval.ranking import ordered_metrics
from rag.utils.errors import RagError

__all__ = ["compare_runs", "format_comparison"]


def _load(run: str | os.PathLike) -> tuple[dict, dict[str, dict]]:
    path = Path(run)
    summary = path / "summary.json"
    if not summary.is_file():
        why = ("no such directory" if not path.exists()
               else "no summary.json: the run is not complete; finish it by rerunning its command")
        raise RagError(f"--compare {path}: {why}")
    records: dict[str, dict] = {}
    with open(path / "records.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                records[r["id"]] = r
    return json.loads(summary.read_text(encoding="utf-8")), records


def compare_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, resamples: int = 2000, seed: int = 0,
                 max_flipped: int = 50) -> dict:
    """The comparison of `run_b` against `run_a` (see the module docstring) as a JSON-able dict."""
    sa, ra = _load(run_a)
    sb, rb = _load(run_b)
    common = [i for i in ra if i in rb]
    if not common:
        raise RagError(f"--compare: {run_a} and {run_b} share no question id; compare two runs over the same evaluation set")
    differ = next((i for i in common if ra[i]["question"] != rb[i]["question"]), None)
    if differ is not None:
        raise RagError(f"--compare: question {differ!r} is {ra[differ]['question']!r} in {run_a} but "
                       f"{rb[differ]['question']!r} in "
                       f"{run_b}: the runs are not over the same evaluation set; compare runs of one set")
    names = ordered_metrics([n for n in sa["metrics"] if n in sb["metrics"]])
    metrics = {}
    for n in names:
        ids = [i for i in common if n in ra[i]["scores"] and n in rb[i]["scores"]]
        if ids:
            metrics[n] = {"a": sum(ra[i]["scores"][n] for i in ids) / len(ids),
                          "b": sum(rb[i]["scores"][n] for i in ids) / len(ids),
                          **paired_mean_difference([ra[i]["scores"][n] for i in ids], [rb[i]["scores"][n] for i in ids],
                                                   resamples=resamples, seed=seed)}
    cats: dict[str, list[str]] = {}
    for i in common:
        if ra[i].get("category") is not None:
            cats.setdefault(ra[i]["category"], []).append(i)
    by_category = {}
    for c, ids in sorted(cats.items()):
        by_category[c] = {"questions": len(ids)}
        for n in names:
            have = [i for i in ids if n in ra[i]["scores"] and n in rb[i]["scores"]]
            if have:
                by_category[c][n] = sum(rb[i]["scores"][n] - ra[i]["scores"][n] for i in have) / len(have)
    flip_on = "em" if "em" in metrics else next((n for n in metrics if n.startswith(("recall@", "answer_recall@"))), None)
    flipped = {"metric": flip_on, "a_wrong_b_right": [], "a_right_b_wrong": []}
    if flip_on is not None:
        for i in common:
            va, vb = ra[i]["scores"].get(flip_on), rb[i]["scores"].get(flip_on)
            if va is None or vb is None or (va > 0) == (vb > 0):
                continue
            item = {"id": i, "question": ra[i]["question"], "gold": ra[i]["gold"], "a": ra[i].get("answer"),
                    "b": rb[i].get("answer")}
            flipped["a_wrong_b_right" if vb > 0 else "a_right_b_wrong"].append(item)
        flipped["counts"] = {k: len(flipped[k]) for k in ("a_wrong_b_right", "a_right_b_wrong")}
        for k in ("a_wrong_b_right", "a_right_b_wrong"):
            flipped[k] = flipped[k][:max_flipped]
    return {"a": {"run": os.fspath(run_a), "model": sa["settings"]["model"], "questions": len(ra)},
            "b": {"run": os.fspath(run_b), "model": sb["settings"]["model"], "questions": len(rb)},
            "paired_questions": len(common), "resamples": resamples, "seed": seed,
            "metrics": metrics, "by_category": by_category, "flipped": flipped}


def format_comparison(c: dict) -> str:
    """The comparison as aligned text: one line per metric (percent), per-category deltas, the flipped questions."""
    lines = [f"A: {c['a']['run']} ({c['a']['model']})", f"B: {c['b']['run']} ({c['b']['model']})",
             f"{c['paired_questions']} paired questions; 95% paired bootstrap intervals, {c['resamples']} resamples", "",
             f"{'metric':<22}{'A':>8}{'B':>8}{'B - A':>9}  {'95% interval':<18}{'B>A':>5}{'B<A':>5}"]
    for n, m in c["metrics"].items():
        interval = f"[{100 * m['low']:+.1f}, {100 * m['high']:+.1f}]"
        lines.append(f"{n:<22}{100 * m['a']:8.1f}{100 * m['b']:8.1f}{100 * m['delta']:+9.1f}  {interval:<18}"
                     f"{m['better']:>5}{m['worse']:>5}")
    if c["by_category"]:
        cols = [n for n in ("em", "f1") if n in c["metrics"]] or list(c["metrics"])[:2]
        lines += ["", "per category, B - A (points): " + ", ".join(cols)]
        for cat, v in c["by_category"].items():
            lines.append(f"  {cat:<20} n={v['questions']:<4} " + "  ".join(f"{n} {100 * v[n]:+.1f}" for n in cols if n in v))
    f = c["flipped"]
    if f["metric"] is not None:
        lines += ["", f"flipped on {f['metric']}: {f['counts']['a_wrong_b_right']} wrong in A and right in B, "
                      f"{f['counts']['a_right_b_wrong']} right in A and wrong in B"]
        for key, mark in (("a_wrong_b_right", "+"), ("a_right_b_wrong", "-")):
            for item in f[key]:
                lines.append(f"  {mark} [{item['id']}] {item['question']}  gold {item['gold']}  A: {item['a']!r}  "
                             f"B: {item['b']!r}")
    return "\n".join(lines)
