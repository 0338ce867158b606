"""(N, D) float32 vectors read in bounded row blocks: from an array in memory or from a ``.npy`` file on disk.

Index builds read their vectors through :class:`Vectors` so that a corpus far larger than RAM is trained on a sample
and added block by block. A file is read with ordinary reads into one reusable buffer, never through a memory map, so
the pages read do not count against the build process's resident memory. :func:`create_npy` and :func:`write_rows`
write such a file chunk by chunk; the bytes equal ``np.save`` of the whole array.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from rag.utils.errors import IntegrityError, RagError

__all__ = ["Vectors", "ArrayVectors", "NpyVectors", "create_npy", "write_rows", "npy_layout"]

_SPARSE = 64  # take() reads row by row when it wants fewer than 1/_SPARSE of the rows, else in one sequential pass


class Vectors:
    """Row blocks of an ``(N, D)`` float32 matrix. ``largest_block`` records the most rows one call held at once."""

    shape: tuple[int, int]
    checked_finite = False
    """True when every value is known to be finite (checked already); builders check each block otherwise."""

    def __init__(self) -> None:
        self.largest_block = 0

    def _held(self, rows: int) -> None:
        self.largest_block = max(self.largest_block, int(rows))

    def blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, block (≤rows, D))`` in row order; a block is valid until the next one is yielded."""
        raise NotImplementedError

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows `idx` (sorted, unique int array) as a new ``(len(idx), D)`` array."""
        raise NotImplementedError


class ArrayVectors(Vectors):
    """An array already in memory (blocks are views of it)."""

    def __init__(self, x: np.ndarray, *, checked_finite: bool = False) -> None:
        super().__init__()
        self.x = x
        self.shape = (int(x.shape[0]), int(x.shape[1]))
        self.checked_finite = checked_finite

    def blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        for s in range(0, self.shape[0], rows):
            block = self.x[s:s + rows]
            self._held(block.shape[0])
            yield s, block

    def take(self, idx: np.ndarray) -> np.ndarray:
        self._held(len(idx))
        return np.ascontiguousarray(self.x[idx])


def npy_layout(path: str | os.PathLike) -> tuple[tuple[int, int], int]:
    """``((N, D), data offset)`` of a C-ordered 2-D float32 ``.npy`` file; IntegrityError naming it otherwise."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
            offset = f.tell()
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path}: not a readable .npy file ({e}); rebuild it") from None
    if len(shape) != 2 or fortran or dtype != np.float32:
        raise IntegrityError(f"{path}: holds a {dtype} array of shape {shape}; expected (N, D) float32 in C order")
    return (int(shape[0]), int(shape[1])), offset


class NpyVectors(Vectors):
    """A ``.npy`` file of ``(N, D)`` float32, read block by block into one buffer."""

    def __init__(self, path: str | os.PathLike, *, checked_finite: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self.shape, self.offset = npy_layout(self.path)
        self.checked_finite = checked_finite
        need = self.offset + self.shape[0] * self.shape[1] * 4
        if self.path.stat().st_size < need:
            raise IntegrityError(f"{self.path}: {self.path.stat().st_size} bytes, fewer than its {self.shape} rows need "
                                 f"({need}); rebuild it")

    def blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        n, d = self.shape
        row_bytes = 4 * d
        buf = np.empty((min(rows, max(n, 1)), d), np.float32)
        self._held(buf.shape[0])
        with open(self.path, "rb", buffering=0) as f:
            for s in range(0, n, rows):
                m = min(rows, n - s)
                view = memoryview(buf[:m]).cast("B")
                got, pos = 0, self.offset + s * row_bytes
                while got < m * row_bytes:
                    k = os.preadv(f.fileno(), [view[got:]], pos + got)
                    if not k:
                        raise IntegrityError(f"{self.path}: ends before its {n} rows; rebuild it")
                    got += k
                yield s, buf[:m]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start … stop`` as a new array (one read)."""
        d = self.shape[1]
        self._held(stop - start)
        with open(self.path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), (stop - start) * 4 * d, self.offset + start * 4 * d)
        if len(data) != (stop - start) * 4 * d:
            raise IntegrityError(f"{self.path}: ends before row {stop}; rebuild it")
        return np.frombuffer(data, np.float32).reshape(-1, d).copy()

    def take(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        n, d = self.shape
        out = np.empty((len(idx), d), np.float32)
        self._held(len(idx))
        if len(idx) * _SPARSE < n:
            with open(self.path, "rb", buffering=0) as f:
                for j, r in enumerate(idx.tolist()):
                    data = os.pread(f.fileno(), 4 * d, self.offset + r * 4 * d)
                    if len(data) != 4 * d:
                        raise IntegrityError(f"{self.path}: ends before row {r}; rebuild it")
                    out[j] = np.frombuffer(data, np.float32)
            return out
        j = 0
        for s, block in self.blocks(16_384):
            stop = np.searchsorted(idx, s + block.shape[0], side="left")
            out[j:stop] = block[idx[j:stop] - s]
            j = stop
        return out


def create_npy(path: str | os.PathLike, shape: tuple[int, int]) -> int:
    """Create (or truncate) `path` as a float32 ``.npy`` of `shape` whose rows are zero until written (a sparse file);
    return the byte offset of row 0. The header is the one ``np.save`` writes for such an array."""
    if len(shape) != 2 or min(shape) < 0:
        raise RagError(f"create_npy: shape {shape} is not (N, D)")
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(int(s) for s in shape))
    offset = int(mm.offset)
    del mm  # nothing was touched: no page of the file is resident
    return offset


def write_rows(fd: int, offset: int, start: int, block: np.ndarray) -> None:
    """Write `block` ``(M, D)`` float32 as rows ``start … start+M`` of the ``.npy`` whose data begins at `offset`."""
    data = memoryview(np.ascontiguousarray(block, dtype=np.float32)).cast("B")
    pos, done = offset + start * block.shape[1] * 4, 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)
