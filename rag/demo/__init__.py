"""The bundled demo data: a real corpus (the Elements database) and QA pairs over it.

See `rag/demo/README.md` for provenance and licence, and `build_elements.py` for
how the files were made.
"""

from __future__ import annotations

from pathlib import Path

from rag.knowledge.passages import Passage
from rag.utils.files import parse_json

DEMO_DIR = Path(__file__).resolve().parent
CORPUS_PATH = DEMO_DIR / "elements.jsonl"
SPLITS = ("train", "dev", "test")
_REINSTALL = "the bundled demo data is damaged; reinstall rag"
EVAL_SETS = {"natural": "elements_natural.jsonl", "natural_dev": "elements_natural_dev.jsonl",
             "freeform": "elements_freeform.jsonl", "freeform_dev": "elements_freeform_dev.jsonl"}
"""Evaluation-only question sets. ``demo:natural``: 42 questions written in kinds and phrasings no training question
has ("who discovered X", "how many protons does X have", "which element is number N on the periodic table", "what's the
symbol for X"), over elements of every split; their answers are in the corpus. ``demo:natural_dev``: 46 questions of the
same kinds in other wordings, about elements ``natural`` does not ask about, made from the corpus's own fields and
"discovered by X in YEAR" sentences; for choosing between recipes, so that ``natural`` stays a test set.
``demo:freeform``: 72 hand-written questions about facts the passages state that no training template asks (uses,
colours, abundance, properties, isotopes, older names, where found), gold answers copied from the passages; for
evaluation only, never trained on. ``demo:freeform_dev``: 51 more written the same way about elements ``freeform`` does not
ask about, for choosing decoding and recipes, so that ``freeform`` stays a test set."""


def qa_path(split: str) -> Path:
    """Path of the demo QA split (`train`, `dev` or `test`; dev/test are held-out elements) or evaluation set
    (`natural`, `natural_dev`, `freeform`, `freeform_dev`)."""
    if split in EVAL_SETS:
        return DEMO_DIR / EVAL_SETS[split]
    if split not in SPLITS:
        raise ValueError(f"unknown demo split {split!r}; choose one of {', '.join((*SPLITS, *EVAL_SETS))}")
    return DEMO_DIR / f"elements_qa_{split}.jsonl"


def load_demo_corpus() -> list[Passage]:
    """The 137 Elements database entries as passages (one per entry, unsplit)."""
    with open(CORPUS_PATH, encoding="utf-8") as f:
        return [Passage(**parse_json(line, f"{CORPUS_PATH}:{n}", fix=_REINSTALL)) for n, line in enumerate(f, 1)]


def load_demo_qa(split: str) -> list[dict]:
    """QA pairs of one split: dicts with `question`, `answers` (list), `type`, `element`."""
    with open(qa_path(split), encoding="utf-8") as f:
        return [parse_json(line, f"{qa_path(split)}:{n}", fix=_REINSTALL) for n, line in enumerate(f, 1)]
