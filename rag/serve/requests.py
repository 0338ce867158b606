"""Running one `rag serve` request within its bounds: a bounded queue, a deadline, stopping on disconnect.

:class:`RequestRunner` admits a request (503 when ``max_queue`` are already waiting), runs its work
on a model thread behind the capacity limiter, and stops it when its deadline passes (504) or its
client disconnects. Work is stopped cooperatively: the model thread calls :meth:`RequestWork.check`
between units of work (:func:`generate_one_version`: between questions), so a question already
being decoded finishes first; a request still queued leaves the queue at once.
"""

from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable, Optional

from rag.serve.limits import ServeLimits
from rag.utils.errors import RagError

__all__ = ["RequestRefused", "RequestWork", "RequestCounters", "RequestRunner", "generate_one_version"]


class RequestRefused(RagError):
    """A request the server will not (finish to) answer: `status` and `headers` of the response."""

    def __init__(self, message: str, status: int, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


class _Stopped(Exception):
    """Raised on the model thread at a check once a request's work is to stop."""


class RequestWork:
    """One admitted request's stop flag, shared by the event loop and the model thread."""

    def __init__(self):
        self._stop = threading.Event()
        self.reason: Optional[str] = None  # "timeout" or "disconnect"
        self.started = False

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def check(self) -> None:
        """Called by the model thread between units of work: raises once the work is to stop."""
        if self._stop.is_set():
            raise _Stopped(self.reason)


class RequestCounters:
    """Request counts for ``/health`` (updated from the event loop and the model threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.pending = 0  # admitted and not finished: running + queued
        self.running = 0  # on a model thread now
        self.works: set = set()
        self.rejected = self.timed_out = self.disconnected = self.restarted = 0

    def admit(self, capacity: int) -> bool:
        """Count a new request in, unless `capacity` requests are already running or queued."""
        with self._lock:
            if self.pending >= capacity:
                self.rejected += 1
                return False
            self.pending += 1
            return True

    def started(self, work: RequestWork) -> None:
        with self._lock:
            self.running += 1
            self.works.add(work)

    def finished(self, work: RequestWork) -> None:
        with self._lock:
            self.running -= 1
            self.works.discard(work)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict:
        with self._lock:
            return {"running": self.running, "queued": self.pending - self.running,
                    "stopping": sum(1 for w in self.works if w.stopping), "rejected_busy": self.rejected,
                    "timed_out": self.timed_out, "disconnected": self.disconnected, "restarted_after_swap": self.restarted}


MAX_RESTARTS = 3
"""How often a request starts over because the knowledge base was swapped between its questions."""


def generate_one_version(pipeline, questions: list[str], kw: dict, work: RequestWork, counters: RequestCounters) -> list:
    """``pipeline.generate(questions, **kw)``, one question at a time (checking `work` before each),
    all answers from one knowledge-base version: a swap between two questions starts them over."""
    for _ in range(MAX_RESTARTS + 1):
        answers, version = [], None
        for q in questions:
            work.check()
            got = pipeline.generate([q], **kw)
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
    """Runs requests' model work within `limits` on at most `max_concurrency` threads at once."""

    def __init__(self, limits: ServeLimits, max_concurrency: int):
        import anyio

        self.limits = limits
        self.max_concurrency = max_concurrency
        self.limiter = anyio.CapacityLimiter(max_concurrency)
        self.counters = RequestCounters()

    def check_within(self, name: str, value: Optional[int], what: str) -> None:
        """422 when `value` (the request's `what`) exceeds the limit `name` of :class:`ServeLimits`."""
        limit = getattr(self.limits, name)
        if value is not None and value > limit:
            raise RequestRefused(f"{what}={value} exceeds this server's limit of {limit} ({name}, set by "
                                 f"`rag serve {ServeLimits.option(name)}`); ask for at most {limit}", 422)

    async def run(self, receive: Callable[[], Awaitable[dict]], fn: Callable[[RequestWork], Any]) -> Any:
        """``fn(work)`` on a model thread: 503 when the queue is full, 504 after the timeout; `work`
        is told to stop when the client disconnects (read from `receive`, the ASGI channel whose body
        was already read) or the time is up."""
        import anyio

        limits, counters = self.limits, self.counters
        if not counters.admit(self.max_concurrency + limits.max_queue):
            raise RequestRefused(f"server busy: {self.max_concurrency} running and {limits.max_queue} waiting (--max-queue); "
                                 f"retry after {limits.retry_after} s", 503, {"Retry-After": str(limits.retry_after)})
        work = RequestWork()
        outcome: dict = {}

        def on_thread():
            counters.started(work)
            work.started = True
            try:
                work.check()
                return fn(work)
            finally:
                counters.finished(work)

        try:
            async with anyio.create_task_group() as tg:
                run_scope = anyio.CancelScope()

                def stop(reason: str) -> None:
                    work.stop(reason)
                    if not work.started:  # still queued: leave the queue now (a started thread finishes its question)
                        run_scope.cancel()

                async def run():
                    with run_scope:
                        try:
                            outcome["value"] = await anyio.to_thread.run_sync(on_thread, limiter=self.limiter)
                        except Exception as e:  # noqa: BLE001 - handed to the caller below
                            outcome["error"] = e
                    tg.cancel_scope.cancel()  # the watchers below are done too

                async def watch_disconnect():
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    counters.add("disconnected")
                    stop("disconnect")

                async def deadline():
                    await anyio.sleep(limits.request_timeout)
                    counters.add("timed_out")
                    stop("timeout")

                tg.start_soon(run)
                tg.start_soon(watch_disconnect)
                if limits.request_timeout is not None:
                    tg.start_soon(deadline)
        finally:
            counters.add("pending", -1)
        if "value" in outcome:
            return outcome["value"]
        error = outcome.get("error")
        if error is not None and not isinstance(error, _Stopped):
            raise error
        if work.reason == "timeout":
            raise RequestRefused(f"request not finished within {limits.request_timeout:g} s (--request-timeout); "
                                 "ask for fewer questions, passages, beams or tokens", 504)
        raise RequestRefused("client disconnected", 499)  # nobody reads it
