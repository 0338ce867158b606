"""Self-Ask with retrieval (Press et al. 2023; Yoran et al. 2024, §3): the reader decomposes a question into
``Follow up:`` questions, each answered with retrieval (``Intermediate answer:``), until ``So the final answer is:``.

* :func:`format_chain` writes the prompt format, :func:`parse_chain` reads a written chain back (well-formed or not).
* :func:`self_ask` runs the loop: the reader (any ``write(prompt) -> text`` callable) continues the chain; each follow-up
  it writes is answered by ``answer(follow_up) -> (answer, premise)`` (retrieve, then read; premise None without
  retrieval) and appended; the loop ends at the final answer, a malformed continuation, a repeated follow-up, or
  ``max_steps`` follow-ups. It never hangs: at most ``max_steps + 1`` reader calls.
* Every intermediate step is returned (:class:`SelfAskStep`: question, answer, premise), so an NLI filter can check
  each ``(premise, question + answer)`` pair (:func:`step_hypotheses`), as §2.1 requires for multi-step answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence

from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

__all__ = ["QUESTION", "NEEDED", "FOLLOW_UP", "INTERMEDIATE", "FINAL", "StopReason", "SelfAskStep", "ParsedChain",
           "SelfAskResult", "format_chain", "parse_chain", "next_action", "self_ask", "step_hypotheses",
           "chain_training_examples"]

QUESTION = "Question:"
NEEDED = "Are follow up questions needed here:"
FOLLOW_UP = "Follow up:"
INTERMEDIATE = "Intermediate answer:"
FINAL = "So the final answer is:"

StopReason = Literal["final_answer", "step_limit", "malformed", "repeated_follow_up"]


@dataclass(frozen=True)
class SelfAskStep:
    """One follow-up: the `question` the reader wrote, its `answer`, and the `premise` (retrieved passage text) the
    answer was read from (None when answered without retrieval)."""

    question: str
    answer: str
    premise: Optional[str] = None


@dataclass
class ParsedChain:
    """A chain read back by :func:`parse_chain`: the (follow-up, intermediate answer or None) pairs in order, the final
    answer (None if absent) and the lines that fit no marker (`malformed`)."""

    steps: list[tuple[str, Optional[str]]] = field(default_factory=list)
    final: Optional[str] = None
    malformed: list[str] = field(default_factory=list)

    @property
    def well_formed(self) -> bool:
        """Every follow-up answered, a final answer, and no stray line."""
        return self.final is not None and not self.malformed and all(a is not None for _, a in self.steps)


@dataclass
class SelfAskResult:
    """The outcome of :func:`self_ask`: the final `answer` (None when the chain stopped without one), every `steps`
    entry, why it `stopped`, the reader calls made, the full chain text (`prompt`) and, when it stopped on a malformed
    or repeated continuation, what the reader wrote (`last_output`)."""

    question: str
    answer: Optional[str]
    steps: list[SelfAskStep]
    stopped: StopReason
    reader_calls: int
    prompt: str
    last_output: Optional[str] = None

    def provenance(self) -> dict:
        """JSON-ready record: answer, stop reason, and every (question, answer, premise) step."""
        return {"question": self.question, "answer": self.answer, "stopped": self.stopped, "reader_calls": self.reader_calls,
                "last_output": self.last_output,
                "steps": [{"question": s.question, "answer": s.answer, "premise": s.premise} for s in self.steps]}


def format_chain(question: str, steps: Sequence[SelfAskStep | tuple[str, str]] = (), final: Optional[str] = None, *,
                 with_premises: bool = False) -> str:
    """The Self-Ask text of `question` with its `steps` so far (and `final` when given), ending with a newline.

    ``with_premises=True`` writes each step's premise on a ``Context:`` line before its intermediate answer (the
    retrieved evidence placed in the prompt, §3).
    """
    lines = [f"{QUESTION} {question.strip()}", f"{NEEDED} Yes."]
    for s in steps:
        q, a, premise = (s.question, s.answer, s.premise) if isinstance(s, SelfAskStep) else (s[0], s[1], None)
        lines.append(f"{FOLLOW_UP} {q.strip()}")
        if with_premises and premise:
            lines.append(f"Context: {' '.join(premise.split())}")
        lines.append(f"{INTERMEDIATE} {a.strip()}")
    if final is not None:
        lines.append(f"{FINAL} {final.strip()}")
    return "\n".join(lines) + "\n"


_MARKERS = ((FOLLOW_UP, "follow_up"), (INTERMEDIATE, "intermediate"), (FINAL, "final"))
_IGNORED = (QUESTION, NEEDED, "Context:")


def _split_markers(text: str) -> list[tuple[Optional[str], str]]:
    """(kind, value) per marker occurrence, also when several share a line; (None, line) for unmarked text. Markers
    match in any case and spacing (an uncased reader writes ``follow up :``)."""
    pattern = re.compile("(" + "|".join(r"\s*".join(map(re.escape, m[:-1].split())) + r"\s*:" for m, _ in _MARKERS) + ")", re.I)
    kinds = {re.sub(r"\s+", "", m.lower()): kind for m, kind in _MARKERS}
    out: list[tuple[Optional[str], str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.lower().startswith(tuple(m.lower() for m in _IGNORED)):
            continue
        parts = pattern.split(line)
        head = parts[0].strip()
        if head:
            out.append((None, head))
        for marker, value in zip(parts[1::2], parts[2::2]):
            out.append((kinds[re.sub(r"\s+", "", marker.lower())], _clean(value)))
    return out


def _clean(value: str) -> str:
    value = value.strip()
    return value[:-1].strip() if value.endswith(".") and not re.search(r"\b[A-Z]\.[A-Z]\.$", value) else value  # keep "U.S."


def parse_chain(text: str) -> ParsedChain:
    """Read a Self-Ask chain (as :func:`format_chain` writes it, or as a reader wrote it).

    Lenient: markers may share a line, ``Question:`` / ``Are follow up…`` / ``Context:`` lines are skipped, a trailing
    full stop is dropped from values (not from an abbreviation such as ``U.S.``). What does not fit is kept in
    ``malformed`` (an intermediate answer with no follow-up before it, text after the final answer, unmarked lines,
    empty values); parsing never raises.
    """
    chain = ParsedChain()
    for kind, value in _split_markers(text):
        if chain.final is not None:
            chain.malformed.append(value if kind is None else f"{kind}: {value}")
        elif kind is None:
            chain.malformed.append(value)
        elif not value:
            chain.malformed.append(f"empty {kind}")
        elif kind == "follow_up":
            chain.steps.append((value, None))
        elif kind == "intermediate":
            if chain.steps and chain.steps[-1][1] is None:
                chain.steps[-1] = (chain.steps[-1][0], value)
            else:
                chain.malformed.append(f"intermediate answer without a follow-up: {value}")
        else:
            chain.final = value
    return chain


def next_action(continuation: str) -> tuple[Literal["follow_up", "final", "malformed"], str]:
    """What a reader's continuation of the chain asks for: its first marker, ``("follow_up", q)`` or
    ``("final", answer)``; ``("malformed", text)`` when it starts with neither (or with an intermediate answer: the
    reader may not answer its own follow-up when retrieval answers it)."""
    for kind, value in _split_markers(continuation):
        if kind in ("follow_up", "final") and value:
            return kind, value
        return "malformed", value if kind is None else f"{kind}: {value}"
    return "malformed", continuation.strip()


def self_ask(question: str, write: Callable[[str], str], answer: Callable[[str], tuple[str, Optional[str]]], *,
             max_steps: int = 4, with_premises: bool = False, prefix: str = "") -> SelfAskResult:
    """Run Self-Ask on `question`.

    Args:
        write: the reader: ``write(prompt) -> continuation``; it sees ``prefix`` (e.g. few-shot examples) + the chain
            so far and should write one ``Follow up: …`` or ``So the final answer is: …`` line (text after the first
            marker's line is ignored).
        answer: answers a follow-up: ``answer(follow_up) -> (answer, premise)`` — retrieve and read (premise = the
            retrieved passage) or read alone (premise None).
        max_steps: most follow-ups; at the limit the chain stops with ``stopped="step_limit"`` and no answer.
        with_premises: write each step's premise into the prompt (``Context:`` line).
    """
    check_number(max_steps, "self_ask max_steps", integer=True, low=0, error=ConfigError)
    steps: list[SelfAskStep] = []
    calls = 0
    while True:
        chain = prefix + format_chain(question, steps, with_premises=with_premises)
        if len(steps) >= max_steps:
            return SelfAskResult(question, None, steps, "step_limit", calls, chain)
        calls += 1
        written = write(chain)
        kind, value = next_action(written)
        if kind == "final":
            return SelfAskResult(question, value, steps, "final_answer", calls, chain + f"{FINAL} {value}\n")
        if kind == "malformed":
            return SelfAskResult(question, None, steps, "malformed", calls, chain, written)
        if any(s.question.lower() == value.lower() for s in steps):
            return SelfAskResult(question, None, steps, "repeated_follow_up", calls, chain, written)
        text, premise = answer(value)
        steps.append(SelfAskStep(value, text, premise))


def step_hypotheses(result: SelfAskResult) -> list[tuple[str, str]]:
    """``(premise, hypothesis)`` for every retrieved step: the premise and ``"{question} {answer}"`` (the pair an NLI
    model must judge entailed, §2.1). Steps without a premise are left out."""
    return [(s.premise, f"{s.question} {s.answer}") for s in result.steps if s.premise]


def chain_training_examples(records: Sequence[dict]) -> list[tuple[str, str]]:
    """(chain so far, next line) for every step of the decomposed multi-hop `records`: what a reader learns to write.

    Each record holds ``question``, ``answers`` (the first is written) and ``follow_ups`` (``[{"question", "answer"}]``,
    in order), as :func:`rag.demo.multihop.load_multihop` returns. A two-hop record gives three examples: the first
    ``Follow up:`` line, the second after the first step's intermediate answer, and ``So the final answer is:``.
    """
    out = []
    for r in records:
        steps = [(f["question"], f["answer"]) for f in r["follow_ups"]]
        for i, (follow_up, _) in enumerate(steps):
            out.append((format_chain(r["question"], steps[:i]), f"{FOLLOW_UP} {follow_up}"))
        out.append((format_chain(r["question"], steps), f"{FINAL} {r['answers'][0]}"))
    return out
