"""Running one `rag serve` request within its bounds: a bounded queue, a deadline, stopping on disconnect, fair turns.

:class:`RequestRunner` admits a request (503 when ``max_queue`` are already waiting), runs its work on a thread of its
own, and lets that thread use the model only while it holds a turn (:class:`~rag.serve.scheduler.ModelTurns`,
``max_concurrency`` of them). The work is cut into bounded units: :func:`generate_one_version` goes question by
question, and inside a question every decoding step and rescoring chunk is a unit
(:func:`rag.generation.search.unit_boundary`). At each boundary the thread calls :meth:`RequestWork.unit`, which

* stops the work once its deadline has passed (504) or its client has disconnected, so a stopped request frees the
  model within one unit, and
* offers the turn to a request that has used the model less (a cheap request overtakes a heavy one between two of
  the heavy one's units).

A request still waiting for its first turn leaves the wait at once when it is stopped.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Awaitable, Callable, Optional

from rag.generation.search import unit_hook
from rag.serve.limits import ServeLimits
from rag.serve.scheduler import ModelTurns
from rag.utils.errors import RagError

__all__ = ["RequestRefused", "RequestWork", "RequestCounters", "RequestRunner", "generate_one_version", "UNIT_ROWS",
           "step_rows"]


class RequestRefused(RagError):
    """A request the server will not (finish to) answer: `status` and `headers` of the response, and the request
    field at fault (`param`, reported by the OpenAI-compatible routes)."""

    def __init__(self, message: str, status: int, headers: Optional[dict] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.param = param


class _Stopped(Exception):
    """Raised on the model thread at a check once a request's work is to stop."""


_admitted = itertools.count()


