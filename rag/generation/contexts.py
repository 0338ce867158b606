"""How a retrieved passage and the input are joined into one generator input, and tokenized.

RAG simply concatenates them (Lewis et al. 2020, §2.3). The default format is
transformers' (``RagRetriever.postprocess_docs``), character for character, so that
released ``facebook/rag-*`` checkpoints see the inputs they were trained on::

    prefix + title + " / " + text + " // " + question

with its two quirks: one leading and one trailing ``"`` are stripped from the title,
and every non-overlapping pair of spaces in the joined string becomes one space.
transformers takes the prefix from the *generator's* config (``config.generator.prefix``),
not from ``RagConfig.prefix``; :meth:`ContextFormat.from_hf_config` does the same.

The question comes last, so transformers' right truncation (``truncation="hf"``) cuts
the question off a long passage. The default here, ``truncation="keep_question"``,
shortens the passage instead. Batches are padded to their longest context, not to a
fixed ``max_combined_length``.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import torch
from torch import Tensor

from rag.utils.errors import ConfigError, RagError

__all__ = [
    "Context",
    "ContextFormat",
    "ContextTruncationWarning",
    "build_contexts",
    "focus_on_question",
    "tokenize_contexts",
    "question_round_trip",
]

logger = logging.getLogger(__name__)

Truncation = Literal["hf", "keep_question"]
Padding = Literal["longest", "max_length"]


class ContextTruncationWarning(UserWarning):
    """Some generator contexts were longer than ``max_length`` tokens and were truncated."""


class _TitledText(Protocol):
    title: str
    text: str


class Context(str):
    """A generator input string that remembers where its question part begins.

    It *is* the plain string (equal to transformers' for the same inputs) and can be
    passed anywhere a ``str`` goes; ``question_start`` is the character offset of the
    ``doc_sep + question`` tail, which :func:`tokenize_contexts` keeps when truncating.
    """

    question_start: int

    def __new__(cls, text: str, question_start: int) -> "Context":
        if not 0 <= question_start <= len(text):
            raise RagError(f"question_start={question_start} lies outside the context of {len(text)} characters.")
        self = super().__new__(cls, text)
        self.question_start = question_start
        return self

    @property
    def passage_part(self) -> str:
        """The part that may be truncated: ``prefix + title + title_sep + text``."""
        return str.__getitem__(self, slice(0, self.question_start))

    @property
    def question_part(self) -> str:
        """The part that is always kept: ``doc_sep + question``."""
        return str.__getitem__(self, slice(self.question_start, None))

    def __getnewargs__(self) -> tuple[str, int]:  # pickling (e.g. DataLoader workers)
        return (str(self), self.question_start)

    def __repr__(self) -> str:
        return f"Context({str.__repr__(self)}, question_start={self.question_start})"


@dataclass(frozen=True)
class ContextFormat:
    """How one passage and one input are joined; the defaults are transformers' ``RagConfig`` defaults."""

    title_sep: str = " / "
    """Between the passage title and its text."""
    doc_sep: str = " // "
    """Between the passage and the input (question)."""
    prefix: str = ""
    """Prepended to every context (T5-style task prefixes)."""

    @classmethod
    def from_hf_config(cls, config) -> "ContextFormat":
        """The format a transformers ``RagConfig`` implies (prefix from ``config.generator.prefix``)."""
        generator = getattr(config, "generator", None)
        prefix = getattr(generator, "prefix", None) if generator is not None else None
        return cls(title_sep=config.title_sep, doc_sep=config.doc_sep, prefix=prefix or "")

    def context(self, title: str, text: str, question: str) -> Context:
        """Join one passage and one question into a :class:`Context` (see :meth:`join`)."""
        head = self.prefix + title.removeprefix('"').removesuffix('"') + self.title_sep + text
        tail = self.doc_sep + question
        joined = (head + tail).replace("  ", " ")
        # `joined` always ends with `tail` collapsed on its own: the pairing of spaces
        # restarts at the tail's first non-space character, and the space run across the
        # boundary keeps at least as many spaces as the tail's own leading run.
        return Context(joined, len(joined) - len(tail.replace("  ", " ")))

    def join(self, title: str, text: str, question: str) -> str:
        """transformers' exact string: ``(prefix + title.strip('"' once each end) + title_sep + text + doc_sep + question)`` with
        double spaces collapsed."""
        return str(self.context(title, text, question))


# Question words that say what kind of answer is wanted, not which entry holds it.
_FRAME_WORDS = frozenset(
    "a an and are as at be by did do does for from has have how in is it its mean means of on or stand stands "
    "the to was were what when where which who whom whose why with".split()
)
_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")
_WORD = re.compile(r"\w+")


def focus_on_question(text: str, question: str) -> str:
    """`text` rotated so that its sentence sharing the rarest, longest question words comes first (``passage_focus:
    question``): a page of many short entries is read from the entry the question names, and a long passage cut to
    ``max_context_length`` keeps that entry. Only the starting point moves (the text after that sentence follows it,
    the text before it goes last), so entries stay whole; with no shared word, or that sentence already first,
    `text` is returned unchanged.

    A question word counts ``len(word) / (sentences holding it)`` once per sentence holding it (longer words are
    rarer; a word in every sentence says little); frame words ("what", "does", "mean", ...) do not count; ties keep
    the earlier sentence.
    """
    cuts = [0] + [m.end() for m in _SENTENCE_END.finditer(text)]
    if len(cuts) < 2:
        return text
    sentences = [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]
    words = [set(_WORD.findall(x.lower())) for x in sentences]
    wanted = set(_WORD.findall(question.lower())) - _FRAME_WORDS
    df = {w: sum(w in ws for ws in words) for w in wanted}
    scores = [sum(len(w) / df[w] for w in wanted & ws) for ws in words]
    best = max(range(len(sentences)), key=lambda i: (scores[i], -i))
    if best == 0 or scores[best] == 0:
        return text
    head, tail = text[:cuts[best]].rstrip(), text[cuts[best]:].rstrip()
    return tail + " " + head


def build_contexts(
    questions: Sequence[str], passages: Sequence[Sequence[_TitledText]], fmt: ContextFormat = ContextFormat()
) -> list[Context]:
    """One context per (question, retrieved passage): ``B·K`` strings, row ``b·K + k`` = question b, passage k.

    This is transformers' order (all documents of the first question, then the next),
    matching ``doc_scores`` of shape ``(B, K)`` flattened row-major.

    Args:
        questions: B input strings (for imported checkpoints, pass them through
            :func:`question_round_trip` first, as transformers does).
        passages: B lists of K passages (anything with ``title`` and ``text``), e.g.
            ``Retrieved.passages``.
        fmt: the joining format.

    Returns:
        ``B·K`` :class:`Context` strings.
    """
    if len(questions) != len(passages):
        raise RagError(f"got {len(questions)} questions but {len(passages)} lists of passages; pass one list per question.")
    n_docs = len(passages[0]) if len(passages) else 0
    for row, docs in enumerate(passages):
        if len(docs) != n_docs:
            raise RagError(
                f"question {row} has {len(docs)} passages but question 0 has {n_docs}; every question needs the same "
                "number of retrieved passages (n_docs)."
            )
    return [fmt.context(doc.title, doc.text, question) for question, docs in zip(questions, passages) for doc in docs]


def _special_layout(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a single sequence."""
    for probe in ("a", "the", "0"):
        content = tokenizer(probe, add_special_tokens=False)["input_ids"]
        if content:
            break
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return full[:start], full[start + len(content) :]
    raise ConfigError(
        f"{type(tokenizer).__name__} adds special tokens inside the text, so contexts cannot be shortened while "
        "keeping the question; use truncation='hf'."
    )


def _keep_question(tokenizer, context: str, layout: tuple[list[int], list[int]], max_length: int) -> tuple[list[int], bool]:
    """Token ids of an over-long context with its passage shortened; also whether the question itself was cut."""
    before, after = layout
    budget = max_length - len(before) - len(after)
    full = tokenizer(str(context), add_special_tokens=False)["input_ids"]
    tail = context.question_part if isinstance(context, Context) else ""
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    if not tail_ids:
        head_ids = full
    elif full[len(full) - len(tail_ids) :] == tail_ids:  # keep the context's own tokenization
        head_ids = full[: len(full) - len(tail_ids)]
    else:  # tokens merged across the boundary: tokenize the two parts separately
        head_ids = tokenizer(context.passage_part, add_special_tokens=False)["input_ids"]
    if len(tail_ids) > budget:
        return before + tail_ids[:budget] + after, True
    return before + head_ids[: budget - len(tail_ids)] + tail_ids + after, False


def tokenize_contexts(
    tokenizer,
    contexts: Sequence[str],
    max_length: int,
    *,
    truncation: Truncation = "keep_question",
    padding: Padding = "longest",
) -> dict[str, Tensor]:
    """Tokenize generator contexts, truncating over-long ones without ever failing.

    Args:
        tokenizer: the generator's transformers tokenizer.
        contexts: ``B·K`` strings, normally the :class:`Context` objects from
            :func:`build_contexts` (plain strings cannot keep their question: they are
            cut from the right, with a warning).
        max_length: the most tokens per context, special tokens included.
        truncation: ``"keep_question"`` (default) shortens the passage so the question
            always survives; ``"hf"`` cuts from the right as transformers'
            ``RagRetriever`` does (identical ids), which can remove the question.
        padding: ``"longest"`` pads to the longest context of the batch; ``"max_length"``
            to `max_length` (transformers' fixed ``max_combined_length`` padding).

    Returns:
        ``input_ids`` and ``attention_mask`` ``(B·K, L)`` int64, and ``truncated``
        ``(B·K,)`` bool marking the contexts that were shortened. A
        :class:`ContextTruncationWarning` is issued when any was.
    """
    if truncation not in ("hf", "keep_question"):
        raise ConfigError(f"truncation={truncation!r} is not one of 'keep_question', 'hf'.")
    if padding not in ("longest", "max_length"):
        raise ConfigError(f"padding={padding!r} is not one of 'longest', 'max_length'.")
    n_special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length <= n_special:
        raise ConfigError(f"max_length={max_length} leaves no room for text after {n_special} special tokens; raise it.")
    if not contexts:
        width = max_length if padding == "max_length" else 0
        empty = torch.zeros(0, width, dtype=torch.long)
        return {"input_ids": empty, "attention_mask": empty.clone(), "truncated": torch.zeros(0, dtype=torch.bool)}

    texts = [str(c) for c in contexts]
    ids = tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    over = [i for i, row in enumerate(ids) if len(row) > max_length]
    truncated = torch.zeros(len(texts), dtype=torch.bool)
    if over:
        truncated[over] = True
        _shorten(tokenizer, contexts, texts, ids, over, max_length, truncation)

    batch = tokenizer.pad(
        {"input_ids": ids}, padding=padding, max_length=max_length if padding == "max_length" else None,
        return_attention_mask=True, return_tensors="pt",
    )
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "truncated": truncated}


def _shorten(tokenizer, contexts, texts, ids, over, max_length, truncation) -> None:
    """Replace ``ids[i]`` for every over-long context i in `over`, and warn."""
    logger.debug("%d of %d generator contexts exceed max_length=%d (truncation=%s)", len(over), len(texts), max_length,
                 truncation)
    if truncation == "hf":
        cut = tokenizer([texts[i] for i in over], add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        for i, row in zip(over, cut):
            ids[i] = row
        warnings.warn(
            f"Some generator contexts are longer than max_length={max_length} tokens and were cut from the right as "
            "transformers does, which can remove the question; truncation='keep_question' keeps it. The result's "
            "'truncated' entry marks them.", ContextTruncationWarning, stacklevel=3,
        )
        return
    layout = _special_layout(tokenizer)
    question_cut = plain = kept = False
    for i in over:
        ids[i], cut = _keep_question(tokenizer, contexts[i], layout, max_length)
        question_cut |= cut
        plain |= not isinstance(contexts[i], Context)
        kept |= isinstance(contexts[i], Context)
    if kept:
        warnings.warn(
            f"Some generator contexts are longer than max_length={max_length} tokens; their passages were shortened "
            "so the question is kept (raise max_length to keep whole passages). The result's 'truncated' entry marks "
            "them.", ContextTruncationWarning, stacklevel=3,
        )
    if question_cut:
        warnings.warn(
            f"Some questions are longer than max_length={max_length} tokens on their own; they were cut from the right.",
            ContextTruncationWarning, stacklevel=3,
        )
    if plain:
        warnings.warn(
            "Over-long contexts given as plain strings have no known question boundary and were cut from the right; "
            "pass the Context objects from build_contexts to keep their questions.", ContextTruncationWarning, stacklevel=3,
        )


def question_round_trip(question_tokenizer, questions: Sequence[str], *, max_length: int | None = None) -> list[str]:
    """The questions as transformers' ``RagRetriever`` puts them into contexts.

    transformers decodes the question encoder's ``input_ids`` back to text
    (``skip_special_tokens=True``) before joining, so an uncased DPR tokenizer
    lower-cases the question and normalises its spacing and punctuation. Use this for
    imported checkpoints; new models can join the raw question.

    Args:
        question_tokenizer: the question encoder's tokenizer.
        questions: B raw questions.
        max_length: truncate the question encoder input to this many tokens, as the
            question encoder's own input would be (None: no truncation).

    Returns:
        B strings.
    """
    enc = question_tokenizer(
        list(questions), add_special_tokens=True, truncation=max_length is not None, max_length=max_length
    )
    return [question_tokenizer.decode(row, skip_special_tokens=True) for row in enc["input_ids"]]
