"""rag serve: real HTTP requests against a loopback server (ephemeral port, background thread).

Knowledge bases A and B hold the same passage ids with texts tagged "[A]" / "[B]", so each
response shows which version answered; it must agree with the response's `kb_version`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.serve.app import ServeLimits, background_server, create_app
from rag.utils.errors import ConfigError

TOKEN = "s3cret-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTIONS = ["what is the atomic number of iron?", "who discovered oxygen?"]


def _tagged(passages, tag):
    return [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in passages]


@pytest.fixture(scope="module")
def layout(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir, tiny_bart_dir):
    """root/{kb_a, kb_b, kb_corrupt, link_out -> outside/kb_out}, outside/kb_out, and a model on kb_a."""
    from rag.knowledge.encoders import TextEncoder
    from rag.models.rag.model import RagModel

    base = tmp_path_factory.mktemp("serve")
    root, outside = base / "root", base / "outside"
    enc = TextEncoder(tiny_dpr_context_dir)
    ps = demo_passages[:12]
    a = KnowledgeBase.build(_tagged(ps, "A"), enc, root / "kb_a", index="flat", show_progress=False)
    b = KnowledgeBase.build(_tagged(ps, "B"), enc, root / "kb_b", index="flat", show_progress=False)
    KnowledgeBase.build(_tagged(ps, "O"), enc, outside / "kb_out", index="flat", show_progress=False)
    shutil.copytree(root / "kb_b", root / "kb_corrupt")
    emb = root / "kb_corrupt" / "embeddings.npy"
    data = bytearray(emb.read_bytes())
    data[-1] ^= 0x01
    emb.write_bytes(bytes(data))
    os.symlink(outside / "kb_out", root / "link_out")
    model_dir = base / "model"
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, root / "kb_a", n_docs=3).save_pretrained(model_dir)
    return {"root": root, "outside": outside, "model": str(model_dir), "versions": {a.version: "A", b.version: "B"}}


@pytest.fixture(scope="module")
def server(layout):
    import rag.pipeline.api

    pipe = rag.pipeline.api.load(layout["model"])
    # No request timeout here: the tests on this server must not depend on how loaded the machine is.
    app = create_app(pipe, kb_roots=[layout["root"]], admin_token=TOKEN, max_concurrency=2, max_body_bytes=64 * 1024,
                     limits=ServeLimits(request_timeout=None))
    with background_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client, app


@pytest.fixture()
def client(server, layout):
    """The shared server, checked to be serving A before and after each test."""
    client, app = server
    assert layout["versions"][client.get("/health").json()["kb_version"]] == "A"
    yield client
    assert layout["versions"][client.get("/health").json()["kb_version"]] == "A"


def _check_generate(resp, versions) -> str:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    v = body["kb_version"]
    for a in body["answers"]:
        assert a["kb_version"] == v
        assert {p["text"][1] for p in a["passages"]} == {versions[v]}
    return v


def _check_retrieve(resp, versions) -> str:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    v = body["kb_version"]
    assert {p["text"][1] for ps in body["results"] for p in ps} == {versions[v]}
    return v


# ---------------------------------------------------------------------------- serving


def test_health_generate_retrieve(client, layout):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["kb_passages"] == 12
    r = client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 4, "num_beams": 2, "num_return_sequences": 2})
    _check_generate(r, layout["versions"])
    answers = r.json()["answers"]
    assert len(answers) == 4 and all(len(a["passages"]) == 3 and isinstance(a["text"], str) for a in answers)
    assert all(abs(sum(p["prior"] for p in a["passages"]) - 1) < 1e-4 for a in answers)
    r = client.post("/retrieve", json={"questions": QUESTIONS, "k": 5})
    _check_retrieve(r, layout["versions"])
    assert [len(ps) for ps in r.json()["results"]] == [5, 5]
    r = client.post("/generate", json={"questions": QUESTIONS[:1], "marginalization": "token", "max_new_tokens": 3})
    _check_generate(r, layout["versions"])


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait until `predicate()` holds; fail loudly (never silently go on) if it does not within `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(0.005)


def test_swap_under_load_drops_no_request(server, layout):
    """Clients send /generate and /retrieve while the admin flips A<->B four times: no request fails or is
    lost, every response names a version that was serving while it ran, and requests were in flight across
    a swap. No timing assumption: the first requests are parked inside A (a gate in its `get_passages`)
    until the first swap has committed, and each client sends at most `per_epoch` requests between two swaps,
    the admin swapping again only after a request that started after its previous swap has finished."""
    client, app = server
    slot, versions, url = app.state.slot, layout["versions"], str(client.base_url)
    n_clients, per_epoch, n_swaps = 4, 3, 4
    real, depth = slot.current, len(slot.history)
    gated = _GatedKB(real)
    slot.swap(gated)  # still version A; the first requests park inside it
    serving = [real.version]  # serving[i]: the version after the i-th swap through the admin endpoint
    records, failures = [], []  # records: (swaps before sending, swaps after the response, version answered)
    sent = [dict() for _ in range(n_clients)]  # per client: requests sent per epoch (number of swaps before sending)
    progress = threading.Condition()
    done = threading.Event()

    def user(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            for j in range(per_epoch * (n_swaps + 1)):
                with progress:
                    if not progress.wait_for(lambda: done.is_set() or sent[i].get(len(serving) - 1, 0) < per_epoch, timeout=120):
                        failures.append(f"client {i}: the admin never swapped again")
                        return
                    if done.is_set():
                        return
                    before = len(serving) - 1
                    sent[i][before] = sent[i].get(before, 0) + 1
                try:
                    # First requests are /retrieve: one pinned call, so one parked across the first swap must answer A.
                    # (A multi-question /generate straddling a swap starts over on the new version by design.)
                    if j and (i + j) % 2:
                        v = _check_generate(c.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 3}), versions)
                    else:
                        v = _check_retrieve(c.post("/retrieve", json={"questions": QUESTIONS, "k": 4}), versions)
                except BaseException as e:  # noqa: BLE001 - every failure is reported
                    v = None
                    failures.append(repr(e))
                with progress:
                    records.append((before, len(serving) - 1, v))
                    progress.notify_all()

    def settle(epoch: int) -> None:
        with progress:
            if not progress.wait_for(lambda: failures or any(b >= epoch for b, _, _ in records), timeout=120):
                pytest.fail(f"no request started after swap {epoch} finished within 120 s")

    users = [threading.Thread(target=user, args=(i,)) for i in range(n_clients)]
    swaps, parked_at_first_swap = [], None
    try:
        for u in users:
            u.start()
        if not gated.entered.wait(timeout=120):
            pytest.fail("no request reached the knowledge base within 120 s")
        with httpx.Client(base_url=url, timeout=120, headers=AUTH) as admin:
            for n in range(n_swaps):
                path, body = ("/admin/swap", {"path": "kb_b"}) if n % 2 == 0 else ("/admin/swap_back", {})
                r = admin.post(path, json=body)
                assert r.status_code == 200, r.text
                swaps.append(r.json())
                with progress:  # recorded before the gate opens, so a parked request's response sees this swap
                    serving.append(r.json()["new_version"])
                    progress.notify_all()
                if n == 0:
                    parked_at_first_swap = gated.inside  # parked in A since before the commit, still there
                    gated.release.set()
                settle(n + 1)
    finally:
        gated.release.set()
        done.set()
        with progress:
            progress.notify_all()
        for u in users:
            u.join(timeout=120)
        while len(slot.history) > depth:  # back to A with the history this test found
            slot.swap_back()
    assert not failures, failures
    assert not any(u.is_alive() for u in users)
    assert len(records) == sum(sum(d.values()) for d in sent)  # every request sent got its answer
    assert [versions[v] for v in serving] == ["A", "B", "A", "B", "A"]
    assert [s["kind"] for s in swaps] == ["swap", "swap_back"] * 2 and all(s["commit_seconds"] < s["seconds"] for s in swaps)
    # Every answer names a version that served at some point while its request was open.
    for before, after, v in records:
        assert v in serving[before:after + 2], (before, after, versions[v])
    # Requests were in flight across the first swap and finished on the version they started with.
    assert parked_at_first_swap >= 1
    assert any(b == 0 and a >= 1 and versions[v] == "A" for b, a, v in records)
    assert {versions[v] for v in serving[1:]} == {"A", "B"} and {versions[v] for _, _, v in records} == {"A", "B"}


def test_failed_swaps_keep_serving(client, layout):
    before = client.get("/health").json()["kb_version"]
    r = client.post("/admin/swap", json={"path": "kb_corrupt"}, headers=AUTH)
    assert r.status_code == 400 and "SHA-256" in r.json()["detail"] and "still serving" in r.json()["detail"]
    r = client.post("/admin/swap_back", headers=AUTH)
    assert r.status_code == 400 and "no previous" in r.json()["detail"]
    assert client.get("/health").json()["kb_version"] == before
    _check_generate(client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 3}), layout["versions"])


# ---------------------------------------------------------------------------- security


@pytest.mark.parametrize(
    "headers, status",
    [
        ({}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Authorization": "Bearer wrong-token"}, 403),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 403),
    ],
)
def test_unauthorised_admin_requests(client, headers, status):
    for path, body in (("/admin/swap", {"path": "kb_b"}), ("/admin/swap_back", {})):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == status, r.text
        if status == 401:
            assert r.headers.get("www-authenticate") == "Bearer"
    # Authentication comes before body validation: no details about the body leak to strangers.
    assert client.post("/admin/swap", json={"nonsense": 1}, headers=headers).status_code == status


def test_admin_disabled_without_token(layout):
    import rag.pipeline.api

    app = create_app(rag.pipeline.api.load(layout["model"]), kb_roots=[layout["root"]], admin_token=None)
    with background_server(app) as url:
        r = httpx.post(f"{url}/admin/swap", json={"path": "kb_b"}, headers=AUTH, timeout=30)
        assert r.status_code == 403 and "disabled" in r.json()["detail"]


@pytest.mark.parametrize(
    "path, status",
    [
        ("../outside/kb_out", 403),
        ("kb_a/../../outside/kb_out", 403),
        ("link_out", 403),  # a symlink inside the root pointing out of it
        ("link_out/../kb_out", 403),
        ("/etc", 403),
        ("{outside}/kb_out", 403),
        ("{root}/../outside/kb_out", 403),
        ("does_not_exist", 404),
        ("kb_a\x00/../../outside", 400),
        ("", 422),
    ],
)
def test_path_escapes_are_refused(client, layout, path, status):
    path = path.format(root=layout["root"], outside=layout["outside"])
    r = client.post("/admin/swap", json={"path": path}, headers=AUTH)
    assert r.status_code == status, r.text
    assert "detail" in r.json()


def test_absolute_path_inside_root_is_accepted(client, layout):
    r = client.post("/admin/swap", json={"path": str(layout["root"] / "kb_b")}, headers=AUTH)
    assert r.status_code == 200 and layout["versions"][r.json()["new_version"]] == "B"
    assert client.post("/admin/swap_back", headers=AUTH, json={}).status_code == 200


def test_admin_swap_always_verifies_fully(client, layout):
    """A flipped byte passes a size-only check; the admin endpoint refuses to skip hashing, so the corrupt
    knowledge base never serves under its (unmodified) version id."""
    for path, body in (("/admin/swap", {"path": "kb_corrupt", "verify": "size"}), ("/admin/swap_back", {"verify": "size"})):
        r = client.post(path, json=body, headers=AUTH)
        assert r.status_code == 422 and "verify" in r.text
    r = client.post("/admin/swap", json={"path": "kb_corrupt"}, headers=AUTH)
    assert r.status_code == 400 and "SHA-256" in r.json()["detail"]


def test_size_verified_knowledge_base_is_reported_unverified(layout):
    """Opened locally with verify="size" (the opt-in fast path), its answers and retrievals say so."""
    import rag.pipeline.api

    kb = KnowledgeBase.open(layout["root"] / "kb_corrupt", verify="size")  # a flipped byte: sizes still match
    assert kb.verified == "size" and kb.served_version == f"{kb.version}+unverified"
    pipe = rag.pipeline.api.load(layout["model"], knowledge_base=kb)
    [hits] = pipe.retrieve(["who discovered oxygen?"], k=2)
    [ans] = pipe.generate(["who discovered oxygen?"], max_new_tokens=2)
    assert hits.kb_version == ans.kb_version == pipe.kb_version == f"{kb.version}+unverified"
    full = KnowledgeBase.open(layout["root"] / "kb_b")
    assert full.verified == "full" and full.served_version == full.version


# ---------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    "endpoint, content, status",
    [
        ("/generate", b'{"questions": ["a"', 422),  # malformed JSON
        ("/generate", b"not json at all", 422),
        ("/generate", b"", 422),
        ("/generate", b'["a list"]', 422),
        ("/generate", {"questions": "a single string"}, 422),
        ("/generate", {"questions": []}, 422),
        ("/generate", {"questions": [""]}, 422),
        ("/generate", {"questions": [3]}, 422),
        ("/generate", {"questions": ["q"], "n_docs": "3"}, 422),
        ("/generate", {"questions": ["q"], "n_docs": 0}, 422),
        ("/generate", {"questions": ["q"], "num_beams": 1.5}, 422),
        ("/generate", {"questions": ["q"], "num_beams": 10_000}, 422),
        ("/generate", {"questions": ["q"], "num_beams": 1, "num_return_sequences": 2}, 422),
        ("/generate", {"questions": ["q"], "marginalization": "bogus"}, 422),
        ("/generate", {"questions": ["q"], "temperature": 0.7}, 422),  # a sampling option without do_sample
        ("/generate", {"questions": ["q"], "temprature": 0.7}, 422),  # unknown field
        ("/generate", {"questions": ["q"] * 65}, 422),
        ("/generate", {"questions": ["q"], "n_docs": 13}, 400),  # more passages than the knowledge base holds
        ("/generate", {"questions": ["   "]}, 400),  # RagError from the pipeline
        ("/retrieve", {"questions": ["q"], "k": 0}, 422),
        ("/retrieve", {"questions": ["q"], "k": True}, 422),
        ("/retrieve", {"questions": ["q"], "k": 13}, 400),
        ("/retrieve", {"questions": None}, 422),
        ("/admin/swap", {"path": 5}, 422),
        ("/admin/swap", {"path": "kb_b", "verify": "none"}, 422),
        ("/admin/swap", {"path": "kb_b", "allow_encoder_change": "yes"}, 422),
        ("/generate", b'{"questions": ["' + b"x" * (70 * 1024) + b'"]}', 413),
        # Non-finite numbers and lone surrogates: rejected at validation, and the error echo still serialises.
        ("/generate", b'{"questions": ["q"], "length_penalty": NaN}', 422),
        ("/generate", b'{"questions": ["q"], "length_penalty": Infinity}', 422),
        ("/generate", b'{"questions": ["q"], "length_penalty": -Infinity}', 422),
        ("/generate", b'{"questions": ["q"], "length_penalty": 1e400}', 422),
        ("/generate", b'{"questions": ["q"], "n_docs": NaN}', 422),
        ("/generate", b'{"questions": ["\\ud800"]}', 422),
        ("/generate", b'{"questions": ["ok \\udfff ok"], "num_beams": 1}', 422),
        ("/generate", b'{"questions": ["q"], "\\ud800": 1}', 422),
        ("/retrieve", b'{"questions": ["\\ud83d"], "k": NaN}', 422),
        ("/admin/swap", b'{"path": "kb_\\ud800"}', 422),
        ("/generate", b'{"questions": ["q"], "n_docs": 1' + b"0" * 5000 + b'}', 400),  # beyond Python's int-parsing limit
    ],
)
def test_malformed_requests_get_4xx_and_server_survives(client, endpoint, content, status):
    kw = {"json": content} if not isinstance(content, bytes) else {"content": content,
                                                                   "headers": {"content-type": "application/json"}}
    if endpoint.startswith("/admin"):
        kw.setdefault("headers", {}).update(AUTH)
    r = client.post(endpoint, **kw)
    assert r.status_code == status, r.text
    assert r.json()["detail"]
    assert client.post("/retrieve", json={"questions": ["q"], "k": 1}).status_code == 200  # still alive


def test_unauthenticated_errors_name_no_server_path(client, layout):
    kb_dir = os.path.realpath(layout["root"] / "kb_a")
    for endpoint, body in (("/retrieve", {"questions": ["q"], "k": 13}), ("/generate", {"questions": ["q"], "n_docs": 13})):
        r = client.post(endpoint, json=body)
        detail = r.json()["detail"]
        assert r.status_code == 400 and "12 passages" in detail, detail  # the reason is still given ...
        assert kb_dir not in detail and str(layout["root"]) not in detail and not re.search(r"(^|\s)/\w", detail), detail


@pytest.mark.parametrize("token", ["   ", " " * 20, "\t\n", f" {TOKEN}", f"{TOKEN} ", "tøken-with-non-ascii-chars"])
def test_admin_tokens_that_cannot_match_are_refused_at_startup(layout, token, monkeypatch):
    import rag.pipeline.api
    from rag.cli import main

    with pytest.raises(ConfigError, match="printable ASCII"):
        create_app(rag.pipeline.api.load(layout["model"]), admin_token=token)
    monkeypatch.setenv("RAG_TEST_BAD_TOKEN", token)
    assert main(["serve", "--model", layout["model"], "--admin-token-env", "RAG_TEST_BAD_TOKEN", "--port", "0"]) == 2


def test_wrong_method_and_unknown_route(client):
    assert client.get("/generate").status_code == 405
    assert client.get("/nope").status_code == 404


# ---------------------------------------------------------------------------- command line


def test_cli_parses_serve_and_checks_token(monkeypatch, layout):
    from rag.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--model", layout["model"], "--kb-root", "a", "--kb-root", "b", "--port", "0"])
    assert args.kb_root == ["a", "b"] and args.host == "127.0.0.1" and args.admin_token_env == "RAG_ADMIN_TOKEN"
    monkeypatch.setenv("RAG_TEST_SHORT_TOKEN", "short")
    assert main(["serve", "--model", layout["model"], "--admin-token-env", "RAG_TEST_SHORT_TOKEN"]) == 2
    assert main(["serve", "--model", layout["model"], "--port", "70000"]) == 2


def test_cli_limit_options(layout):
    from rag.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--max-n-docs", "3", "--max-beams", "2", "--max-new-tokens", "9",
                                      "--max-batch", "4", "--request-timeout", "2.5", "--max-queue", "0"])
    assert (args.max_n_docs, args.max_beams, args.max_new_tokens, args.max_batch, args.request_timeout, args.max_queue) == (
        3, 2, 9, 4, 2.5, 0)
    d = build_parser().parse_args(["serve"])
    assert (d.max_n_docs, d.max_beams, d.max_new_tokens, d.max_batch, d.request_timeout, d.max_queue) == (
        ServeLimits.max_n_docs, ServeLimits.max_beams, ServeLimits.max_new_tokens, ServeLimits.max_batch,
        ServeLimits.request_timeout, ServeLimits.max_queue)
    for bad in (["--max-beams", "17"], ["--max-n-docs", "0"], ["--max-queue", "-1"], ["--request-timeout", "-1"]):
        assert main(["serve", "--model", layout["model"], "--port", "0", *bad]) == 2, bad


def test_chunked_body_over_limit_is_refused(client):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


class _GatedKB:
    """A knowledge base that parks every call inside `get_passages` until released; counts the calls
    (one per retrieval) and the threads parked now."""

    def __init__(self, kb):
        self._kb = kb
        self.entered = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.calls = self.inside = 0

    def __getattr__(self, name):
        return getattr(self._kb, name)

    def __len__(self):
        return len(self._kb)

    def get_passages(self, rows):
        with self._lock:
            self.calls += 1
            self.inside += 1
        self.entered.set()
        try:
            if not self.release.wait(timeout=120):
                raise RuntimeError("test gate never released")
        finally:
            with self._lock:
                self.inside -= 1
        return self._kb.get_passages(rows)


def test_request_parked_in_old_kb_does_not_block_health_or_swap(server, layout):
    """A one-question request parked in A across a swap finishes on A; a two-question request whose first
    question read A and whose second would read B starts over on B, so its answers share one version."""
    client, app = server
    slot = app.state.slot
    real, depth = slot.current, len(slot.history)
    gated = _GatedKB(real)
    slot.swap(gated)
    outs = {}
    threads = [threading.Thread(target=lambda n=n: outs.update({n: client.post(
        "/generate", json={"questions": QUESTIONS[:n], "max_new_tokens": 3})})) for n in (1, 2)]
    restarts = client.get("/health").json()["requests"]["restarted_after_swap"]
    for t in threads:
        t.start()
    try:
        _wait_for(lambda: gated.inside == 2, "both requests to park in A")
        # The event loop and the swap path are free while model calls are parked in the old knowledge base.
        assert client.get("/health").status_code == 200
        r = client.post("/admin/swap", json={"path": "kb_b"}, headers=AUTH)
        assert r.status_code == 200 and layout["versions"][client.get("/health").json()["kb_version"]] == "B"
    finally:
        gated.release.set()
        for t in threads:
            t.join(timeout=120)
        while len(slot.history) > depth:
            slot.swap_back()
    assert layout["versions"][_check_generate(outs[1], layout["versions"])] == "A"  # finished on the old version
    assert layout["versions"][_check_generate(outs[2], layout["versions"])] == "B"  # one version for all its answers
    assert len(outs[2].json()["answers"]) == 2
    assert client.get("/health").json()["requests"]["restarted_after_swap"] == restarts + 1


# ---------------------------------------------------------------------------- bounded requests


@pytest.fixture()
def own_server(layout):
    """A server of its own over a fresh pipeline (start it with `start(**create_app_kw)`), its knowledge base
    A behind a gate, so that requests park inside retrieval until the test releases them."""
    import contextlib

    import rag.pipeline.api

    with contextlib.ExitStack() as stack:
        def start(**kw):
            app = create_app(rag.pipeline.api.load(layout["model"]), kb_roots=[layout["root"]], admin_token=TOKEN, **kw)
            gated = _GatedKB(app.state.slot.current)
            app.state.slot.swap(gated)
            stack.callback(gated.release.set)  # runs before the server stops (LIFO), so no request stays parked
            url = stack.enter_context(background_server(app))
            client = stack.enter_context(httpx.Client(base_url=url, timeout=120))
            stack.callback(gated.release.set)
            return client, gated
        yield start


def _requests(client) -> dict:
    return client.get("/health").json()["requests"]


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _joined(t: threading.Thread, out: dict):
    t.join(timeout=120)
    assert not t.is_alive(), "the request did not finish within 120 s"
    if "e" in out:
        raise out["e"]
    return out["r"]


def test_operator_limits_refuse_oversized_requests_with_422_naming_the_limit(own_server):
    limits = ServeLimits(max_n_docs=2, max_beams=2, max_new_tokens=4, max_batch=2, request_timeout=None)
    client, gated = own_server(limits=limits)
    gated.release.set()
    cases = [
        ("/generate", {"questions": ["q"], "n_docs": 3}, "--max-n-docs"),
        ("/retrieve", {"questions": ["q"], "k": 3}, "--max-n-docs"),
        ("/generate", {"questions": ["q"], "num_beams": 3}, "--max-beams"),
        ("/generate", {"questions": ["q"], "max_new_tokens": 5}, "--max-new-tokens"),
        ("/generate", {"questions": ["q"] * 3}, "--max-batch"),
        ("/retrieve", {"questions": ["q"] * 3, "k": 1}, "--max-batch"),
    ]
    for endpoint, body, option in cases:
        r = client.post(endpoint, json=body)
        assert r.status_code == 422 and option in r.json()["detail"], (endpoint, body, r.text)
    assert gated.calls == 0  # refused before any work
    r = client.post("/generate", json={"questions": QUESTIONS, "n_docs": 2, "num_beams": 2, "max_new_tokens": 4})
    assert r.status_code == 200 and len(r.json()["answers"]) == 2
    assert client.post("/retrieve", json={"questions": QUESTIONS, "k": 2}).status_code == 200
    with pytest.raises(ConfigError, match="--max-beams"):
        ServeLimits(max_beams=17)  # above what the request schema allows
    with pytest.raises(ConfigError, match="--request-timeout"):
        ServeLimits(request_timeout=float("nan"))


def test_full_queue_answers_503_with_retry_after(own_server):
    client, gated = own_server(max_concurrency=1, limits=ServeLimits(max_queue=1, request_timeout=None, retry_after=3))
    body = {"questions": QUESTIONS[:1], "max_new_tokens": 3}
    t1, o1 = _in_thread(lambda: client.post("/generate", json=body))
    assert gated.entered.wait(timeout=120)  # request 1 runs (parked in retrieval)
    t2, o2 = _in_thread(lambda: client.post("/generate", json=body))
    _wait_for(lambda: _requests(client)["queued"] == 1, "request 2 to be queued")
    r = client.post("/retrieve", json={"questions": ["q"], "k": 1})  # a third: no room
    assert r.status_code == 503 and r.headers["retry-after"] == "3" and "--max-queue" in r.json()["detail"]
    assert client.get("/health").status_code == 200  # the server itself stays responsive
    gated.release.set()
    assert _joined(t1, o1).status_code == 200 and _joined(t2, o2).status_code == 200
    assert gated.calls == 2 and _requests(client)["rejected_busy"] == 1
    assert client.post("/retrieve", json={"questions": ["q"], "k": 1}).status_code == 200  # room again


def test_request_timeout_answers_504_and_stops_the_work(own_server):
    """A request parked past its timeout gets 504 and generates no further question; one still queued at its
    deadline leaves the queue at once (504 while the first is still parked)."""
    client, gated = own_server(max_concurrency=1, limits=ServeLimits(request_timeout=0.5))
    t1, o1 = _in_thread(lambda: client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 3}))
    assert gated.entered.wait(timeout=120)
    r2 = client.post("/retrieve", json={"questions": ["q"], "k": 1})  # queued behind it, times out there
    assert r2.status_code == 504 and "--request-timeout" in r2.json()["detail"]
    _wait_for(lambda: _requests(client)["stopping"] == 1, "the parked request's deadline")
    assert gated.calls == 1 and gated.inside == 1  # the first request is still parked in its first question
    gated.release.set()
    r1 = _joined(t1, o1)
    assert r1.status_code == 504 and "--request-timeout" in r1.json()["detail"]
    _wait_for(lambda: _requests(client)["running"] == 0, "the stopped request to leave the model thread")
    assert gated.calls == 1  # the second question was never started
    assert _requests(client)["timed_out"] == 2


def _raw_post(base_url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so that the test decides when the client goes away)."""
    u = urlsplit(base_url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_disconnect_stops_the_work(own_server):
    client, gated = own_server(limits=ServeLimits(request_timeout=None))
    questions = QUESTIONS + ["which element has the symbol W?"]
    sock = _raw_post(str(client.base_url), "/generate", {"questions": questions, "max_new_tokens": 3})
    assert gated.entered.wait(timeout=120)  # parked in the first of three questions
    sock.close()
    _wait_for(lambda: _requests(client)["disconnected"] == 1, "the server to notice the disconnect")
    assert _requests(client)["stopping"] == 1
    gated.release.set()
    _wait_for(lambda: _requests(client)["running"] == 0, "the request to stop")
    assert gated.calls == 1  # questions 2 and 3 were never generated
    # A request that stays connected does all its questions.
    r = client.post("/generate", json={"questions": questions, "max_new_tokens": 3})
    assert r.status_code == 200 and len(r.json()["answers"]) == 3 and gated.calls == 4
