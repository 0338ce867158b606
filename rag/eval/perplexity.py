"""Perplexity of long texts under (retrieval-augmented) causal LMs: token-level, word-level, and bits per byte.

Every text token is scored exactly once (see :mod:`rag.models.ralm.model`); the totals are summed over texts:

* token perplexity ``exp(NLL / tokens)``;
* word perplexity ``exp(NLL / words)`` (whitespace-separated words; comparable across tokenizers);
* bits per byte ``NLL / ln 2 / UTF-8 bytes`` (comparable across tokenizers).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from rag.eval.bootstrap import bootstrap_interval
from rag.knowledge.documents import MAX_DOCUMENT_CHARS
from rag.models.ralm.model import EvalText, InContextRALM, TextScore
from rag.utils.errors import CorpusError
from rag.utils.files import bounded_lines, parse_json, regular_file

__all__ = ["PerplexityResult", "perplexity_totals", "per_text_records", "paired_difference", "evaluate_perplexity",
           "read_eval_texts"]


@dataclass
class PerplexityResult:
    """Totals and the three normalisations of one evaluation."""

    nll: float
    """Total negative log-likelihood, nats."""
    tokens: int
    words: int
    bytes: int
    texts: int
    retrieved_chunks: int = 0
    """Chunks read after a retrieved document."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def word_perplexity(self) -> float:
        return math.exp(self.nll / max(1, self.words))

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / max(1, self.bytes)

    def to_dict(self) -> dict:
        return {"perplexity": self.perplexity, "word_perplexity": self.word_perplexity, "bits_per_byte": self.bits_per_byte,
                **asdict(self)}


def perplexity_totals(scores: Iterable[TextScore]) -> PerplexityResult:
    """Sum the per-text scores into one :class:`PerplexityResult`."""
    nll, tokens, words, nbytes, texts, chunks = 0.0, 0, 0, 0, 0, 0
    for s in scores:
        nll -= float(s.token_logprobs.sum())
        tokens += int(s.token_logprobs.size)
        words += s.n_words
        nbytes += s.n_bytes
        texts += 1
        chunks += sum(d is not None for d in s.doc_ids)
    if tokens == 0:
        raise CorpusError("no text to evaluate; give at least one non-empty text")
    return PerplexityResult(nll, tokens, words, nbytes, texts, chunks)


def per_text_records(scores: Iterable[TextScore]) -> list[dict]:
    """One JSON-able record per text, ``{"id", "nll" (nats), "bytes"}``: what :func:`paired_difference` compares."""
    return [{"id": s.id, "nll": -float(s.token_logprobs.sum()), "bytes": s.n_bytes} for s in scores]


def paired_difference(base: list[dict], run: list[dict], *, resamples: int = 2000, seed: int = 0) -> Optional[dict]:
    """Bits per byte of `run` minus `base` (:func:`per_text_records` of the same texts), with a 95% bootstrap interval
    over texts (texts resampled with replacement, totals recomputed) and how many texts `run` predicts better.
    None when either has no records or they are not the same texts in the same order."""
    if not base or not run or [t["id"] for t in base] != [t["id"] for t in run]:
        return None
    nll0, nll1, nbytes = [t["nll"] for t in base], [t["nll"] for t in run], [t["bytes"] for t in base]

    def delta(idx) -> float:
        return (sum(nll1[i] for i in idx) - sum(nll0[i] for i in idx)) / math.log(2) / max(1, sum(nbytes[i] for i in idx))

    n = len(base)
    low, high = bootstrap_interval(n, delta, resamples=resamples, seed=seed)
    return {"delta_bpb": delta(range(n)), "low": low, "high": high,
            "texts": n, "texts_better": sum(x < y for x, y in zip(nll1, nll0))}


def evaluate_perplexity(ralm: InContextRALM, texts: Iterable[EvalText | str], *, progress: bool = False) -> PerplexityResult:
    """Perplexity of `texts` under `ralm` (retrieval per its config; ``retriever=None`` is the plain sliding window)."""
    return perplexity_totals(ralm.score_texts((t if isinstance(t, EvalText) else EvalText(t) for t in texts), progress=progress))


def _record(obj, where: str, field: str) -> EvalText:
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object with a {field!r} field")
    text = obj.get(field)
    if not isinstance(text, str) or not text.strip():
        raise CorpusError(f"{where}: field {field!r} is missing or empty; each record needs its text there (--text-field)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CorpusError(f"{where}: field {field!r} holds {text[e.start]!r}, a lone UTF-16 surrogate that is not valid "
                          "Unicode (a JSON escape such as \\ud800 without its pair); fix the escape") from None
    ident, title = obj.get("id"), obj.get("title")
    return EvalText(text, None if ident is None else str(ident), None if title is None else str(title))


def read_eval_texts(path: str | os.PathLike, *, field: str = "text", limit: Optional[int] = None) -> list[EvalText]:
    """Texts to evaluate from ``path`` (``--data``):

    * ``*.jsonl``: one object per line, the text in `field`, optional ``id`` / ``title`` naming its source document
      (the leakage guard excludes passages of that document);
    * a ``datasets`` directory (``save_to_disk``): rows with the same fields;
    * any other file: one plain UTF-8 text (a WikiText-style token stream).
    """
    p = Path(path)
    out: list[EvalText] = []
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise CorpusError(f"--data {p}: not a datasets directory ({e}); pass a .jsonl or text file, or a "
                              f"save_to_disk directory") from e
        if isinstance(ds, datasets.DatasetDict):
            if "test" not in ds:
                raise CorpusError(f"--data {p}: a DatasetDict without a 'test' split; save the split to evaluate")
            ds = ds["test"]
        for i, row in enumerate(ds):
            out.append(_record(row, f"{p}[{i}]", field))
            if limit is not None and len(out) >= limit:
                break
    elif p.exists():
        regular_file(p, "--data", error=CorpusError)  # a device or pipe (/dev/zero) is never read
        try:
            with open(p, encoding="utf-8") as f:
                if p.suffix == ".jsonl":
                    for n, line in enumerate(bounded_lines(f, str(p), MAX_DOCUMENT_CHARS, error=CorpusError), 1):
                        if not line.strip():
                            continue
                        out.append(_record(parse_json(line, f"{p}:{n}", fix="fix or remove the line", error=CorpusError),
                                           f"{p}:{n}", field))
                        if limit is not None and len(out) >= limit:
                            break
                else:
                    raw = f.read(MAX_DOCUMENT_CHARS + 1)
                    if len(raw) > MAX_DOCUMENT_CHARS:
                        raise CorpusError(f"--data {p}: longer than {MAX_DOCUMENT_CHARS:,} characters, the most one plain text "
                                          "may hold; split it into a .jsonl file of texts (one JSON object per line)")
                    if raw.strip():
                        out.append(EvalText(raw))
        except UnicodeDecodeError as e:
            raise CorpusError(f"--data {p}: not UTF-8 text ({e})") from e
    else:
        raise CorpusError(f"--data {p}: no such file or directory")
    if not out:
        raise CorpusError(f"--data {p}: holds no text to evaluate")
    return out
