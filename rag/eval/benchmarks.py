"""Evaluation sets as their projects publish them, read into one form (:class:`EvalExample`) for `rag evaluate`.

Formats (``format="auto"`` tells them apart by their files and first record):

* ``kilt``: KILT JSONL (Petroni et al. 2021): ``id``, ``input``, ``output[].answer``,
  ``output[].provenance[].wikipedia_id`` (gold pages). Each output's pages form one evidence set (R-precision).
* ``dpr``: DPR's retriever JSON (``biencoder-nq-dev.json``, ``trivia-dev.json``): an array of ``question``,
  ``answers``, ``positive_ctxs[].passage_id`` (gold passages, the ids of DPR's ``psgs_w100.tsv``).
* ``hotpotqa``: HotpotQA JSON: an array of ``_id``, ``question``, ``answer``, ``supporting_facts`` ``[[title, sent]]``
  (gold pages by *title*), ``type`` (bridge / comparison: the category), ``level``.
* ``beir``: a BEIR dataset directory: ``corpus.jsonl``, ``queries.jsonl`` (``_id``, ``text``), ``qrels/SPLIT.tsv``
  (``query-id<TAB>corpus-id<TAB>score`` under a header; graded). Retrieval only (no answers). ``DIR#SPLIT`` names the
  split (default ``test``, else ``dev``, else the only one).
* ``qa``: everything :func:`rag.eval.qa_data.read_qa` reads: the project's own JSONL (``question``, ``answers``,
  optional ``id``, ``type``/``category``, ``passage_ids``), NQ-open JSONL, DPR's ``*.qa.csv`` / ``qas.tsv`` (NQ-open and
  TriviaQA as DPR distributes them), ``demo:SPLIT``.

Gold provenance is matched against retrieved passages by id (``match="id"``: the passage id, or the document id before
a chunk suffix ``-N``) or by title (``match="title"``, HotpotQA). Bad input (a missing field, a malformed row, a
duplicate id, qrels naming an unknown query) is an :class:`EvalDataError` naming ``file:line`` and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from rag.eval.qa_data import QADataError, read_qa
from rag.utils.files import bounded_lines, parse_json, read_json

__all__ = ["EvalDataError", "EvalExample", "FORMATS", "detect_format", "read_eval_set"]

FORMATS = ("auto", "kilt", "dpr", "hotpotqa", "beir", "qa")
MAX_LINE = 64 << 20
"""Longest JSONL record read (a KILT record with its provenance is far below it)."""
MAX_JSON = 1 << 30
"""Largest JSON array read whole (DPR's dev files with their negative contexts are below it)."""


class EvalDataError(QADataError):
    """An evaluation set cannot be read; the message names file:line and the fix."""


@dataclass(frozen=True)
class EvalExample:
    """One question of an evaluation set.

    `qrels` is ``{gold id: grade}`` (None: the set names no gold provenance for it); `evidence` the KILT evidence sets
    (one tuple of gold ids per gold output); `match` whether gold ids name passage ids or titles."""

    id: str
    question: str
    answers: tuple[str, ...]
    where: str
    category: Optional[str] = None
    qrels: Optional[Mapping[str, int]] = None
    evidence: tuple[tuple[str, ...], ...] = ()
    match: str = "id"
    extra: Mapping[str, Any] = field(default_factory=dict)


def detect_format(source: str | os.PathLike) -> str:
    """The format of `source` (see the module docstring), from its files and first record."""
    spec = os.fspath(source)
    if spec.startswith("demo:"):
        return "qa"
    path = Path(spec.partition("#")[0])
    if path.is_dir():
        return "beir" if (path / "queries.jsonl").is_file() else "qa"
    first = _first_record(path)
    if isinstance(first, dict):
        if "input" in first and ("output" in first or "question" not in first):
            return "kilt"
        if "positive_ctxs" in first:
            return "dpr"
        if "supporting_facts" in first:
            return "hotpotqa"
    return "qa"


def _first_record(path: Path) -> Any:
    """The first JSON object of a .jsonl/.json file (None for other files or when it cannot be parsed cheaply)."""
    if path.suffix.lower() not in (".jsonl", ".json") or not path.is_file():
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16)
    text = head.lstrip()
    if text.startswith("["):
        text = text[1:].lstrip()
    depth, end, in_str, esc = 0, None, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    if end is None:  # longer than the head: look at the keys seen so far
        return {k: None for k in ("input", "output", "positive_ctxs", "supporting_facts", "question") if f'"{k}"' in text}
    try:
        return json.loads(text[:end])
    except ValueError:
        return None


