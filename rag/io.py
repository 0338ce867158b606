"""Atomic file and directory writes (checksums of files live in :mod:`rag.checksums`).

Everything `rag` persists (knowledge bases, checkpoints, demo data) goes through
these helpers so that a crash or kill mid-write never leaves a file or directory
that a later `open` would accept.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (after a rename) where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Have `write(tmp)` write a temporary file beside `path` (by name), then fsync it and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same directory and a rename."""
    atomic_write_file(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it into place on success.

    The temporary directory is named ``.<name>.tmp-*`` so that a killed build leaves
    only a hidden, obviously-partial directory (removed on the next build of the same
    target). If `final` exists and `overwrite` is false, FileExistsError is raised
    before any work is done.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"{final} already exists; choose another --out directory or pass overwrite=True (--overwrite)"
        )
    for stale in parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        yield tmp
        if final.exists():
            # Move the old directory aside first so the swap is two renames, never a
            # window in which `final` holds a mix of old and new files.
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=parent))
            os.replace(final, trash / "old")
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
