"""Checksums of files: SHA-256 of one file or many (optionally in a low-priority child), and the per-file records
(``{"sha256", "bytes"}``) that knowledge-base manifests and model checkpoints keep and verify on opening.

One routine for the whole package: :func:`file_checksums` writes the records, :func:`verify_files` checks a
directory against them (``verify="full"``: every byte hashed; ``"size"``: presence and sizes; ``"none"``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence

from rag.utils.errors import ConfigError, IntegrityError
from rag.utils.validate import check_number

logger = logging.getLogger(__name__)

__all__ = ["Verify", "sha256_file", "sha256_files", "check_niceness", "confined_path", "file_checksums", "verify_files",
           "uncovered_files"]

Verify = Literal["full", "size", "none"]

_CHUNK = 1 << 20
_HASH_CHUNK = 4 << 20  # bytes per read + hash step; hashlib releases the GIL for buffers > 2 KiB
_HASH_CHILD = Path(__file__).with_name("hash_child.py")  # run as a script in a low-priority child


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()




def check_niceness(value: Any, what: str) -> None:
    """Raise ConfigError unless `value` is None or an integer niceness in [0, 19]."""
    check_number(value, f"{what} (a niceness; None: normal priority)", integer=True, low=0, high=19, allow_none=True,
                 error=ConfigError)


def sha256_files(paths: Sequence[Path], *, nice: Optional[int] = None) -> list[str]:
    """Hex SHA-256 of each file, in order.

    `nice` None hashes in this thread, 4 MiB at a time (reads and hashing release the GIL, so
    other threads keep running). An integer hashes in a child interpreter started at that
    niceness (Unix; 10 gives it roughly a tenth of a core that nice-0 threads want), so that
    verifying a large knowledge base yields the CPU to the threads serving requests and never
    holds their GIL. The child also yields the disk: it reads 1 MiB at a time without
    readahead and, after a read that was not in the page cache (``preadv`` with RWF_NOWAIT
    tells), pauses as long as that read took, so that the page faults of a server reading a
    memory-mapped knowledge base are not queued behind a stream of verification reads. If the child cannot run or fails, the files
    are hashed in this thread.
    """
    check_niceness(nice, "nice")
    paths = [Path(p) for p in paths]
    if nice is not None and paths:
        # Started through nice(1) where available, so that even the interpreter's start-up runs at low priority.
        wrapper = shutil.which("nice")
        prefix = [wrapper, "-n", str(nice)] if wrapper else []
        try:
            proc = subprocess.run(
                [*prefix, sys.executable, "-I", str(_HASH_CHILD), str(nice), str(os.getpid()), *map(os.fspath, paths)],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
            )
            digests = proc.stdout.split()
            if proc.returncode == 0 and len(digests) == len(paths):
                return digests
            logger.warning("hashing subprocess failed (exit %s: %s); hashing in-process", proc.returncode,
                           proc.stderr.strip()[-300:])
        except OSError as e:
            logger.warning("cannot start a hashing subprocess (%s); hashing in-process", e)
    out = []
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    for path in paths:
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        out.append(h.hexdigest())
    return out


def confined_path(root: Path, rel: Any, record: Path) -> Path:
    """``root / rel`` for a relative path `rel` read from the file `record`, refusing any path that leaves `root`
    (absolute, ``..``, or a symbolic link pointing outside): a file's own records never name files elsewhere."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise IntegrityError(f"{record}: file entry {rel!r} is not a relative path; restore {record.name}")
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise IntegrityError(f"{record}: file entry {rel!r} points outside {root}; restore {record.name} (paths must "
                             f"stay inside it)")
    full = root / p
    try:
        inside = full.resolve().is_relative_to(Path(root).resolve())
    except (OSError, RuntimeError):  # a link loop
        inside = False
    if not inside:
        raise IntegrityError(f"{record}: file entry {rel!r} resolves outside {root}; restore {record.name}")
    return full


def file_checksums(root: Path, files: Iterable[Path]) -> dict[str, dict]:
    """``{relative posix path: {"sha256": hex, "bytes": size}}`` of `files` (under directory `root`), in sorted order."""
    out: dict[str, dict] = {}
    for f in sorted(Path(p) for p in files):
        out[f.relative_to(root).as_posix()] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


def uncovered_files(root: Path, files: Any, required: Iterable[str] = (), dirs: Iterable[str] = ()) -> list[str]:
    """What a loader would open under `root` that the checksum records `files` do not cover: each name of
    `required` (relative posix paths, present or not) and every file found under each directory of `dirs`."""
    names = set(files) if isinstance(files, dict) else set()
    wanted = set(required)
    for d in dirs:
        base = Path(root) / d
        if base.is_dir():
            wanted.update(f.relative_to(root).as_posix() for f in base.rglob("*") if f.is_file() or f.is_symlink())
    return sorted(wanted - names)


def verify_files(root: Path, files: Any, verify: Verify, *, record: Path, incomplete: str, fix: str,
                 hash_nice: Optional[int] = None, required: Iterable[str] = (), dirs: Iterable[str] = ()) -> None:
    """Check the files under `root` against their checksum records `files` (as :func:`file_checksums` writes).

    `verify`: ``"full"`` hashes every file (in a child at niceness `hash_nice`, see :func:`sha256_files`),
    ``"size"`` checks presence and sizes, ``"none"`` returns at once. Records must cover what the loader opens:
    every name in `required` and every file under the directories `dirs` (see :func:`uncovered_files`), so that
    a record emptied or trimmed by hand cannot make verification vacuous. Messages name the file and `record`
    (the manifest / config file holding the checksums) and end with `incomplete` (a missing file) or `fix`.

    Raises:
        IntegrityError: no records, a loaded file without a record, a listed file missing, a size or SHA-256 that differs.
        ConfigError: `verify` is not one of the three choices.
    """
    if verify not in ("full", "size", "none"):
        raise ConfigError(f"verify={verify!r}; choose 'full', 'size' or 'none'")
    if verify == "none":
        return
    if not isinstance(files, dict) or not files:
        raise IntegrityError(f"{record}: records no file checksums; {incomplete}")
    missing = uncovered_files(root, files, required, dirs)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise IntegrityError(f"{record}: records no checksum for {missing[:5]}{more}, which would be loaded unverified; {fix}")
    checked = []
    for rel, meta in files.items():
        f = confined_path(root, rel, record)
        if not isinstance(meta, dict):
            raise IntegrityError(f"{record}: the checksum record of {rel!r} is not an object; {fix}")
        if not f.is_file():
            raise IntegrityError(f"{f}: listed in {record} but missing; {incomplete}")
        size = f.stat().st_size
        if size != meta.get("bytes"):
            raise IntegrityError(f"{f}: {size} bytes, {record.name} says {meta.get('bytes')} (truncated or altered); {fix}")
        checked.append((f, meta.get("sha256")))
    if verify == "full":
        for (f, expected), got in zip(checked, sha256_files([f for f, _ in checked], nice=hash_nice)):
            if got != expected:
                raise IntegrityError(f"{f}: SHA-256 does not match {record} (the file was altered or damaged); {fix}")
