"""Faithfulness of answers to the passages they read, judged by an NLI model (``rag evaluate --faithfulness NLI_DIR``).

For an answer y to a question x read from passages z_1..z_K, each passage is a premise (``"{title}. {text}"``,
:func:`~rag.retrobust.nli.nli_premise`) and the answer a hypothesis (:func:`~rag.retrobust.nli.nli_hypothesis`: a
declarative sentence for the Elements question types, else ``"Q: {x} A: {y}"``); a passage *supports* the answer when
the NLI model's P(entailment) is at least ``threshold`` (default 0.5). Per answer (scores of 0 or 1):

* ``supported_top``: the passage of highest posterior p(z|x,y) (prior where there is none) supports it;
* ``supported_cited``: one of the passages it cites (:attr:`~rag.generation.answers.Answer.citations`) supports it;
* ``supported_any``: one of the passages read supports it.

An empty answer, or one that read no passage, is supported by none. :func:`calibrate` measures the judge against
hand labels (:data:`LABELS_PATH`: 40 pairs over the demo Elements passages): accuracy and Cohen's kappa.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rag.demo import load_demo_corpus
from rag.generation.answers import Answer
from rag.retrobust.nli import NLIScorer, nli_hypothesis, nli_premise, validate_threshold
from rag.utils.errors import ConfigError, RagError
from rag.utils.files import bounded_lines, parse_json

__all__ = ["FaithfulnessJudge", "Judgement", "LABELS_PATH", "LabelledPair", "read_labels", "calibrate", "cohen_kappa",
           "format_calibration", "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 0.5
LABELS_PATH = Path(__file__).resolve().parents[1] / "demo" / "faithfulness_labels.jsonl"
"""The hand-labelled calibration pairs: ``passage_id`` (a demo Elements passage), ``question``, ``answer``, ``label``
(``"supported"`` or ``"not_supported"``)."""
MAX_LABEL_LINE = 1 << 16
MAX_LABEL_ROWS = 100_000


class FaithfulnessError(RagError):
    """A calibration file cannot be read; the message names file:line and the fix."""


@dataclass
class Judgement:
    """One answer's faithfulness: P(entailment) per passage read (in ``Answer.passages`` order), the top-posterior
    passage's index, the cited passages' indices, and the three 0/1 scores of the module docstring."""

    entailment: list[float]
    top: Optional[int]
    cited: list[int]
    threshold: float

    def scores(self) -> dict[str, float]:
        ok = [e >= self.threshold for e in self.entailment]
        return {"supported_top": float(self.top is not None and ok[self.top]),
                "supported_cited": float(any(ok[i] for i in self.cited)),
                "supported_any": float(any(ok))}

    def to_dict(self) -> dict:
        return {"entailment": self.entailment, "top": self.top, "cited": self.cited, "threshold": self.threshold}


class FaithfulnessJudge:
    """Judges answers with `scorer` (an :class:`~rag.retrobust.nli.NLIScorer`) at `threshold` on P(entailment)."""

    def __init__(self, scorer: NLIScorer, threshold: float = DEFAULT_THRESHOLD):
        self.scorer = scorer
        self.threshold = validate_threshold(threshold, "faithfulness threshold (--faithfulness-threshold)")

    @classmethod
    def open(cls, name_or_path: str | os.PathLike, threshold: float = DEFAULT_THRESHOLD, device: Optional[str] = None,
             batch_size: int = 32) -> "FaithfulnessJudge":
        """The NLI model at `name_or_path` (a directory, ``"minilm-snli"`` for the one ``rag nli prepare`` builds, or a
        hub id where a hub is reachable)."""
        return cls(NLIScorer.from_pretrained(name_or_path, device=device, batch_size=batch_size), threshold)

    @property
    def name(self) -> str:
        return self.scorer.name

    def entailment(self, pairs: Sequence[tuple[str, str, str, str]]) -> list[float]:
        """P(entailment) of each ``(title, text, question, answer)``: passage ``title``/``text`` as the premise."""
        if not pairs:
            return []
        premises = [nli_premise(title, text) for title, text, _, _ in pairs]
        hypotheses = [nli_hypothesis(question, answer) for _, _, question, answer in pairs]
        return [float(p) for p in self.scorer.entailment_probs(premises, hypotheses).tolist()]

    def judge(self, answers: Sequence[Answer]) -> list[Judgement]:
        """One :class:`Judgement` per answer; every (answer, passage) pair in one batched NLI call."""
        pairs, owners = [], []
        for i, a in enumerate(answers):
            if a.text.strip():
                for p in a.passages:
                    pairs.append((p.title, p.text, a.question, a.text))
                    owners.append(i)
        probs = self.entailment(pairs)
        per: list[list[float]] = [[] for _ in answers]
        for i, p in zip(owners, probs):
            per[i].append(p)
        out = []
        for a, ent in zip(answers, per):
            if not ent:  # empty answer or no passage: nothing supports it
                out.append(Judgement([0.0] * len(a.passages) if a.text.strip() else [], None, [], self.threshold))
                continue
            weights = [p.posterior if p.posterior is not None else p.prior for p in a.passages]
            top = max(range(len(weights)), key=lambda j: (weights[j] == weights[j], weights[j]))  # NaN never wins
            out.append(Judgement(ent, top, [c.passage for c in a.citations], self.threshold))
        return out


# ---------------------------------------------------------------------------- calibration against hand labels


@dataclass
class LabelledPair:
    passage_id: str
    title: str
    text: str
    question: str
    answer: str
    supported: bool


def read_labels(path: str | os.PathLike = LABELS_PATH) -> list[LabelledPair]:
    """The labelled pairs of a JSONL file (fields as :data:`LABELS_PATH`); ``passage_id`` names a demo Elements passage.
    Errors name ``file:line`` and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FaithfulnessError(f"{path}: no such file; give a JSONL file of passage_id, question, answer, label rows")
    corpus = {p.id: p for p in load_demo_corpus()}
    rows: list[LabelledPair] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(bounded_lines(f, str(path), MAX_LABEL_LINE, error=FaithfulnessError), 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            if len(rows) >= MAX_LABEL_ROWS:
                raise FaithfulnessError(f"{where}: more than {MAX_LABEL_ROWS:,} rows; split the file")
            rec = parse_json(line, where, fix="fix or remove the line", error=FaithfulnessError)
            if not isinstance(rec, dict):
                raise FaithfulnessError(f"{where}: expected a JSON object, got {type(rec).__name__}; fix or remove the line")
            missing = [k for k in ("passage_id", "question", "answer", "label") if not isinstance(rec.get(k), str)]
            if missing:
                raise FaithfulnessError(f"{where}: field {missing[0]!r} missing or not a string; every row needs passage_id, "
                                        "question, answer and label")
            if rec["label"] not in ("supported", "not_supported"):
                raise FaithfulnessError(f"{where}: label {rec['label']!r}; use 'supported' or 'not_supported'")
            passage = corpus.get(rec["passage_id"])
            if passage is None:
                raise FaithfulnessError(f"{where}: passage_id {rec['passage_id']!r} is not a demo Elements passage "
                                        "(ids look like 'elements/argon')")
            rows.append(LabelledPair(passage.id, passage.title, passage.text, rec["question"], rec["answer"],
                                     rec["label"] == "supported"))
    if not rows:
        raise FaithfulnessError(f"{path}: holds no labelled pair")
    return rows


def cohen_kappa(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Cohen's kappa of two binary labellings: (p_o - p_e) / (1 - p_e); 1.0 when both are constant and agree."""
    if len(a) != len(b) or not a:
        raise RagError(f"kappa needs two labellings of the same non-zero length, got {len(a)} and {len(b)}")
    n = len(a)
    p_o = sum(x == y for x, y in zip(a, b)) / n
    pa, pb = sum(a) / n, sum(b) / n
    p_e = pa * pb + (1 - pa) * (1 - pb)
    return 1.0 if p_e == 1.0 else (p_o - p_e) / (1 - p_e)


def calibrate(judge: FaithfulnessJudge, rows: Sequence[LabelledPair]) -> dict:
    """The judge's agreement with hand labels at its threshold: pairs, accuracy, Cohen's kappa, the confusion counts
    and each pair's P(entailment)."""
    if not rows:
        raise ConfigError("calibration needs at least one labelled pair")
    probs = judge.entailment([(r.title, r.text, r.question, r.answer) for r in rows])
    said = [p >= judge.threshold for p in probs]
    gold = [r.supported for r in rows]
    count = {f"{'supported' if g else 'not_supported'}->{'supported' if s else 'not_supported'}": 0
             for g in (True, False) for s in (True, False)}
    for g, s in zip(gold, said):
        count[f"{'supported' if g else 'not_supported'}->{'supported' if s else 'not_supported'}"] += 1
    return {"model": judge.name, "threshold": judge.threshold, "pairs": len(rows),
            "accuracy": sum(g == s for g, s in zip(gold, said)) / len(rows), "kappa": cohen_kappa(gold, said),
            "confusion": count, "entailment": probs}


def format_calibration(result: dict) -> str:
    """:func:`calibrate`'s result as a few lines of text."""
    c = result["confusion"]
    return (f"NLI judge {result['model']} at P(entailment) >= {result['threshold']:g} on {result['pairs']} hand-labelled pairs:\n"
            f"  accuracy {result['accuracy']:.3f}, Cohen's kappa {result['kappa']:.3f}\n"
            f"  supported judged supported {c['supported->supported']}, judged not {c['supported->not_supported']}; "
            f"not supported judged supported {c['not_supported->supported']}, judged not {c['not_supported->not_supported']}")
