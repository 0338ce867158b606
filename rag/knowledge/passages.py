"""Corpus ingestion: documents in, disjoint fixed-length passages (with their titles) out.

Reading (:func:`rag.knowledge.documents.read_documents`) streams documents from JSONL, CSV,
TSV, DPR ``psgs_w100.tsv``, plain-text files or folders, and ``datasets`` datasets
(objects or ``save_to_disk`` directories). Splitting (:func:`split_passages`) cuts
each document into disjoint passages of ``words_per_passage`` whitespace words that
keep the document's title, as in RAG (Lewis et al. 2020, §4: "100-word chunks").
:func:`iter_corpus` / :func:`load_corpus` do both and validate the result.

Passage id rule (deterministic; the same input always gives the same ids):

* the document id is the source's id field when present and non-empty; for a text
  file it is the file's path relative to the folder given (a single file: its name);
  otherwise it is a content hash, the first 16 hex digits of
  ``sha1(title + "\\0" + text)`` (never the row number, so re-ordering rows keeps ids);
* a document that yields exactly one passage keeps the document id unchanged;
* a document split into n > 1 passages gives ``"<doc id>-0"`` ... ``"<doc id>-<n-1>"``;
* a passage cut further to fit a reader's token window (:func:`fit_passages`) gives ``"<passage id>-<k>"`` likewise.

DPR ``psgs_w100`` rows are already 100-word passages: they are never split and keep
their ids. Documents whose text is empty (or only whitespace) are skipped with a
:class:`EmptyDocumentsWarning` giving their count; a corpus with no non-empty document
raises :class:`~rag.utils.errors.CorpusError`. Every error names the file and line (or
dataset row) and the field at fault, and says how to fix it.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from rag.knowledge.documents import Document, is_dataset, read_documents
from rag.utils.errors import ConfigError, CorpusError
from rag.utils.validate import check_number, check_positive_int

__all__ = [
    "Passage",
    "EmptyDocumentsWarning",
    "split_passages",
    "iter_corpus",
    "load_corpus",
    "content_id",
    "fit_passages",
    "passage_token_lengths",
]



@dataclass(frozen=True)
class Passage:
    """One retrievable unit of text.

    `id` is stable across rebuilds of the same input: the source id (plus a chunk
    number when a document is split) or, for sources without ids, a content hash.
    """

    id: str
    title: str
    text: str


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class EmptyDocumentsWarning(UserWarning):
    """Some documents had empty text and were skipped."""


def content_id(title: str, text: str) -> str:
    """Id of a document without one: 16 hex digits of sha1(title NUL text)."""
    return hashlib.sha1(title.encode("utf-8") + b"\0" + text.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------- splitting


def _check_words_per_passage(words_per_passage: int | None) -> int | None:
    if words_per_passage is None or words_per_passage == 0:
        return None
    return check_positive_int(words_per_passage, "words_per_passage (--words-per-passage; 0 or None: no splitting)",
                              error=ConfigError)


def _check_min_tail(min_tail_words: int | None, words_per_passage: int | None) -> int:
    """The shortest last passage kept on its own: `min_tail_words`, or a fifth of a passage when None."""
    if min_tail_words is None:
        return (words_per_passage or 0) // 5
    return check_number(min_tail_words, "min_tail_words (--min-tail-words; 0: never merge a short last passage)", integer=True,
                        low=0, error=ConfigError)


def _split_document(doc: Document, words_per_passage: int | None, min_tail: int = 0) -> list[Passage]:
    """Passages of one document (empty list for an empty text); see the module docstring for ids. A last chunk of fewer
    than `min_tail` words joins the previous passage (a lone "display." would otherwise be a passage that is all title)."""
    if not doc.text.strip():
        return []
    doc_id = doc.id if doc.id is not None else content_id(doc.title, doc.text)
    if words_per_passage is None or doc.keep_whole:
        return [Passage(doc_id, doc.title, doc.text)]
    words = doc.text.split()
    starts = list(range(0, len(words), words_per_passage))
    if len(starts) > 1 and len(words) - starts[-1] < min_tail:
        starts.pop()  # the short tail stays with the passage before it
    chunks = [" ".join(words[a:b]) for a, b in zip(starts, starts[1:] + [len(words)])]
    if len(chunks) == 1:
        return [Passage(doc_id, doc.title, chunks[0])]
    return [Passage(f"{doc_id}-{k}", doc.title, chunk) for k, chunk in enumerate(chunks)]


class _EmptyCounter:
    """Counts documents and skipped empty ones; warns once at the end."""

    def __init__(self) -> None:
        self.documents = 0
        self.empty = 0
        self.first_empty: str | None = None

    def see(self, doc: Document, n_passages: int) -> None:
        self.documents += 1
        if n_passages == 0:
            self.empty += 1
            if self.first_empty is None:
                self.first_empty = doc.source

    def warn(self) -> None:
        if self.empty and self.empty < self.documents:
            warnings.warn(
                f"skipped {self.empty} of {self.documents} documents with empty text (first at {self.first_empty}); "
                f"fill in or remove them to silence this warning",
                EmptyDocumentsWarning,
                stacklevel=3,
            )


def split_passages(documents: Iterable[Document], words_per_passage: int | None = 100, *,
                   min_tail_words: int | None = None) -> Iterator[Passage]:
    """Cut documents into disjoint passages of `words_per_passage` whitespace words.

    Each passage keeps its document's title; words are re-joined with single spaces,
    the last passage of a document may be shorter; a last piece of fewer than `min_tail_words`
    words (default: a fifth of a passage; 0: never) joins the passage before it. `None`/0 (and ``keep_whole``
    documents, e.g. DPR psgs_w100 rows) keep the text verbatim as one passage. Empty
    documents are skipped (warning with their count). Ids: see the module docstring.
    """
    n = _check_words_per_passage(words_per_passage)
    tail = _check_min_tail(min_tail_words, n)
    counter = _EmptyCounter()
    for doc in documents:
        passages = _split_document(doc, n, tail)
        counter.see(doc, len(passages))
        yield from passages
    counter.warn()


def passage_token_lengths(passages: Sequence[Passage], count: Callable[[Sequence[str]], list[int]]) -> list[int]:
    """The token length of each passage's text, ``count`` being a tokenizer's batch length (texts -> lengths)."""
    out: list[int] = []
    for i in range(0, len(passages), 256):
        out += [int(n) for n in count([p.text for p in passages[i:i + 256]])]
    return out


def _pieces(text: str) -> list[str]:
    """A text's sentences (the cut points tried first), in order."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def fit_passages(passages: Iterable[Passage], budget: Callable[[Passage], int],
                 count: Callable[[Sequence[str]], list[int]]) -> Iterator[Passage]:
    """`passages`, each longer than ``budget(passage)`` tokens of text (``count``: texts -> token lengths) cut into
    consecutive passages that fit: whole sentences first, a sentence longer than the budget at word boundaries. A
    passage that fits is kept as is; the pieces of passage ``p`` are ``p~0``, ``p~1``, ... with its title.

    Raises:
        ConfigError: a budget below 1 token (the reader's window leaves no room for the passage's text).
    """
    for p in passages:
        room = int(budget(p))
        if room < 1:
            raise ConfigError(f"passage {p.id!r}: the window leaves {room} tokens for its text; raise the window")
        if count([p.text])[0] <= room:
            yield p
            continue
        units: list[str] = []
        for sentence in _pieces(p.text):
            if count([sentence])[0] <= room:
                units.append(sentence)
                continue
            words, a = sentence.split(), 0  # a sentence over budget: the longest runs of words that fit
            while a < len(words):
                low, high = a + 1, min(len(words), a + room)  # a word is at least one token: a run fits at most `room`
                while low < high:  # binary search: the last end b whose run words[a:b] fits (a lone word always goes)
                    mid = (low + high + 1) // 2
                    if count([" ".join(words[a:mid])])[0] <= room:
                        low = mid
                    else:
                        high = mid - 1
                units.append(" ".join(words[a:low]))
                a = low
        chunks, current = [], ""
        for unit in units:
            joined = f"{current} {unit}" if current else unit
            if current and count([joined])[0] > room:
                chunks.append(current)
                joined = unit
            current = joined
        chunks.append(current)
        for k, chunk in enumerate(chunks):
            yield Passage(f"{p.id}-{k}", p.title, chunk)


