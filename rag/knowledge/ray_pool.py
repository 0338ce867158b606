"""A pool of Ray actors serving search over one knowledge base (the transformers RAG design, with its faults handled).

Each actor opens the knowledge base itself (memory-mapped: actors on one node share its pages) and answers
``search(query_embeds, k)``. Queries go round-robin over the actors. An actor that dies is restarted by Ray
(``max_restarts``; it reopens the knowledge base); a query whose actor died or timed out is retried once on the
next actor, then fails with a :class:`~rag.utils.errors.RetrievalError` naming the actor and the cause. A cluster that
cannot be reached fails at construction with an error naming the address. Needs ``pip install -e ".[ray]"``.

    pool = RayRetrievalPool("kbs/wiki", n_actors=4)                 # a local Ray, or address="head:6379"
    scores, rows = pool.search(query_embeddings, k=5)             # (B, k) float32, (B, k) int64, as KnowledgeBase.search
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from typing import Any, Optional

import numpy as np

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.utils.errors import ConfigError, RetrievalError
from rag.utils.validate import check_positive_int

__all__ = ["RayRetrievalPool", "SearchActor", "connect", "check_reachable"]


class SearchActor:
    """What one Ray actor runs: an opened knowledge base and its search."""

    def __init__(self, path: str, verify: str) -> None:
        self.kb = KnowledgeBase.open(path, verify=verify)

    def version(self) -> str:
        return self.kb.version

    def pid(self) -> int:
        return os.getpid()

    def search(self, query_embeds: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.kb.search(query_embeds, k)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("RayRetrievalPool needs Ray: pip install -e \".[ray]\" (or pip install ray)") from e
    return ray


def check_reachable(address: str, timeout: float, error: type[Exception] = RetrievalError, option: str = "") -> None:
    """`error` unless a ``host:port`` / ``ray://host:port`` address accepts a TCP connection within `timeout`
    (Ray itself would retry for minutes); other forms (``auto``, ``local``) are left to Ray. `option` names the
    setting that gave the address (e.g. ``--ray``) in the message."""
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise error(f"{option + ': ' if option else ''}Ray cluster at {address} is not reachable ({e}); start it "
                    "(`ray start --head`) or pass the address its head node prints, or none for a local Ray") from None


def connect(address: Optional[str], *, timeout: float = 5.0, error: type[Exception] = RetrievalError, option: str = ""):
    """The `ray` module, initialised: joined to the cluster at `address` (checked reachable within `timeout` first, else
    `error` naming it and `option`), or a local Ray when `address` is None; an already initialised Ray is used as is."""
    ray = _import_ray()
    if not ray.is_initialized():
        if address is not None:
            check_reachable(address, timeout, error, option)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise error(f"{option + ': ' if option else ''}cannot connect to the Ray cluster at {address or 'a local Ray'}: "
                        f"{e}") from e
    return ray


class RayRetrievalPool:
    """`n_actors` Ray actors, each serving :meth:`KnowledgeBase.search` over the knowledge base at `path`.

    Args:
        path: knowledge-base directory, readable at the same path on every node that runs an actor.
        n_actors: number of actors.
        address: Ray cluster address (``host:port`` or ``ray://host:port``); None starts or joins a local Ray.
        verify: how each actor checks the knowledge base when it opens it (``full``, ``size``, ``none``).
        max_restarts: restarts Ray grants each actor after it dies.
        timeout: seconds one query may take before it is retried on the next actor.
        num_cpus: CPUs Ray reserves for each actor.
    """

    def __init__(self, path: str | os.PathLike, n_actors: int = 2, *, address: Optional[str] = None, verify: str = "size",
                 max_restarts: int = 3, timeout: float = 60.0, num_cpus: float = 0.5) -> None:
        check_positive_int(n_actors, "n_actors", error=ConfigError)
        self.timeout = float(timeout)
        ray = connect(address, timeout=min(5.0, self.timeout))
        self._ray = ray
        self.path = str(os.path.abspath(path))
        remote = ray.remote(max_restarts=max_restarts, max_task_retries=0, num_cpus=num_cpus)(SearchActor)
        self.actors = [remote.remote(self.path, verify) for _ in range(n_actors)]
        try:
            versions = ray.get([a.version.remote() for a in self.actors], timeout=max(self.timeout, 120.0))
        except Exception as e:  # noqa: BLE001 - RayTaskError wraps the actor's own (e.g. KnowledgeBaseError)
            self.close()
            raise RetrievalError(f"{self.path}: the retrieval actors could not open the knowledge base: {_cause(e)}") from e
        self.version = versions[0]
        self._next = itertools.count()
        self._lock = threading.Lock()

    def search(self, query_embeds: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k search of `(B, D)` query vectors on one actor -> scores `(B, k)`, rows `(B, k)` (as KnowledgeBase.search).

        An actor that died or timed out: retried once on the next actor, then RetrievalError."""
        ray = self._ray
        if hasattr(query_embeds, "detach"):
            query_embeds = query_embeds.detach().to("cpu").float().numpy()
        q = np.ascontiguousarray(query_embeds, dtype=np.float32)
        with self._lock:
            first = next(self._next) % len(self.actors)
        errors = []
        for attempt in range(2):
            i = (first + attempt) % len(self.actors)
            try:
                scores, rows = ray.get(self.actors[i].search.remote(q, k), timeout=self.timeout)
                return scores.copy(), rows.copy()  # the object store's arrays are read-only views
            except ray.exceptions.RayTaskError as e:  # the search itself raised (bad k, wrong dim): not retried
                raise _cause_error(e) from e
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ObjectLostError) as e:
                errors.append(f"actor {i}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise RetrievalError(f"{self.path}: a query failed on two retrieval actors ({'; '.join(errors)}); the Ray cluster "
                             "may be gone or overloaded — check `ray status`, or recreate the pool")

    def actor_pids(self) -> list[int]:
        """Process id of each actor (for diagnosis, and for tests that kill one)."""
        return self._ray.get([a.pid.remote() for a in self.actors], timeout=self.timeout)

    def close(self) -> None:
        """Stop the actors (the Ray cluster itself is left running)."""
        for a in getattr(self, "actors", []):
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []

    def __len__(self) -> int:
        return len(self.actors)


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(e).__name__}: {e}"


def _cause_error(e: BaseException) -> BaseException:
    """The actor's own exception (a RagError keeps its type and message) from a RayTaskError."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else RetrievalError(str(e))
