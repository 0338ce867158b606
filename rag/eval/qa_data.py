"""Reading question-answering files: every format `rag fit`, `rag test` and `rag hotswap-eval` accept.

Accepted sources (one per split):

* **JSONL** (``.jsonl``/``.json``) in NQ-open style: ``{"question": …, "answers": [...]}``
  per line (NQ-open's own field name ``answer`` is accepted too). A ``.json`` file
  holding one JSON array of such objects also works.
* **TSV** (``.tsv``, and DPR's tab-separated ``*.qa.csv``): ``question<TAB>answers``
  where `answers` is a JSON (or Python) list literal as in DPR's files, or plain
  text; further columns are further answers. A first row ``question<TAB>answers`` is
  taken as a header.
* a **datasets** directory written by ``save_to_disk`` (a ``DatasetDict`` picks the
  split named after the stage; ``DIR#SPLIT`` names one), or a ``datasets.Dataset``
  object given in code.
* **source/target line files** of the transformers RAG example: ``X.source`` holds
  one question per line and ``X.target`` the answer on the same line. Give the
  ``.source`` path, or ``data_dir`` holding ``{train,val,test}.{source,target}``.
* ``demo:train`` / ``demo:dev`` / ``demo:test``: the bundled Elements QA splits; ``demo:natural`` and
  ``demo:natural_dev``: naturally phrased evaluation questions over the same corpus (test and development);
  ``demo:freeform`` and ``demo:freeform_dev``: questions of kinds no training question asks (test and development).

Training uses one ``(question, answer)`` pair per gold answer, as the RAG paper
does for multi-answer datasets (Lewis et al. 2020, App. B); evaluation keeps one
item per question with all of its answers.

Bad input: a record that cannot be read (bad JSON, missing field, ``answers`` not a
list of strings) raises :class:`QADataError` naming ``file:line`` and the field.
Empty questions and empty answers are *skipped* by default — an empty answer is
dropped from its list, a question left without answers is dropped — and one
:class:`EmptyExamplesWarning` per file reports the counts and the first location;
``on_empty="error"`` raises instead.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Optional, Sequence

from rag.demo import EVAL_SETS, SPLITS, qa_path
from rag.utils.errors import ConfigError, RagError
from rag.utils.files import parse_json, read_json
from rag.utils.validate import is_integer

logger = logging.getLogger(__name__)

OnEmpty = Literal["skip", "error"]
STAGE_SPLITS = {
    "train": ("train",),
    "val": ("validation", "val", "dev"),
    "test": ("test",),
    "predict": ("test", "validation", "val", "dev"),
}


class QADataError(RagError):
    """A question-answering file or dataset cannot be read; the message names file:line and field."""


class EmptyExamplesWarning(UserWarning):
    """Some examples had an empty question or empty answers and were skipped."""


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers; `where` is its ``file:line`` (for messages)."""

    question: str
    answers: tuple[str, ...]
    where: str
    passage_id: Optional[str] = None
    """The knowledge-base passage that holds the answer, when the data names it (``data.passage_field``)."""
    id: Optional[str] = None
    """The record's own id (field ``id`` or ``_id``), when it has one."""
    category: Optional[str] = None
    """The question's category (field ``category``, else ``type``), when the record has one (reports group by it)."""
    gold_passages: tuple[str, ...] = ()
    """Knowledge-base passage ids holding the answer (field ``passage_ids``, a list, or ``passage_id``): the gold
    provenance `rag evaluate` scores retrieval against."""


# ---------------------------------------------------------------------------- validation