# --------------------------------------------------------------------------- corpus


def _source_name(source: Any) -> str:
    if is_dataset(source):
        return "dataset"
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    try:
        return ", ".join(str(s) if not is_dataset(s) else "dataset" for s in source)
    except TypeError:
        return repr(source)


def _first_location(source: Any, passage_id: str, words_per_passage: int | None, read_kw: dict, min_tail: int = 0) -> str | None:
    """Re-read `source` to find where `passage_id` first occurs (error path only: keeps memory at one set)."""
    for doc in read_documents(source, **read_kw):
        if any(p.id == passage_id for p in _split_document(doc, words_per_passage, min_tail)):
            return doc.source
    return None


def iter_corpus(
    source: Any,
    *,
    words_per_passage: int | None = 100,
    min_tail_words: int | None = None,
    show_progress: bool = False,
    **read_kw: Any,
) -> Iterator[Passage]:
    """Stream the validated passages of a corpus: :func:`read_documents` + :func:`split_passages`.

    Raises CorpusError on a duplicate passage id (naming both locations; the first is
    found by re-reading the source, so only a set of ids is kept in memory), and when
    the corpus yields no passage at all. `read_kw` goes to :func:`read_documents`.
    """
    n = _check_words_per_passage(words_per_passage)
    tail = _check_min_tail(min_tail_words, n)
    seen: set[str] = set()
    counter = _EmptyCounter()
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        total = len(source) if is_dataset(source) and hasattr(source, "__len__") else None
        bar = tqdm(total=total, desc=f"reading {_source_name(source)[:60]}", unit=" docs", dynamic_ncols=True)
    try:
        for doc in read_documents(source, **read_kw):
            passages = _split_document(doc, n, tail)
            counter.see(doc, len(passages))
            if bar is not None:
                bar.update(1)
            for p in passages:
                if p.id in seen:
                    first = _first_location(source, p.id, n, read_kw, tail) or "an earlier row"
                    how = (
                        "two documents have identical title and text (ids without an id field are content hashes); remove one"
                        if doc.id is None
                        else "ids must be unique: fix one of them, or pass --id-field naming another column"
                    )
                    raise CorpusError(f"duplicate passage id {p.id!r} at {doc.source}, first seen at {first}; {how}")
                seen.add(p.id)
                yield p
    finally:
        if bar is not None:
            bar.close()
    if not seen:
        name = _source_name(source)
        if counter.documents:
            raise CorpusError(
                f"{name}: all {counter.documents} documents have empty text (field {read_kw.get('text_field', 'text')!r}); "
                f"point --text-field at the column that holds the text"
            )
        raise CorpusError(f"{name} contains no documents; check the path and format")
    counter.warn()


def load_corpus(
    source: Any,
    *,
    words_per_passage: int | None = 100,
    min_tail_words: int | None = None,
    show_progress: bool = True,
    **read_kw: Any,
) -> list[Passage]:
    """Read, split and validate a whole corpus into memory (see :func:`iter_corpus`).

    `source`: path, list of paths, or ``datasets.Dataset``; `read_kw`: ``format``,
    ``title_field``, ``text_field``, ``id_field``, ``encoding``. Shows a tqdm bar.
    """
    return list(iter_corpus(source, words_per_passage=words_per_passage, min_tail_words=min_tail_words,
                            show_progress=show_progress,
                            **read_kw))
