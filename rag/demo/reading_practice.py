"""Synthetic reading practice for the Elements demo: real passages with randomised facts.

A small generator trained only on the demo's few hundred QA pairs memorises their answers; held-out
questions then get a training element's answer. Reading practice makes memorising useless: each
example is a *training* element's passage whose facts (name, symbol, atomic number, atomic weight,
discovery year) are replaced by random ones, with a templated question about one of them, so the
answer can only be found by reading the passage. Only training passages are used, so nothing of
the held-out elements leaks. Used as an auxiliary generator loss by ``examples/elements_recipe.py``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

from rag.demo.build_elements import YEAR_PATTERN
from rag.knowledge.passages import Passage

FIELDS = re.compile(r"^Symbol: (\S+)\. Atomic number: (\d+)\. Atomic weight: (\S+)\.")
_SYLLABLES = ("ar", "bo", "ce", "di", "el", "fa", "go", "ha", "in", "jo", "ka", "lu", "mo", "ne", "or", "pa", "qu", "ro",
              "si", "ta", "ul", "ve", "wo", "xe", "yt", "zi", "th", "pr", "st", "gr")
_ENDINGS = ("ium", "on", "ine", "um", "ese", "en", "ur", "ic")
_LOWER = "abcdefghiklmnoprstuvy"


@dataclass(frozen=True)
class PracticeExample:
    """One question, its answer, and the (synthetic) passage that holds the answer."""

    question: str
    answer: str
    passage: Passage


class ReadingPractice:
    """Draws :class:`PracticeExample` s from `passages` (those with the Elements field header).

    `names`: words to use as element names half of the time (e.g. a tokenizer's whole-word
    vocabulary, so names are not always made of the same syllables); the other half are invented.
    Deterministic for a given `seed`.
    """

    def __init__(self, passages: Sequence[Passage], names: Sequence[str] = (), *, seed: int = 0):
        self.rng = random.Random(seed)
        self.names = list(names)
        self.base = [p for p in passages if FIELDS.match(p.text)]
        if not self.base:
            raise ValueError("no passage starts with 'Symbol: … Atomic number: … Atomic weight: …'; pass Elements passages")

    def _name(self) -> str:
        rng = self.rng
        if self.names and rng.random() < 0.5:
            return rng.choice(self.names)
        return ("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) + rng.choice(_ENDINGS)).capitalize()

    def _symbol(self) -> str:
        rng = self.rng
        s = rng.choice("ABCDEFGHIKLMNOPRSTUVWXYZ")
        r = rng.random()
        if r < 0.6:
            s += rng.choice(_LOWER)
        elif r < 0.7:
            s += rng.choice(_LOWER) + rng.choice(_LOWER)
        return s

    def _weight(self) -> str:
        rng = self.rng
        if rng.random() < 0.15:
            return f"({rng.randint(200, 270)})"
        return f"{rng.uniform(1, 260):.{rng.choice([1, 2, 3, 4])}f}"

    def example(self) -> PracticeExample:
        rng = self.rng
        p = rng.choice(self.base)
        name, sym, num, weight = self._name(), self._symbol(), str(rng.randint(1, 130)), self._weight()
        head = FIELDS.match(p.text)
        text = f"Symbol: {sym}. Atomic number: {num}. Atomic weight: {weight}." + p.text[head.end():]
        text = text.replace(p.title, name)
        year = None
        found = YEAR_PATTERN.search(text)
        if found:
            year = str(rng.randint(1500, 1999))
            text = text[:found.start(1)] + year + text[found.end(1):]
        low = name.lower()
        questions = [(f"what is the chemical symbol of {low}?", sym), (f"which element has the symbol {sym}?", name),
                     (f"what is the atomic number of {low}?", num), (f"which element has atomic number {num}?", name),
                     (f"what is the atomic weight of {low}?", weight)]
        if year:
            questions.append((f"in what year was {low} discovered?", year))
        q, a = rng.choice(questions)
        return PracticeExample(q, a, Passage(id=f"practice/{low}", title=name, text=text))

    def examples(self, n: int) -> list[PracticeExample]:
        """`n` fresh examples."""
        return [self.example() for _ in range(n)]
