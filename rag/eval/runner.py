"""`rag evaluate` / ``rag.evaluate(...)``: a model, or a retriever alone, over an evaluation set, into a results
directory.

The results directory:

* ``settings.json``: what the run is (model, knowledge-base version, data and a digest of its questions, options,
  cut-offs, limit, seed), written first; a directory made with other settings is never resumed;
* ``records.jsonl``: one JSON line per question (id, question, gold answers and provenance, answer, the passages it read
  with prior and posterior, the top-k retrieved, and every per-question score), appended and flushed batch by batch: a
  killed run continues from the questions it has not recorded (a line cut by the kill is dropped and redone);
* ``summary.json`` (every metric's mean, per category, the provenance coverage), ``results.md`` (the same as a table)
  and ``plots/``, written only when every question is recorded: a directory without ``summary.json`` is incomplete.

Each answered record also holds the answer's citations and ``cited_text`` (:func:`rag.generation.answers.cite`). With
``faithfulness=NLI_DIR`` it holds the NLI judge's verdict too (:mod:`rag.eval.faithfulness`: P(entailment) per passage
read) and the scores ``supported_top``, ``supported_cited``, ``supported_any``, whose means in the summary are the
fractions of answers supported by their top-posterior passage, by a cited passage and by any passage read.

It answers with the pipeline's own ``retrieve`` and ``generate`` (:class:`~rag.pipeline.api.RagPipeline`), or, for a
retriever alone, the knowledge base's retriever (dense with the query encoder it records, or BM25), as ``rag index
search`` does. The ranking metrics are those of :mod:`rag.eval.ranking`, the answer metrics SQuAD v1.1's
(:mod:`rag.eval.metrics`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import rag
from rag.demo.kb import resolve_knowledge_base
from rag.eval.benchmarks import EvalExample, read_eval_set
from rag.eval.faithfulness import DEFAULT_THRESHOLD, FaithfulnessJudge
from rag.eval.metrics import exact_match, gold_in_answer, has_answer, token_f1
from rag.eval.ranking import parse_ks, query_metrics, r_precision, trec_order
from rag.eval.report import markdown, write_report
from rag.generation.answers import cited_text, retrievals
from rag.knowledge.retriever_kinds import retriever_for_kind
from rag.pipeline.api import RagPipeline, load
from rag.utils.errors import ConfigError, RagError
from rag.utils.io import atomic_write_json, to_json
from rag.utils.truncation import counting_cut_prompts
from rag.utils.validate import check_positive_int

__all__ = ["evaluate", "EvalResumeError", "read_records", "summarize", "markdown", "MAX_COVERAGE_CHECK"]

MAX_COVERAGE_CHECK = 5_000_000
"""Largest knowledge base whose passage ids are all read to check that the gold provenance names them."""


class EvalResumeError(RagError):
    """A results directory cannot be resumed: made with other settings, or not a results directory."""


def evaluate(model: Any = None, data: Any = None, out: str | os.PathLike = None, *, knowledge_base: Any = None,
             format: str = "auto", ks: Sequence[int] | str = (1, 5, 10, 20), limit: Optional[int] = None, seed: int = 0,
             batch_size: int = 8, verify: str = "full", device: Optional[str] = None, progress: bool = True,
             faithfulness: Any = None, faithfulness_threshold: float = DEFAULT_THRESHOLD,
             rerank: Optional[int] = None, reranker: Optional[str] = None, **options) -> dict:
    """Evaluate `model` (anything :func:`rag.load` takes, or a :class:`RagPipeline`) — or, with ``model=None``, the
    retriever of `knowledge_base` alone (``retrieval="bm25"`` for BM25) — on the evaluation set `data` (any format of
    :func:`rag.eval.benchmarks.read_eval_set`), writing the results directory `out` (see the module docstring).

    `ks`: retrieval cut-offs; `limit`: the first N questions; `seed`: seeds torch, numpy and random before each batch;
    `options`: generation options for ``pipeline.generate``. `faithfulness`: an NLI model (directory, ``"minilm-snli"``,
    or a :class:`~rag.eval.faithfulness.FaithfulnessJudge`) judging each answer against its passages at
    `faithfulness_threshold`. `rerank` / `reranker`: :func:`rag.load`'s rerank stage (recorded in the
    settings). Resumes `out` when it holds an unfinished run with the same settings. Returns the
    summary (also ``out/summary.json``)."""
    if data is None or out is None:
        raise ConfigError("evaluate needs data= (an evaluation set) and out= (the results directory)")
    if model is None and knowledge_base is None:
        raise ConfigError("give a model (--model) or, to evaluate a retriever alone, a knowledge base (--kb)")
    ks = parse_ks(ks if isinstance(ks, str) else list(ks))
    check_positive_int(batch_size, "batch_size (--batch-size)", error=ConfigError)
    check_positive_int(limit, "limit (--limit)", allow_none=True, error=ConfigError)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed (--seed) must be a non-negative integer, got {seed!r}")
    if faithfulness is not None and model is None:
        raise ConfigError("--faithfulness judges answers: give a model (--model), or drop --faithfulness for a retriever alone")
    out = Path(out)
    _check_out(out)
    examples = read_eval_set(data, format=format)
    examples = examples[:limit] if limit is not None else examples
    stage = {k: v for k, v in (("rerank", rerank), ("reranker", reranker)) if v is not None}
    judge = None
    if faithfulness is not None:
        judge = (faithfulness if isinstance(faithfulness, FaithfulnessJudge)
                 else FaithfulnessJudge.open(faithfulness, faithfulness_threshold, device=device))
    system = _System.open(model, knowledge_base, verify=verify, device=device, options=dict(options), load_kw=stage)
    k_max = min(max(ks), system.size) if system.size else max(ks)
    settings = {"rag_version": rag.__version__, "model": system.name, "kb_version": system.kb_version,
                "data": str(data), "format": format, "questions": len(examples), "data_sha256": _digest(examples),
                "ks": list(ks), "limit": limit, "seed": seed,
                "options": {k: v for k, v in sorted(options.items()) if v is not None}}
    if judge is not None:  # named only when set: a directory made without it resumes as before
        settings["faithfulness"] = {"model": judge.name, "threshold": judge.threshold}
    if stage:
        settings["rerank"] = {"candidates": rerank, "reranker": os.fspath(reranker)}
    summary_path = out / "summary.json"
    done = _open_run(out, settings)
    if summary_path.is_file() and len(done) == len(examples):
        return json.loads(summary_path.read_text(encoding="utf-8"))
    todo = [ex for ex in examples if ex.id not in done]
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc="evaluate", unit="q", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        with open(out / "records.jsonl", "a", encoding="utf-8") as f, counting_cut_prompts() as cut:
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                _seed_everything(seed + len(examples) - len(todo) + start)
                records = system.run(batch, k_max, ks, judge)
                f.write("".join(to_json(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
    finally:
        bar.close()
    records = read_records(out)
    summary = summarize(records, settings, coverage=system.coverage(examples))
    summary["cut_prompts"] = {**cut.to_dict(), "questions": len(todo)}  # the reader prompts of this run's questions
    write_report(out, summary, records)
    atomic_write_json(summary_path, summary)  # last: its presence says the run is complete
    return summary


# ---------------------------------------------------------------------------- the system under evaluation


class _System:
    """A pipeline (retrieve + generate) or a knowledge base's retriever, answering batches of examples as records."""

    def __init__(self, name: str, pipeline: Optional[RagPipeline], retriever, kb, options: dict):
        self.name, self.pipeline, self.retriever, self.kb, self.options = name, pipeline, retriever, kb, options

    @classmethod
    def open(cls, model, knowledge_base, *, verify: str, device, options: dict, load_kw: Optional[dict] = None) -> "_System":
        if load_kw and isinstance(model, RagPipeline):
            raise ConfigError("rerank= / reranker= are rag.load's: load the pipeline with them, or pass the model's name")
        if model is None:
            if load_kw:
                raise ConfigError("--rerank / --reranker rerank a model's retrieval: give --model")
            kb = resolve_knowledge_base(knowledge_base, verify=verify)
            kind = options.pop("retrieval", None) or "dense"
            if options:
                raise ConfigError(f"a retriever alone generates nothing: drop the generation options {sorted(options)} "
                                  "or give --model")
            retriever = retriever_for_kind(kind, kb, build_missing=True)  # BM25 in memory where the KB has none
            return cls(f"retriever:{kind}", None, retriever, kb, {"retrieval": kind})
        pipe = model if isinstance(model, RagPipeline) else load(model, knowledge_base=knowledge_base, device=device,
                                                                 **(load_kw or {}))
        name = os.fspath(model) if isinstance(model, (str, os.PathLike)) else type(pipe.reader).__name__
        kb = getattr(pipe.retriever, "knowledge_base", None)
        return cls(name, pipe, None, kb, options)

    @property
    def size(self) -> int:
        return len(self.kb) if self.kb is not None else 0

    @property
    def kb_version(self) -> Optional[str]:
        return self.pipeline.kb_version if self.pipeline is not None else self.kb.served_version

    def retrieve(self, questions: list[str], k: int):
        if self.pipeline is None:
            got = self.retriever.retrieve(questions, k)
            return retrievals(questions, got.kb_version, got.passages, got.scores)
        retrieval = self.options.get("retrieval")
        return self.pipeline.retrieve(questions, k=k, **({"retrieval": retrieval} if retrieval else {}))

    def run(self, batch: list[EvalExample], k_max: int, ks: Sequence[int],
            judge: Optional[FaithfulnessJudge] = None) -> list[dict]:
        questions = [ex.question for ex in batch]
        hits = self.retrieve(questions, k_max)
        answers = self.pipeline.generate(questions, **self.options) if self.pipeline is not None else [None] * len(batch)
        if len(answers) != len(batch):
            raise RagError(f"the pipeline returned {len(answers)} answers for {len(batch)} questions; evaluate with "
                           "num_return_sequences=1")
        verdicts = judge.judge(answers) if judge is not None else [None] * len(batch)
        return [_record(ex, hit, ans, ks, v) for ex, hit, ans, v in zip(batch, hits, answers, verdicts)]

    def coverage(self, examples: Sequence[EvalExample]) -> dict:
        """How many gold provenance ids the knowledge base holds (None where the set names none or it is too large)."""
        gold = {(ex.match, g) for ex in examples if ex.qrels for g, grade in ex.qrels.items() if grade >= 1}
        out: dict = {"questions_with_provenance": sum(1 for ex in examples if ex.qrels), "gold_ids": len(gold)}
        if not gold:
            out["note"] = "the evaluation set names no gold provenance: retrieval is scored by answer strings only"
            return out
        if self.kb is None or len(self.kb) > MAX_COVERAGE_CHECK:
            out["note"] = "not checked (knowledge base unavailable or too large to list)"
            return out
        passages = self.kb.all_passages()
        keys = {"id": set(), "title": set()}
        for p in passages:
            keys["id"].update((p.id, _chunk_base(p.id)))
            keys["title"].add(p.title)
        found = sum(1 for match, g in gold if g in keys[match])
        out["in_knowledge_base"] = found
        if found == 0:
            out["note"] = ("no gold provenance id is a passage id (or title) of the knowledge base: the provenance metrics "
                           "(recall@k, nDCG@k, MRR@k, MAP, R-precision, KILT-EM) are 0 by construction and say nothing; "
                           "build the knowledge base from the corpus the evaluation set names")
        elif found < len(gold):
            out["note"] = f"{len(gold) - found} of {len(gold)} gold provenance ids are not in the knowledge base"
        return out