class RequestWork:
    """One admitted request's stop flag and deadline, shared by the event loop and its model thread; ``seq`` and
    ``served`` (model seconds used) rank it for the next turn (:class:`~rag.serve.scheduler.ModelTurns`)."""

    def __init__(self, timeout: Optional[float] = None, turns: Optional[ModelTurns] = None):
        self._stop = threading.Event()
        self.reason: Optional[str] = None  # "timeout" or "disconnect"
        self.started = False
        self.seq = next(_admitted)
        self.served = 0.0
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.turns = turns

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._stop.set()
        if self.turns is not None:
            self.turns.wake()  # a request waiting for a turn leaves the wait now

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def check(self) -> None:
        """Raises once the work is to stop: told to (disconnect, timeout), or past its deadline."""
        if not self._stop.is_set() and self.deadline is not None and time.monotonic() >= self.deadline:
            self.stop("timeout")
        if self._stop.is_set():
            raise _Stopped(self.reason)

    def wait_timeout(self) -> Optional[float]:
        """How long a wait for a turn may block before re-checking the deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic()) + 0.001

    def unit(self, _generated=None) -> None:
        """A boundary between two units of model work (the model thread calls it; also a
        :func:`~rag.generation.search.unit_hook`): stop here if the work is to stop, else let a request that has used
        the model less go first."""
        self.check()
        if self.turns is not None:
            self.turns.between_units(self, self.wait_timeout())


class RequestCounters:
    """Request counts for ``/health`` (updated from the event loop and the model threads)."""

    def __init__(self, turns: ModelTurns):
        self._lock = threading.Lock()
        self.turns = turns
        self.pending = 0  # admitted and not finished: holding a turn + waiting for one
        self.works: set = set()
        self.rejected = self.timed_out = self.disconnected = self.restarted = 0

    def admit(self, capacity: int, work: RequestWork) -> bool:
        """Count `work` in, unless `capacity` requests are already running or queued."""
        with self._lock:
            if self.pending >= capacity:
                self.rejected += 1
                return False
            self.pending += 1
            self.works.add(work)
            return True

    def done(self, work: RequestWork) -> None:
        with self._lock:
            self.pending -= 1
            self.works.discard(work)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict:
        running = self.turns.holding
        with self._lock:
            return {"running": running, "queued": self.pending - running,
                    "stopping": sum(1 for w in self.works if w.stopping), "rejected_busy": self.rejected,
                    "timed_out": self.timed_out, "disconnected": self.disconnected, "restarted_after_swap": self.restarted,
                    "handovers": self.turns.handovers, "longest_unit_seconds": round(self.turns.longest_unit, 3)}


UNIT_ROWS = 16
"""Rows per chunk of a rescoring pass while serving (each chunk is a unit of work; outside the server: 64, or as memory
allows): small enough that one chunk of the heaviest request the default limits admit takes about as long as one of
its decoding steps, so a cheap request never waits long for a unit to end."""

def step_rows(pipeline, options: dict) -> int:
    """Rows one decoding step of a generation with `options` runs on `pipeline`'s model: passages x beams (RAG: n_docs
    x num_beams; a causal reader: ensemble x num_beams; closed-book: num_beams); unset options count as stored."""
    return pipeline.reader.step_rows(options)


MAX_RESTARTS = 3
"""How often a request starts over because the knowledge base was swapped between its questions."""


def generate_one_version(pipeline, questions: list[str], kw: dict, work: RequestWork, counters: RequestCounters,
                         per_question: Optional[list[dict]] = None) -> list:
    """``pipeline.generate(questions, **kw)``, one question at a time (a unit boundary before each: see
    :meth:`RequestWork.unit`), all answers from one knowledge-base version: a swap between two questions starts them
    over. `per_question`: options added to `kw` for each question (e.g. its own sampling seed)."""
    extra = per_question or [{}] * len(questions)
    for _ in range(MAX_RESTARTS + 1):
        answers, version = [], None
        for q, more in zip(questions, extra):
            work.unit()
            got = pipeline.generate([q], **kw, **more)
            v = got[0].kb_version if got else version
            if version is not None and v != version:
                counters.add("restarted")
                break
            version = v
            answers.extend(got)
        else:
            return answers
    raise RequestRefused(f"the knowledge base was swapped {MAX_RESTARTS + 1} times while this request ran; retry it", 503,
                         {"Retry-After": "1"})


class RequestRunner:
    """Runs requests' model work within `limits`, each on its own thread, at most `max_concurrency` holding the model."""

    def __init__(self, limits: ServeLimits, max_concurrency: int, *, turns: Optional[ModelTurns] = None):
        import anyio

        self.limits = limits
        self.max_concurrency = max_concurrency
        self.turns = turns or ModelTurns(max_concurrency)
        # Every admitted request gets a thread at once (admission bounds them): a queued request waits for a model
        # turn, not for a thread, so that it can overtake a heavy one between two units of the heavy one's work.
        self.capacity = max_concurrency + limits.max_queue
        self.threads = anyio.CapacityLimiter(self.capacity)
        self.counters = RequestCounters(self.turns)

    def check_within(self, name: str, value: Optional[int], what: str, param: Optional[str] = None) -> None:
        """422 when `value` (the request's `what`; field `param`) exceeds the limit `name` of :class:`ServeLimits`."""
        limit = getattr(self.limits, name)
        if value is not None and value > limit:
            raise RequestRefused(f"{what}={value} exceeds this server's limit of {limit} ({name}, set by "
                                 f"`rag serve {ServeLimits.option(name)}`); ask for at most {limit}", 422, param=param)

    def check_generation(self, options: dict, questions: int, rows: Optional[int] = None) -> None:
        """422 naming the limit when generation `options` (the schema's names) for `questions` questions exceed this
        server's limits: every route that generates checks the same ones. `rows`: the rows of one decoding step
        (:func:`step_rows`), checked against ``max_step_rows``."""
        if rows is not None and rows > self.limits.max_step_rows:
            limit = self.limits.max_step_rows
            raise RequestRefused(f"one decoding step would run {rows} rows (passages x beams), over this server's limit of "
                                 f"{limit} (max_step_rows, set by `rag serve --max-step-rows`): ask for fewer passages "
                                 "(n_docs, ensemble) or beams", 422)
        self.check_within("max_batch", questions, "len(questions)")
        self.check_within("max_n_docs", options.get("n_docs"), "n_docs")
        self.check_within("max_n_docs", options.get("ensemble"), "ensemble")
        self.check_within("max_beams", options.get("num_beams"), "num_beams")
        self.check_within("max_beams", options.get("num_return_sequences"), "num_return_sequences")
        self.check_within("max_new_tokens", options.get("max_new_tokens"), "max_new_tokens")

    def admit(self) -> RequestWork:
        """A new request's work, counted in; 503 (``Retry-After``) when ``max_concurrency + max_queue`` are in."""
        limits = self.limits
        work = RequestWork(limits.request_timeout, self.turns)
        if not self.counters.admit(self.capacity, work):
            raise RequestRefused(f"server busy: {self.max_concurrency} running and {limits.max_queue} waiting (--max-queue); "
                                 f"retry after {limits.retry_after} s", 503, {"Retry-After": str(limits.retry_after)})
        return work

    async def run(self, receive: Callable[[], Awaitable[dict]], fn: Callable[[RequestWork], Any],
                  work: Optional[RequestWork] = None) -> Any:
        """``fn(work)`` on a model thread holding a turn, with ``work.unit`` as the decoding unit hook: 503 when the
        queue is full, 504 after the timeout; `work` (default: :meth:`admit`'s) is told to stop when the client
        disconnects (read from `receive`, the ASGI channel whose body was already read) or the time is up."""
        import anyio

        limits, counters, turns = self.limits, self.counters, self.turns
        work = self.admit() if work is None else work
        outcome: dict = {}

        def on_thread():
            work.started = True
            turns.acquire(work, work.wait_timeout())
            try:
                work.check()
                with unit_hook(work.unit, max_rows=UNIT_ROWS):
                    return fn(work)
            finally:
                turns.release(work)

        try:
            async with anyio.create_task_group() as tg:
                async def run():
                    try:
                        outcome["value"] = await anyio.to_thread.run_sync(on_thread, limiter=self.threads)
                    except Exception as e:  # noqa: BLE001 - handed to the caller below
                        outcome["error"] = e
                    tg.cancel_scope.cancel()  # the watchers below are done too

                async def watch_disconnect():
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    counters.add("disconnected")
                    work.stop("disconnect")

                async def deadline():
                    await anyio.sleep(max(0.0, work.deadline - time.monotonic()))
                    work.stop("timeout")

                tg.start_soon(run)
                tg.start_soon(watch_disconnect)
                if work.deadline is not None:
                    tg.start_soon(deadline)
        finally:
            counters.done(work)
        if "value" in outcome:
            return outcome["value"]
        error = outcome.get("error")
        if error is not None and not isinstance(error, _Stopped):
            raise error
        if work.reason == "timeout":
            counters.add("timed_out")
            raise RequestRefused(f"request not finished within {limits.request_timeout:g} s (--request-timeout); "
                                 "ask for fewer questions, passages, beams or tokens", 504)
        raise RequestRefused("client disconnected", 499)  # nobody reads it
