"""Page-cache control of a process's read-only file mappings: release resident pages (``MADV_DONTNEED``),
prewarm them (``MADV_POPULATE_READ``), and list the mappings of a directory's files (Linux ``/proc/self/maps``).

:class:`~rag.knowledge.knowledge_base.KnowledgeBase` uses these so that a swapped-out version frees without
stalling the threads serving requests, and a new version's pages are resident before its first request.
Everything here only ever saves time: off Linux the callers do nothing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["RELEASE_CHUNK", "PREWARM_CHUNK", "PREWARM_PAUSE", "mapped_addresses", "arrow_addresses", "own_mappings",
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
    import bisect

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
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.mincore.restype = ctypes.c_int
    return libc


def _touch(start: int, n: int, page: int) -> None:
    """Read one byte of every page of [start, start + n) (the fallback without MADV_POPULATE_READ)."""
    import ctypes

    view = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(start))
    int(view[::page].max())


def populate(regions: list[tuple[int, int]], chunk: int, pause: float) -> int:
    """Fault in and map every page of `regions` (page-aligned mappings the caller keeps alive), `chunk`
    bytes per call, pausing after each step (see :meth:`KnowledgeBase.prewarm`); returns the bytes done."""
    import ctypes

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