def _chunk_base(pid: str) -> str:
    head, sep, tail = pid.rpartition("-")
    return head if sep and tail.isdigit() else pid


def _gold_key(passage, ex: EvalExample) -> str:
    """The id a retrieved passage counts as against `ex`'s gold provenance: its title (``match="title"``), its id,
    or, for a chunk ``DOC-N`` of a gold document, ``DOC``."""
    if ex.match == "title":
        return passage.title
    if ex.qrels and passage.id not in ex.qrels and _chunk_base(passage.id) in ex.qrels:
        return _chunk_base(passage.id)
    return passage.id


def _record(ex: EvalExample, hit, answer, ks: Sequence[int], verdict=None) -> dict:
    scores: dict[str, float] = {}
    if ex.answers:
        for k in ks:
            scores[f"answer_recall@{k}"] = float(any(has_answer(p, list(ex.answers)) for p in hit.passages[:k]))
    if ex.qrels is not None:
        run: dict[str, float] = {}
        for p in hit.passages:
            run.setdefault(_gold_key(p, ex), p.score)
        scores.update(query_metrics(trec_order(run), ex.qrels, ks))
    read = hit.passages if answer is None else answer.passages
    if answer is not None and ex.answers:
        scores["em"] = exact_match(answer.text, list(ex.answers))
        scores["f1"] = token_f1(answer.text, list(ex.answers))
        scores["gold_in_answer"] = gold_in_answer(answer.text, list(ex.answers))
    if ex.evidence:
        ordered = sorted(read, key=lambda p: -p.score)  # the pages read, best retrieved first (KILT's guess provenance)
        scores["rprec"] = r_precision([_gold_key(p, ex) for p in ordered], ex.evidence)
        if "em" in scores:
            scores["kilt_em"] = scores["em"] if scores["rprec"] == 1.0 else 0.0
            scores["kilt_f1"] = scores["f1"] if scores["rprec"] == 1.0 else 0.0
    if verdict is not None:
        scores.update(verdict.scores())
    cites = [] if answer is None else answer.citations
    extra = {} if answer is None else {"citations": [asdict(c) for c in cites], "cited_text": cited_text(answer.text, cites)}
    if verdict is not None:
        extra["faithfulness"] = verdict.to_dict()
    return {
        "id": ex.id, "question": ex.question, "gold": list(ex.answers), "category": ex.category,
        "gold_provenance": None if ex.qrels is None else dict(ex.qrels),
        "answer": None if answer is None else answer.text,
        "answer_score": None if answer is None else answer.score,
        "kb_version": hit.kb_version if answer is None else answer.kb_version,
        "passages": [{"id": p.id, "title": p.title, "score": p.score, "prior": p.prior, "posterior": p.posterior}
                     for p in read],
        "retrieved": [{"id": p.id, "title": p.title, "score": p.score} for p in hit.passages],
        **extra,
        "scores": scores,
    }


