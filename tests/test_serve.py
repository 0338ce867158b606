"""rag serve: real HTTP requests against a loopback server (ephemeral port, background thread).

Knowledge bases A and B hold the same passage ids with texts tagged "[A]" / "[B]", so each
response shows which version answered; it must agree with the response's `kb_version`.
"""

from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.serve import background_server, create_app

TOKEN = "s3cret-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTIONS = ["what is the atomic number of iron?", "who discovered oxygen?"]


def _tagged(passages, tag):
    return [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in passages]


@pytest.fixture(scope="module")
def layout(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir, tiny_bart_dir):
    """root/{kb_a, kb_b, kb_corrupt, link_out -> outside/kb_out}, outside/kb_out, and a model on kb_a."""
    from rag.knowledge.encoders import TextEncoder
    from rag.models.rag_model import RagModel

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
    import rag.pipeline

    pipe = rag.pipeline.load(layout["model"])
    app = create_app(pipe, kb_roots=[layout["root"]], admin_token=TOKEN, max_concurrency=2, max_body_bytes=64 * 1024)
    with background_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
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


def test_swap_under_load_drops_no_request(client, layout):
    """Clients hammer /generate and /retrieve while the admin flips A<->B; all requests succeed.

    After each swap the admin waits for n_clients + 1 more completed requests, so at least one
    request started after the swap (both versions are served) — no timing assumptions.
    """
    n_clients, per_client = 4, 8
    versions = layout["versions"]
    failures, seen, swaps = [], [], []
    done = threading.Event()
    progress = threading.Condition()
    url = str(client.base_url)

    def user(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for j in range(per_client):
                try:
                    if (i + j) % 2:
                        v = _check_generate(c.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 3}), versions)
                    else:
                        v = _check_retrieve(c.post("/retrieve", json={"questions": QUESTIONS, "k": 4}), versions)
                except BaseException as e:  # noqa: BLE001 - every failure is reported
                    v = None
                    failures.append(repr(e))
                with progress:
                    seen.append(v)
                    progress.notify_all()

    def settle() -> None:
        with progress:
            start = len(seen)
            progress.wait_for(lambda: done.is_set() or len(seen) >= start + n_clients + 1, timeout=60)

    def admin() -> None:
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as c:
            while not done.is_set():
                for path in ("/admin/swap", "/admin/swap_back"):
                    r = c.post(path, json={"path": "kb_b"} if path == "/admin/swap" else {})
                    if r.status_code != 200:
                        failures.append(f"{path}: {r.status_code} {r.text}")
                        return
                    swaps.append(r.json())
                    settle()

    users = [threading.Thread(target=user, args=(i,)) for i in range(n_clients)]
    a = threading.Thread(target=admin)
    a.start()
    for u in users:
        u.start()
    for u in users:
        u.join(timeout=180)
    done.set()
    with progress:
        progress.notify_all()
    a.join(timeout=60)
    assert not failures, failures
    assert len(seen) == n_clients * per_client
    assert {versions[v] for v in seen} == {"A", "B"}
    assert len(swaps) >= 2 and all(s["commit_seconds"] < s["seconds"] for s in swaps)
    assert [s["kind"] for s in swaps[:2]] == ["swap", "swap_back"]


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
    import rag.pipeline

    app = create_app(rag.pipeline.load(layout["model"]), kb_roots=[layout["root"]], admin_token=None)
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
    r = client.post("/admin/swap", json={"path": str(layout["root"] / "kb_b"), "verify": "size"}, headers=AUTH)
    assert r.status_code == 200 and layout["versions"][r.json()["new_version"]] == "B"
    assert client.post("/admin/swap_back", headers=AUTH, json={"verify": "size"}).status_code == 200


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
        ("/generate", {"questions": ["q"], "temperature": 0.7}, 422),  # unknown field
        ("/generate", {"questions": ["q"] * 65}, 422),
        ("/generate", {"questions": ["q"], "n_docs": 50}, 400),  # more passages than the knowledge base holds
        ("/generate", {"questions": ["   "]}, 400),  # RagError from the pipeline
        ("/retrieve", {"questions": ["q"], "k": 0}, 422),
        ("/retrieve", {"questions": ["q"], "k": True}, 422),
        ("/retrieve", {"questions": ["q"], "k": 13}, 400),
        ("/retrieve", {"questions": None}, 422),
        ("/admin/swap", {"path": 5}, 422),
        ("/admin/swap", {"path": "kb_b", "verify": "none"}, 422),
        ("/admin/swap", {"path": "kb_b", "allow_encoder_change": "yes"}, 422),
        ("/generate", b'{"questions": ["' + b"x" * (70 * 1024) + b'"]}', 413),
    ],
)
def test_malformed_requests_get_4xx_and_server_survives(client, endpoint, content, status):
    kw = {"json": content} if not isinstance(content, bytes) else {"content": content, "headers": {"content-type": "application/json"}}
    if endpoint.startswith("/admin"):
        kw.setdefault("headers", {}).update(AUTH)
    r = client.post(endpoint, **kw)
    assert r.status_code == status, r.text
    assert r.json()["detail"]
    assert client.post("/retrieve", json={"questions": ["q"], "k": 1}).status_code == 200  # still alive


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


def test_chunked_body_over_limit_is_refused(client):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


class _GatedKB:
    """A knowledge base that parks every call inside `get_passages` until released."""

    def __init__(self, kb):
        self._kb = kb
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._kb, name)

    def __len__(self):
        return len(self._kb)

    def get_passages(self, rows):
        self.entered.set()
        if not self.release.wait(timeout=60):
            raise RuntimeError("test gate never released")
        return self._kb.get_passages(rows)


def test_request_parked_in_old_kb_does_not_block_health_or_swap(server, layout):
    client, app = server
    slot = app.state.slot
    real = slot.current
    gated = _GatedKB(real)
    slot.swap(gated)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 3})))
    t.start()
    try:
        assert gated.entered.wait(timeout=60)
        # The event loop and the swap path are free while a model call is parked in the old knowledge base.
        assert client.get("/health").status_code == 200
        r = client.post("/admin/swap", json={"path": "kb_b"}, headers=AUTH)
        assert r.status_code == 200 and layout["versions"][client.get("/health").json()["kb_version"]] == "B"
    finally:
        gated.release.set()
        t.join(timeout=60)
        slot.swap(real)
    assert layout["versions"][_check_generate(out["r"], layout["versions"])] == "A"  # finished on the old version
