"""Index hot-swapping: replace a live model's knowledge base without a restart (Lewis et al. 2020, §4.5).

RAG's non-parametric memory can be updated at test time by swapping the index: the
paper answers questions about world leaders from a December 2016 and a December 2018
Wikipedia index with the same model. :class:`KnowledgeBaseSlot` does this for a model
that is serving requests:

1. The new knowledge base is opened and verified (SHA-256 of every file by default, hashed
   in a child process at a lower CPU priority so that it yields to the threads serving
   requests) and checked against the retriever (dimension, metric, document-encoder
   identity; a BM25 retriever loads the new BM25 index) *before* the swap lock is taken,
   on the caller's thread — never on the request path. A request running meanwhile is not
   blocked by anything. Then the new version is pre-warmed (``prewarm=True``,
   :meth:`~rag.knowledge.knowledge_base.KnowledgeBase.prewarm`): every page of its memory-mapped
   index, embeddings and passages is made resident and mapped, gently, so that its first requests
   after the swap do not fault them in from the disk one page at a time (hundreds of ms per
   request for a version that is not, or no longer, in the page cache).
2. Under the lock, one reference changes (``retriever.set_knowledge_base``). The lock
   only serialises swaps against each other; requests never take it.
3. A request that started on the old knowledge base finishes on it: retrievers read
   their knowledge-base reference once per call, and everything downstream (contexts,
   doc scores, decoding, provenance) uses the :class:`~rag.knowledge.types.Retrieved`
   that call returned, whose ``kb_version`` names the version. The old knowledge base
   stays open while such a call holds it, and is closed
   (:meth:`~rag.knowledge.knowledge_base.KnowledgeBase.close`) on a background thread
   once the last of them has let go of it.
4. A failed swap (missing directory, checksum mismatch, other dimension, metric or
   encoder, no BM25 index for a BM25 retriever) raises with the reason and leaves the old
   knowledge base serving.

:meth:`KnowledgeBaseSlot.swap_back` undoes the last swap in one call. The slot keeps a
short history; only the most recent ``keep_loaded`` previous knowledge bases stay
open in memory (their index and mappings need not be loaded again), older entries are
re-opened from their directory when swapped back to; either way the files are verified
again first (a version kept open is re-hashed: an edit in place would change what it serves).
"""

from __future__ import annotations