# ---------------------------------------------------------------------------- the results directory


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise EvalResumeError(f"--out {out}: is a file; give a directory for the results (created if missing)")
    if out.is_dir() and any(out.iterdir()) and not (out / "settings.json").is_file():
        raise EvalResumeError(f"--out {out}: a non-empty directory that is not a results directory (no settings.json); "
                              "choose another --out")


def _open_run(out: Path, settings: dict) -> set[str]:
    """Create `out` with its settings, or check an existing run's; the ids already recorded."""
    path = out / "settings.json"
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "records.jsonl").unlink(missing_ok=True)
        atomic_write_json(path, settings)
        return set()
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvalResumeError(f"{path}: cannot be read ({e}); choose another --out") from None
    derived = ("questions", "data_sha256")  # follow from the others: named last
    diff = sorted((k for k in set(old) | set(settings) if old.get(k) != settings.get(k)), key=lambda k: (k in derived, k))
    if diff:
        k = diff[0]
        also = f"; also {', '.join(diff[1:])}" if diff[1:] else ""
        raise EvalResumeError(f"{out}: made with other settings ({k}: {old.get(k)!r}, now {settings.get(k)!r}{also}); it is "
                              "never resumed with others: choose another --out, or delete it to start over")
    return {r["id"] for r in read_records(out, repair=True)}


