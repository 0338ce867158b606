"""Counting the reader prompts that were cut to the model's window, for a command's report.

Inside ``with counting_cut_prompts() as count:`` every (question, passage) prompt a RAG model builds for retrieval is
added to ``count`` (``prompts``, ``cut``, the windows), and the model does not warn per call: the caller reports the
total once (:meth:`CutPrompts.summary`). Outside such a block nothing is counted and the model warns as before. The
count follows the context (``contextvars``), so concurrent calls in other threads or tasks are not mixed in.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

__all__ = ["CutPrompts", "counting_cut_prompts", "note_cut_prompts", "sample_cut_prompts"]


@dataclass
class CutPrompts:
    """How many reader prompts were built and how many were longer than their window (``max_context_length``)."""

    prompts: int = 0
    cut: int = 0
    windows: set[int] = field(default_factory=set)

    @property
    def fraction(self) -> float:
        return self.cut / self.prompts if self.prompts else 0.0

    def to_dict(self) -> dict:
        return {"prompts": self.prompts, "cut": self.cut, "fraction": round(self.fraction, 4),
                "max_context_length": sorted(self.windows)}

    def summary(self) -> Optional[str]:
        """One line naming the count and the fix, or None when no prompt was cut."""
        if not self.cut:
            return None
        window = "/".join(str(w) for w in sorted(self.windows))
        return (f"{self.cut} of {self.prompts} reader prompts ({self.fraction:.0%}) were longer than max_context_length="
                f"{window} tokens: their passages were cut (the question kept), so what a passage says last was not read; "
                f"raise the model's max_context_length or split passages shorter")


_ACTIVE: ContextVar[Optional[CutPrompts]] = ContextVar("rag_cut_prompts", default=None)


@contextlib.contextmanager
def counting_cut_prompts() -> Iterator[CutPrompts]:
    """Count the reader prompts built inside the block (nested blocks each count their own calls)."""
    count = CutPrompts()
    token = _ACTIVE.set(count)
    try:
        yield count
    finally:
        _ACTIVE.reset(token)


def note_cut_prompts(cut: int, total: int, window: int) -> bool:
    """Add `total` prompts, `cut` of them shortened to `window` tokens, to the active count; True when one is active
    (the caller then need not warn), False otherwise."""
    count = _ACTIVE.get()
    if count is None:
        return False
    count.prompts += int(total)
    count.cut += int(cut)
    count.windows.add(int(window))
    return True


def sample_cut_prompts(prepare: Callable[[list[str]], Any], questions: Sequence[str], *, limit: int = 64,
                       batch_size: int = 16) -> tuple[CutPrompts, int]:
    """The count of cut prompts that ``prepare`` (a RAG model's ``prepare_inputs``: retrieve, then build the prompts)
    makes for up to `limit` of the distinct `questions`, evenly spaced through them; and how many questions that was."""
    distinct = list(dict.fromkeys(questions))
    n = min(len(distinct), max(1, limit))
    chosen = [distinct[i * len(distinct) // n] for i in range(n)] if distinct else []
    with counting_cut_prompts() as count:
        for i in range(0, len(chosen), batch_size):
            prepare(chosen[i:i + batch_size])
    return count, len(chosen)
