"""Page-cache control of a process's read-only file mappings: release resident pages (``MADV_DONTNEED``),
prewarm them (``MADV_POPULATE_READ``), and list the mappings of a directory's files (Linux ``/proc/self/maps``).

:class:`MappedPages` is a knowledge base's page-cache part (:class:`~rag.knowledge.knowledge_base.KnowledgeBase`
composes one): a swapped-out version frees without stalling the threads serving requests, and a new version's pages
are resident before its first request. Everything here only ever saves time: off Linux it does nothing.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from rag.knowledge.lifetime import Lifetime
from rag.utils.validate import check_number, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["MappedPages", "RELEASE_CHUNK", "PREWARM_CHUNK", "PREWARM_PAUSE", "mapped_addresses", "arrow_addresses",
           "own_mappings",
           "madvise_dontneed", "file_mappings", "populate"]

_MADV_DONTNEED = 4
RELEASE_CHUNK = 64 << 20
"""Bytes per madvise call in :meth:`KnowledgeBase.release_pages` (default)."""
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault pages in (reading them if needed) and map them, without writing
PREWARM_CHUNK = 8 << 20
"""Bytes per step of :meth:`KnowledgeBase.prewarm` (default)."""
PREWARM_PAUSE = 0.001
"""Seconds :meth:`KnowledgeBase.prewarm` sleeps between steps that found their pages cached (default)."""


def mapped_addresses(embeddings, passages, index) -> list[int]:
    """An address inside each large read-only file mapping of a knowledge base's data: memory-mapped
    `embeddings` (np.memmap), the Arrow columns of `passages` (a memory-mapped ``datasets.Dataset``) and the
    codes of a memory-mapped flat / HNSW / HNSW-SQ8 faiss `index`; in-memory data contributes nothing."""
    out = []
    if isinstance(embeddings, np.memmap) and embeddings.size:
        out.append(int(embeddings.ctypes.data))
    try:  # a memory-mapped Arrow table (datasets): one buffer address per column suffices
        for column in passages.data.table.columns:
            for chunk in column.chunks[:1]:
                out.extend(b.address for b in chunk.buffers() if b is not None and b.size)
    except Exception:  # noqa: BLE001 - not a datasets.Dataset (or closed)
        pass
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


def arrow_addresses(passages) -> list[int]:
    """An address in every record batch of every Arrow shard of `passages` (a ``datasets.Dataset``; else none)."""
    out = []
    try:
        for column in passages.data.table.columns:
            for chunk in column.chunks:
                out.extend(b.address for b in chunk.buffers()[:2] if b is not None and b.size)
    except Exception:  # noqa: BLE001 - not a datasets.Dataset
        pass
    return out


def own_mappings(root: Path, owned: list[int]) -> list[tuple[str, int, int]]:
    """(path, start, end) of this process's read-only mappings of files under `root` that hold one of the
    `owned` addresses. Where a file is mapped more than once (another KnowledgeBase open on the same
    directory, e.g. the previous object kept for swap_back), only the mappings holding owned data count; a
    file none of whose mappings can be attributed (an index type :func:`mapped_addresses` does not know)
    counts with all of them, provided anything is owned at all (an in-memory copy maps nothing, and must
    not claim another object's mappings)."""
    owned = sorted(owned)
    maps = file_mappings(root)
    mine = []
    for name, start, end in maps:
        i = bisect.bisect_left(owned, start)
        if i < len(owned) and owned[i] < end:
            mine.append((name, start, end))
    if not mine:
        return []
    known = {name for name, _, _ in mine}
    return mine + [m for m in maps if m[0] not in known]


def madvise_dontneed(addresses: list[int], chunk: int, pause: float) -> int:
    """madvise(MADV_DONTNEED) every read-only file mapping of this process that contains one of
    `addresses`, `chunk` bytes per call; returns the bytes advised. The caller keeps the mappings
    alive. Failures are logged and ignored: this only ever saves time."""
    advised = 0
    try:
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
            for a in range(start, end, max(1, int(chunk))):
                n = min(chunk, end - a)
                if madvise(a, n, _MADV_DONTNEED) == 0:
                    advised += n
                if pause:
                    time.sleep(pause)
    except Exception as e:  # noqa: BLE001 - purely an optimisation
        logger.debug("could not release knowledge-base pages: %s", e)
    return advised


def file_mappings(root: Path) -> list[tuple[str, int, int]]:
    """(path, start, end) of each read-only mapping of this process of a file under directory `root`."""
    base = os.path.realpath(root) + os.sep
    out = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or "w" in parts[1]:
                continue
            name = parts[5].rstrip("\n")
            if not name.startswith(base):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((name, start, end))
    return out


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.mincore.restype = ctypes.c_int
    return libc


def _touch(start: int, n: int, page: int) -> None:
    """Read one byte of every page of [start, start + n) (the fallback without MADV_POPULATE_READ)."""
    view = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(start))
    int(view[::page].max())


