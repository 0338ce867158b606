"""Index hot-swapping: replace a live model's knowledge base without a restart (Lewis et al. 2020, §4.5).

RAG's non-parametric memory can be updated at test time by swapping the index: the
paper answers questions about world leaders from a December 2016 and a December 2018
Wikipedia index with the same model. :class:`KnowledgeBaseSlot` does this for a model
that is serving requests:

1. The new knowledge base is opened and verified (SHA-256 of every file by default)
   and checked against the retriever (dimension, metric, document-encoder identity)
   *before* the swap lock is taken, on the caller's thread — never on the request
   path. A request running meanwhile is not blocked by anything.
2. Under the lock, one reference changes (``retriever.set_knowledge_base``). The lock
   only serialises swaps against each other; requests never take it.
3. A request that started on the old knowledge base finishes on it: retrievers read
   their knowledge-base reference once per call, and everything downstream (contexts,
   doc scores, decoding, provenance) uses the :class:`~rag.knowledge.retriever.Retrieved`
   that call returned. The old knowledge base stays alive while such a call holds it.
4. A failed swap (missing directory, checksum mismatch, other dimension, metric or
   encoder) raises with the reason and leaves the old knowledge base serving.

:meth:`KnowledgeBaseSlot.swap_back` undoes the last swap in one call. The slot keeps a
short history; only the most recent ``keep_loaded`` previous knowledge bases stay
open in memory (so the undo is instant), older entries are re-opened and re-verified
from their directory when swapped back to.
"""

from __future__ import annotations

import collections
import datetime as _dt
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from rag.errors import ConfigError, KnowledgeBaseError, RagError

logger = logging.getLogger(__name__)

__all__ = ["KnowledgeBaseSlot", "SwapResult", "HistoryEntry", "SwapConflictError"]


class SwapConflictError(KnowledgeBaseError):
    """swap_back could not complete because other swaps kept changing the history meanwhile."""