class _EmptyTally:
    """Counts skipped questions / dropped answers of one source; warns once at the end."""

    def __init__(self, name: str, on_empty: OnEmpty) -> None:
        if on_empty not in ("skip", "error"):
            raise ConfigError(f"on_empty={on_empty!r}; choose 'skip' or 'error'")
        self.name, self.on_empty = name, on_empty
        self.questions = self.answers = 0
        self.first: Optional[str] = None

    def _hit(self, where: str, what: str) -> None:
        if self.on_empty == "error":
            raise QADataError(f"{where}: {what}; fix the record, or pass on_empty='skip' to skip such examples")
        self.first = self.first or where

    def question(self, where: str, what: str) -> None:
        self._hit(where, what)
        self.questions += 1

    def answer(self, where: str) -> None:
        self._hit(where, "empty answer string")
        self.answers += 1

    def warn(self) -> None:
        if self.questions or self.answers:
            warnings.warn(
                f"{self.name}: skipped {self.questions} example(s) with an empty question or no non-empty answer and "
                f"dropped {self.answers} empty answer string(s) (first at {self.first}); pass on_empty='error' to fail instead",
                EmptyExamplesWarning,
                stacklevel=3,
            )


def _make_example(question: Any, answers: Any, where: str, field: tuple[str, str], tally: _EmptyTally,
                  require_answers: bool) -> Optional[QAExample]:
    """Validate one record; None if it is skipped as empty."""
    qf, af = field
    if not isinstance(question, str):
        raise QADataError(f"{where}: field {qf!r} must be a string, got {type(question).__name__}")
    if answers is None and not require_answers:
        answers = []
    if not isinstance(answers, (list, tuple)):
        raise QADataError(
            f"{where}: field {af!r} must be a list of answer strings, got {type(answers).__name__} "
            f"({str(answers)[:40]!r}); write e.g. {{\"{af}\": [\"Paris\"]}}"
        )
    for i, a in enumerate(answers):
        if not isinstance(a, str):
            raise QADataError(f"{where}: field {af!r} item {i} must be a string, got {type(a).__name__} ({a!r})")
    if not question.strip():
        tally.question(where, f"empty {qf!r}")
        return None
    kept = []
    for a in answers:
        if a.strip():
            kept.append(a.strip())
        else:
            tally.answer(where)
    if require_answers and not kept:
        tally.question(where, f"no non-empty answer in {af!r}")
        return None
    return QAExample(question.strip(), tuple(kept), where)


# ---------------------------------------------------------------------------- readers


def _answers_field(record: dict, answers_field: Optional[str], where: str, require_answers: bool) -> tuple[str, Any]:
    if answers_field is not None:
        if answers_field not in record and require_answers:
            raise QADataError(f"{where}: missing field {answers_field!r} (fields: {sorted(record)}); set answers_field")
        return answers_field, record.get(answers_field)
    for name in ("answers", "answer"):
        if name in record:
            return name, record[name]
    if require_answers:
        raise QADataError(f"{where}: no 'answers' (or 'answer') field (fields: {sorted(record)}); set answers_field")
    return "answers", None


def _records_to_examples(records: Iterable[tuple[str, Any]], name: str, question_field: str,
                         answers_field: Optional[str], on_empty: OnEmpty, require_answers: bool,
                         passage_field: Optional[str] = None) -> list[QAExample]:
    tally = _EmptyTally(name, on_empty)
    out = []
    for where, rec in records:
        if not isinstance(rec, dict):
            raise QADataError(f"{where}: expected a JSON object with {question_field!r} and answers, got {type(rec).__name__}")
        if question_field not in rec:
            raise QADataError(f"{where}: missing field {question_field!r} (fields: {sorted(rec)}); set question_field")
        af, answers = _answers_field(rec, answers_field, where, require_answers)
        ex = _make_example(rec[question_field], answers, where, (question_field, af), tally, require_answers)
        if ex is not None and passage_field is not None:
            pid = rec.get(passage_field)
            if not (isinstance(pid, str) or is_integer(pid)) or not str(pid).strip():
                raise QADataError(f"{where}: field {passage_field!r} (data.passage_field) must name the answer's passage id, got "
                                  f"{pid!r}; add it to every record or unset data.passage_field")
            ex = dataclasses.replace(ex, passage_id=str(pid))
        if ex is not None:
            out.append(dataclasses.replace(ex, **_extra_fields(rec, where)))
    tally.warn()
    return out


