"""Atomic file and directory writes (checksums of files live in :mod:`rag.utils.checksums`).

Everything `rag` persists (knowledge bases, checkpoints, demo data) goes through
these helpers so that a crash or kill mid-write never leaves a file or directory
that a later `open` would accept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rag.utils.errors import OutputExistsError, RagError


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (after a rename) where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def process_umask() -> int:
    """This process's umask, read without changing it where /proc allows (os.umask can only read by setting)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Have `write(tmp)` write a temporary file beside `path` (by name), then fsync it and rename it into place.

    The file gets the permissions a plain ``open(path, "w")`` would give it: those of the file it replaces, else
    0666 less the umask (tempfile's 0600 would hide knowledge bases and models from the other users of a machine)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:
        mode = 0o666 & ~process_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
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


def json_safe(obj: Any) -> Any:
    """A copy of `obj` that JSON (UTF-8, no NaN) can always carry: non-finite floats (e.g. an impossible answer's -inf
    score) become None, lone surrogates in strings (and keys) become ``\\udXXX`` escapes, tuples lists, and anything else
    its ``str``. Every JSON document rag emits goes through it (:func:`to_json`; the server's responses too)."""
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, str):
        return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {json_safe(str(k)): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a numpy / torch scalar
        return json_safe(obj.item())
    return json_safe(str(obj))


def to_json(obj: Any, **dumps_kw: Any) -> str:
    """`obj` as JSON text that every parser accepts (:func:`json_safe`: never ``NaN``/``Infinity``), non-ASCII kept."""
    return json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False, **dumps_kw)


def check_output_dir(final: str | os.PathLike, overwrite: bool = False, *,
                     replaces: Optional[Callable[[Path], bool]] = None, kind: str = "directory",
                     option: str = "--out") -> Path:
    """Raise OutputExistsError unless `final` may be written by :func:`atomic_directory`; return it as a Path.

    Cheap, so writers call it before their expensive work (encoding a corpus, training) as well.
    A path that does not exist, or an empty directory, may always be written. Anything else needs
    `overwrite`, and even then only a directory that `replaces(final)` recognises as the writer's own
    `kind` (a knowledge base, a checkpoint, a BM25 index ...) is replaced: never a plain file, never
    a directory of something else (an input corpus, a home directory). `replaces=None` recognises
    any directory (for callers whose path is their own by construction). Also raises RagError when
    `final`'s parent cannot be created or written.
    """
    final = Path(final)
    if final.is_symlink() or final.exists():
        if not final.is_dir():
            what = "a broken symbolic link" if not final.exists() else "a file"
            raise OutputExistsError(f"{final} exists and is {what}, not a {kind}; it is never replaced — choose another output "
                                    f"path ({option})")
        if any(final.iterdir()):
            if not overwrite:
                raise OutputExistsError(f"{final} already exists; choose another output path ({option}), or pass --overwrite "
                                        f"(overwrite=True) to replace the {kind} there")
            if replaces is not None and not replaces(final):
                raise OutputExistsError(
                    f"{final} exists and is not a {kind}, so it is not replaced even with --overwrite (overwrite=True), which "
                    f"only ever replaces a {kind}, never other data such as an input corpus; choose another output path "
                    f"({option}), or move that directory away yourself"
                )
    _check_writable_parent(final, option)
    return final


def _check_writable_parent(final: Path, option: str) -> None:
    """RagError unless the nearest existing ancestor of `final` is a directory this process can create directories in."""
    parent = final.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise RagError(f"{final}: {parent} is a file, so no directory can be created under it; choose another output "
                       f"path ({option})")
    try:  # the one reliable test (permissions, read-only mounts, /proc ...): create a directory there, and remove it
        os.rmdir(tempfile.mkdtemp(prefix=f".{final.name}.probe-", dir=parent))
    except OSError as e:
        raise RagError(f"{final}: cannot create a directory in {parent} ({e.strerror}); choose another output "
                       f"path ({option})") from None


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = False, *,
                     replaces: Optional[Callable[[Path], bool]] = None, kind: str = "directory") -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it into place on success.

    The temporary directory is named ``.<name>.tmp-*`` so that a killed build leaves
    only a hidden, obviously-partial directory (removed on the next build of the same
    target). What may be replaced is decided before any work, by :func:`check_output_dir`
    (same arguments): without `overwrite` an existing non-empty `final` raises
    OutputExistsError (a FileExistsError); with it, only a directory that `replaces`
    recognises as the writer's own `kind` is replaced — pass a predicate in every writer.
    """
    if overwrite and replaces is None:
        raise TypeError("atomic_directory(overwrite=True) needs replaces=: a predicate recognising the writer's own kind")
    final = check_output_dir(final, overwrite, replaces=replaces, kind=kind)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{final.name}.tmp-*"):
        if not _held_by_a_live_writer(stale):  # another process building the same target right now keeps its own
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    held = _hold(tmp)
    os.chmod(tmp, 0o777 & ~process_umask())  # as os.mkdir would make it, not mkdtemp's 0700
    try:
        yield tmp
        if final.is_symlink() or final.exists():
            # Checked again: the directory may have appeared, or changed, while the content was written.
            check_output_dir(final, overwrite, replaces=replaces, kind=kind)
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
    finally:
        if held is not None:
            os.close(held)  # drops the flock


def _hold(directory: Path) -> Optional[int]:
    """An open descriptor of `directory` holding an exclusive ``flock`` on it while a writer fills it (the kernel drops
    it when the process ends, however it ends); None where the file system has no ``flock``."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):  # pragma: no cover - not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _held_by_a_live_writer(directory: Path) -> bool:
    """True when another writer's :func:`_hold` is on `directory` (a partial directory of a killed writer is not)."""
    fd = _hold(directory)
    if fd is None:
        return directory.is_dir()  # locked by a live writer (or not lockable: then keep it, it may be in use)
    os.close(fd)
    return False


def cache_dir() -> Path:
    """Where `rag` keeps derived artefacts (demo knowledge base, demo LM, tiny models): `$RAG_CACHE`, else `~/.cache/rag`."""
    return Path(os.environ.get("RAG_CACHE", Path.home() / ".cache" / "rag")).expanduser()
