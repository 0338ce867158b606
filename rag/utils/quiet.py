"""What `rag` shows on stderr: its own progress and warnings, not those of the libraries it calls (unless -v).

:func:`quiet_libraries` is the one place that hides third-party output. Within it

- a tqdm bar is drawn only when code of an allowed package (:data:`SHOWN_OWNERS`: ``rag``, the training loop's
  ``lightning``, a user's ``__main__``) created it: transformers' "Loading weights", datasets' "Saving the dataset",
  bm25s' stages and the GGUF de-quantization bar are created disabled, whichever library draws them;
- log records of other packages reach the console handlers only at ERROR and above, and transformers, datasets and
  huggingface_hub, if first imported inside the block, start at verbosity ``error``;

:func:`one_line_warnings` shows a warning of rag's own as one line ``<prefix>: <Category>: <message>`` and hides the
warnings other packages issue (e.g. a library's FutureWarning about another library's call). :func:`quiet` is both, as
every `rag` command runs (``rag.quiet()`` for a script of the Python API). :func:`stage` prints one line per long step
of a command, with the seconds it took.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional, TextIO

__all__ = ["SHOWN_OWNERS", "quiet", "quiet_libraries", "one_line_warnings", "is_own_warning", "stage"]

SHOWN_OWNERS = ("rag", "lightning", "pytorch_lightning", "__main__")
"""Top-level packages whose own tqdm bars and log records stay visible inside :func:`quiet_libraries`: rag, the
training loop (its progress bar, model summary and checkpoint notes) and a user's script."""

_VERBOSITY_ENV = {"transformers": "TRANSFORMERS_VERBOSITY", "datasets": "DATASETS_VERBOSITY",
                  "huggingface_hub": "HF_HUB_VERBOSITY"}
"""The libraries that read their verbosity from the environment when first imported (and keep their own handler)."""
_RAG_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def _bar_owner(frame) -> str:
    """The module that asked for a bar: the first frame outside tqdm and outside a bar class's own ``__init__``/``__new__``
    (huggingface_hub's and transformers' tqdm subclasses and factories count as their library)."""
    import tqdm.std

    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if _package(module) != "tqdm":
            own = frame.f_locals.get("self",
                                     frame.f_locals.get("cls")) if frame.f_code.co_name in ("__init__", "__new__") else None
            if not (isinstance(own, tqdm.std.tqdm) or (isinstance(own, type) and issubclass(own, tqdm.std.tqdm))):
                return module
        frame = frame.f_back
    return ""


@contextlib.contextmanager
def _own_bars_only() -> Iterator[None]:
    import tqdm.std

    real_init = tqdm.std.tqdm.__init__

    def __init__(self, *args, **kwargs):
        if _package(_bar_owner(sys._getframe(1))) not in SHOWN_OWNERS:
            kwargs["disable"] = True
        real_init(self, *args, **kwargs)

    tqdm.std.tqdm.__init__ = __init__
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = real_init


class _OwnRecords(logging.Filter):
    """Passes the records of :data:`SHOWN_OWNERS` and every record at ERROR or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _package(record.name) in SHOWN_OWNERS or record.levelno >= logging.ERROR


def _console_handlers() -> list[logging.Handler]:
    """The stream handlers (not files) on the root logger and on every other package's loggers."""
    loggers = [logging.getLogger()] + [lg for name, lg in list(logging.root.manager.loggerDict.items())
                                       if isinstance(lg, logging.Logger) and _package(name) != "rag"]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def _other_packages_at_error() -> Iterator[None]:
    imported = {m for m in _VERBOSITY_ENV if m in sys.modules}
    env_before = {k: os.environ.get(k) for k in _VERBOSITY_ENV.values()}
    for k in _VERBOSITY_ENV.values():
        os.environ.setdefault(k, "error")
    own = _OwnRecords()
    handlers = _console_handlers()
    for h in handlers:
        h.addFilter(own)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(own)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name, key in _VERBOSITY_ENV.items():  # first imported inside the block: back to the library's default
            if name in sys.modules and name not in imported and env_before[key] is None:
                logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def quiet_libraries(enabled: bool = True) -> Iterator[None]:
    """Within the block, only rag's (and the training loop's) progress bars are drawn and other packages log only
    errors; ``enabled=False`` (``-v``) changes nothing. Restores every setting it changed on exit."""
    if not enabled:
        yield
        return
    with _own_bars_only(), _other_packages_at_error():
        yield


@contextlib.contextmanager
def quiet(prefix: str = "rag", enabled: bool = True) -> Iterator[None]:
    """What a `rag` command shows, for a script of the Python API: within ``with rag.quiet():`` the libraries' bars,
    log records below ERROR and warnings are not shown, and rag's own warnings are one line each, ``<prefix>:
    <Category>: <message>``. ``enabled=False`` changes nothing (a script's ``-v``)."""
    with one_line_warnings(prefix, enabled=enabled), quiet_libraries(enabled):
        yield


def is_own_warning(category: type, filename: str) -> bool:
    """A warning of rag's own: its category is defined in rag, or it is attributed to rag's code (`filename`: issued
    there, or by a library with a ``stacklevel`` that names rag's call)."""
    if _package(getattr(category, "__module__", "")) == "rag":
        return True
    return bool(filename) and str(Path(filename).resolve()).startswith(_RAG_DIR)


@contextlib.contextmanager
def one_line_warnings(prefix: str, enabled: bool = True, stream: Optional[TextIO] = None) -> Iterator[None]:
    """Within the block, each of rag's own warnings is one line ``<prefix>: <Category>: <message>`` on `stream`
    (default stderr) and other packages' warnings are not shown; ``enabled=False`` (``-v``) keeps Python's display."""
    with warnings.catch_warnings():
        if enabled:
            def show(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001 - showwarning's signature
                if is_own_warning(category, filename):
                    text = " ".join(str(message).split())
                    print(f"{prefix}: {category.__name__}: {text}", file=stream or sys.stderr)

            warnings.showwarning = show
        yield


@contextlib.contextmanager
def stage(label: str, *, inline: bool = True, stream: Optional[TextIO] = None) -> Iterator[None]:
    """One line on `stream` (default stderr) for a long step: ``<label> ... <seconds> s`` once it is done
    (``... failed`` if it raised). The label is written first, so a slow step shows what it is doing; ``inline=False``
    (``-v``, where libraries write in between) ends that line at once and repeats the label with the seconds."""
    out = stream or sys.stderr
    print(f"{label} ...", end="" if inline else "\n", file=out, flush=True)
    head = " " if inline else f"{label}: "
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(f"{head}failed", file=out, flush=True)
        raise
    print(f"{head}{time.perf_counter() - start:.1f} s", file=out, flush=True)