def read_records(out: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """The records of a results directory, in the order written. A last line cut short (a killed run) is dropped and,
    with `repair`, cut off the file so that appending continues cleanly."""
    path = Path(out) / "records.jsonl"
    if not path.is_file():
        return []
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            records.append(json.loads(line))
        except ValueError:
            break
        good += len(line)
    if repair and good < len(data):
        with open(path, "rb+") as f:
            f.truncate(good)
    return records


def _digest(examples: Sequence[EvalExample]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.id, ex.question, list(ex.answers), sorted((ex.qrels or {}).items())],
                            ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def summarize(records: Sequence[dict], settings: dict, *, coverage: Optional[dict] = None) -> dict:
    """Means of every per-question score, overall and per category, with the run's settings."""
    names = list(dict.fromkeys(n for r in records for n in r["scores"]))

    def means(rs) -> dict:
        return {n: sum(r["scores"][n] for r in rs if n in r["scores"]) / max(1, sum(n in r["scores"] for r in rs))
                for n in names if any(n in r["scores"] for r in rs)}

    cats: dict[str, list[dict]] = {}
    for r in records:
        if r.get("category") is not None:
            cats.setdefault(r["category"], []).append(r)
    return {"complete": True, "questions": len(records), "metrics": means(records),
            "by_category": {c: {"questions": len(rs), **means(rs)} for c, rs in sorted(cats.items())},
            "provenance": coverage or {}, "settings": settings}
