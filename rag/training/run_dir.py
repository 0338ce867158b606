"""A training run's folder: every output path of a ``rag fit|validate|test|predict`` config follows
``trainer.default_root_dir``, and two runs never share that folder.

Output paths in a config name the run's folder as ``{default_root_dir}`` (``save_dir: "{default_root_dir}"``,
``dirpath: "{default_root_dir}/checkpoints"``, ``export_dir: "{default_root_dir}/model"``): :func:`expand_run_dir`
replaces it with the value in force, so ``--trainer.default_root_dir runs/exp2`` moves the logs, checkpoints and
exported model together. :func:`hold_run_dir` takes an exclusive lock on the folder for the run (released when the
process ends): a second run started with the same folder, while the first runs, is refused before anything is built,
instead of both writing ``logs/version_0`` and ``last.ckpt`` in one place.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from rag.utils.errors import ConfigError

__all__ = ["RUN_DIR", "LOCK_FILE", "expand_run_dir", "hold_run_dir", "release_run_dirs", "is_launched_rank"]

RUN_DIR = "{default_root_dir}"
"""The placeholder for ``trainer.default_root_dir`` in a config's output paths."""
LOCK_FILE = ".rag-run.lock"

_held: dict[str, int] = {}  # resolved folder -> descriptor of its locked lock file, held by this process


def expand_run_dir(value: Any, root: str) -> Any:
    """`value` (a config: jsonargparse Namespaces, dicts, lists, strings) with every ``{default_root_dir}`` in its strings
    replaced by `root`, in place where it is mutable; returns the expanded value."""
    if isinstance(value, str):
        return value.replace(RUN_DIR, root)
    if isinstance(value, list):
        for i, v in enumerate(value):
            value[i] = expand_run_dir(v, root)
        return value
    if isinstance(value, dict):
        for k in list(value):
            value[k] = expand_run_dir(value[k], root)
        return value
    if hasattr(value, "__dict__") and type(value).__name__ == "Namespace":  # jsonargparse / argparse namespaces
        for k, v in list(vars(value).items()):
            setattr(value, k, expand_run_dir(v, root))
        return value
    return value


def is_launched_rank() -> bool:
    """True in a process that a distributed launcher started for a rank other than the first (Lightning's DDP
    subprocess launcher, torchrun, SLURM): the run's folder is locked by the first rank's process."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return True
    return os.environ.get("NODE_RANK", "0") not in ("", "0")


def hold_run_dir(root: str | os.PathLike, command: str) -> None:
    """Lock the run folder `root` for this process (created if missing), or ConfigError when another process holds it.

    The lock is ``flock`` on ``root/.rag-run.lock``: the kernel drops it when the process ends, however it ends, so a
    killed run never leaves the folder locked. Ranks after the first (:func:`is_launched_rank`) take none: they belong
    to the run that holds it. Where the file system offers no ``flock``, nothing is locked."""
    if is_launched_rank():
        return
    path = Path(root)
    key = str(path.resolve())
    if key in _held:
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    path.mkdir(parents=True, exist_ok=True)
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        os.close(fd)
        raise ConfigError(f"--trainer.default_root_dir {root}: another run is using this "
                          f"folder{f' ({holder})' if holder else ''}; "
                          "two runs would write the same logs and checkpoints — wait for it to finish, or give this run its "
                          "own folder with --trainer.default_root_dir DIR") from None
    except OSError:  # a file system without flock: run unlocked
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"rag {command}, pid {os.getpid()}".encode(), 0)
    _held[key] = fd


def release_run_dirs() -> None:
    """Release every run folder this process holds (the end of an in-process ``rag fit``; process exit does it too)."""
    while _held:
        _, fd = _held.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the descriptor drops the flock
