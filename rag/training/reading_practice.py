"""Reading practice for any corpus: an auxiliary generator loss on (question, answer, passage) examples that only
reading the passage can answer, so a small generator learns to read instead of memorising its training answers.

Built from the knowledge base's own passages (no labels needed): each example takes a real passage, replaces its title
by an invented name everywhere (so what the passage says can never be looked up from memory under the real name), and
asks one of

* ``what is NAME?`` -> the passage's first sentence (definition-style corpora: dictionaries, glossaries, manuals);
* ``which term is described as "…"?`` -> NAME, quoting a few words of a later sentence;

:class:`ReadingPracticeSettings` is the typed option (``model.reading_practice`` of
:class:`~rag.training.modules.RagModule`); ``source: elements`` uses the Elements demo's own practice
(:mod:`rag.demo.reading_practice`, randomised facts of the training elements).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from rag.knowledge.passages import Passage
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

__all__ = ["ReadingPracticeSettings", "PracticeExample", "corpus_practice", "practice_pool"]

_SYLLABLES = ("ar", "bo", "ce", "di", "el", "fa", "go", "ha", "in", "jo", "ka", "lu", "mo", "ne", "or", "pa", "qu", "ro",
              "si", "ta", "ul", "ve", "wo", "xe", "yt", "zi", "th", "pr", "st", "gr")
_ENDINGS = ("ix", "on", "ine", "um", "ese", "en", "ur", "ic", "ax", "ol")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass
class ReadingPracticeSettings:
    """Reading practice mixed into every training step (RagModule ``model.reading_practice``)."""

    source: Literal["corpus", "elements"] = "corpus"
    """``corpus``: examples built from the knowledge base's passages (any corpus); ``elements``: the Elements demo's."""
    per_step: int = 4
    """Practice examples per training step, beside the batch's real QA pairs (each weighs as one pair)."""
    pool: int = 4000
    """Size of the fixed pool the examples are drawn from (built once, seeded)."""
    max_answer_words: int = 24
    """Definition answers are cut to this many words (at a sentence end when sooner)."""
    pretrain_steps: int = 0
    """The run's first optimizer steps train the generator on practice alone (no retrieval, the query encoder idle), a
    stand-in for a pretrained reader: retrieval's gradients carry no signal until the generator can read."""
    pretrain_batch: int = 16
    """Practice examples per pre-training step."""
    pretrain_lr: float = 1.0e-3
    """Generator learning rate during pre-training (then ``model.generator_lr`` and its schedule take over)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("per_step", 1), ("pool", 1), ("max_answer_words", 1), ("pretrain_steps", 0), ("pretrain_batch", 1)):
            check_number(getattr(self, name), f"model.reading_practice.{name}", integer=True, low=low, error=ConfigError)
        check_number(self.pretrain_lr, "model.reading_practice.pretrain_lr", above=0, error=ConfigError)
        if self.source not in ("corpus", "elements"):
            raise ConfigError(f"model.reading_practice.source={self.source!r}: choose corpus or elements")


@dataclass(frozen=True)
class PracticeExample:
    """One question, its answer, and the passage (title replaced) that holds the answer."""

    question: str
    answer: str
    passage: Passage


def _invented_name(rng: random.Random) -> str:
    return ("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) + rng.choice(_ENDINGS)).capitalize()


def corpus_practice(passages: Sequence[Passage], n: int, *, seed: int = 0, max_answer_words: int = 24) -> list[PracticeExample]:
    """`n` reading-practice examples from `passages` (those with a title that their text can be asked about).

    Raises:
        ConfigError: no passage has a title and a first sentence of at least three words.
    """
    usable = [p for p in passages if p.title.strip() and len(p.text.split()) >= 3]
    if not usable:
        raise ConfigError("reading practice needs passages with titles and text (of >= 3 words); this knowledge base has none")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = rng.choice(usable)
        name = _invented_name(rng)
        text = re.sub(re.escape(p.title.strip()), name, p.text, flags=re.IGNORECASE)
        sentences = [s for s in _SENTENCE.split(text.strip()) if s.split()]
        first = " ".join(sentences[0].split()[:max_answer_words])
        later = [s for s in sentences[1:] if len(s.split()) >= 6 and name not in s]
        if later and rng.random() < 0.3:
            words = rng.choice(later).split()
            a = rng.randrange(0, len(words) - 4)
            quote = " ".join(words[a:a + rng.randint(4, min(10, len(words) - a))])
            question, answer = f'which term is described as "{quote}"?', name
        else:
            question, answer = f"what is {name}?", first
        out.append(PracticeExample(question, answer, Passage(id=f"practice/{len(out)}", title=name, text=text)))
    return out


def practice_pool(settings: ReadingPracticeSettings, knowledge_base, tokenizer=None) -> list[PracticeExample]:
    """The fixed pool of `settings`: from `knowledge_base`'s passages, or the Elements demo's practice."""
    if settings.source == "elements":
        from rag.demo import load_demo_corpus, load_demo_qa
        from rag.demo.reading_practice import ReadingPractice

        train_elements = {x["element"] for x in load_demo_qa("train")}
        names = sorted(w.capitalize() for w in (tokenizer.get_vocab() if tokenizer is not None else ()) if w.isalpha() and len(w) > 4)
        base = [p for p in load_demo_corpus() if p.title in train_elements]
        return [PracticeExample(e.question, e.answer, e.passage)
                for e in ReadingPractice(base, names, seed=settings.seed).examples(settings.pool)]
    return corpus_practice(knowledge_base.all_passages(), settings.pool, seed=settings.seed,
                           max_answer_words=settings.max_answer_words)
