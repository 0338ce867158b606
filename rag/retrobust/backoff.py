"""The RetRobust NLI back-off (Yoran et al. 2024, §2.1): keep a retrieval answer only when the evidence entails it.

A reader generates twice in one batch, with retrieval and without (``generate_with_and_without_retrieval``); an NLI model
(:class:`~rag.retrobust.nli.NLIScorer`) scores premise = the retrieved evidence the answer was read from, hypothesis = the
question + answer (:func:`~rag.retrobust.nli.nli_hypothesis`); the retrieval answer is kept iff P(entailment) >= the
threshold (paper: 0.5), else the no-retrieval answer is returned. For multi-step answers (Self-Ask) every intermediate
question-answer pair must be entailed: :func:`check_steps` takes each answer's list of (premise, question, answer) steps.
Every returned answer records the probabilities (``nli_entailment``) and which branch answered (``answered_with``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence, Union

from rag.retrobust.nli import NLIScorer, nli_hypothesis, nli_premise, validate_threshold
from rag.utils.errors import ConfigError, RagError

if TYPE_CHECKING:  # pragma: no cover
    from rag.generation.answers import Answer

__all__ = ["DEFAULT_THRESHOLD", "NLISpec", "StepsVerdict", "check_steps", "answer_premise", "choose_answers",
           "resolve_nli", "generate_with_backoff"]

DEFAULT_THRESHOLD = 0.5
"""The paper's entailment threshold."""

NLISpec = Union["NLIScorer", str, os.PathLike, bool]
"""What ``nli=`` takes: an :class:`~rag.retrobust.nli.NLIScorer`, a model directory or hub id, or True (the default model
``rag nli prepare`` builds into ``$RAG_CACHE/nli/minilm-snli``)."""


@dataclass(frozen=True)
class StepsVerdict:
    """The NLI verdict on one answer's steps: per step the class probabilities, and whether every step is entailed."""

    probs: list[dict[str, float]]
    entailed: bool


def _class_names(scorer: "NLIScorer") -> list[str]:
    id2label = getattr(scorer.model.config, "id2label", None) or {}
    canonical = {i: name for name, i in scorer.labels.items()}
    n = scorer.model.config.num_labels
    return [canonical.get(i, str(id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def check_steps(scorer: "NLIScorer", chains: Sequence[Sequence[tuple[str, str, str]]],
                threshold: float = DEFAULT_THRESHOLD) -> list[StepsVerdict]:
    """Judge each answer's ``(premise, question, answer)`` steps in one NLI batch over all steps of all answers.

    An answer is entailed iff P(entailment | premise, :func:`~rag.retrobust.nli.nli_hypothesis`) >= `threshold` for every
    one of its steps (the paper's rule for multi-step answers; a single-hop answer has one step). Raises
    :class:`~rag.utils.errors.ConfigError` for a threshold outside [0, 1], :class:`~rag.utils.errors.RagError` for an answer with
    no steps (nothing to check it against).
    """
    threshold = validate_threshold(threshold)
    premises, hypotheses, owner = [], [], []
    for i, steps in enumerate(chains):
        steps = list(steps)
        if not steps:
            raise RagError(f"answer {i} has no (premise, question, answer) step to check; give at least one")
        for step in steps:
            if len(step) != 3:
                raise RagError(f"answer {i}: a step is (premise, question, answer), got {step!r}")
            premise, question, answer = step
            premises.append(premise)
            hypotheses.append(nli_hypothesis(question, answer))
            owner.append(i)
    probs = scorer.probs(premises, hypotheses).tolist() if premises else []
    names = _class_names(scorer)
    ent = scorer.entailment_id
    out = [StepsVerdict([], True) for _ in chains]
    for i, row in zip(owner, probs):
        out[i].probs.append({n: float(p) for n, p in zip(names, row)})
    return [StepsVerdict(v.probs, all(p[names[ent]] >= threshold for p in v.probs)) for v in out]


def answer_premise(answer: "Answer") -> str:
    """The evidence `answer` was read from, as an NLI premise: an In-Context RALM answer's documents in reading order
    (each once); a RAG answer's top passage by posterior p(z|x,y) (prior p(z|x) when there is none)."""
    if not answer.passages:
        raise RagError(f"answer {answer.text!r} to {answer.question!r} lists no passages: nothing to check it against")
    if answer.segments:
        return " ".join(nli_premise(p.title, p.text) for p in answer.passages)
    best = max(answer.passages, key=lambda p: p.posterior if p.posterior is not None else p.prior)
    return nli_premise(best.title, best.text)


def choose_answers(scorer: "NLIScorer", with_retrieval: Sequence["Answer"], without: Sequence["Answer"],
                   threshold: float = DEFAULT_THRESHOLD) -> list["Answer"]:
    """Per answer: the retrieval answer if its evidence entails it (:func:`check_steps`), else the no-retrieval answer;
    each with ``nli_entailment`` (the retrieval answer's probabilities) and ``answered_with`` set."""
    if len(with_retrieval) != len(without):
        raise RagError(f"{len(with_retrieval)} retrieval answers but {len(without)} no-retrieval answers; give one of each")
    verdicts = check_steps(scorer, [[(answer_premise(a), a.question, a.text)] for a in with_retrieval], threshold)
    return [replace(a, nli_entailment=v.probs, answered_with="retrieval") if v.entailed
            else replace(b, nli_entailment=v.probs, answered_with="no_retrieval")
            for a, b, v in zip(with_retrieval, without, verdicts)]


def resolve_nli(nli: NLISpec) -> "NLIScorer":
    """An :class:`~rag.retrobust.nli.NLIScorer` from what ``nli=`` was given (see :data:`NLISpec`)."""
    if isinstance(nli, NLIScorer):
        return nli
    if nli is True:
        return NLIScorer.from_pretrained(None)
    if isinstance(nli, (str, os.PathLike)):  # (a bool is neither)
        return NLIScorer.from_pretrained(nli)
    raise ConfigError(f"nli= takes an NLIScorer, an NLI model directory or hub id, or True (the default model), got {nli!r}")


def generate_with_backoff(reader, questions: Sequence[str], nli: NLISpec, threshold: float = DEFAULT_THRESHOLD,
                          **options) -> list["Answer"]:
    """The back-off with `reader`: both generations in one batch, then :func:`choose_answers`."""
    threshold = validate_threshold(threshold)
    both = getattr(reader, "generate_with_and_without_retrieval", None)
    if both is None:
        raise ConfigError(f"the NLI back-off needs a reader that can also generate without retrieval; "
                          f"{type(reader).__name__} has no generate_with_and_without_retrieval")
    scorer = resolve_nli(nli)
    with_retrieval, without = both(questions, **options)
    return choose_answers(scorer, with_retrieval, without, threshold)