def read_eval_set(source: str | os.PathLike, *, format: str = "auto") -> list[EvalExample]:
    """Read an evaluation set (see the module docstring). Ids are the records' own, else their position (0, 1, ...);
    a duplicate id is an error."""
    if format not in FORMATS:
        raise EvalDataError(f"--format {format!r}: unknown; choose one of {', '.join(FORMATS)}")
    fmt = detect_format(source) if format == "auto" else format
    reader = {"kilt": _read_kilt, "dpr": _read_dpr, "hotpotqa": _read_hotpotqa, "beir": _read_beir, "qa": _read_qa}[fmt]
    examples = reader(os.fspath(source))
    seen: dict[str, str] = {}
    for ex in examples:
        if ex.id in seen:
            raise EvalDataError(f"{ex.where}: duplicate id {ex.id!r} (first at {seen[ex.id]}); ids must be unique: "
                                "fix or remove one of the records")
        seen[ex.id] = ex.where
    if not examples:
        raise EvalDataError(f"{source}: holds no question to evaluate")
    return examples


# ---------------------------------------------------------------------------- readers


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise EvalDataError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(bounded_lines(f, str(path), MAX_LINE, error=EvalDataError), 1):
            if line.strip():
                where = f"{path}:{n}"
                rec = parse_json(line, where, fix="fix or remove the line", error=EvalDataError)
                if not isinstance(rec, dict):
                    raise EvalDataError(f"{where}: expected a JSON object, got {type(rec).__name__}; fix or remove the line")
                yield where, rec


def _json_array(path: Path, what: str) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise EvalDataError(f"{path}: no such file")
    items = read_json(path, fix=f"a {what} file is one JSON array of records; fix the file", error=EvalDataError,
                      max_bytes=MAX_JSON)
    if not isinstance(items, list):
        raise EvalDataError(f"{path}: expected a JSON array of {what} records, got {type(items).__name__}")
    for i, rec in enumerate(items):
        where = f"{path}[{i}]"
        if not isinstance(rec, dict):
            raise EvalDataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        yield where, rec


def _text(rec: dict, key: str, where: str, fix: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        raise EvalDataError(f"{where}: field {key!r} is missing or not a non-empty string; {fix}")
    return value.strip()


def _ident(rec: dict, key: str, where: str, default: str) -> str:
    value = rec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise EvalDataError(f"{where}: field {key!r} must be a non-empty string or integer id, got {value!r}")
    return str(value).strip()


def _read_kilt(spec: str) -> list[EvalExample]:
    path = Path(spec)
    out = []
    for i, (where, rec) in enumerate(_jsonl(path)):
        qid = _ident(rec, "id", where, str(i))
        question = _text(rec, "input", where, "every KILT record needs its question in 'input'")
        outputs = rec.get("output")
        if not isinstance(outputs, list) or not outputs:
            raise EvalDataError(f"{where}: KILT record {qid!r} has no 'output' list (answers and provenance); a test file "
                                "without gold outputs cannot be scored: evaluate on the dev file, or give 'output'")
        answers, evidence = [], []
        for j, o in enumerate(outputs):
            if not isinstance(o, dict):
                raise EvalDataError(f"{where}: output[{j}] must be an object with 'answer' and/or 'provenance'")
            a = o.get("answer")
            if isinstance(a, str) and a.strip() and a.strip() not in answers:
                answers.append(a.strip())
            if "provenance" in o:
                prov = o["provenance"]
                if not isinstance(prov, list) or not all(isinstance(p, dict) and "wikipedia_id" in p for p in prov):
                    raise EvalDataError(f"{where}: output[{j}].provenance must be a list of objects with 'wikipedia_id'")
                ids = tuple(dict.fromkeys(str(p["wikipedia_id"]).strip() for p in prov))
                if ids and ids not in evidence:
                    evidence.append(ids)
        qrels = {g: 1 for ids in evidence for g in ids} or None
        out.append(EvalExample(qid, question, tuple(answers), where, qrels=qrels, evidence=tuple(evidence)))
    return out


def _read_dpr(spec: str) -> list[EvalExample]:
    path = Path(spec)
    out = []
    for i, (where, rec) in enumerate(_json_array(path, "DPR")):
        question = _text(rec, "question", where, "every DPR record needs 'question'")
        answers = rec.get("answers")
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise EvalDataError(f"{where}: field 'answers' must be a list of strings, got {str(answers)[:40]!r}")
        positives = rec.get("positive_ctxs", [])
        if not isinstance(positives, list) or not all(isinstance(p, dict) for p in positives):
            raise EvalDataError(f"{where}: field 'positive_ctxs' must be a list of objects")
        ids = [str(p.get("passage_id", p.get("psg_id"))) for p in positives if p.get("passage_id", p.get("psg_id")) is not None]
        qrels = {g: 1 for g in ids} or None
        out.append(EvalExample(_ident(rec, "id", where, str(i)), question,
                               tuple(a.strip() for a in answers if a.strip()), where, qrels=qrels))
    return out


def _read_hotpotqa(spec: str) -> list[EvalExample]:
    path = Path(spec)
    out = []
    for i, (where, rec) in enumerate(_json_array(path, "HotpotQA")):
        question = _text(rec, "question", where, "every HotpotQA record needs 'question'")
        answer = _text(rec, "answer", where, "every HotpotQA record needs 'answer' (the test file has none: use dev)")
        facts = rec.get("supporting_facts")
        if not isinstance(facts, list) or not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) for f in facts):
            raise EvalDataError(f"{where}: field 'supporting_facts' must be a list of [title, sentence id] pairs")
        titles = tuple(dict.fromkeys(f[0] for f in facts))
        kind = rec.get("type") if isinstance(rec.get("type"), str) else None
        out.append(EvalExample(_ident(rec, "_id", where, str(i)), question, (answer,), where, category=kind,
                               qrels={t: 1 for t in titles} or None, evidence=(titles,) if titles else (), match="title",
                               extra={"level": rec.get("level")} if isinstance(rec.get("level"), str) else {}))
    return out