def _extra_fields(rec: dict, where: str) -> dict:
    """A record's optional id, category and gold passage ids, where the fields hold strings or integers (other values
    are left alone: a dataset may use these names for something else); a malformed ``passage_ids`` list is an error."""
    out: dict = {}
    for name, fields in (("id", ("id", "_id")), ("category", ("category", "type"))):
        value = next((rec[f] for f in fields if _scalar(rec.get(f))), None)
        if value is not None:
            out[name] = str(value).strip()
    if "passage_ids" in rec:
        ids = rec["passage_ids"]
        if not isinstance(ids, list) or not all(_scalar(i) for i in ids):
            raise QADataError(f"{where}: field 'passage_ids' must be a list of passage ids, got {str(ids)[:60]!r}; write e.g. "
                              '{"passage_ids": ["elements/argon"]}')
        out["gold_passages"] = tuple(dict.fromkeys(str(i).strip() for i in ids))
    elif _scalar(rec.get("passage_id")):
        out["gold_passages"] = (str(rec["passage_id"]).strip(),)
    return out


def _scalar(value: Any) -> bool:
    return (isinstance(value, str) or is_integer(value)) and bool(str(value).strip())


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 12).lstrip()
        f.seek(0)
        if path.suffix == ".json" and head.startswith("["):
            items = read_json(path, fix="fix the file, or convert it to JSONL (one object per line, read as a stream)",
                              error=QADataError)
            for i, item in enumerate(items):
                yield f"{path}[{i}]", item
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield f"{path}:{lineno}", parse_json(line, f"{path}:{lineno}", fix="fix or remove the line", error=QADataError)


def _parse_tsv_answers(cells: list[str], where: str) -> list[Any]:
    if len(cells) == 1 and cells[0].lstrip().startswith("["):
        text = cells[0].strip()
        try:
            value = parse_json(text, where, fix="", error=QADataError)
        except QADataError:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError) as e:
                raise QADataError(f"{where}: column 'answers' looks like a list but cannot be parsed ({e}); "
                                  f"write a JSON list such as [\"Paris\", \"City of Light\"]") from e
        return value
    return list(cells)


def _tsv_records(path: Path, require_answers: bool) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8", newline="") as f:
        first = True
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            cells = line.split("\t")
            if first and [c.strip().lower() for c in cells[:2]] in (["question", "answers"], ["question", "answer"]):
                first = False
                continue
            first = False
            where = f"{path}:{lineno}"
            if len(cells) < 2:
                if require_answers:
                    raise QADataError(f"{where}: expected 'question<TAB>answers', found no tab; separate the columns with a tab")
                yield where, {"question": cells[0], "answers": None}
                continue
            yield where, {"question": cells[0], "answers": _parse_tsv_answers(cells[1:], where)}


def read_source_target(source: str | os.PathLike, target: str | os.PathLike | None = None, *,
                       on_empty: OnEmpty = "skip", require_answers: bool = True) -> list[QAExample]:
    """Read the transformers RAG example's line files: line i of `source` is a question and
    line i of `target` (default: `source` with suffix ``.target``) its one answer."""
    source = Path(source)
    target = Path(target) if target is not None else source.with_suffix(".target")
    if not source.is_file():
        raise QADataError(f"{source}: no such file")
    with open(source, encoding="utf-8") as f:
        questions = f.read().splitlines()
    if not target.is_file():
        if require_answers:
            raise QADataError(f"{target}: no such file (the answers for {source}); create it or give another source")
        answers: list[Optional[str]] = [None] * len(questions)
    else:
        with open(target, encoding="utf-8") as f:
            answers = f.read().splitlines()
    if len(answers) != len(questions):
        raise QADataError(f"{source} has {len(questions)} lines but {target} has {len(answers)}; "
                          f"line i of the .target file must answer line i of the .source file")
    records = (
        (f"{source}:{i}", {"question": q, "answers": None if a is None else [a]})
        for i, (q, a) in enumerate(zip(questions, answers), 1)
    )
    return _records_to_examples(records, str(source), "question", "answers", on_empty, require_answers)


