"""Sparse (BM25) retrieval with the same output type as dense retrieval.

Tokenization (lower-casing, English stop-word removal, Snowball stemming via
PyStemmer) and BM25 scoring come from the `bm25s` library; this module adds the
`rag` conventions around it: passages are indexed as their title (counted ``title_weight`` times) and text,
results are ``(B, k)`` arrays with a deterministic order (score descending, then
row ascending, so ties and queries without any known term are reproducible),
errors are :class:`~rag.utils.errors.RagError` subclasses, and saving is atomic.

BM25 is the sparse baseline of the RAG paper (Lewis et al. 2020, §4.1/Table 6) and
the retriever of In-Context RALM (Ram et al. 2023, §3).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from rag.knowledge.passages import Passage
from rag.knowledge.types import Retrieved
from rag.utils.errors import ConfigError, CorpusError, KnowledgeBaseError, RagError
from rag.utils.files import check_json_files, read_json
from rag.utils.io import atomic_directory, atomic_write_json
from rag.utils.validate import check_number, check_strings

SETTINGS_FILE = "rag_bm25.json"
BM25S_DIR = "bm25s"
FORMAT = 1
TOKEN_PATTERN = r"(?u)\d+(?:[.,]\d+)+|\b\w+\b"
"""Tokens are decimal numbers kept whole ("39.948", "1,000", "3.11") and runs of word characters, single characters
included. bm25s's default (``\\w\\w+``) drops "5", "K" and "C", so "which element is number 5?" had no term to match;
splitting at the point made "39" of "atomic number 39?" match Argon's atomic weight "39.948" (as Lucene's standard
tokenizer does, a number with its decimals is one token)."""
LEGACY_TOKEN_PATTERN = r"(?u)\b\w\w+\b"
"""What indexes saved without a ``token_pattern`` setting were built with (bm25s's default)."""
TITLE_WEIGHT = 3
"""How many times a passage's title is counted: a title term is stronger evidence than a term of the text (BM25F,
Robertson, Zaragoza and Taylor 2004, with the title field's weight as a repeat count). A passage's title names what it
is about, and "What's the chemical symbol for sodium?" ranked the Potassium passage, whose text mentions sodium, above
Sodium's own. 3 was chosen with ``benchmarks/hybrid_recall.py --title-weight`` on development questions only."""
LEGACY_TITLE_WEIGHT = 1
"""What indexes saved without a ``title_weight`` setting were built with."""

def is_bm25_index(path: str | os.PathLike) -> bool:
    """True when `path` is a directory written by :meth:`BM25Index.save` (what ``overwrite=True`` may replace)."""
    try:
        s = read_json(Path(path) / SETTINGS_FILE, fix="")
    except RagError:
        return False
    return isinstance(s, dict) and s.get("format") is not None


PassageLookup = Callable[[np.ndarray], "list[list[Passage]]"]


@functools.cache
def _bm25s():
    """The bm25s module. Importing it sets its logger to DEBUG, so every application that logs to the root
    logger (the `rag` command among them) printed its DEBUG lines, `--quiet` or not; that level is undone
    once, here, so the application's own level decides again."""
    import bm25s

    log = logging.getLogger("bm25s")
    if log.level == logging.DEBUG:
        log.setLevel(logging.NOTSET)
    return bm25s


def passage_text(p: Passage, title_weight: int = TITLE_WEIGHT) -> str:
    """The text BM25 indexes for a passage: its title `title_weight` times, then its text."""
    return " ".join([p.title] * title_weight + [p.text]) if p.title else p.text


def _stemmer(name: Optional[str]):
    if name is None:
        return None
    import Stemmer

    try:
        return Stemmer.Stemmer(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"stemmer={name!r} is not a PyStemmer algorithm; choose one of {Stemmer.algorithms()} or None") from e


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of ``(N,)`` scores: ``(k,)`` scores and ``(k,)`` int64 rows, ordered by
    score descending, ties broken by the lower row. O(N) selection plus O(k log k)."""
    n = scores.shape[0]
    if k >= n:
        cand = np.arange(n)
    else:
        threshold = np.partition(scores, n - k)[n - k]  # the k-th largest score
        above = np.flatnonzero(scores > threshold)
        ties = np.flatnonzero(scores == threshold)[: k - above.size]
        cand = np.concatenate([above, ties])
    order = np.lexsort((cand, -scores[cand]))
    rows = cand[order].astype(np.int64)
    return scores[rows].astype(np.float32), rows


class BM25Index:
    """A BM25 index over N passages (rows ``0..N-1`` in corpus order).

    Build with :meth:`build`, query with :meth:`search`, persist with
    :meth:`save` / :meth:`load`.
    """

    def __init__(self, bm25, *, k1: float, b: float, stemmer: Optional[str], stopwords: Optional[str], num_docs: int,
                 token_pattern: str = TOKEN_PATTERN, title_weight: int = TITLE_WEIGHT):
        self._bm25 = bm25
        self.token_pattern = token_pattern
        self.title_weight = int(title_weight)
        self.k1 = float(k1)
        self.b = float(b)
        self.stemmer_name = stemmer
        self.stopwords = stopwords
        self._num_docs = int(num_docs)
        self._stemmer = _stemmer(stemmer)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        *,
        k1: float = 0.9,
        b: float = 0.4,
        stemmer: str | None = "english",
        stopwords: str | None = "en",
        token_pattern: str = TOKEN_PATTERN,
        title_weight: int = TITLE_WEIGHT,
        show_progress: bool = True,
    ) -> "BM25Index":
        """Index each passage's title and text (see :func:`passage_text`).

        Defaults k1=0.9, b=0.4 are Pyserini's (Anserini's) BM25 settings. `stemmer`
        is a PyStemmer algorithm name or None; `stopwords` a bm25s stop-word list
        name ("en", "de", ...) or None; `token_pattern` the regular expression a token matches (stored with the
        index, so queries are split as the passages were); `title_weight` how many times a title counts (0: not
        indexed; see :data:`TITLE_WEIGHT`).
        """
        bm25s = _bm25s()

        passages = list(passages)
        if not passages:
            raise CorpusError("cannot build a BM25 index over an empty corpus; give at least one passage")
        for i, p in enumerate(passages):
            if not isinstance(p, Passage):
                raise CorpusError(f"passages[{i}] is a {type(p).__name__}, not a Passage")
        if not (isinstance(k1, (int, float)) and k1 >= 0 and isinstance(b, (int, float)) and 0 <= b <= 1):
            raise ConfigError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1!r}, b={b!r}")
        try:
            re.compile(token_pattern)
        except (re.error, TypeError) as e:
            raise ConfigError(f"token_pattern={token_pattern!r} is not a regular expression ({e}); the default is "
                              f"{TOKEN_PATTERN!r}") from e
        check_number(title_weight, "title_weight (how many times a passage's title counts; 0: not indexed)", integer=True,
                     low=0, high=100, error=ConfigError)
        index = cls(None, k1=k1, b=b, stemmer=stemmer, stopwords=stopwords, num_docs=len(passages), token_pattern=token_pattern,
                    title_weight=title_weight)
        tokens = index._tokenize([passage_text(p, index.title_weight) for p in passages], show_progress)
        bm25 = bm25s.BM25(k1=float(k1), b=float(b))
        bm25.index(tokens, show_progress=show_progress)
        index._bm25 = bm25
        return index

    def _tokenize(self, texts: list[str], show_progress: bool = False) -> list[list[str]]:
        bm25s = _bm25s()

        try:
            return bm25s.tokenize(
                texts, stopwords=self.stopwords, stemmer=self._stemmer, token_pattern=self.token_pattern, return_ids=False,
                show_progress=show_progress,
            )
        except ValueError as e:  # unknown stop-word list name
            raise ConfigError(f"stopwords={self.stopwords!r}: {e}") from e

    def __len__(self) -> int:
        return self._num_docs

    # ------------------------------------------------------------------ search
    def search(self, queries: Sequence[str], k: int, *, show_progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-k passages for each of B queries.

        Returns ``scores`` ``(B, k)`` float32 (best first) and ``rows`` ``(B, k)`` int64.
        Equal scores are ordered by row; a query with no indexed term scores 0
        everywhere and gets rows ``0..k-1``.
        """
        scores, rows, _ = self.search_and_score(queries, k, None, show_progress=show_progress)
        return scores, rows

    def score_rows(self, queries: Sequence[str], rows: np.ndarray) -> np.ndarray:
        """BM25 scores ``(B, R)`` float32 of the passages `rows` ``(B, R)`` (int64; -1: none, scored 0) for B queries."""
        return self.search_and_score(queries, 1, rows)[2]

    def search_and_score(self, queries: Sequence[str], k: int, rows: Optional[np.ndarray], *,
                         show_progress: bool = False) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """:meth:`search` and :meth:`score_rows` from one tokenization and one scoring pass per query: the top-k
        ``scores`` and ``rows`` ``(B, k)``, and the scores ``(B, R)`` of the given `rows` (None when `rows` is None)."""
        from tqdm.auto import tqdm

        queries = check_strings(queries, "queries", allow_empty=True, allow_blank=True)
        check_number(k, f"k (at most the number of indexed passages, {self._num_docs})", integer=True, low=1, high=self._num_docs)
        k = int(k)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        top = np.zeros((len(queries), k), dtype=np.int64)
        given = None
        if rows is not None:
            rows = np.asarray(rows, dtype=np.int64)
            if rows.ndim != 2 or rows.shape[0] != len(queries) or (rows >= self._num_docs).any():
                raise ConfigError(f"score_rows: rows must be (B={len(queries)}, R) row numbers below {self._num_docs}, "
                                  f"got shape {rows.shape}")
            given = np.zeros(rows.shape, dtype=np.float32)
        if not queries:
            return scores, top, given
        tokens = self._tokenize(queries)
        for i, toks in enumerate(tqdm(tokens, desc="BM25 search", unit="query", disable=not show_progress)):
            full = self._all_scores(toks)
            scores[i], top[i] = top_k(full, k)
            if rows is not None:
                valid = rows[i] >= 0
                given[i, valid] = full[rows[i, valid]]
        return scores, top, given

    def _all_scores(self, tokens: list[str]) -> np.ndarray:
        """The ``(N,)`` float32 BM25 score of every passage for one tokenized query (0 everywhere without a known term)."""
        ids = self._bm25.get_tokens_ids(tokens)
        if not ids:
            return np.zeros(self._num_docs, dtype=np.float32)
        return np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float32)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the index to `directory` atomically (built in a temporary sibling,
        then renamed). An existing directory is replaced only with `overwrite`."""
        bm25s = _bm25s()

        with atomic_directory(directory, overwrite=overwrite, replaces=is_bm25_index, kind="BM25 index") as tmp:
            self._bm25.save(tmp / BM25S_DIR, show_progress=False)
            atomic_write_json(tmp / SETTINGS_FILE, {
                "format": FORMAT,
                "k1": self.k1,
                "b": self.b,
                "stemmer": self.stemmer_name,
                "stopwords": self.stopwords,
                "token_pattern": self.token_pattern,
                "title_weight": self.title_weight,
                "num_docs": self._num_docs,
                "bm25s_version": bm25s.__version__,
            })

    @classmethod
    def load(cls, directory: str | os.PathLike, *, mmap: bool = False) -> "BM25Index":
        """Open an index written by :meth:`save` (`mmap`: memory-map the score arrays)."""
        bm25s = _bm25s()

        directory = Path(directory)
        settings_file = directory / SETTINGS_FILE
        if not settings_file.is_file():
            raise KnowledgeBaseError(f"{directory} is not a BM25 index directory ({SETTINGS_FILE} missing); build one with "
                                     f"BM25Index.build(...).save(...)")
        s = read_json(settings_file, fix="rebuild the index", error=KnowledgeBaseError)
        check_json_files(directory / BM25S_DIR, fix="rebuild the index", error=KnowledgeBaseError)  # bm25s parses them unbounded
        if not isinstance(s, dict):
            raise KnowledgeBaseError(f"{settings_file}: holds a JSON {type(s).__name__}, not an object; rebuild the index")
        try:
            if s.get("format") != FORMAT:
                raise KnowledgeBaseError(f"{settings_file}: format {s.get('format')!r} is not {FORMAT}; rebuild the index")
            bm25 = bm25s.BM25.load(directory / BM25S_DIR, mmap=mmap, load_corpus=False, show_progress=False)
            num_docs = int(s["num_docs"])
            index = cls(bm25, k1=s["k1"], b=s["b"], stemmer=s["stemmer"], stopwords=s["stopwords"], num_docs=num_docs,
                        token_pattern=str(s.get("token_pattern", LEGACY_TOKEN_PATTERN)),
                        title_weight=check_number(s.get("title_weight", LEGACY_TITLE_WEIGHT),
                                                  f"{settings_file}: title_weight", integer=True, low=0, high=100,
                                                  error=KnowledgeBaseError))
        except (OSError, ValueError, KeyError, TypeError) as e:
            if isinstance(e, RagError):
                raise
            raise KnowledgeBaseError(f"cannot load the BM25 index in {directory}: {e!r}; rebuild it") from e
        if bm25.scores.get("num_docs") != num_docs:
            raise KnowledgeBaseError(
                f"{directory}: {SETTINGS_FILE} says {num_docs} passages but the bm25s index has "
                f"{bm25.scores.get('num_docs')}; rebuild the index"
            )
        return index


@dataclass(frozen=True)
class BM25Source:
    """What a :class:`BM25Retriever` serves from, replaced as one reference by a hot swap."""

    index: BM25Index
    lookup: PassageLookup
    kb_version: str
    knowledge_base: Any = None
    """The knowledge base whose passages `lookup` reads (None for bare passages)."""


def _owner_knowledge_base(passages, index: BM25Index):
    """The knowledge base behind a ``kb.get_passages`` lookup whose stored BM25 index is `index`."""
    owner = getattr(passages, "__self__", None)
    if owner is not None and getattr(passages, "__name__", None) == "get_passages" and getattr(owner, "bm25", None) is index:
        return owner
    return None


class BM25Retriever:
    """Sparse retriever returning :class:`~rag.knowledge.types.Retrieved` with
    ``doc_embeds=None`` (BM25 scores are not differentiable).

    Hot-swappable like :class:`~rag.knowledge.retriever.DenseRetriever`: index, passage lookup
    and version live in one :class:`BM25Source` that a call reads once, so
    :meth:`set_knowledge_base` (used by :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`)
    changes one reference and a call already running finishes on the old index and passages.

    Args:
        index: the BM25 index.
        passages: either the passages in index row order (any sequence supporting
            ``len`` and integer indexing), or a callable mapping a ``(B, K)`` int64
            row array to B lists of K passages (e.g. a knowledge base's lookup).
        kb_version: reported in every result's ``kb_version``; None: the knowledge base's ``served_version`` (its
            version id, ``+unverified`` when it was opened without hashing), or ``"bm25"`` over bare passages. Over a
            knowledge base it must be that served version (ConfigError otherwise).
        knowledge_base: the knowledge base `index` and `passages` belong to; inferred when
            `passages` is ``kb.get_passages`` of a knowledge base whose stored index is `index`.
        build_missing: when swapping to a knowledge base stored without a BM25 index, build one
            in memory (off the request path, but CPU-heavy for large corpora; keywords as the
            current index) instead of refusing the swap.
    """

    def __init__(
        self,
        index: BM25Index,
        passages: Union[PassageLookup, Sequence[Passage]],
        kb_version: Optional[str] = None,
        *,
        knowledge_base=None,
        build_missing: bool = False,
    ) -> None:
        if not isinstance(index, BM25Index):
            raise ConfigError(f"index must be a BM25Index, got {type(index).__name__}")
        if callable(passages) and not isinstance(passages, Sequence):
            lookup: PassageLookup = passages
            if knowledge_base is None:
                knowledge_base = _owner_knowledge_base(passages, index)
        else:
            if not hasattr(passages, "__getitem__") or not hasattr(passages, "__len__"):
                raise ConfigError("passages must be a sequence of Passage or a callable mapping (B, K) rows to passages")
            if len(passages) != len(index):
                raise KnowledgeBaseError(
                    f"{len(passages)} passages given for a BM25 index over {len(index)}; "
                    "pass the passages the index was built from, in the same order"
                )
            seq = passages
            lookup = lambda rows: [[seq[int(r)] for r in row] for row in rows]  # noqa: E731
        if knowledge_base is not None and len(knowledge_base) != len(index):
            raise KnowledgeBaseError(
                f"{getattr(knowledge_base, 'path', 'the knowledge base')}: holds {len(knowledge_base)} passages but the "
                f"BM25 index covers {len(index)}; use the BM25 index built with it"
            )
        if knowledge_base is not None and getattr(knowledge_base, "served_version", None) is not None:
            served = str(knowledge_base.served_version)
            if kb_version is not None and str(kb_version) != served:  # e.g. kb.version of a size-verified one
                raise ConfigError(f"kb_version={kb_version!r}, but the knowledge base {getattr(knowledge_base, 'path', '')} "
                                  f"serves as {served!r}; omit kb_version (it is the knowledge base's served_version)")
            kb_version = served
        self.build_missing = bool(build_missing)
        self._source = BM25Source(index, lookup, str("bm25" if kb_version is None else kb_version), knowledge_base)

    # ------------------------------------------------------------------ state
    @property
    def index(self) -> BM25Index:
        """The BM25 index serving now."""
        return self._source.index

    @property
    def kb_version(self) -> str:
        """Version reported by results served now."""
        return self._source.kb_version

    @property
    def knowledge_base(self):
        """The knowledge base serving now (None when built over bare passages)."""
        return self._source.knowledge_base

    # ------------------------------------------------------------------ hot swap
    def prepare_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None) -> BM25Source:
        """Everything a swap to `kb` needs, done before the swap: its stored BM25 index (or one
        built now with ``build_missing``), checked against its passage count.

        `allow_encoder_change` is accepted for the slot's protocol and ignored: BM25 uses no encoder.

        Raises:
            KnowledgeBaseError: `kb` has no BM25 index (and ``build_missing`` is off), or the
                index does not cover its passages.
        """
        index = kb.bm25
        if index is None:
            if not self.build_missing:
                raise KnowledgeBaseError(
                    f"{kb.path}: has no BM25 index, so a BM25 retriever cannot serve from it; rebuild it with bm25=True "
                    "(`rag index build --bm25`), or create the retriever with build_missing=True"
                )
            cur = self._source.index
            index = BM25Index.build(kb.all_passages(), k1=cur.k1, b=cur.b, stemmer=cur.stemmer_name,
                                    stopwords=cur.stopwords, token_pattern=cur.token_pattern, title_weight=cur.title_weight,
                                    show_progress=False)
        if len(index) != len(kb):
            raise KnowledgeBaseError(
                f"{kb.path}: its BM25 index covers {len(index)} passages but it holds {len(kb)}; rebuild the knowledge base"
            )
        return BM25Source(index, kb.get_passages, str(kb.served_version), kb)

    def set_knowledge_base(self, kb, *, allow_encoder_change: Optional[bool] = None,
                           prepared: Optional[BM25Source] = None) -> None:
        """Serve from `kb` and its BM25 index from now on (one reference assignment).

        `prepared` is :meth:`prepare_knowledge_base`'s result for `kb` (computed off the swap
        lock); without it the preparation runs here.
        """
        source = prepared if prepared is not None else self.prepare_knowledge_base(kb)
        if source.knowledge_base is not kb:
            raise ConfigError("set_knowledge_base: `prepared` was made for another knowledge base; prepare this one")
        self._source = source

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_passages(cls, passages: Sequence[Passage], *, kb_version: str = "bm25", **build_kw) -> "BM25Retriever":
        """Build an index over `passages` (keywords as :meth:`BM25Index.build`) and wrap it."""
        passages = list(passages)
        return cls(BM25Index.build(passages, **build_kw), passages, kb_version=kb_version)

    # ------------------------------------------------------------------ retrieval
    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k passages for B queries: rows/scores ``(B, k)``, passages B×k, no embeddings.

        Reads the serving :class:`BM25Source` once, so the whole result (and its ``kb_version``)
        comes from one version even if a swap happens meanwhile.
        """
        source = self._source
        kb = source.knowledge_base
        with kb.in_use() if callable(getattr(kb, "in_use", None)) else contextlib.nullcontext():
            scores, rows = source.index.search(queries, k)
            passages = source.lookup(rows)
        if len(passages) != rows.shape[0] or any(len(p) != rows.shape[1] for p in passages):
            raise KnowledgeBaseError(
                f"the passage lookup returned {[len(p) for p in passages]} passages per query for rows of shape "
                f"{tuple(rows.shape)}; it must return B lists of K passages"
            )
        return Retrieved(
            rows=torch.from_numpy(rows),
            scores=torch.from_numpy(scores),
            passages=[list(p) for p in passages],
            doc_embeds=None,
            kb_version=source.kb_version,
        )
