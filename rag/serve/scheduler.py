"""Who holds the model next: `rag serve`'s fair hand-over of model turns between requests, at unit boundaries.

A request's model work is cut into bounded units (a retrieval, one question's encoder pass, one decoding step, one
rescoring chunk: :func:`rag.generation.search.unit_boundary`). Between two units the running request offers its turn
back (:meth:`ModelTurns.between_units`); the turn goes to the waiting request that has used the model least, so one
heavy client cannot shut the others out:

* **Least-served first, by levels** (a multi-level feedback queue): a request's level is 0 until it has held the model
  for `quantum` seconds, then grows by one each time its model time doubles (level ``1 + floor(log2(served /
  quantum))``). The lowest level goes first; within a level, the request admitted first. A cheap request (a retrieval,
  one greedy question) stays at level 0-2 and overtakes a heavy one (level 8+ after a few seconds) at the heavy one's
  next unit boundary, so it waits for at most one unit, not for the heavy request. Two heavy requests do not
  alternate step by step (which would delay both): the one admitted first keeps the turn until it moves up a level.
* **Deadlines and disconnects take effect between units**: a waiting request whose work is stopped leaves the wait at
  once; a running one stops at its next unit boundary (:class:`~rag.serve.requests.RequestWork`).

A request at a high level waits while lower-level work keeps arriving; its deadline (``--request-timeout``) bounds
that wait as it bounds everything else.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Optional, Protocol

from rag.utils.errors import ConfigError
from rag.utils.validate import check_number, check_positive_int

__all__ = ["ModelTurns", "Turnholder"]

DEFAULT_QUANTUM = 0.05
"""Seconds of model time a request may use before it leaves level 0 (a retrieval or a short answer stays near it)."""


class Turnholder(Protocol):
    """What :class:`ModelTurns` needs of a request: its admission order, model time, and stop check."""

    seq: int
    served: float

    def check(self) -> None:
        """Raise once the request is to stop (deadline passed, client gone)."""
        ...


class ModelTurns:
    """`slots` turns on the model, handed out least-served level first (see the module docstring). Thread-safe: model
    threads block in :meth:`acquire` / :meth:`between_units`; :meth:`wake` (any thread) makes waiters re-check their
    stop flags."""

    def __init__(self, slots: int, *, quantum: float = DEFAULT_QUANTUM):
        check_positive_int(slots, "slots (max_concurrency)", error=ConfigError)
        if quantum != math.inf:
            check_number(quantum, "the fairness quantum (seconds; math.inf: first come, first served)", low=1e-9,
                         error=ConfigError)
        self.slots, self.quantum = slots, float(quantum)
        self._cond = threading.Condition()
        self._holding: dict[int, float] = {}  # id(request) -> when it took the turn
        self._waiting: dict[int, tuple[int, int]] = {}  # id(request) -> (level, seq)
        self.handovers = 0
        """Times a running request gave its turn to another between two units."""
        self.longest_unit = 0.0
        """Longest time (seconds) one request held a turn without reaching a unit boundary or finishing."""

    # ------------------------------------------------------------------ state
    @property
    def holding(self) -> int:
        """Turns held now."""
        with self._cond:
            return len(self._holding)

    @property
    def waiting(self) -> int:
        """Requests waiting for a turn now."""
        with self._cond:
            return len(self._waiting)

    def level(self, served: float) -> int:
        """0 below one quantum of model time, then one more per doubling (an infinite quantum: always 0)."""
        return 0 if served < self.quantum else 1 + int(math.log2(served / self.quantum))

    def wake(self) -> None:
        """Make every waiter re-check its request (called when a request is told to stop)."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ taking and giving turns
    def acquire(self, who: Turnholder, timeout: Optional[float] = None) -> None:
        """Block until `who` holds a turn: a slot is free and no waiting request ranks before it. Raises what
        ``who.check()`` raises once the request is stopped while it waits. `timeout`: seconds between re-checks."""
        with self._cond:
            self._waiting[id(who)] = (self.level(who.served), who.seq)
            try:
                while True:
                    who.check()
                    free = self.slots - len(self._holding)
                    if free > 0 and self._waiting[id(who)] in sorted(self._waiting.values())[:free]:
                        break
                    self._cond.wait(timeout)
            finally:
                del self._waiting[id(who)]
            now = time.monotonic()
            self._holding[id(who)] = [now, now]  # took the turn at, current unit started at
            self._cond.notify_all()  # the next waiter may take another free slot

    def _end_unit(self, ident: int, now: float) -> float:
        """Close the current unit of `ident` (for :attr:`longest_unit`); returns the model time of this turn so far."""
        took, unit = self._holding[ident]
        self.longest_unit = max(self.longest_unit, now - unit)
        self._holding[ident][1] = now
        return now - took

    def release(self, who: Turnholder) -> None:
        """Give `who`'s turn back for good (its work is done or abandoned); adds its model time to ``who.served``."""
        with self._cond:
            if id(who) in self._holding:
                who.served += self._end_unit(id(who), time.monotonic())
                del self._holding[id(who)]
            self._cond.notify_all()

    def between_units(self, who: Turnholder, timeout: Optional[float] = None) -> None:
        """A unit boundary of `who`'s work: keep the turn unless a waiting request ranks before `who` (lower level, or
        the same level and admitted earlier); then hand it over and wait for the next turn."""
        with self._cond:
            if id(who) not in self._holding:  # cannot happen inside the runner; a turn is needed to go on
                pass
            else:
                mine = (self.level(who.served + self._end_unit(id(who), time.monotonic())), who.seq)
                if not self._waiting or min(self._waiting.values()) >= mine:
                    return
                self.handovers += 1
        self.release(who)
        self.acquire(who, timeout)
