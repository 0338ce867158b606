"""What the third adversarial probe found on `rag serve` (issue 46), each class held by a test: lone surrogates in any
text field of any request form, bounded units of work, long prompts scored in windows, route names in 404s, the
closed-book option, options checked before a stream starts, stalled bodies, one secret for two roles, auth first."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import serving

from rag.serve.app import ServeLimits, create_app

QUESTION = "what is the atomic number of iron?"
BAD = "who \udc00 discovered"  # a lone surrogate: json.dumps writes it as the escape \udc00


@pytest.fixture(scope="module")
def causal_server(serve_layout, tiny_gpt2_dir):
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=4, query_length=8, max_length=96,
                    doc_max_length=24)
    with serving(pipe, limits=ServeLimits(request_timeout=None)) as served:
        yield served


def _post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode("ascii")  # ascii: surrogates as escapes
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=120, **kw)


# ---------------------------------------------------------------------------- 1. lone surrogates, every text field

def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, **kw}


SURROGATE_BODIES = [
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": BAD}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": BAD}]}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                                          {"type": "text", "text": BAD}]}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": BAD, "text": "ok"}]}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "system", "content": [{"type": "text", "text": BAD}]},
                                             {"role": "user", "content": QUESTION}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": QUESTION, "name": BAD}])),
    ("/v1/chat/completions", _chat(user=BAD)),
    ("/v1/chat/completions", _chat(metadata={BAD: "x"})),
    ("/v1/chat/completions", _chat(rag={"marginalization": BAD})),
    ("/v1/completions", {"model": "tiny", "prompt": [QUESTION, BAD], "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 2, "user": BAD}),
]


@pytest.mark.parametrize("path, body", SURROGATE_BODIES)
def test_a_lone_surrogate_in_any_text_field_is_the_same_400(rag_server, path, body):
    url, _ = rag_server
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"]
    assert _post(url, "/v1/chat/completions", _chat()).status_code == 200  # the server lives on


@pytest.mark.parametrize("body", [{"questions": [BAD]}, {"questions": [QUESTION], "marginalization": BAD},
                                  {"questions": [QUESTION], BAD: 1}])
def test_a_lone_surrogate_in_a_generate_body_is_422(rag_server, body):
    url, _ = rag_server
    r = _post(url, "/generate", body)
    assert r.status_code == 422, r.text
    assert "lone surrogate" in r.text


# ---------------------------------------------------------------------------- 2. one unit of work is bounded

@pytest.fixture(scope="module")
def causal_rag_dir(tmp_path_factory, serve_layout, tiny_gpt2_dir) -> str:
    """RAG-Sequence over the tiny causal GPT-2 (the shape of the default demo model: a causal reader, thorough
    rescoring), saved and loaded back as `rag serve` loads it."""
    from rag.models.rag.model import RagModel, RagModelConfig

    out = tmp_path_factory.mktemp("causal_rag") / "model"
    RagModel.from_components(None, tiny_gpt2_dir, serve_layout["kbs"]["kb_a"].path,
                             RagModelConfig(n_docs=4, max_context_length=96)).save_pretrained(out)
    return str(out)


def test_every_unit_of_causal_rag_sequence_work_is_at_most_one_bounded_forward(causal_rag_dir):
    """Inside the server's unit hook, each LM forward of a causal RAG-Sequence request is a unit of its own (the one
    question's prompt prefill, prefixes then the rest, is one unit of two), and a rescoring chunk holds at most
    UNIT_ROWS (candidate, passage) rows:
    one unit's work is bounded whatever n_docs x num_beams x max_new_tokens the limits admit. (Before: the whole
    thorough rescoring pass, 32 rows per forward, was one unit.)"""
    import rag
    from rag.generation.search import unit_hook
    from rag.serve.requests import UNIT_ROWS

    pipe = rag.load(causal_rag_dir)
    lm = pipe.model.generator
    forwards: list[list[int]] = [[]]  # rows of each forward, per unit
    handle = lm.register_forward_hook(lambda mod, args, kwargs, out: forwards[-1].append(int(kwargs["input_ids"].shape[0])),
                                      with_kwargs=True)
    try:
        with unit_hook(lambda _generated: forwards.append([]), max_rows=UNIT_ROWS):
            answers = pipe.generate([QUESTION], marginalization="sequence", decoding="thorough", n_docs=4, num_beams=8,
                                    num_return_sequences=8, max_new_tokens=6, min_new_tokens=6)
    finally:
        handle.remove()
    assert answers and all(len(a.text) for a in answers)
    units = [u for u in forwards if u]
    rescoring = 8 * 4 * 4  # up to beams x docs candidates, each scored under every passage
    assert sum(len(u) for u in units) >= rescoring // UNIT_ROWS  # the rescoring pass ran, chunked
    assert max(len(u) for u in units[1:]) == 1 and len(units[0]) <= 2, [len(u) for u in units]
    assert max(max(u) for u in units) <= max(UNIT_ROWS, 8 * 4)  # a chunk, or one beam step over beams x docs rows


# ---------------------------------------------------------------------------- 3. long prompts: a token limit, windows

def test_scoring_reads_a_long_prompt_in_windows_that_are_units_with_the_one_pass_log_probs(serve_layout, tiny_gpt2_dir):
    """Window by window (each continuing the cache of the ones before) gives the one-pass log-probs and top
    alternatives up to float32 rounding of other batch shapes (the REPLUG scorer tests' 2e-5); each window is one forward of at
    most `window` + 1 tokens (its logits bound the memory) and a unit boundary lies between two windows."""
    import rag
    from rag.serve.scoring import score_prompt

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, max_length=96, doc_max_length=24)
    model, tok = pipe.reader.model, pipe.reader.tokenizer
    prompt = " ".join(["oxygen was discovered by Priestley and Scheele in the eighteenth century"] * 6)
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert 100 < n < 250
    one = score_prompt(model, tok, prompt, top=3)
    fed: list[int] = []
    handle = model.register_forward_hook(lambda m, a, kw, out: fed.append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    units: list[int] = []
    try:
        windows = score_prompt(model, tok, prompt, top=3, window=16, unit=lambda: units.append(1))
    finally:
        handle.remove()
    assert len(fed) == -(-n // 16) and max(fed) <= 17 and len(units) == len(fed) - 1
    assert windows["tokens"] == one["tokens"] and windows["text_offset"] == one["text_offset"]
    assert windows["token_logprobs"] == pytest.approx(one["token_logprobs"], abs=2e-5)
    for a, b in zip(windows["top_logprobs"], one["top_logprobs"]):
        assert set(a) == set(b) and [a[k] for k in b] == pytest.approx(list(b.values()), abs=2e-5)


def test_prompt_tokens_of_a_scoring_request_are_limited(serve_layout, tiny_gpt2_dir):
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, max_length=96, doc_max_length=24)
    with serving(pipe, limits=ServeLimits(request_timeout=None, max_prompt_tokens=40)) as (url, _):
        body = {"model": "tiny", "max_tokens": 0, "echo": True, "logprobs": 1}
        ok = _post(url, "/v1/completions", {**body, "prompt": ["the capital of France is Paris"] * 2})
        assert ok.status_code == 200, ok.text
        r = _post(url, "/v1/completions", {**body, "prompt": ["the capital of France is Paris"] * 8})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "--max-prompt-tokens" in err["message"] and err["param"] == "prompt"


# ---------------------------------------------------------------------------- the milder ones

def test_a_404_names_the_route_it_points_to(rag_server):
    url, _ = rag_server
    r = httpx.get(f"{url}/v1/models/other", timeout=60)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "(GET /v1/models)" in message and "<server path>" not in message


def test_generate_takes_the_closed_book_option(rag_server):
    url, _ = rag_server
    r = _post(url, "/generate", {"questions": [QUESTION], "retrieval": False, "max_new_tokens": 3})
    assert r.status_code == 200, r.text
    (answer,) = r.json()["answers"]
    assert answer["passages"] == [] and answer["answered_with"] == "no_retrieval"
    r = _post(url, "/generate", {"questions": [QUESTION], "retrieval": True})
    assert r.status_code == 422 and "retrieval: true is the default" in r.text


@pytest.mark.parametrize("rag_options", [{"n_docs": 13}, {"stride": 4}])
def test_a_streamed_request_the_model_refuses_is_a_4xx_before_the_stream(rag_server, rag_options):
    """n_docs over the knowledge base's 12 passages, a causal-only option for a RAG model: 400 as unstreamed, never
    200 followed by an error event."""
    url, _ = rag_server
    body = _chat(rag=rag_options)
    plain = _post(url, "/v1/chat/completions", body)
    streamed = _post(url, "/v1/chat/completions", {**body, "stream": True})
    assert plain.status_code == 400, plain.text
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["message"] == plain.json()["error"]["message"]
    ok = _post(url, "/v1/chat/completions", {**_chat(), "stream": True})
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")


def test_a_stalled_request_body_gets_408(serve_layout):
    import socket
    from urllib.parse import urlsplit

    import rag

    with serving(rag.load(serve_layout["model"]), body_timeout=0.5) as (url, _):
        u = urlsplit(url)
        with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
            sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100\r\n\r\n{\"questions\": [".encode())  # then nothing more
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert _post(url, "/generate", {"questions": [QUESTION], "max_new_tokens": 2}).status_code == 200


def test_one_secret_for_api_key_and_admin_token_is_refused(serve_layout, capsys, monkeypatch, tmp_path):
    import rag
    from rag.cli import main
    from rag.utils.errors import ConfigError

    secret = "the-same-secret-for-both-roles-0123"
    with pytest.raises(ConfigError, match="same secret"):
        create_app(rag.load(serve_layout["model"]), admin_token=secret, api_key=secret)
    monkeypatch.setenv("RAG_ADMIN_TOKEN", secret)
    monkeypatch.setenv("RAG_API_KEY", secret)
    assert main(["serve", "--model", str(tmp_path / "no-model-here")]) == 2  # refused before loading the model
    err = capsys.readouterr().err
    assert "same secret" in err and "RAG_ADMIN_TOKEN" in err and "no-model-here" not in err


def test_with_an_api_key_authentication_comes_before_validation(serve_layout):
    import rag

    key = "test-api-key-0123456789abcdef"
    with serving(rag.load(serve_layout["model"]), api_key=key) as (url, _):
        for path in ("/generate", "/retrieve", "/v1/chat/completions", "/v1/completions"):
            r = _post(url, path, b'{"questions": [')  # malformed JSON, no key
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert ("error" in r.json()) == path.startswith("/v1/")
            bad = _post(url, path, b'{"questions": [', headers={"authorization": f"Bearer {key}"})
            assert bad.status_code in (400, 422), (path, bad.text)  # with the key: the validation error
        assert httpx.get(f"{url}/", timeout=60).status_code == 200  # the page needs no key


def test_a_request_whose_decoding_step_is_over_the_row_limit_is_refused(serve_layout):
    """passages x beams per decoding step (a step is one unit of work) is admitted up to --max-step-rows; unset options
    count as the model's stored ones (n_docs 3 here)."""
    import rag

    with serving(rag.load(serve_layout["model"]), limits=ServeLimits(request_timeout=None, max_step_rows=12)) as (url, _):
        ok = _post(url, "/generate", {"questions": [QUESTION], "num_beams": 4, "max_new_tokens": 2})  # 3 x 4
        assert ok.status_code == 200, ok.text
        for body in ({"questions": [QUESTION], "num_beams": 5}, {"questions": [QUESTION], "n_docs": 4, "num_beams": 4}):
            r = _post(url, "/generate", body)
            assert r.status_code == 422 and "--max-step-rows" in r.text, r.text
        r = _post(url, "/v1/chat/completions", _chat(n=5))  # n raises num_beams to 5
        assert r.status_code == 400 and "--max-step-rows" in r.json()["error"]["message"], r.text


def test_a_causal_readers_prompt_prefill_is_cut_into_units(causal_rag_dir):
    """Inside the server's unit hook the prefill of n_docs prompts runs UNIT_TOKENS tokens' worth of prompts per forward,
    each forward a unit of its own, with the same answers as one prefill (float32 over other batch shapes: 1e-4 on a
    score). (Before: the n_docs prompts were one forward, one unit, whatever n_docs the limits admitted.)"""
    import rag
    from rag.generation.causal import UNIT_TOKENS
    from rag.generation.search import unit_hook
    from rag.serve.requests import UNIT_ROWS

    pipe = rag.load(causal_rag_dir)
    kw = dict(marginalization="sequence", n_docs=12, num_beams=1, max_new_tokens=2)
    whole = pipe.generate([QUESTION], **kw)
    fed: list[list[tuple[int, int]]] = [[]]  # (rows, columns) fed by each forward, per unit
    handle = pipe.model.generator.register_forward_hook(
        lambda mod, args, kwargs, out: fed[-1].append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        with unit_hook(lambda _generated: fed.append([]), max_rows=UNIT_ROWS):
            cut = pipe.generate([QUESTION], **kw)
    finally:
        handle.remove()
    # max_new_tokens 2: every later forward feeds one column (a step, or a rescoring chunk over the cache)
    prefill = [(i, rows, cols) for i, unit in enumerate(fed) for rows, cols in unit if cols > 1]
    assert len(prefill) >= 2 and len({i for i, _, _ in prefill}) == len(prefill), fed  # several forwards, one unit each
    assert sum(rows for _, rows, _ in prefill) == 12 and all(rows * cols <= UNIT_TOKENS for _, rows, cols in prefill)
    assert [a.text for a in cut] == [a.text for a in whole]
    assert [a.score for a in cut] == pytest.approx([a.score for a in whole], abs=1e-4)
