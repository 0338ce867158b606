"""Issue #28 point 3: work is cut into bounded units (a question, a decoding step, a rescoring chunk); between two units
a cheap request overtakes a heavy one, and a deadline or a disconnect takes effect. Deterministic: requests are parked
inside retrieval by a gate, and the order in which they reach the knowledge base (which thread) is what is checked,
never how long anything took. benchmarks/serve_fairness.py measures the latencies."""

from __future__ import annotations

import threading

import httpx
import pytest
from serve_support import GatedKB, until

from rag.serve.app import ServeLimits, background_server, create_app
from rag.serve.scheduler import ModelTurns
from rag.utils.errors import ConfigError


def _post(url: str, path: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run():
        out[key] = httpx.post(f"{url}{path}", json=body, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture()
def gated(serve_layout):
    """``start(**create_app_kw) -> (url, app, gate)``: a server of its own over the tiny RAG model, one model slot,
    its knowledge base behind a :class:`~serve_support.GatedKB` (parking its first read)."""
    import contextlib

    import rag

    with contextlib.ExitStack() as stack:
        def start(**kw):
            app = create_app(rag.load(serve_layout["model"]), max_concurrency=1, **kw)
            gate = GatedKB(app.state.slot.current, parks=lambda n: n == 1)
            app.state.slot.swap(gate)
            url = stack.enter_context(background_server(app))
            stack.callback(gate.release.set)  # runs before the server stops: no request stays parked
            return url, app, gate

        yield start


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()["requests"]


def test_cheap_request_overtakes_a_heavy_one_between_its_units(gated):
    url, app, gate = gated(limits=ServeLimits(request_timeout=None), fairness_quantum=1e-6)
    out: dict = {}
    heavy = _post(url, "/generate", {"questions": ["what is the atomic number of iron?", "who discovered oxygen?"],
                                     "max_new_tokens": 8, "min_new_tokens": 8}, out, "heavy")
    assert gate.parked.wait(timeout=120)  # the heavy request holds the one slot, inside its first question
    cheap = _post(url, "/retrieve", {"questions": ["which element has the symbol W?"], "k": 1}, out, "cheap")
    until(lambda: _health(url)["queued"] == 1, "the cheap request to wait for the slot")
    gate.release.set()
    for t in (heavy, cheap):
        t.join(timeout=120)
    assert out["heavy"].status_code == 200 and out["cheap"].status_code == 200
    h, c = gate.readers[0], gate.readers[1]
    # heavy question 1, then the cheap retrieval (at the heavy one's next unit boundary), then heavy question 2
    assert h != c and gate.readers == [h, c, h]
    assert _health(url)["handovers"] >= 1


def test_first_come_first_served_without_fairness(gated):
    """The control: with an infinite quantum every request stays at level 0 and the one admitted first keeps the model."""
    url, app, gate = gated(limits=ServeLimits(request_timeout=None), fairness_quantum=float("inf"))
    out: dict = {}
    heavy = _post(url, "/generate", {"questions": ["what is the atomic number of iron?", "who discovered oxygen?"],
                                     "max_new_tokens": 8, "min_new_tokens": 8}, out, "heavy")
    assert gate.parked.wait(timeout=120)
    cheap = _post(url, "/retrieve", {"questions": ["which element has the symbol W?"], "k": 1}, out, "cheap")
    until(lambda: _health(url)["queued"] == 1, "the cheap request to wait for the slot")
    gate.release.set()
    for t in (heavy, cheap):
        t.join(timeout=120)
    h = gate.readers[0]
    assert gate.readers[:2] == [h, h] and gate.readers[2] != h and _health(url)["handovers"] == 0


def test_a_deadline_stops_the_work_within_a_question(gated):
    """A one-question request parked past its deadline gets 504 and, once released, decodes no step (it stopped at the
    first step boundary; stopping only between questions, it decoded all 16)."""
    url, app, gate = gated(limits=ServeLimits(request_timeout=0.5))
    steps = []
    handle = app.state.pipeline.model.generator.lm_head.register_forward_hook(lambda *a: steps.append(1))
    try:
        out: dict = {}
        t = _post(url, "/generate", {"questions": ["who discovered oxygen?"], "marginalization": "token", "max_new_tokens": 16,
                                     "min_new_tokens": 16}, out, "r")
        assert gate.parked.wait(timeout=120)
        until(lambda: _health(url)["stopping"] == 1, "the deadline")
        gate.release.set()
        t.join(timeout=120)
        assert out["r"].status_code == 504 and "--request-timeout" in out["r"].json()["detail"]
        until(lambda: _health(url)["running"] == 0, "the stopped work to leave the model")
        assert steps == []
        r = httpx.post(f"{url}/generate", json={"questions": ["who discovered oxygen?"], "marginalization": "token",
                                                "max_new_tokens": 16, "min_new_tokens": 16}, timeout=120)
        assert r.status_code == 200 and len(steps) >= 16  # the control: an unhurried request decodes every step
    finally:
        handle.remove()


class _Holder:
    def __init__(self, seq: int, served: float = 0.0):
        self.seq, self.served = seq, served

    def check(self) -> None:
        pass


def test_turns_go_to_the_least_served_level_first_and_fifo_within_a_level():
    assert [ModelTurns(1, quantum=0.05).level(s) for s in (0.0, 0.049, 0.05, 0.1, 0.2, 0.8)] == [0, 0, 1, 2, 3, 5]
    turns = ModelTurns(1, quantum=10.0)  # a quantum no wait in this test comes near: levels change only as set below
    first, second = _Holder(1), _Holder(2)
    turns.acquire(first)
    got = threading.Event()
    t = threading.Thread(target=lambda: (turns.acquire(second), got.set()))
    t.start()
    until(lambda: turns.waiting == 1, "the second request to wait")
    turns.between_units(first)  # same level, admitted first: keeps the turn
    assert not got.is_set() and turns.handovers == 0
    first.served = 100.0  # now far above the waiting request's level: it hands over at its next boundary
    order = []
    back = threading.Thread(target=lambda: (turns.between_units(first), order.append("first again")))
    back.start()
    assert got.wait(timeout=30)
    order.append("second")
    turns.release(second)
    back.join(timeout=30)
    t.join(timeout=30)
    assert order == ["second", "first again"] and turns.handovers == 1 and turns.holding == 1
    turns.release(first)
    assert turns.holding == 0
    with pytest.raises(ConfigError, match="quantum"):
        ModelTurns(1, quantum=0)


def test_serving_cuts_rescoring_into_small_chunks_with_the_same_answers(serve_layout):
    """RAG-Sequence's thorough rescoring pass runs `max_rows` rows per chunk inside a unit hook (the server asks for
    UNIT_ROWS): more, shorter units, the same answers and scores (float32 passes of other batch shapes: ~1e-5)."""
    import rag
    from rag.generation.search import unit_hook

    pipe = rag.load(serve_layout["model"])
    kw = dict(marginalization="sequence", decoding="thorough", n_docs=3, num_beams=4, num_return_sequences=4, max_new_tokens=6)
    counts = {}
    answers = {}
    for rows in (None, 2):
        seen = []
        with unit_hook(seen.append, max_rows=rows):
            answers[rows] = pipe.generate(["what is the atomic number of iron?"], **kw)
        counts[rows] = len(seen)
    assert counts[2] > counts[None]
    assert [a.text for a in answers[2]] == [a.text for a in answers[None]]
    assert [a.score for a in answers[2]] == pytest.approx([a.score for a in answers[None]], abs=1e-4)