@dataclass(frozen=True)
class SwapResult:
    """What one swap did. Times are wall-clock seconds."""

    old_version: Optional[str]
    """Version that served before the swap (None if the retriever had no knowledge base)."""
    new_version: str
    """Version that serves now."""
    seconds: float
    """Whole swap: open + verify + validate + commit."""
    load_seconds: float
    """Opening and verifying the new knowledge base (0 when it was already open), off the request path."""
    commit_seconds: float
    """Time the swap lock was held (validation + one reference assignment)."""
    path: Optional[str]
    """Directory of the new knowledge base."""
    old_path: Optional[str]
    kind: str
    """"swap" or "swap_back"."""
    seq: int
    """Commit order: the slot's n-th successful swap (results sorted by seq form a chain old -> new)."""
    at: str
    """UTC time of the commit (ISO 8601)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HistoryEntry:
    """A knowledge base that served before the current one. `kb` is None once unloaded."""

    version: str
    path: Optional[str]
    replaced_at: str
    kb: Any = None

    def describe(self) -> dict:
        return {"version": self.version, "path": self.path, "replaced_at": self.replaced_at, "loaded": self.kb is not None}


_MADV_DONTNEED = 4
_MADVISE_CHUNK = 64 << 20  # bytes per madvise call when releasing inline
_GENTLE_CHUNK = 8 << 20  # ... and on the background thread, which sleeps _GENTLE_PAUSE between calls
_GENTLE_PAUSE = 0.001


def _mapped_addresses(kb) -> list[int]:
    """Addresses inside the large read-only file mappings a knowledge base owns: its memory-mapped
    embeddings, passages (Arrow) and the codes of a memory-mapped flat / HNSW / HNSW-SQ8 index."""
    import numpy as np

    out = []
    emb = getattr(kb, "_embeddings", None)
    if isinstance(emb, np.memmap) and emb.size:
        out.append(int(emb.ctypes.data))
    passages = getattr(kb, "_passages", None)
    try:  # a memory-mapped Arrow table (datasets): one buffer address per column suffices
        for column in passages.data.table.columns:
            for chunk in column.chunks[:1]:
                out.extend(b.address for b in chunk.buffers() if b is not None and b.size)
    except Exception:  # noqa: BLE001 - not a datasets.Dataset
        pass
    index = getattr(kb, "_index", None)
    if index is not None:
        try:
            import faiss

            core = faiss.downcast_index(index)
            if isinstance(core, faiss.IndexHNSW):
                core = faiss.downcast_index(core.storage)
            owned = getattr(getattr(core, "codes", None), "is_owned", True)
            owned = owned() if callable(owned) else owned  # an attribute in recent faiss, a method in others
            if isinstance(core, faiss.IndexFlatCodes) and core.ntotal and not owned:
                out.append(int(faiss.rev_swig_ptr(core.codes.data(), 1).ctypes.data))
        except Exception:  # noqa: BLE001 - an unfamiliar index type is simply not pre-released
            pass
    return out


def _drop_mapped_pages(kb, chunk: int = _MADVISE_CHUNK, pause: float = 0.0) -> None:
    """madvise(MADV_DONTNEED) the read-only file mappings containing `_mapped_addresses(kb)`.

    The caller holds `kb`, so those mappings stay alive during the calls. Safe for read-only
    file-backed mappings: the data stays in the page cache and is faulted back in on access.
    """
    import sys

    if not sys.platform.startswith("linux"):
        return
    addresses = _mapped_addresses(kb)
    if not addresses:
        return
    try:
        import ctypes

        regions = []
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or "w" in parts[1] or not parts[5].startswith("/"):
                    continue  # only read-only mappings of real files
                start, end = (int(x, 16) for x in parts[0].split("-"))
                if any(start <= a < end for a in addresses):
                    regions.append((start, end))
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        for start, end in regions:
            for a in range(start, end, chunk):
                madvise(a, min(chunk, end - a), _MADV_DONTNEED)
                if pause:
                    time.sleep(pause)
    except Exception as e:  # noqa: BLE001 - purely an optimisation
        logger.debug("could not pre-release knowledge-base pages: %s", e)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _path_of(kb) -> Optional[str]:
    p = getattr(kb, "path", None)
    return None if p is None else str(p)


class KnowledgeBaseSlot:
    """The knowledge base a retriever serves from, swappable while requests run.

    Args:
        retriever: anything with a ``knowledge_base`` attribute and
            ``set_knowledge_base(kb, allow_encoder_change=...)`` that validates and assigns one
            reference (:class:`~rag.knowledge.retriever.DenseRetriever`). Use :meth:`for_model`
            for a :class:`~rag.models.rag_model.RagModel` or a pipeline.
        history: how many previous versions :attr:`history` remembers (>= 1).
        keep_loaded: how many of those stay open in memory for an instant :meth:`swap_back`
            (0..history). Each open knowledge base holds its index in memory.
        background_release: free swapped-out knowledge bases on a background thread, a few
            megabytes at a time (see :meth:`_release`), instead of inside the swap call.

    Raises:
        ConfigError: `retriever` cannot be swapped (e.g. a BM25 retriever, which has no
            ``set_knowledge_base``).
    """

    def __init__(self, retriever, *, history: int = 8, keep_loaded: int = 1, background_release: bool = True):
        if not callable(getattr(retriever, "set_knowledge_base", None)) or not hasattr(retriever, "knowledge_base"):
            raise ConfigError(
                f"{type(retriever).__name__} cannot hot-swap its knowledge base (it needs a `knowledge_base` attribute and "
                "`set_knowledge_base(kb, allow_encoder_change=...)`); dense retrievers support it — BM25 retrieval does not yet"
            )
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ConfigError(f"history must be a positive integer, got {history!r}")
        if not isinstance(keep_loaded, int) or isinstance(keep_loaded, bool) or not 0 <= keep_loaded <= history:
            raise ConfigError(f"keep_loaded must be an integer in [0, history={history}], got {keep_loaded!r}")
        self.retriever = retriever
        self._lock = threading.Lock()  # serialises commits (swaps against swaps); requests never take it
        self._history: collections.deque[HistoryEntry] = collections.deque(maxlen=history)
        self._keep_loaded = keep_loaded
        self._swaps = 0
        self._background_release = bool(background_release)
        self._release_lock = threading.Lock()
        self._release_queue: collections.deque = collections.deque()
        self._release_thread: Optional[threading.Thread] = None

    @classmethod
    def for_model(cls, model, **kw) -> "KnowledgeBaseSlot":
        """A slot over the retriever of a RagModel, or of a pipeline's ``.model``."""
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "retriever"):
            model = inner
        retriever = getattr(model, "retriever", None)
        if retriever is None:
            raise ConfigError(f"{type(model).__name__} has no retriever; pass a RagModel, a RagPipeline or a retriever")
        return cls(retriever, **kw)

    # ------------------------------------------------------------------ state
    @property
    def current(self):
        """The knowledge base serving now."""
        return self.retriever.knowledge_base

    @property
    def version(self) -> Optional[str]:
        kb = self.current
        return None if kb is None else kb.version

    @property
    def history(self) -> list[dict]:
        """Previous versions, most recent first (what :meth:`swap_back` would return to, in order)."""
        with self._lock:
            return [e.describe() for e in reversed(self._history)]

    @property
    def swap_count(self) -> int:
        """Number of successful swaps and swap-backs so far."""
        return self._swaps

    # ------------------------------------------------------------------ swapping
    def check(self, path_or_kb, *, allow_encoder_change: bool = False, allow_metric_change: bool = False,
              verify: str = "full"):
        """Open and validate `path_or_kb` exactly as :meth:`swap` would, without swapping (a dry run).

        Returns the opened knowledge base; raises the error :meth:`swap` would raise.
        """
        kb = self._open(path_or_kb, verify)
        self._precheck(kb, allow_encoder_change, allow_metric_change)
        return kb

    def swap(
        self,
        path_or_kb: Union[str, os.PathLike, Any],
        *,
        allow_encoder_change: bool = False,
        allow_metric_change: bool = False,
        verify: str = "full",
    ) -> SwapResult:
        """Serve from `path_or_kb` (a knowledge-base directory or an open KnowledgeBase) from now on.

        The directory is opened and verified (`verify`: "full" checks every file's SHA-256,
        "size" only sizes) and checked for compatibility before the swap lock is taken; then
        the retriever's reference changes in one assignment. Calls already running finish on
        the old knowledge base.

        Raises:
            KnowledgeBaseError / IntegrityError: the directory is missing or damaged, or its
                dimension, metric or encoder does not fit; the old knowledge base keeps serving.
        """
        t0 = time.perf_counter()
        new = self._open(path_or_kb, verify)
        load_seconds = time.perf_counter() - t0
        self._precheck(new, allow_encoder_change, allow_metric_change)  # fail fast, still off the lock
        with self._lock:
            tc = time.perf_counter()
            old = self.current
            self._commit(new, allow_encoder_change, allow_metric_change)
            unloaded = []
            if old is not None:
                if len(self._history) == self._history.maxlen:
                    evicted = self._history.popleft()  # the oldest entry falls off the history
                    if evicted.kb is not None:
                        unloaded.append(evicted.kb)
                self._history.append(HistoryEntry(old.version, _path_of(old), _now(), old))
            unloaded += self._unload_old()
            commit_seconds = time.perf_counter() - tc
            self._swaps += 1
            seq = self._swaps
        self._release(unloaded)  # outside the lock
        return self._result(old, new, t0, load_seconds, commit_seconds, "swap", seq)

    def swap_back(self, *, allow_encoder_change: bool = True, verify: str = "full", _retries: int = 3) -> SwapResult:
        """Undo the last swap: serve the previous version again (and drop it from the history).

        Repeated calls walk further back. The previous knowledge base is still open when it is
        among the last ``keep_loaded``; otherwise it is re-opened and verified from its
        directory first (off the lock). `allow_encoder_change` defaults to True, and a metric
        change is accepted, because the version being returned to already served this retriever
        (e.g. before a deliberate encoder or metric change); its dimension is still checked.

        Raises:
            KnowledgeBaseError: there is no previous version, or it can no longer be opened;
                the current knowledge base keeps serving.
        """
        t0 = time.perf_counter()
        for _ in range(max(1, _retries)):
            with self._lock:
                if not self._history:
                    raise KnowledgeBaseError(
                        f"no previous knowledge base to swap back to; still serving {self.version} — swap to a directory instead"
                    )
                entry = self._history[-1]
                target = entry.kb
            load_seconds = 0.0
            if target is None:
                if entry.path is None:
                    raise KnowledgeBaseError(f"previous version {entry.version} was unloaded and has no directory to re-open; swap to a directory instead")
                tl = time.perf_counter()
                target = self._open(entry.path, verify)
                load_seconds = time.perf_counter() - tl
                if target.version != entry.version:
                    raise KnowledgeBaseError(
                        f"{entry.path}: now holds version {target.version}, not {entry.version} which served from there; "
                        f"swap to it explicitly if that is intended (still serving {self.version})"
                    )
            self._precheck(target, allow_encoder_change, True)
            with self._lock:
                if not self._history or self._history[-1] is not entry:
                    continue  # another swap changed the history while we were loading; look again
                tc = time.perf_counter()
                old = self.current
                self._commit(target, allow_encoder_change, True)
                self._history.pop()
                unloaded = self._unload_old()
                commit_seconds = time.perf_counter() - tc
                self._swaps += 1
                seq = self._swaps
            self._release(unloaded)
            return self._result(old, target, t0, load_seconds, commit_seconds, "swap_back", seq)
        raise SwapConflictError(f"swap_back gave up: the history changed {_retries} times while loading; retry (still serving {self.version})")

    # ------------------------------------------------------------------ internals
    def _open(self, path_or_kb, verify: str):
        """Open and verify off the lock; any failure becomes a KnowledgeBaseError naming what still serves."""
        from rag.knowledge.knowledge_base import KnowledgeBase

        if verify not in ("full", "size", "none"):
            raise ConfigError(f"verify={verify!r}; choose 'full', 'size' or 'none'")
        if isinstance(path_or_kb, (str, os.PathLike)):
            where = os.fspath(path_or_kb)
            try:
                return KnowledgeBase.open(Path(where), verify=verify)
            except RagError as e:
                raise type(e)(f"swap refused, still serving {self.version}: {e}") from e
            except Exception as e:  # faiss/datasets/numpy errors on damaged files opened with verify='none'
                raise KnowledgeBaseError(
                    f"swap refused, still serving {self.version}: {where} cannot be opened ({type(e).__name__}: {e}); rebuild it"
                ) from e
        if all(hasattr(path_or_kb, a) for a in ("version", "dim", "encoder", "search")):
            return path_or_kb
        raise ConfigError(f"swap() takes a knowledge-base directory or an open KnowledgeBase, got {type(path_or_kb).__name__}")

    def _precheck(self, new, allow_encoder_change: bool, allow_metric_change: bool) -> None:
        """Dimension / encoder (rag.knowledge.retriever.check_compatible) and metric, before the lock."""
        from rag.knowledge.retriever import check_compatible

        current = self.current
        try:
            qenc = getattr(self.retriever, "query_encoder", None)
            if qenc is not None:
                check_compatible(new, qenc.dim, getattr(self.retriever, "space", None), allow_encoder_change=allow_encoder_change)
            if current is not None and not allow_metric_change and getattr(new, "metric", None) != getattr(current, "metric", None):
                raise KnowledgeBaseError(
                    f"{_path_of(new)}: indexed with metric={new.metric!r} but the serving knowledge base uses "
                    f"{current.metric!r}, so the model would rank passages differently from how it was trained; rebuild it "
                    f"with metric={current.metric} or pass allow_metric_change=True"
                )
        except RagError as e:
            raise type(e)(f"swap refused, still serving {self.version}: {e}") from e

    def _commit(self, new, allow_encoder_change: bool, allow_metric_change: bool) -> None:
        """Under the lock: re-check against what serves now (no I/O), then the one reference assignment
        (the retriever validates again; a failure assigns nothing)."""
        self._precheck(new, allow_encoder_change, allow_metric_change)
        try:
            self.retriever.set_knowledge_base(new, allow_encoder_change=allow_encoder_change)
        except RagError as e:
            raise type(e)(f"swap refused, still serving {self.version}: {e}") from e

    def _unload_old(self) -> list:
        """Detach all but the newest `keep_loaded` previous knowledge bases (and any that fell off the
        bounded history); returns them so the caller releases them after leaving the lock."""
        dropped = []
        for i, e in enumerate(reversed(self._history)):
            if i >= self._keep_loaded and e.kb is not None:
                dropped.append(e.kb)
                e.kb = None
        return dropped

    def _release(self, kbs: list) -> None:
        """Let go of swapped-out knowledge bases without stalling requests.

        Freeing a large memory-mapped index tears down its page-table entries, and faiss does so
        in its destructor while holding the GIL (measured: 100-300 ms for a 500k x 768 HNSW
        index, during which every request thread waits). Dropping the mapped pages first with
        ``madvise(MADV_DONTNEED)`` — ctypes calls, which release the GIL — a few megabytes at a
        time with short sleeps in between, leaves the destructor almost nothing to do and never
        takes the CPU from requests for long. Only read-only file-backed mappings owned by the
        knowledge base being released are touched; a call still running on it merely re-reads
        its pages from the page cache. Linux only; elsewhere the knowledge base is simply dropped.
        With ``background_release`` this runs on a short-lived daemon thread, so the swap call
        returns right after the commit (:meth:`wait_released` waits for it).
        """
        with self._lock:
            keep = {id(self.current)} | {id(e.kb) for e in self._history if e.kb is not None}
        todo = [kb for kb in kbs if id(kb) not in keep]
        kbs.clear()
        if not todo:
            return
        if not self._background_release:
            for kb in todo:
                _drop_mapped_pages(kb)
            return
        with self._release_lock:
            self._release_queue.extend(todo)
            if self._release_thread is None:
                self._release_thread = threading.Thread(target=self._release_worker, name="rag-kb-release", daemon=True)
                self._release_thread.start()

    def _release_worker(self) -> None:
        while True:
            with self._release_lock:
                if not self._release_queue:
                    self._release_thread = None
                    return
                kb = self._release_queue.popleft()
            _drop_mapped_pages(kb, chunk=_GENTLE_CHUNK, pause=_GENTLE_PAUSE)
            del kb  # the last reference, unless a call is still running on it

    def wait_released(self, timeout: Optional[float] = None) -> bool:
        """Wait until swapped-out knowledge bases queued for release have been let go; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._release_lock:
                t = self._release_thread
            if t is None:
                return True
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False

    def _result(self, old, new, t0: float, load_s: float, commit_s: float, kind: str, seq: int) -> SwapResult:
        res = SwapResult(
            old_version=None if old is None else old.version,
            new_version=new.version,
            seconds=time.perf_counter() - t0,
            load_seconds=load_s,
            commit_seconds=commit_s,
            path=_path_of(new),
            old_path=None if old is None else _path_of(old),
            kind=kind,
            seq=seq,
            at=_now(),
        )
        logger.info("%s: %s -> %s in %.3f s (load %.3f s, lock held %.6f s)", kind, res.old_version, res.new_version,
                    res.seconds, load_s, commit_s)
        return res

    def __repr__(self) -> str:
        return f"KnowledgeBaseSlot(version={self.version}, history={len(self._history)}, swaps={self._swaps})"
