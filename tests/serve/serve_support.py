"""Constants and helpers shared by the serving tests (a module with a unique name: conftest modules cannot be imported)."""

from __future__ import annotations

import contextlib

from rag.knowledge.passages import Passage
from rag.serve.app import background_server, create_app

TOKEN = "s3cret-admin-token-for-serve-tests"
API_KEY = "test-api-key-0123456789abcdef"
XSS_TEXT = ('<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> '
            '<b onmouseover="window.__xss = 3">bold?</b> the atomic number of iron is 26')
XSS_TITLE = '<img src=x onerror="window.__xss = 4">Iron'


def tagged(passages, tag):
    return [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in passages]


def until(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait until `predicate()` holds; fail loudly (never silently go on) if it does not within `timeout` seconds."""
    import time

    import pytest

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(0.005)


class GatedKB:
    """A knowledge base whose `get_passages` parks the calls `parks(n)` says (n: 1 for the first call) until `release` is
    set; records which thread made each call (`readers`), and `parked` is set once one is parked."""

    def __init__(self, kb, parks):
        import threading

        self._kb, self.parks = kb, parks
        self.readers: list[int] = []
        self.parked = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._kb, name)

    def __len__(self):
        return len(self._kb)

    @property
    def calls(self) -> int:
        return len(self.readers)

    def get_passages(self, rows):
        import threading

        self.readers.append(threading.get_ident())
        if self.parks(len(self.readers)):
            self.parked.set()
            if not self.release.wait(timeout=120):
                raise RuntimeError("test gate never released")
        return self._kb.get_passages(rows)


@contextlib.contextmanager
def serving(pipe, **kw):
    """`pipe` served on 127.0.0.1 (``model_name`` "tiny" unless given): yields ``(url, app)``."""
    kw.setdefault("model_name", "tiny")
    app = create_app(pipe, **kw)
    with background_server(app) as url:
        yield url, app
