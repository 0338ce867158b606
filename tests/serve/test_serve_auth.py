"""Issue #28 point 4: an optional API key for the public routes (`Authorization: Bearer`, the OpenAI convention), and
required by default on a non-loopback address unless --no-auth. The non-loopback cases check the server's decision
(refusal or warning) only: nothing is bound to, or sent to, any address but 127.0.0.1."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_support import API_KEY, TOKEN

from rag.serve.app import background_server, check_bind, create_app, serve
from rag.utils.errors import ConfigError


@pytest.fixture(scope="module")
def keyed(serve_layout):
    import rag

    app = create_app(rag.load(serve_layout["model"]), api_key=API_KEY, admin_token=TOKEN, kb_roots=[serve_layout["root"]],
                     model_name="tiny")
    with background_server(app) as url:
        yield url


ROUTES = [("POST", "/generate", {"questions": ["q"], "max_new_tokens": 2}), ("POST", "/retrieve", {"questions": ["q"], "k": 1}),
          ("GET", "/health", None), ("GET", "/v1/models", None),
          ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}),
          ("POST", "/v1/completions", {"model": "tiny", "prompt": "q", "max_tokens": 2})]


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_public_routes_need_the_key(keyed, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"Bearer {TOKEN}"}):
        r = httpx.request(method, f"{keyed}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, r.text)
        assert "API key" in r.text and API_KEY not in r.text
    r = httpx.request(method, f"{keyed}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200, r.text


def test_openai_client_sends_the_key(keyed):
    good = openai.OpenAI(base_url=f"{keyed}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0, timeout=60).models.list()


def test_page_needs_no_key_and_admin_needs_its_token(keyed):
    assert httpx.get(keyed, timeout=30).status_code == 200  # the page holds no data; it asks for the key
    assert httpx.get(f"{keyed}/static/app.js", timeout=30).status_code == 200
    r = httpx.post(f"{keyed}/admin/swap_back", json={}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 403  # the API key is not the admin token


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    assert check_bind(host, api_key=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.5", "example.org", "my-host"])
def test_non_loopback_needs_a_key_or_no_auth(host):
    with pytest.raises(ConfigError, match="--no-auth"):
        check_bind(host, api_key=False)
    assert "API key required" in check_bind(host, api_key=True)
    assert "WITHOUT an API key" in check_bind(host, api_key=False, no_auth=True)


def test_serve_refuses_before_binding(serve_layout):
    """`serve()` itself refuses an unauthenticated app on 0.0.0.0 (ConfigError before uvicorn is started)."""
    import rag

    app = create_app(rag.load(serve_layout["model"]))
    with pytest.raises(ConfigError, match="no API key"):
        serve(app, host="0.0.0.0", port=0)


def test_cli_decides_before_loading_the_model(capsys, monkeypatch, tmp_path):
    """`rag serve --host 0.0.0.0` without a key exits 2 naming the fix; a missing model shows it is decided first."""
    from rag.cli import main

    missing = str(tmp_path / "no-model-here")
    monkeypatch.delenv("RAG_API_KEY", raising=False)
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--no-auth" in err and "RAG_API_KEY" in err and "no-model-here" not in err
    monkeypatch.setenv("RAG_API_KEY", "short")
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    assert "at least 16" in capsys.readouterr().err
    monkeypatch.setenv("RAG_API_KEY", API_KEY)
    assert main(["serve", "--model", missing, "--host", "0.0.0.0", "--no-auth"]) == 2
    assert "drop one of them" in capsys.readouterr().err
    # With a key (or --no-auth) the bind is allowed: the command goes on to load the model (missing here: exit 2).
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "API key required" in err and "no-model-here" in err
    monkeypatch.delenv("RAG_API_KEY")
    assert main(["serve", "--model", missing, "--host", "0.0.0.0", "--no-auth"]) == 2
    err = capsys.readouterr().err
    assert "WITHOUT an API key" in err and "no-model-here" in err
