"""Whether a reader's window holds its knowledge base's passages: measured once when the two are paired.

A RAG reader reads each retrieved passage in one input of at most ``max_context_length`` tokens (its prompt or
"title / text // question" context, as its :class:`~rag.generators.base.Generator` lays it out); a passage whose input
is longer loses its end, whatever is asked. :func:`passage_window` measures, for every passage of the knowledge base
(or a fixed random sample of :data:`MEASURED_PASSAGES` of a larger one), the length of that input with a question of
:data:`~rag.generators.base.QUESTION_TOKENS` tokens, through the generator's fast batch tokenizer; a knowledge base
built with ``rag index build --max-passage-tokens N`` for the same prompt layout (its manifest's
``build.passage_tokens``, the layout's fingerprint equal) is taken at its word when its longest prompt fits.
:func:`warn_cut_passages` says so once, in one :class:`PassageWindowWarning` line naming the fraction, the window and
the fix; inside :func:`held_window_lines` (a command that reports its cut prompts once, at its end) the line is kept for
that report instead (:func:`end_of_run_line`).
"""

from __future__ import annotations

import contextlib
import warnings
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from rag.generation.contexts import ContextTruncationWarning
from rag.generators.base import QUESTION_TOKENS
from rag.knowledge.passages import Passage

__all__ = ["MEASURED_PASSAGES", "CHARS_PER_TOKEN", "PassageWindow", "PassageWindowWarning", "passage_window", "warn_cut_passages",
           "held_window_lines", "end_of_run_line"]

MEASURED_PASSAGES = 1024
"""Passages measured at most: a larger knowledge base is measured on a fixed random sample of this many."""
CHARS_PER_TOKEN = 32
"""A passage's text is measured up to this many characters per token of the window: enough to tell that a passage of
natural text does not fit, and a bound on the time a knowledge base of whole documents takes."""


_HELD: ContextVar[Optional[list]] = ContextVar("rag_held_window_lines", default=None)


@contextlib.contextmanager
def held_window_lines() -> Iterator[list[str]]:
    """Inside the block, :func:`warn_cut_passages` appends its line to the yielded list instead of warning."""
    held: list[str] = []
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


def end_of_run_line(summary: Optional[str], held: list[str]) -> Optional[str]:
    """A command's one end-of-run line: its cut-prompt summary and the held knowledge-base lines, joined by "; "."""
    return "; ".join(p for p in [summary, *held] if p) or None


class PassageWindowWarning(ContextTruncationWarning):
    """Some of a knowledge base's passages do not fit the reader's window (their ends are never read)."""


@dataclass(frozen=True)
class PassageWindow:
    """How many of a knowledge base's passages fit a reader's window, with a question of ``question_tokens`` tokens."""

    window: int
    """The reader's ``max_context_length``."""
    passages: int
    """Passages in the knowledge base."""
    measured: int
    """Passages measured (all of them, or a fixed random sample; 0 when the manifest's record settled it)."""
    cut: int
    """Of those, how many make an input longer than ``window``."""
    longest: int
    """The longest input measured (or recorded), in tokens."""
    from_manifest: bool = False
    """True when ``build.passage_tokens`` of the manifest, for this very layout, showed that every passage fits."""
    question_tokens: int = QUESTION_TOKENS

    @property
    def fraction(self) -> float:
        return self.cut / self.measured if self.measured else 0.0

    @property
    def sampled(self) -> bool:
        return 0 < self.measured < self.passages

    def summary(self, where: str, tokenizer_dir: str) -> Optional[str]:
        """One line naming the fraction cut, the window and the fix, or None when every passage fits."""
        if not self.cut:
            return None
        of = (f"{self.cut} of a random sample of {self.measured} of its {self.passages} passages" if self.sampled
              else f"{self.cut} of its {self.passages} passages")
        wide = -(-self.longest // 32) * 32
        return (f"knowledge base {where}: {of} ({self.fraction:.0%}) are longer than the reader's window: with a "
                f"{self.question_tokens}-token question their inputs exceed max_context_length={self.window} tokens (the "
                f"longest {self.longest}), so what they say last is never read; split them to fit (rag index build "
                f"--max-passage-tokens {self.window} --tokenizer {tokenizer_dir} ...), or load the reader with "
                f"max_context_length={wide}")


def _recorded_fit(kb, fingerprint: str, window: int) -> Optional[int]:
    """The manifest's longest prompt when ``build.passage_tokens`` was measured for this layout and fits `window`."""
    record = (getattr(kb.manifest, "build", None) or {}).get("passage_tokens")
    if not isinstance(record, dict) or record.get("layout") != fingerprint:
        return None
    longest = record.get("longest_prompt")
    if record.get("question_tokens") != QUESTION_TOKENS or not isinstance(longest, int) or longest > window:
        return None
    return longest


def passage_window(generator, settings, kb, *, limit: int = MEASURED_PASSAGES, seed: int = 0) -> PassageWindow:
    """How many of `kb`'s passages make an input longer than ``settings.max_context_length`` for `generator` (a
    :class:`~rag.generators.base.Generator`): all passages when there are at most `limit`, else a random sample of
    `limit` drawn with `seed` (the same rows every time). Each text is measured up to :data:`CHARS_PER_TOKEN` x the
    window characters, so ``longest`` is at most what that much text holds."""
    window, n = int(settings.max_context_length), len(kb)
    recorded = _recorded_fit(kb, generator.layout_fingerprint(settings), window)
    if recorded is not None:
        return PassageWindow(window, n, 0, 0, recorded, from_manifest=True)
    rows = np.arange(n) if n <= limit else np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))
    lengths: list[int] = []
    for i in range(0, len(rows), 512):
        [passages] = kb.get_passages(rows[i:i + 512].reshape(1, -1))
        passages = [Passage(p.id, p.title, p.text[:CHARS_PER_TOKEN * window]) for p in passages]
        lengths += generator.prompt_lengths(passages, settings)
    return PassageWindow(window, n, len(lengths), sum(x > window for x in lengths), max(lengths, default=0))


def _tokenizer_dir(tokenizer) -> str:
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return name if name and Path(name).is_dir() else "READER_TOKENIZER_DIR"


def warn_cut_passages(model, *, limit: int = MEASURED_PASSAGES) -> Optional[PassageWindow]:
    """Measure a RAG model's window against its knowledge base (:func:`passage_window`) and, when passages are cut,
    warn once (:class:`PassageWindowWarning`, one line; inside :func:`held_window_lines`, keep the line). Returns the
    measurement, or None for a model without a knowledge base."""
    kb = getattr(model, "knowledge_base", None)
    if kb is None or not len(kb):
        return None
    found = passage_window(model.lm, model.config, kb, limit=limit)
    where = getattr(kb, "path", None)
    line = found.summary(str(Path(where).resolve()) if where else "in use", _tokenizer_dir(model.lm.tokenizer))
    held = _HELD.get()
    if line and held is not None:
        held.append(line)
    elif line:
        warnings.warn(line, PassageWindowWarning, stacklevel=2)
    return found