def _read_qa(spec: str) -> list[EvalExample]:
    try:
        examples = read_qa(spec, stage="test", require_answers=True)
    except QADataError as e:
        raise EvalDataError(str(e)) from None
    out = []
    for i, ex in enumerate(examples):
        gold = tuple(dict.fromkeys((*ex.gold_passages, *((ex.passage_id,) if ex.passage_id else ()))))
        out.append(EvalExample(ex.id or str(i), ex.question, ex.answers, ex.where, category=ex.category,
                               qrels={g: 1 for g in gold} or None, evidence=(gold,) if gold else ()))
    return out


def _read_beir(spec: str) -> list[EvalExample]:
    root_text, _, split = spec.partition("#")
    root = Path(root_text)
    qrels_dir = root / "qrels"
    if not qrels_dir.is_dir():
        raise EvalDataError(f"{root}: a BEIR directory needs qrels/SPLIT.tsv beside queries.jsonl; download the full dataset")
    if not split:
        names = sorted(p.stem for p in qrels_dir.glob("*.tsv"))
        split = next((s for s in ("test", "dev") if s in names), names[0] if len(names) == 1 else "")
        if not split:
            raise EvalDataError(f"{qrels_dir}: no test.tsv or dev.tsv (has {names}); name the split as {root}#SPLIT")
    qrels_path = qrels_dir / f"{split}.tsv"
    if not qrels_path.is_file():
        raise EvalDataError(f"{qrels_path}: no such file; name a split of {qrels_dir} as {root}#SPLIT")
    queries: dict[str, tuple[str, str]] = {}
    for where, rec in _jsonl(root / "queries.jsonl"):
        qid = _ident(rec, "_id", where, "")
        if qid in queries:
            raise EvalDataError(f"{where}: duplicate query id {qid!r} (first at {queries[qid][1]}); fix or remove one")
        queries[qid] = (_text(rec, "text", where, "every BEIR query needs its text in 'text'"), where)
    qrels: dict[str, dict[str, int]] = {}
    with open(qrels_path, encoding="utf-8") as f:
        for n, line in enumerate(bounded_lines(f, str(qrels_path), 1 << 16, error=EvalDataError), 1):
            if not line.strip():
                continue
            where = f"{qrels_path}:{n}"
            cells = line.rstrip("\r\n").split("\t")
            if n == 1 and len(cells) >= 3 and not _is_int(cells[-1]):
                continue  # the header: query-id, corpus-id, score
            if len(cells) not in (3, 4) or not _is_int(cells[-1]):
                raise EvalDataError(f"{where}: expected 'query-id<TAB>corpus-id<TAB>score' with an integer score, got "
                                    f"{line.strip()[:60]!r}; fix or remove the row")
            qid, did, grade = cells[0].strip(), cells[-2].strip(), int(cells[-1])
            if qid not in queries:
                raise EvalDataError(f"{where}: query id {qid!r} is not in {root / 'queries.jsonl'}; remove the row "
                                    f"or add the query")
            qrels.setdefault(qid, {})[did] = grade
    return [EvalExample(qid, queries[qid][0], (), queries[qid][1], qrels=qrels[qid]) for qid in queries if qid in qrels]


def _is_int(text: str) -> bool:
    try:
        int(text.strip())
    except ValueError:
        return False
    return True
