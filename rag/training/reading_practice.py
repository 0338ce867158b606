"""Reading practice for any corpus: an auxiliary generator loss on (question, answer, passage) examples that only
reading the passage can answer, so a small generator learns to read instead of memorising its training answers.

Built from the knowledge base's own passages (no labels needed): each example takes a real passage, replaces its title
by an invented name everywhere (so what the passage says can never be looked up from memory under the real name), and
asks one of

* ``what is NAME?`` -> the passage's first sentence (definition-style corpora: dictionaries, glossaries, manuals);
* ``which term is described as "…"?`` -> NAME, quoting a few words of a later sentence;

or, with ``source: cloze``, cloze questions made from the passages' own sentences (:func:`cloze_practice`: the rules of
:mod:`rag.training.cloze`, after Lewis et al. 2019, "Unsupervised Question Answering by Cloze Translation"), the
passage keeping its real title (the pairs teach reading free-form questions about the corpus itself, the corpus-only
recipe's training data);

or, with ``source: questions``, the training questions' own forms applied to other passages (for corpora whose passages
hold many short entries: glossaries, catalogues, tables): where a training answer occurs in one passage next to words of
its question (the key: "What does NCB stand for?" and "... NCB: National Computer Board. ..."), the question with
the key cut out is a form ("What does {} stand for?") and the text between key and answer its pattern (": " up to
". "); every other match of a pattern supported by several pairs is a new example, its key renamed as above
(a pattern-expansion step in the manner of Brin 1998, DIPRE).

:class:`ReadingPracticeSettings` is the typed option (``model.reading_practice`` of
:class:`~rag.training.modules.RagModule`); ``source: elements`` uses the Elements demo's own practice
(:mod:`rag.demo.reading_practice`, randomised facts of the training elements).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from rag.demo import load_demo_corpus, load_demo_qa
from rag.demo.reading_practice import ReadingPractice
from rag.knowledge.passages import Passage
from rag.training.cloze import cloze_pairs, split_sentences
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

__all__ = ["ReadingPracticeSettings", "PracticeExample", "QuestionForm", "corpus_practice", "cloze_practice",
           "find_question_forms", "question_form_practice", "fit_to_window", "practice_pool"]

logger = logging.getLogger(__name__)

_SYLLABLES = ("ar", "bo", "ce", "di", "el", "fa", "go", "ha", "in", "jo", "ka", "lu", "mo", "ne", "or", "pa", "qu", "ro",
              "si", "ta", "ul", "ve", "wo", "xe", "yt", "zi", "th", "pr", "st", "gr")
_ENDINGS = ("ix", "on", "ine", "um", "ese", "en", "ur", "ic", "ax", "ol")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass
class ReadingPracticeSettings:
    """Reading practice mixed into every training step (RagModule ``model.reading_practice``)."""

    source: Literal["corpus", "cloze", "questions", "elements"] = "corpus"
    """``corpus``: examples built from the knowledge base's passages (any corpus); ``cloze``: cloze questions made from
    the passages' sentences (free-form questions, :func:`cloze_practice`); ``questions``: the training questions' forms
    applied to other passages (passages of many short entries; corpus practice where no form is found); ``elements``:
    the Elements demo's."""
    per_step: int = 4
    """Practice examples per training step, beside the batch's real QA pairs (each weighs as one pair)."""
    mix_ratio: Optional[float] = None
    """Practice examples per real pair of a step (0.5: one for every two pairs; at least one a step), in place of
    ``per_step``; None: ``per_step``."""
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
    """Generator learning rate during pre-training (then ``model.optimizer.lr`` and its schedule take over)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("per_step", 1), ("pool", 1), ("max_answer_words", 1), ("pretrain_steps", 0), ("pretrain_batch", 1)):
            check_number(getattr(self, name), f"model.reading_practice.{name}", integer=True, low=low, error=ConfigError)
        check_number(self.pretrain_lr, "model.reading_practice.pretrain_lr", above=0, error=ConfigError)
        if self.mix_ratio is not None:
            check_number(self.mix_ratio, "model.reading_practice.mix_ratio", above=0, high=64, error=ConfigError)
        if self.source not in ("corpus", "cloze", "questions", "elements"):
            raise ConfigError(f"model.reading_practice.source={self.source!r}: choose corpus, cloze, questions or elements")

    def examples_per_step(self, real_pairs: int) -> int:
        """How many practice examples go beside `real_pairs` real pairs in one step (``mix_ratio``, else ``per_step``)."""
        if self.mix_ratio is None:
            return self.per_step
        return max(1, round(self.mix_ratio * real_pairs))


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


def cloze_practice(passages: Sequence[Passage], n: int, *, seed: int = 0, max_answer_words: int = 24) -> list[PracticeExample]:
    """Up to `n` cloze question-answer pairs from `passages`' sentences (:func:`rag.training.cloze.cloze_pairs`), each
    with its own passage; deterministic for `seed`. Empty when no sentence yields one."""
    return [PracticeExample(q, a, p) for q, a, p in cloze_pairs(passages, n, seed=seed, max_answer_words=max_answer_words)]


_WORD = re.compile(r"\w[\w'-]*")
_KEY_CHARS = r"[^.;:!?\n]"  # a key is a few words within one clause
MAX_MIDDLE_CHARS = 30
"""The most characters between a key and its answer for the pair to define a pattern ("NCB: National..." has 2)."""


@dataclass(frozen=True)
class QuestionForm:
    """A training question with its key cut out, and how its key and answer sit in a passage.

    ``prefix`` and ``suffix``: the question around its key; ``key_first``: the key comes before the answer in the
    passage; ``middle``: the text between them; ``before`` / ``after``: the punctuation and spaces before the first and
    after the second of them (``^`` / ``$``: the passage's start / end)."""

    prefix: str
    suffix: str
    key_first: bool
    middle: str
    before: str
    after: str

    def question(self, key: str) -> str:
        return self.prefix + key + self.suffix

    def pattern(self) -> re.Pattern:
        """The regular expression of this form's (key, answer) pairs in a passage's text."""
        key = rf"(?P<key>\w{_KEY_CHARS}{{0,60}}?)"
        answer = r"(?P<answer>\w.{0,300}?)"
        first, second = (key, answer) if self.key_first else (answer, key)
        start = "^" if self.before == "^" else rf"(?:^|(?<={re.escape(self.before)}))"
        end = "$" if self.after == "$" else rf"(?=(?:{re.escape(self.after)})|{re.escape(self.after.rstrip())}$|$)"
        return re.compile(start + first + re.escape(self.middle) + second + end)


def _locate(question: str, answer: str, text: str) -> Optional[tuple[QuestionForm, str]]:
    """The form of one (question, answer) pair in the passage text holding the answer once, and its key; or None."""
    low = text.lower()
    a = low.find(answer.lower())
    if a < 0 or low.find(answer.lower(), a + 1) >= 0:
        return None
    a_end = a + len(answer)
    words = list(_WORD.finditer(question))
    best = None  # (distance, question span, text span)
    for n in range(len(words), 0, -1):  # the longest run of question words found in the text
        for i in range(len(words) - n + 1):
            q0, q1 = words[i].start(), words[i + n - 1].end()
            key = re.escape(question[q0:q1].lower())
            for m in re.finditer(rf"(?<!\w){key}(?!\w)", low):
                if m.end() <= a or m.start() >= a_end:
                    gap = a - m.end() if m.end() <= a else m.start() - a_end
                    if gap <= MAX_MIDDLE_CHARS and (best is None or gap < best[0]):
                        best = (gap, (q0, q1), (m.start(), m.end()))
        if best is not None:
            break
    if best is None:
        return None
    _, (q0, q1), (k0, k1) = best
    key_first = k1 <= a
    first0, first1, second0, second1 = (k0, k1, a, a_end) if key_first else (a, a_end, k0, k1)
    middle = text[first1:second0]
    before = "^" if first0 == 0 else re.search(r"\W{0,2}$", text[:first0]).group()
    after = "$" if second1 == len(text) else re.match(r"\W{0,2}", text[second1:]).group()
    if not before or not after:  # the key or answer runs on inside a word: no boundary to match on
        return None
    return QuestionForm(question[:q0], question[q1:], key_first, middle, before, after), text[k0:k1]


def find_question_forms(passages: Sequence[Passage], pairs: Sequence[tuple[str, str]], *, max_pairs: int = 2000,
                        min_support: int = 3, min_precision: float = 0.8) -> Counter:
    """The forms of the training `pairs` (question, answer) found in `passages`, each with the number of pairs that
    show it. A form is kept when at least `min_support` pairs (and 1% of those located) show it and its pattern, run
    over those pairs' passages, finds their own key and answer for at least `min_precision` of them (a pattern that
    also matches elsewhere, "the first word, a space, the next word", finds other spans and is dropped)."""
    texts = [p.text for p in passages]
    lows = [t.lower() for t in texts]
    shown: dict[QuestionForm, list[tuple[str, str, str]]] = {}
    located = 0
    for question, answer in list(pairs)[:max_pairs]:
        answer = answer.strip()
        needle = answer.lower()
        if len(needle) < 3:
            continue
        hits = [i for i, t in enumerate(lows) if needle in t]
        if len(hits) != 1:
            continue
        located += 1
        found = _locate(question, answer, texts[hits[0]])
        if found is not None:
            form, key = found
            shown.setdefault(form, []).append((texts[hits[0]], key.lower(), needle))
    floor = max(min_support, located // 100)
    kept: Counter = Counter()
    for form, rows in shown.items():
        if len(rows) < floor:
            continue
        pattern = form.pattern()
        right = sum(any((m.group("key").strip().lower(), m.group("answer").strip().lower()) == (key, answer)
                        for m in pattern.finditer(text)) for text, key, answer in rows)
        if right >= min_precision * len(rows):
            kept[form] = len(rows)
    return kept


def question_form_practice(passages: Sequence[Passage], pairs: Sequence[tuple[str, str]], n: int, *, seed: int = 0,
                           max_answer_words: int = 24) -> list[PracticeExample]:
    """Up to `n` practice examples from the forms of the training `pairs` (:func:`find_question_forms`) matched in every
    passage: the question of the form about the key matched, the answer matched, the passage with that key renamed
    (so the answer cannot be recalled from the real key). Empty when no form is found."""
    forms = find_question_forms(passages, pairs)
    if not forms:
        return []
    rng = random.Random(seed)
    candidates: list[tuple[QuestionForm, Passage, str, str]] = []
    for form, _ in forms.most_common():
        pattern = form.pattern()
        for p in passages:
            for m in pattern.finditer(p.text):
                answer = m.group("answer").strip()
                if answer and len(answer.split()) <= max_answer_words:
                    candidates.append((form, p, m.group("key").strip(), answer))
    rng.shuffle(candidates)
    out = []
    for form, p, key, answer in candidates[:n]:
        name = _invented_name(rng)
        text = re.sub(rf"(?<!\w){re.escape(key)}(?!\w)", name, p.text)
        if name not in text or answer not in text:  # the key overlapped the answer: renaming would change it
            continue
        out.append(PracticeExample(form.question(name), answer,
                                   Passage(id=f"practice/{len(out)}", title=p.title, text=text)))
    return out


def _excerpt(example: PracticeExample, sentences: Sequence[str], lo: int, hi: int) -> PracticeExample:
    """`example` read with its passage's sentences ``lo:hi`` alone."""
    return dataclasses.replace(example, passage=dataclasses.replace(example.passage, text=" ".join(sentences[lo:hi])))


def fit_to_window(pool: Sequence[PracticeExample], prompt_length: Callable[[PracticeExample], int],
                  window: int) -> tuple[list[PracticeExample], int, int]:
    """`pool` with every example's prompt within `window` tokens and its answer still in its passage.

    A prompt longer than `window` (``prompt_length(example)`` tokens, laid out whole) would lose the end of its
    passage, and with it, often, the answer: such an example trains the reader to answer what it did not read. Its
    passage becomes the sentence holding the answer and as many of the sentences around it (after, then before, in
    turn) as fit; an example whose answer's sentence alone does not fit is dropped. Returns the fitted pool, the
    number shortened and the number dropped."""
    out, shortened, dropped = [], 0, 0
    for e in pool:
        if prompt_length(e) <= window:
            out.append(e)
            continue
        sentences = split_sentences(e.passage.text)
        k = next((i for i, s in enumerate(sentences) if e.answer in s), None)
        best = _excerpt(e, sentences, k, k + 1) if k is not None else None
        if best is None or prompt_length(best) > window:
            dropped += 1
            continue
        lo, hi, grow_after = k, k + 1, True
        while lo > 0 or hi < len(sentences):
            trial = (lo, hi + 1) if (grow_after and hi < len(sentences)) or lo == 0 else (lo - 1, hi)
            candidate = _excerpt(e, sentences, *trial)
            if prompt_length(candidate) > window:
                break
            (lo, hi), best, grow_after = trial, candidate, not grow_after
        out.append(best)
        shortened += 1
    return out, shortened, dropped


def practice_pool(settings: ReadingPracticeSettings, knowledge_base, tokenizer=None,
                  pairs: Sequence[tuple[str, str]] = ()) -> list[PracticeExample]:
    """The fixed pool of `settings`: from `knowledge_base`'s passages (with ``source: questions``, in the forms of the
    training `pairs`), or the Elements demo's practice."""
    if settings.source == "elements":
        train_elements = {x["element"] for x in load_demo_qa("train")}
        names = sorted(w.capitalize() for w in (tokenizer.get_vocab() if tokenizer is not None else ()) if w.isalpha()
                       and len(w) > 4)
        base = [p for p in load_demo_corpus() if p.title in train_elements]
        return [PracticeExample(e.question, e.answer, e.passage)
                for e in ReadingPractice(base, names, seed=settings.seed).examples(settings.pool)]
    passages = knowledge_base.all_passages()
    if settings.source == "cloze":
        pool = cloze_practice(passages, settings.pool, seed=settings.seed, max_answer_words=settings.max_answer_words)
        if pool:
            return pool
        logger.warning("reading practice (source: cloze): no sentence of the passages yields a cloze question (a year, "
                       "number, name or 'used in ...' phrase to ask about); using corpus practice instead")
    if settings.source == "questions":
        pool = question_form_practice(passages, pairs, settings.pool, seed=settings.seed,
                                      max_answer_words=settings.max_answer_words)
        if pool:
            return pool
        logger.warning("reading practice (source: questions): no form of the training questions was found in the passages "
                       "(the key must be in a passage's text, next to the answer); using corpus practice instead")
    return corpus_practice(passages, settings.pool, seed=settings.seed, max_answer_words=settings.max_answer_words)
