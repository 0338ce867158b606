"""The reference-counted lifetime of an opened knowledge base: reads hold it open, :meth:`Lifetime.close` waits for
them to end, then refuses new ones.

A hot swap (:mod:`rag.knowledge.hotswap`) closes the version it replaced while requests may still be reading it: a
request that started on the old version finishes on it, and one that starts after the close is told to read the one
serving now.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

from rag.utils.errors import KnowledgeBaseError

__all__ = ["Lifetime"]


class Lifetime:
    """A count of running reads and a closed flag, under one lock; `name` says what is closed in its error."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._use = threading.Condition(threading.Lock())  # guards _in_use / _closed
        self._in_use = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Reads (and :meth:`hold` blocks) running now."""
        return self._in_use

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep it open for the block (nests); :class:`KnowledgeBaseError` if it is already closed."""
        with self._use:
            if self._closed:
                raise KnowledgeBaseError(f"{self._name} was closed (swapped out and released); read from the one "
                                         "serving now, or open the directory again")
            self._in_use += 1
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def hold_if_open(self) -> Iterator[bool]:
        """Keep it open for the block if it still is: yields False (holding nothing) once closed."""
        with self._use:
            if self._closed:
                held = False
            else:
                held = True
                self._in_use += 1
        try:
            yield held
        finally:
            if held:
                self._release()

    def close(self, timeout: Optional[float] = None) -> Optional[bool]:
        """Wait up to `timeout` seconds (None: forever) until no read runs, then refuse new ones. True: closed now (the
        caller frees); None: it already was; False: reads still ran at the timeout (nothing changed). Never call it
        inside a :meth:`hold` block."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._use:
            while self._in_use:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._use.wait(left)
            if self._closed:
                return None
            self._closed = True  # from here on no read can start, and none is running
            return True

    def _release(self) -> None:
        with self._use:
            self._in_use -= 1
            if self._in_use == 0:
                self._use.notify_all()