import collections
import datetime as _dt
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.pagecache import PREWARM_CHUNK, PREWARM_PAUSE
from rag.knowledge.retriever import check_compatible
from rag.utils.checksums import check_niceness
from rag.utils.errors import ConfigError, KnowledgeBaseError, RagError
from rag.utils.validate import check_bool, check_number, check_positive_int

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
    """Whole swap: open + verify + validate + prewarm + commit."""
    load_seconds: float
    """Opening and verifying the new knowledge base (one kept open by swap_back: verifying its files again; 0 only with
    ``verify="none"``), off the request path."""
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
    prewarm_seconds: float = 0.0
    """Pre-warming the new knowledge base before the commit (0 when disabled), off the request path."""
    prewarmed_bytes: int = 0
    """Bytes of memory-mapped files pre-warmed (0 when disabled, failed, or nothing is mapped)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HistoryEntry:
    """A knowledge base that served before the current one. `kb` is None once unloaded."""

    version: str
    path: Optional[str]
    replaced_at: str
    kb: Any = None
    served_version: Optional[str] = None
    """The version as it was reported while serving (``+unverified`` unless fully verified); `version` if None."""

    def describe(self) -> dict:
        return {"version": self.served_version or self.version, "path": self.path, "replaced_at": self.replaced_at,
                "loaded": self.kb is not None}


_GENTLE_CHUNK = 8 << 20  # bytes per madvise call when the background thread releases a knowledge base ...
_GENTLE_PAUSE = 0.001  # ... sleeping this long between calls, so that it never holds a core for long


def _only_here(items: list, i: int) -> bool:
    """True if nothing but the list `items` references `items[i]`: no retriever, history entry,
    caller, or running call (a call holds the knowledge base it read in a local variable, or
    through the retriever state it read) can reach it any more, so no call can be using it
    or start using it. (CPython reference count: the list's slot plus getrefcount's argument.)"""
    return sys.getrefcount(items[i]) <= 2


def _close(kb, **kw) -> None:
    """Close a swapped-out KnowledgeBase (the caller made sure nothing else uses it); other objects
    (test doubles, wrappers) are simply dropped."""
    if isinstance(kb, KnowledgeBase):
        kb.close(timeout=0, **kw)


def _release_pages(kb, **kw) -> None:
    """Release the mapped pages of a swapped-out KnowledgeBase that something still holds."""
    if isinstance(kb, KnowledgeBase):
        kb.release_pages(**kw)


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
            for a :class:`~rag.models.rag.model.RagModel` or a pipeline.
            A retriever may also offer ``prepare_knowledge_base(kb, allow_encoder_change=...)``
            (:class:`~rag.knowledge.bm25.BM25Retriever`: loads the new BM25 index): the slot calls it
            off the lock and passes its result to ``set_knowledge_base(kb, ..., prepared=result)``.
        history: how many previous versions :attr:`history` remembers (>= 1).
        keep_loaded: how many of those stay open in memory for an instant :meth:`swap_back`
            (0..history). Each open knowledge base holds its index in memory.
        background_release: release swapped-out knowledge bases on a background thread (see
            :meth:`_release`). False: inside the swap call when no call is using them any more,
            else still on the background thread once the last one finishes.
        verify_nice: niceness of the child process that checksums a new knowledge base
            (``verify="full"``), so that hashing gigabytes yields the CPU to requests; None
            hashes in the swapping thread at normal priority (it still releases the GIL).
        release_wait: seconds to wait for the last holder of a swapped-out knowledge base to let
            go before giving up on closing it; its mapped pages are then released (harmless to a
            holder still reading) and it is freed whenever that holder drops it.
        prewarm: pre-warm the new knowledge base before each swap's commit (default; see
            :meth:`KnowledgeBase.prewarm <rag.knowledge.knowledge_base.KnowledgeBase.prewarm>`);
            :meth:`swap` / :meth:`swap_back` can override it per call. A failure to pre-warm is
            logged and the swap goes ahead.
        prewarm_chunk: bytes per pre-warming step.
        prewarm_pause: seconds between pre-warming steps that found their pages cached (after a
            step that read from the disk it pauses as long as the read took).

    Raises:
        ConfigError: `retriever` cannot be swapped (it lacks ``knowledge_base`` /
            ``set_knowledge_base``), or an argument is out of range.
    """

    def __init__(self, retriever, *, history: int = 8, keep_loaded: int = 1, background_release: bool = True,
                 verify_nice: Optional[int] = 10, release_wait: float = 60.0, prewarm: bool = True,
                 prewarm_chunk: int = PREWARM_CHUNK, prewarm_pause: float = PREWARM_PAUSE):
        if not callable(getattr(retriever, "set_knowledge_base", None)) or not hasattr(retriever, "knowledge_base"):
            raise ConfigError(
                f"{type(retriever).__name__} cannot hot-swap its knowledge base: it needs a `knowledge_base` attribute and "
                "`set_knowledge_base(kb, allow_encoder_change=...)`, as DenseRetriever and BM25Retriever have"
            )
        check_positive_int(history, "history", error=ConfigError)
        check_number(keep_loaded, f"keep_loaded (at most history={history})", integer=True, low=0, high=history,
                     error=ConfigError)
        check_niceness(verify_nice, "verify_nice")
        check_number(release_wait, "release_wait (seconds)", low=0, error=ConfigError)
        check_bool(prewarm, "prewarm", error=ConfigError)
        check_positive_int(prewarm_chunk, "prewarm_chunk (bytes)", error=ConfigError)
        check_number(prewarm_pause, "prewarm_pause (seconds)", low=0, error=ConfigError)
        self.retriever = retriever
        self._prewarm_default = prewarm
        self._prewarm_chunk = prewarm_chunk
        self._prewarm_pause = float(prewarm_pause)
        self._verify_nice = verify_nice
        self._release_wait = float(release_wait)
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
        """The serving version as answers report it (``+unverified`` unless its files were all hashed)."""
        kb = self.current
        return None if kb is None else kb.served_version

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
        self._prepare(kb, allow_encoder_change)
        return kb

    def swap(
        self,
        path_or_kb: Union[str, os.PathLike, Any],
        *,
        allow_encoder_change: bool = False,
        allow_metric_change: bool = False,
        verify: str = "full",
        prewarm: Optional[bool] = None,
    ) -> SwapResult:
        """Serve from `path_or_kb` (a knowledge-base directory or an open KnowledgeBase) from now on.

        The directory is opened and verified (`verify`: "full" checks every file's SHA-256,
        "size" only sizes) and checked for compatibility before the swap lock is taken, then
        pre-warmed (`prewarm`, None: the slot's setting); then the retriever's reference changes
        in one assignment. Calls already running finish on
        the old knowledge base, which is closed after the last of them (see :meth:`_release`).

        Raises:
            KnowledgeBaseError / IntegrityError: the directory is missing or damaged, or its
                dimension, metric or encoder does not fit (or, for a BM25 retriever, it has no
                BM25 index); the old knowledge base keeps serving.
        """
        t0 = time.perf_counter()
        new = self._open(path_or_kb, verify)
        load_seconds = time.perf_counter() - t0
        self._precheck(new, allow_encoder_change, allow_metric_change)  # fail fast, still off the lock
        prepared = self._prepare(new, allow_encoder_change)  # e.g. the BM25 index: loaded off the lock
        warm = self._prewarm(new, prewarm)  # its pages resident before the first request reads them
        with self._lock:
            tc = time.perf_counter()
            old = self.current
            self._commit(new, allow_encoder_change, allow_metric_change, prepared)
            unloaded = []
            if old is not None:
                if len(self._history) == self._history.maxlen:
                    evicted = self._history.popleft()  # the oldest entry falls off the history
                    if evicted.kb is not None:
                        unloaded.append(evicted.kb)
                        evicted.kb = None
                    del evicted
                self._history.append(HistoryEntry(old.version, _path_of(old), _now(), old, old.served_version))
            unloaded += self._unload_old()
            commit_seconds = time.perf_counter() - tc
            self._swaps += 1
            seq = self._swaps
        old_version, old_path = (None, None) if old is None else (old.served_version, _path_of(old))
        del old, prepared  # this frame must not keep the old knowledge base alive
        self._release(unloaded)  # outside the lock
        return self._result(old_version, old_path, new, t0, load_seconds, commit_seconds, "swap", seq, warm)

    def swap_back(self, *, allow_encoder_change: bool = True, verify: str = "full", prewarm: Optional[bool] = None,
                  _retries: int = 3) -> SwapResult:
        """Undo the last swap: serve the previous version again (and drop it from the history).

        Repeated calls walk further back. The previous knowledge base is still open when it is
        among the last ``keep_loaded``: its files are then checked again (`verify`; "full" hashes
        every one, in the low-priority child), since an edit in place would change what its memory
        maps serve; otherwise it is re-opened and verified from its directory first. Both happen off
        the lock. `allow_encoder_change` defaults to True, and a metric
        change is accepted, because the version being returned to already served this retriever
        (e.g. before a deliberate encoder or metric change); its dimension is still checked.
        It is pre-warmed as in :meth:`swap` (`prewarm`): pages of a version kept open may have
        been reclaimed since it served.

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
            if target is not None and verify != "none":
                # Kept open, but its memory-mapped files may have been edited in place since it served: what it would
                # serve is proven to be what its version id names by hashing the files again (off the lock).
                tl = time.perf_counter()
                try:
                    target.recheck(verify, hash_nice=self._verify_nice)
                except RagError as e:
                    raise type(e)(f"swap_back refused, still serving {self.version}: {entry.version}'s files changed since it "
                                  f"served ({e}); restore them, or swap to a rebuilt knowledge base") from e
                load_seconds = time.perf_counter() - tl
            elif target is not None:
                target.verified = "none"  # served as +unverified: nothing was checked this time
            if target is None:
                if entry.path is None:
                    raise KnowledgeBaseError(f"previous version {entry.version} was unloaded and has no directory to re-open; "
                                             f"swap to a directory instead")
                tl = time.perf_counter()
                target = self._open(entry.path, verify)
                load_seconds = time.perf_counter() - tl
                if target.version != entry.version:
                    raise KnowledgeBaseError(
                        f"{entry.path}: now holds version {target.version}, not {entry.version} which served from there; "
                        f"swap to it explicitly if that is intended (still serving {self.version})"
                    )
            self._precheck(target, allow_encoder_change, True)
            prepared = self._prepare(target, allow_encoder_change)
            warm = self._prewarm(target, prewarm)
            with self._lock:
                if not self._history or self._history[-1] is not entry:
                    continue  # another swap changed the history while we were loading; look again
                tc = time.perf_counter()
                old = self.current
                self._commit(target, allow_encoder_change, True, prepared)
                self._history.pop()
                entry.kb = None
                unloaded = self._unload_old()
                commit_seconds = time.perf_counter() - tc
                self._swaps += 1
                seq = self._swaps
            old_version, old_path = (None, None) if old is None else (old.served_version, _path_of(old))
            if old is not None:
                unloaded.append(old)  # swap_back forgets the version it leaves: release it too
            del old, prepared
            self._release(unloaded)
            return self._result(old_version, old_path, target, t0, load_seconds, commit_seconds, "swap_back", seq, warm)
        raise SwapConflictError(f"swap_back gave up: the history changed {_retries} times while loading; retry (still serving "
                                f"{self.version})")

    # ------------------------------------------------------------------ internals
    def _open(self, path_or_kb, verify: str):
        """Open and verify off the lock; any failure becomes a KnowledgeBaseError naming what still serves."""
        if verify not in ("full", "size", "none"):
            raise ConfigError(f"verify={verify!r}; choose 'full', 'size' or 'none'")
        if isinstance(path_or_kb, (str, os.PathLike)):
            where = os.fspath(path_or_kb)
            try:
                return KnowledgeBase.open(Path(where), verify=verify, hash_nice=self._verify_nice)
            except RagError as e:
                raise type(e)(f"swap refused, still serving {self.version}: {e}") from e
            except Exception as e:  # faiss/datasets/numpy errors on damaged files opened with verify='none'
                raise KnowledgeBaseError(
                    f"swap refused, still serving {self.version}: {where} cannot be opened ({type(e).__name__}: {e}); rebuild it"
                ) from e
        if all(hasattr(path_or_kb, a) for a in ("version", "dim", "encoder", "search")):
            if getattr(path_or_kb, "closed", False) is True:
                raise KnowledgeBaseError(f"swap refused, still serving {self.version}: knowledge base {path_or_kb.version} "
                                         "was closed; swap to its directory instead")
            return path_or_kb
        raise ConfigError(f"swap() takes a knowledge-base directory or an open KnowledgeBase, got {type(path_or_kb).__name__}")

    def _precheck(self, new, allow_encoder_change: bool, allow_metric_change: bool) -> None:
        """Dimension / encoder (rag.knowledge.retriever.check_compatible) and metric of a dense
        retriever, before the lock (a BM25 retriever uses neither the embeddings nor their metric)."""
        current = self.current
        try:
            qenc = getattr(self.retriever, "query_encoder", None)
            if qenc is None:
                return
            check_compatible(new, qenc.dim, getattr(self.retriever, "space", None), allow_encoder_change=allow_encoder_change)
            if current is not None and not allow_metric_change and getattr(new, "metric",
                                                                           None) != getattr(current, "metric", None):
                raise KnowledgeBaseError(
                    f"{_path_of(new)}: indexed with metric={new.metric!r} but the serving knowledge base uses "
                    f"{current.metric!r}, so the model would rank passages differently from how it was trained; rebuild it "
                    f"with metric={current.metric} or pass allow_metric_change=True"
                )
        except RagError as e:
            raise type(e)(f"swap refused, still serving {self.version}: {e}") from e

    def _prepare(self, new, allow_encoder_change: bool):
        """The retriever's own off-lock preparation (a BM25 retriever loads and checks the new BM25
        index), or None for retrievers that need none."""
        prepare = getattr(self.retriever, "prepare_knowledge_base", None)
        if not callable(prepare):
            return None
        try:
            return prepare(new, allow_encoder_change=allow_encoder_change)
        except RagError as e:
            raise type(e)(f"swap refused, still serving {self.version}: {e}") from e

    def _prewarm(self, new, prewarm: Optional[bool]) -> tuple[float, int]:
        """Pre-warm `new` off the lock if enabled (`prewarm` None: the slot's default); returns
        (seconds, bytes). Never raises an Exception: a swap must not fail because its new
        knowledge base could not be pre-warmed (its first requests are then merely slower)."""
        if prewarm is None:
            prewarm = self._prewarm_default
        fn = getattr(new, "prewarm", None)
        if not prewarm or not callable(fn):
            return 0.0, 0
        t = time.perf_counter()
        try:
            done = int(fn(chunk=self._prewarm_chunk, pause=self._prewarm_pause) or 0)
        except Exception as e:  # noqa: BLE001 - an optimisation only: log and swap anyway
            logger.warning("could not pre-warm knowledge base %s (%s: %s); swapping without it", getattr(new, "version", "?"),
                           type(e).__name__, e)
            done = 0
        return time.perf_counter() - t, done

    def _commit(self, new, allow_encoder_change: bool, allow_metric_change: bool, prepared=None) -> None:
        """Under the lock: re-check against what serves now (no I/O), then the one reference assignment
        (the retriever validates again; a failure assigns nothing)."""
        self._precheck(new, allow_encoder_change, allow_metric_change)
        try:
            if prepared is None:
                self.retriever.set_knowledge_base(new, allow_encoder_change=allow_encoder_change)
            else:
                self.retriever.set_knowledge_base(new, allow_encoder_change=allow_encoder_change, prepared=prepared)
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
        """Close swapped-out knowledge bases once no call is using them, without stalling requests.

        A call that started on a knowledge base holds a reference to it until it returns, and
        the slot has dropped its own (history entry, retriever); so once only the release
        queue references it, its last in-flight call has finished and no new one can start —
        then :meth:`KnowledgeBase.close` frees it. Closing first drops its mapped pages with
        ``madvise(MADV_DONTNEED)`` a few megabytes at a time (ctypes calls, which release the
        GIL, with short sleeps in between): freeing a large memory-mapped index otherwise tears
        down its page tables inside faiss's destructor with the GIL held, and every request
        thread waits (docs/benchmarks.md, "Hot swap"). A knowledge base
        still held after ``release_wait`` seconds (e.g. by the caller who passed it in) only has
        its pages released, which a holder still reading does not notice, and is freed by its
        last holder. Knowledge bases still in the history are kept. With ``background_release``
        this runs on a short-lived daemon thread, so the swap call returns right after the
        commit (:meth:`wait_released` waits for it).
        """
        with self._lock:
            keep = {id(self.current)} | {id(e.kb) for e in self._history if e.kb is not None}
        todo = [kb for kb in kbs if id(kb) not in keep]
        kbs.clear()
        if not todo:
            return
        if not self._background_release:
            i = 0
            while i < len(todo):
                if _only_here(todo, i) and getattr(todo[i], "in_flight", 0) == 0:
                    _close(todo.pop(i))
                else:
                    i += 1
            if not todo:
                return
        with self._release_lock:
            while todo:
                self._release_queue.append(todo.pop())
            if self._release_thread is None:
                self._release_thread = threading.Thread(target=self._release_worker, name="rag-kb-release", daemon=True)
                self._release_thread.start()

    def _release_worker(self) -> None:
        pending: list = []  # knowledge bases waiting for their last in-flight call to finish
        queued_at: list[float] = []
        delay = 0.001
        while True:
            with self._release_lock:
                while self._release_queue:
                    pending.append(self._release_queue.popleft())
                    queued_at.append(time.monotonic())
                if not pending:
                    self._release_thread = None
                    return
            i, progressed = 0, False
            while i < len(pending):
                if _only_here(pending, i) and getattr(pending[i], "in_flight", 0) == 0:
                    _close(pending.pop(i), chunk=_GENTLE_CHUNK, pause=_GENTLE_PAUSE)
                elif time.monotonic() - queued_at[i] >= self._release_wait:
                    _release_pages(pending.pop(i), chunk=_GENTLE_CHUNK, pause=_GENTLE_PAUSE)
                else:
                    i += 1
                    continue
                queued_at.pop(i)
                progressed = True
            if pending:
                delay = 0.001 if progressed else min(0.05, 2 * delay)
                time.sleep(delay)

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

    def _result(self, old_version, old_path, new, t0: float, load_s: float, commit_s: float, kind: str, seq: int,
                warm: tuple[float, int] = (0.0, 0)) -> SwapResult:
        res = SwapResult(
            old_version=old_version,
            new_version=new.served_version,  # "+unverified" unless its files were all hashed
            seconds=time.perf_counter() - t0,
            load_seconds=load_s,
            commit_seconds=commit_s,
            path=_path_of(new),
            old_path=old_path,
            kind=kind,
            seq=seq,
            at=_now(),
            prewarm_seconds=warm[0],
            prewarmed_bytes=warm[1],
        )
        logger.info("%s: %s -> %s in %.3f s (load %.3f s, prewarm %.3f s, lock held %.6f s)", kind, res.old_version,
                    res.new_version, res.seconds, load_s, warm[0], commit_s)
        return res

    def __repr__(self) -> str:
        return f"KnowledgeBaseSlot(version={self.version}, history={len(self._history)}, swaps={self._swaps})"