def populate(regions: list[tuple[int, int]], chunk: int, pause: float) -> int:
    """Fault in and map every page of `regions` (page-aligned mappings the caller keeps alive), `chunk`
    bytes per call, pausing after each step (see :meth:`KnowledgeBase.prewarm`); returns the bytes done."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    chunk = max(page, chunk // page * page)
    vec = (ctypes.c_ubyte * (chunk // page))()
    populate = True
    done = 0
    for start, end in regions:
        for a in range(start, end, chunk):
            n = min(chunk, end - a)
            missing = True  # unknown: assume a disk read
            if libc.mincore(a, n, vec) == 0:
                missing = not bool(np.all(np.frombuffer(vec, np.uint8, -(-n // page)) & 1))
            t = time.monotonic()
            if missing:  # one large read-ahead of the whole step; populating alone would read page by page
                libc.madvise(a, n, _MADV_WILLNEED)
            if populate and libc.madvise(a, n, _MADV_POPULATE_READ) != 0:
                err = ctypes.get_errno()
                if err != 22:  # EINVAL: not supported by this kernel -> touch instead; anything else is real
                    raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
                populate = False
            if not populate:
                _touch(a, n, page)
            done += n
            took = time.monotonic() - t
            if missing:
                time.sleep(took)  # leave the disk to the serving knowledge base as long as we used it
            elif pause:
                time.sleep(pause)
    return done


_LINUX = sys.platform.startswith("linux")


class MappedPages:
    """The page-cache part of the knowledge base `owner` in directory `root`: ``data(owner)`` gives its
    ``(embeddings, passages, index)`` (None each once freed), `lifetime` keeps them alive while their pages are advised
    or read. It refers to `owner` weakly, so the knowledge base is freed as soon as nothing else holds it."""

    def __init__(self, root: Path, owner: object, data: Callable[[object], tuple], lifetime: Lifetime) -> None:
        self.root, self._owner, self._get, self._lifetime = root, weakref.ref(owner), data, lifetime

    def _data(self) -> tuple:
        owner = self._owner()
        return (None, None, None) if owner is None else self._get(owner)

    def addresses(self) -> list[int]:
        """An address inside each large read-only file mapping the knowledge base owns: the memory-mapped embeddings,
        the passages' Arrow columns and the codes of a memory-mapped flat / HNSW / HNSW-SQ8 index (empty once closed,
        or for in-memory copies)."""
        return mapped_addresses(*self._data())

    def release(self, *, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> int:
        """Drop this process's resident pages of the read-only file mappings (``madvise(MADV_DONTNEED)``, `chunk` bytes
        per call, sleeping `pause` s between calls). Non-destructive: the data stays in the page cache and a read running
        meanwhile faults it back in and gets the same results. Done before freeing, it leaves faiss's destructor (which
        holds the GIL) almost nothing to unmap; the madvise calls themselves release the GIL. Returns the bytes advised
        (0 off Linux, when closed, or when nothing is mapped)."""
        if not _LINUX:
            return 0
        with self._lifetime.hold_if_open() as held:
            return self.drop(chunk=chunk, pause=pause) if held else 0

    def drop(self, *, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> int:
        """:meth:`release` for a caller that keeps the mappings alive itself (closing: no read can run)."""
        addresses = self.addresses() if _LINUX else []
        return madvise_dontneed(addresses, chunk, pause) if addresses else 0

    def files(self) -> dict[str, int]:
        """The files this process serves the knowledge base from through memory maps, with their mapped bytes:
        ``{path: bytes}`` (Linux; empty elsewhere, when closed, or for in-memory copies). With ``mmap=True``: the FAISS
        index, ``embeddings.npy`` and the passages' Arrow files — the pages a request reads."""
        if not _LINUX:
            return {}
        out: dict[str, int] = {}
        for name, start, end in self.own_mappings():
            out[name] = out.get(name, 0) + (end - start)
        return out

    def own_mappings(self) -> list[tuple[str, int, int]]:
        """(path, start, end) of the knowledge base's read-only mappings of files in `root` (:func:`own_mappings`:
        where a file is mapped more than once, e.g. another object open on the same directory kept for swap_back, only
        the mappings holding this object's data count)."""
        if self._lifetime.closed:
            return []
        passages = self._data()[1]
        return own_mappings(self.root, self.addresses() + arrow_addresses(passages))

    def prewarm(self, *, chunk: int = PREWARM_CHUNK, pause: float = PREWARM_PAUSE) -> int:
        """Make every page a request can touch resident and mapped before requests use the knowledge base.

        Requests read the memory-mapped files at random (an HNSW search visits graph nodes and vectors all over the
        index, then the rows of its hits); a page not in memory costs a request a disk read. This walks each mapping in
        `chunk`-byte steps with ``madvise(MADV_POPULATE_READ)`` (releasing the GIL), first asking for a step's missing
        pages at once (``MADV_WILLNEED``); after a step that found its pages cached it sleeps `pause` seconds, after one
        that read from the disk it leaves the disk idle as long as the read took, so the version serving meanwhile is
        not queued behind it. Without MADV_POPULATE_READ (Linux < 5.14) every page is touched instead. Returns the
        bytes prewarmed (0 off Linux or when nothing is mapped).

        Raises:
            KnowledgeBaseError: closed meanwhile (the hot-swap slot logs it and swaps anyway).
        """
        check_positive_int(chunk, "prewarm chunk (bytes)")
        check_number(pause, "prewarm pause (seconds)", low=0)
        if not _LINUX:
            return 0
        with self._lifetime.hold():  # keeps the mappings alive while we read them; raises if closed
            regions = [(start, end) for _, start, end in self.own_mappings()]
            return populate(regions, int(chunk), float(pause)) if regions else 0
