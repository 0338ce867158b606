"""One model against several knowledge bases: matched vs mismatched accuracy (Lewis et al. 2020, §4.5).

The paper answers "Who is {position}?" for 82 world leaders with one RAG model and two
indexes (Wikipedia 2016 and 2018): each index answers its own year's leaders well (70% / 68%)
and the other year's poorly (12% / 4%), showing that the model's knowledge is updated by
swapping the index, without retraining. :func:`evaluate_hotswap` reproduces that experiment
for any model, knowledge bases and question sets: it hot-swaps the model through every
knowledge base (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`) and scores every question
set on each, giving an exact-match matrix with rows = knowledge bases and columns = question
sets. When both lists have the same length, knowledge base i is paired with question set i:
the diagonal is "matched", the rest "mismatched".
"""

from __future__ import annotations

import io
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from rag.eval.metrics import ExactMatch, TokenF1
from rag.eval.qa_data import read_qa
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.retrobust.backoff import resolve_nli
from rag.retrobust.nli import validate_threshold
from rag.utils.errors import ConfigError, RagError
from rag.utils.io import atomic_write_bytes
from rag.utils.validate import check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["HotswapEvalResult", "evaluate_hotswap"]

PathLike = Union[str, os.PathLike]


@dataclass
class HotswapEvalResult:
    """Scores of one model on every (knowledge base, question set) pair. Scores are fractions in [0, 1]."""

    kb_labels: list[str]
    kb_versions: list[str]
    kb_paths: list[str]
    data_labels: list[str]
    n_questions: list[int]
    em: list[list[float]]
    """(n_kbs, n_data): exact match of question set j answered from knowledge base i."""
    f1: list[list[float]]
    """(n_kbs, n_data): token F1, same layout."""
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    answered_with_retrieval: Optional[list[list[float]]] = None
    """With the NLI back-off (``nli=``): (n_kbs, n_data) fraction of answers that kept the retrieval answer (the rest
    backed off to no retrieval); None without it."""

    @property
    def paired(self) -> bool:
        """True when knowledge base i is paired with question set i (as many of each)."""
        return len(self.kb_labels) == len(self.data_labels) > 1

    def matched(self, metric: str = "em") -> Optional[float]:
        """Mean score of the diagonal (each question set on its own knowledge base), if paired."""
        m = self._metric(metric)
        return sum(m[i][i] for i in range(len(m))) / len(m) if self.paired else None

    def mismatched(self, metric: str = "em") -> Optional[float]:
        """Mean score off the diagonal (question sets on the other knowledge bases), if paired."""
        if not self.paired:
            return None
        m = self._metric(metric)
        off = [m[i][j] for i in range(len(m)) for j in range(len(m)) if i != j]
        return sum(off) / len(off)

    def _metric(self, metric: str) -> list[list[float]]:
        if metric not in ("em", "f1"):
            raise ConfigError(f"metric={metric!r}; choose 'em' or 'f1'")
        return self.em if metric == "em" else self.f1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["matched"] = {m: self.matched(m) for m in ("em", "f1")}
        d["mismatched"] = {m: self.mismatched(m) for m in ("em", "f1")}
        return d

    def table(self, metric: str = "em") -> str:
        """The matrix as aligned text, in percent: rows = knowledge bases, columns = question sets."""
        m = self._metric(metric)
        rows = [f"{label} ({v})" for label, v in zip(self.kb_labels, self.kb_versions)]
        cols = [f"{label} (n={n})" for label, n in zip(self.data_labels, self.n_questions)]
        head = f"{metric.upper()} (%)  rows: knowledge base, columns: question set"
        w0 = max(len("knowledge base"), *(len(r) for r in rows))
        widths = [max(len(c), 6) for c in cols]
        lines = [head, "  ".join(["knowledge base".ljust(w0)] + [c.rjust(w + 1) for c, w in zip(cols, widths)])]
        for i, (r, vals) in enumerate(zip(rows, m)):
            cells = []
            for j, (v, w) in enumerate(zip(vals, widths)):
                mark = "*" if self.paired and i == j else " "
                cells.append(f"{100 * v:.1f}{mark}".rjust(w + 1))
            lines.append("  ".join([r.ljust(w0)] + cells))
        if self.paired:
            lines.append(f"matched (*) {100 * self.matched(metric):.1f}   mismatched {100 * self.mismatched(metric):.1f}")
        if self.answered_with_retrieval is not None:
            lines.append("NLI back-off: answered with retrieval (%), same layout")
            for r, vals in zip(rows, self.answered_with_retrieval):
                lines.append("  ".join([r.ljust(w0)] + [f"{100 * v:.1f} ".rjust(w + 1) for v, w in zip(vals, widths)]))
        return "\n".join(lines)

    def plot(self, path: PathLike, metric: str = "em") -> Path:
        """Write the matrix as a heatmap PNG (matplotlib, Agg backend); returns the path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        grid = 100 * np.asarray(self._metric(metric), dtype=float)
        n_kb, n_data = grid.shape
        fig, ax = plt.subplots(figsize=(2.0 + 1.6 * n_data, 1.4 + 0.8 * n_kb))
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(n_data), [f"{d}\n(n={n})" for d, n in zip(self.data_labels, self.n_questions)])
        ax.set_yticks(range(n_kb), [f"{k}\n{v}" for k, v in zip(self.kb_labels, self.kb_versions)])
        ax.set_xlabel("question set")
        ax.set_ylabel("knowledge base")
        for i in range(n_kb):
            for j in range(n_data):
                ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", color="white" if grid[i, j] < 60 else "black",
                        fontweight="bold" if self.paired and i == j else "normal")
        title = f"{metric.upper()} (%) of one model on each knowledge base"
        if self.paired:
            title += f"\nmatched {100 * self.matched(metric):.1f}, mismatched {100 * self.mismatched(metric):.1f}"
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120)
        plt.close(fig)
        path = Path(path)
        atomic_write_bytes(path, buf.getvalue())
        return path


def _labels(given: Optional[Sequence[str]], paths: Sequence[PathLike], what: str) -> list[str]:
    if given is not None:
        if len(given) != len(paths):
            raise ConfigError(f"{len(given)} {what} labels for {len(paths)} {what}s; give one label each")
        return list(given)
    names = [Path(os.fspath(p)).name or os.fspath(p) for p in paths]
    stems = [Path(n).stem if what == "question set" else n for n in names]
    if len(set(stems)) == len(stems):
        return stems
    return [os.fspath(p) for p in paths]


def evaluate_hotswap(
    pipeline,
    kbs: Sequence[PathLike],
    data: Sequence[PathLike],
    *,
    batch_size: int = 8,
    n_docs: Optional[int] = None,
    num_beams: Optional[int] = None,
    marginalization: Optional[str] = None,
    decoding: Optional[str] = None,
    max_new_tokens: Optional[int] = None,
    limit: Optional[int] = None,
    allow_encoder_change: bool = False,
    verify: str = "full",
    kb_labels: Optional[Sequence[str]] = None,
    data_labels: Optional[Sequence[str]] = None,
    show_progress: bool = True,
    nli=None,
    nli_threshold: float = 0.5,
) -> HotswapEvalResult:
    """Score `pipeline` on every question set in `data` with every knowledge base in `kbs`.

    The pipeline's model is hot-swapped to each knowledge base in turn (every directory is
    opened and checked for compatibility before any generation starts), and swapped back to
    its original knowledge base at the end — also after an error. Do not run this on a
    pipeline that is serving requests: they would see the swaps.

    Args:
        pipeline: a :class:`rag.pipeline.api.RagPipeline` (anything with ``generate`` and a
            ``model.retriever`` that can swap).
        kbs: knowledge-base directories (rows of the matrix).
        data: QA files in NQ-open JSONL (``question``, ``answers``) or any format
            :func:`rag.eval.qa_data.read_qa` reads (columns).
        limit: score only the first `limit` questions of each set.
        nli, nli_threshold: the RetRobust NLI back-off (``pipeline.generate(..., nli=...)``; pass a loaded
            :class:`~rag.retrobust.nli.NLIScorer` to load it once); the result then records, per cell, the fraction of
            answers that kept the retrieval answer (``answered_with_retrieval``).
        The generation keywords go to ``pipeline.generate``.

    Returns:
        :class:`HotswapEvalResult` with EM and F1 matrices.

    Raises:
        RagError: a data file cannot be read, or a knowledge base is missing, damaged or
            incompatible with the model (before any generation).
    """
    from tqdm.auto import tqdm

    kbs, data = list(kbs), list(data)
    if not kbs or not data:
        raise ConfigError("give at least one knowledge base (--kb) and one question set (--data)")
    check_positive_int(batch_size, "batch_size", error=ConfigError)
    check_positive_int(limit, "limit (--limit)", allow_none=True, error=ConfigError)
    klabels, dlabels = _labels(kb_labels, kbs, "knowledge base"), _labels(data_labels, data, "question set")
    if nli is not None:
        nli_threshold = validate_threshold(nli_threshold)
        nli = resolve_nli(nli)  # once, not per batch

    sets = []
    for path in data:
        examples = read_qa(path, stage="test", require_answers=True)
        if limit is not None:
            examples = examples[:limit]
        if not examples:
            raise RagError(f"{path}: no usable questions (every example was empty or unanswered)")
        sets.append(examples)

    slot = KnowledgeBaseSlot.for_model(pipeline, keep_loaded=1)
    for path in kbs:  # fail before generating anything: missing / damaged / incompatible directories
        slot.check(path, allow_encoder_change=allow_encoder_change, verify="size")
    original = slot.current

    gen_kw = dict(n_docs=n_docs, num_beams=num_beams, marginalization=marginalization, decoding=decoding,
                  max_new_tokens=max_new_tokens)
    nli_kw = {} if nli is None else {"nli": nli, "nli_threshold": nli_threshold}
    em = [[0.0] * len(sets) for _ in kbs]
    kept = [[0.0] * len(sets) for _ in kbs]
    f1 = [[0.0] * len(sets) for _ in kbs]
    versions, paths = [], []
    t0 = time.perf_counter()
    total = len(kbs) * sum(len(s) for s in sets)
    bar = tqdm(total=total, desc="hotswap-eval", unit="q", disable=not show_progress)
    try:
        for i, path in enumerate(kbs):
            res = slot.swap(path, allow_encoder_change=allow_encoder_change, verify=verify)
            versions.append(res.new_version)
            paths.append(res.path or os.fspath(path))
            for j, examples in enumerate(sets):
                em_m, f1_m = ExactMatch(), TokenF1()
                n_kept = 0
                for start in range(0, len(examples), batch_size):
                    batch = examples[start : start + batch_size]
                    answers = pipeline.generate([e.question for e in batch], **gen_kw, **nli_kw)
                    if len(answers) != len(batch):
                        raise RagError(f"the pipeline returned {len(answers)} answers for {len(batch)} questions")
                    stray = {a.kb_version for a in answers} - {res.new_version}
                    if stray:
                        raise RagError(f"answers came from knowledge base {sorted(stray)} while evaluating {res.new_version}: "
                                       "something else swapped the model's knowledge base during the evaluation")
                    preds, golds = [a.text for a in answers], [list(e.answers) for e in batch]
                    em_m.update(preds, golds)
                    f1_m.update(preds, golds)
                    if nli is not None:
                        n_kept += sum(a.answered_with == "retrieval" for a in answers)
                    bar.update(len(batch))
                em[i][j], f1[i][j] = float(em_m.compute()), float(f1_m.compute())
                kept[i][j] = n_kept / len(examples)
                logger.info("kb %s x %s: EM %.3f F1 %.3f", klabels[i], dlabels[j], em[i][j], f1[i][j])
    finally:
        bar.close()
        if slot.current is not original:
            slot.swap(original, allow_encoder_change=True, allow_metric_change=True)
    return HotswapEvalResult(
        kb_labels=klabels, kb_versions=versions, kb_paths=paths, data_labels=dlabels,
        n_questions=[len(s) for s in sets], em=em, f1=f1, seconds=round(time.perf_counter() - t0, 3),
        settings={**gen_kw, "batch_size": batch_size, "limit": limit, "verify": verify,
                  "data": [os.fspath(p) for p in data],
                  **({} if nli is None else {"nli": nli.name, "nli_threshold": nli_threshold})},
        answered_with_retrieval=None if nli is None else kept,
    )