def _dataset_records(ds: Any, name: str) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(ds):
        yield f"{name}[{i}]", row


def _load_saved_dataset(spec: str, stage: str) -> tuple[Any, str]:
    import datasets

    path, _, split = spec.partition("#")
    try:
        obj = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises several types for non-dataset dirs
        raise QADataError(f"{path}: not a dataset saved with save_to_disk ({e})") from e
    if isinstance(obj, datasets.DatasetDict):
        names = (split,) if split else STAGE_SPLITS.get(stage, (stage,))
        for n in names:
            if n in obj:
                return obj[n], f"{path}#{n}"
        raise QADataError(f"{path}: no split {' / '.join(names)} (has {sorted(obj)}); name one as {path}#SPLIT")
    if split:
        raise QADataError(f"{path} holds a single Dataset, not a DatasetDict; drop '#{split}'")
    return obj, path


def read_qa(source: Any, *, stage: str = "train", question_field: str = "question", answers_field: Optional[str] = None,
            on_empty: OnEmpty = "skip", require_answers: bool = True, passage_field: Optional[str] = None) -> list[QAExample]:
    """Read QA examples from any supported source (see module docstring).

    `stage` picks the split of a ``DatasetDict``; `require_answers=False` allows
    question-only input (prediction).
    """
    if _is_dataset(source):
        name = f"dataset({getattr(source, 'info', None) and source.info.dataset_name or 'in-memory'})"
        return _records_to_examples(_dataset_records(source, name), name, question_field, answers_field, on_empty,
                                    require_answers,
                                    passage_field)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"data source must be a path, 'demo:SPLIT' or a datasets.Dataset, got {type(source).__name__}")
    spec = os.fspath(source)
    if spec.startswith("demo:"):
        split = spec[len("demo:"):]
        if split not in SPLITS and split not in EVAL_SETS:
            raise ConfigError(f"{spec!r}: unknown demo split; use one of {', '.join('demo:' + s for s in (*SPLITS, *EVAL_SETS))}")
        spec = str(qa_path(split))
    path = Path(spec.partition("#")[0])
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            ds, name = _load_saved_dataset(spec, stage)
            return _records_to_examples(_dataset_records(ds, name), name, question_field, answers_field, on_empty,
                                        require_answers,
                                        passage_field)
        raise QADataError(f"{path}: a directory but not a saved dataset; for source/target files give data_dir={path} "
                          f"(or the .source file), otherwise a .jsonl/.tsv file")
    if not path.is_file():
        raise QADataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".source":
        if passage_field is not None:
            raise ConfigError(f"{path}: .source/.target files name no passages; unset data.passage_field or use JSONL")
        return read_source_target(path, on_empty=on_empty, require_answers=require_answers)
    if suffix in (".jsonl", ".json"):
        records = _jsonl_records(path)
    elif suffix in (".tsv", ".csv"):
        records = _tsv_records(path, require_answers)
        answers_field = "answers"
        question_field = "question"
    else:
        raise QADataError(f"{path}: unknown QA format {suffix!r}; use .jsonl/.json (NQ-open style), .tsv, "
                          f"X.source + X.target, or a saved datasets directory")
    return _records_to_examples(records, str(path), question_field, answers_field, on_empty, require_answers, passage_field)


def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")


def expand_answers(examples: Sequence[QAExample]) -> list[tuple[str, str]]:
    """One ``(question, answer)`` training pair per gold answer (answers kept in order)."""
    return [(ex.question, a) for ex in examples for a in ex.answers]
