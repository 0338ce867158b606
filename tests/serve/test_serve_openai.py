"""The OpenAI-compatible routes, driven by the official `openai` client against `rag serve` on a free loopback port,
for both reader kinds: the answers are /generate's, provenance rides in the extra `rag` field, streaming reassembles
the same answer (token by token for a causal reader), errors are OpenAI error objects with 4xx statuses, and a
streaming client that disconnects frees its slot.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_support import GatedKB, serving, until

from rag.serve.app import ServeLimits

QUESTION = "what is the atomic number of iron?"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def causal_server(serve_layout, tiny_gpt2_dir):
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=4, query_length=8, max_length=96,
                    doc_max_length=24)
    with serving(pipe, limits=ServeLimits(request_timeout=None)) as (url, app):
        yield url, app


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _generate(url: str, questions, **options) -> dict:
    r = httpx.post(f"{url}/generate", json={"questions": questions, **options}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- models, chat, completions


def test_models_lists_the_served_model(rag_server):
    url, _ = rag_server
    client = _client(url)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "rag"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_answers_as_generate_with_provenance_in_the_rag_field(rag_server, serve_layout):
    url, _ = rag_server
    client = _client(url)
    got = client.chat.completions.create(model="tiny", max_tokens=4, user="someone", messages=[
        {"role": "system", "content": "You answer questions."}, {"role": "user", "content": QUESTION}])
    want = _generate(url, [QUESTION], max_new_tokens=4)
    [a] = want["answers"]
    assert got.object == "chat.completion" and len(got.choices) == 1
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == a["text"]
    eos = rag_server[1].state.pipeline.model.generator.config.eos_token_id
    assert got.choices[0].finish_reason == ("stop" if a["token_ids"][-1] == eos else "length")
    assert got.usage.prompt_tokens > 0 and got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    prov = got.model_extra["rag"]  # the one extra field: plain clients ignore it
    assert prov["kb_version"] == want["kb_version"] and serve_layout["versions"][prov["kb_version"]] == "A"
    [c] = prov["choices"]
    assert [p["id"] for p in c["passages"]] == [p["id"] for p in a["passages"]]
    assert all({"prior", "posterior", "title", "text"} <= set(p) for p in c["passages"])
    assert abs(sum(p["prior"] for p in c["passages"]) - 1) < 1e-4 and abs(sum(p["posterior"] for p in c["passages"]) - 1) < 1e-4


def test_n_and_rag_options_map_onto_the_schema(rag_server):
    url, _ = rag_server
    client = _client(url)
    got = client.chat.completions.create(model="tiny", n=2, max_completion_tokens=3,
                                         messages=[{"role": "user", "content": QUESTION}],
                                         extra_body={"rag": {"marginalization": "token", "n_docs": 2}})
    want = _generate(url, [QUESTION], num_return_sequences=2, num_beams=2, max_new_tokens=3, marginalization="token", n_docs=2)
    assert [c.message.content for c in got.choices] == [a["text"] for a in want["answers"]]
    assert [c.index for c in got.choices] == [0, 1]
    prov = got.model_extra["rag"]["choices"]
    assert all(len(c["passages"]) == 2 for c in prov)
    grids = [(c["tokens"], c["token_doc_posterior"]) for c in prov if c["tokens"]]  # RAG-Token: Figure 2's (T, K) grid
    assert grids and all(len(g) == len(t) and all(len(row) == 2 for row in g) for t, g in grids)


def test_completions_of_a_rag_model_answer_the_prompt(rag_server):
    url, _ = rag_server
    got = _client(url).completions.create(model="tiny", prompt=[QUESTION, "who discovered oxygen?"], max_tokens=3, echo=True)
    want = _generate(url, [QUESTION, "who discovered oxygen?"], max_new_tokens=3)
    assert [c.text for c in got.choices] == [q + a["text"] for q, a in zip([QUESTION, "who discovered oxygen?"], want["answers"])]


def test_causal_reader_chat_and_completions(causal_server):
    url, _ = causal_server
    client = _client(url)
    want = _generate(url, [PROMPT], max_new_tokens=8)["answers"][0]
    chat = client.chat.completions.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": PROMPT}])
    comp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
    assert chat.choices[0].message.content == comp.choices[0].text == want["text"]
    segs = comp.model_extra["rag"]["choices"][0]["segments"]  # In-Context RALM: which passage for which tokens
    assert segs and segs[0]["start"] == 0


def test_sampling_honours_temperature_seed_and_n(causal_server):
    url, _ = causal_server
    client = _client(url)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # a seeded draw is reproducible
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert greedy.choices[0].text == _generate(url, [PROMPT], max_new_tokens=8)["answers"][0]["text"]
    three = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=7, n=3)
    assert len(three.choices) == 3 and three.choices[0].text == a.choices[0].text  # draw i uses seed + i
    assert len({c.text for c in three.choices}) > 1


# ---------------------------------------------------------------------------- streaming


def test_streamed_chat_reassembles_the_answer(rag_server):
    url, _ = rag_server
    client = _client(url)
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="tiny", max_tokens=5, messages=messages)
    chunks = list(client.chat.completions.create(model="tiny", max_tokens=5, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["rag"]["choices"][0]["passages"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_causal_reader_streams_token_by_token(causal_server):
    url, _ = causal_server
    client = _client(url)
    want = _generate(url, [PROMPT], max_new_tokens=32)["answers"][0]
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, stream=True)
              if c.choices and c.choices[0].text]
    assert "".join(pieces) == want["text"]
    # Sent as the tokens come (the tiny random LM's byte tokens decode to U+FFFD: each is held 4 tokens in case it is
    # part of a character split over tokens), not in one piece at the end.
    assert len(pieces) >= 5


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, status, param", [
    (dict(model="gpt-4o"), 404, "model"),
    (dict(extra_body={"temprature": 0.5}), 400, "temprature"),  # unknown: named, not ignored
    (dict(stop=["\n"]), 400, "stop"),  # cannot be honoured: named
    (dict(frequency_penalty=0.5), 400, "frequency_penalty"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools"),
    (dict(n=10_000), 400, "n"),
    (dict(n=9), 400, None),  # over the server's --max-beams
    (dict(max_tokens=65), 400, None),  # over --max-new-tokens
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(temperature=0.7), 400, None),  # a RAG model decodes greedily or by beam search
    (dict(messages=[{"role": "assistant", "content": "hi"}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": "   "}]), 400, "messages"),
    (dict(extra_body={"rag": {"n_docs": 13}}), 400, None),  # more passages than the knowledge base holds
    (dict(extra_body={"rag": {"n_docs": 0}}), 400, "rag.n_docs"),
    (dict(extra_body={"rag": {"max_new_tokens": 3}}, max_tokens=3), 400, "rag.max_new_tokens"),
])
def test_errors_are_openai_error_objects(rag_server, kw, status, param):
    url, _ = rag_server
    client = _client(url)
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == status, e.value.response.text
    err = e.value.response.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[-1] in err["message"] or status == 404
    ok = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": QUESTION}])
    assert ok.choices  # the server lives on


@pytest.mark.parametrize("content", [
    b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], "temperature": NaN}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], "top_p": Infinity}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 1e400}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "\\udfff", "messages": [{"role": "user", "content": "q"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], "n": 1' + b"0" * 5000 + b"}",
    b'{"model": "tiny", "messages": "not a list"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], "rag": {"length_penalty": NaN}}',
    b'{"model": "tiny", "messages": [', b"",
    b'{"model": "tiny", "prompt": "\ud800 q", "max_tokens": 2}',
    b'{"model": "tiny", "prompt": ["ok", "\udfff"], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": [[1, 2, 1e400]], "max_tokens": 0, "echo": true}',
    b'{"model": "tiny", "prompt": [[1, 2, 99999999999]], "max_tokens": 0, "echo": true}',
    b'{"model": "tiny", "prompt": "q", "max_tokens": 0, "echo": true, "logprobs": NaN}',
    b'{"model": "tiny", "prompt": "q", "max_tokens": 2, "n": 99999999999999999999999}',
    b'{"model": "tiny", "prompt": {"text": "q"}, "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "q", "max_tokens": -1}',
])
def test_bad_json_values_get_4xx_never_500(rag_server, causal_server, content):
    """What the official client cannot send (non-finite numbers, lone surrogates, broken JSON): sent by hand."""
    for url in (rag_server[0], causal_server[0]):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
            assert 400 <= r.status_code < 500, r.text
            assert r.json()["error"]["message"]


def test_completion_prompt_bounds(causal_server):
    url, _ = causal_server
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="256"):  # the tiny GPT-2's window
        client.completions.create(model="tiny", prompt=" word" * 300, max_tokens=0, echo=True, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="tiny", prompt=[5, 10 ** 6], max_tokens=0, echo=True, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="max-batch"):
        client.completions.create(model="tiny", prompt=[PROMPT] * 17, max_tokens=0, echo=True, logprobs=1)


def test_body_size_limit_is_an_openai_error(serve_layout):
    import rag

    with serving(rag.load(serve_layout["model"]), max_body_bytes=4096) as (url, _):
        with pytest.raises(openai.APIStatusError) as e:
            _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and "--max-body-bytes" in e.value.response.json()["error"]["message"]


# ---------------------------------------------------------------------------- a streaming client that leaves


def test_streaming_client_that_disconnects_frees_its_slot(serve_layout, tiny_gpt2_dir):
    """In-Context RALM retrieves every 8 tokens: the stream's first tokens arrive, then the second retrieval parks; the
    client leaves; once released, the work stops at its next unit boundary (no third retrieval of the 8 that 64
    tokens would need) and the one model slot serves the next request."""
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=8, query_length=8, max_length=96,
                    doc_max_length=24)
    with serving(pipe, max_concurrency=1, limits=ServeLimits(request_timeout=None, max_queue=0)) as (url, app):
        gate = GatedKB(app.state.slot.current, parks=lambda n: n >= 2)
        app.state.slot.swap(gate)
        health = lambda: httpx.get(f"{url}/health", timeout=30).json()["requests"]  # noqa: E731
        try:
            stream = _client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=64, stream=True,
                                                     extra_body={"rag": {"min_new_tokens": 64}})
            first = next(iter(stream))
            assert first.choices[0].text  # tokens of the first stride arrived before the second retrieval
            assert gate.parked.wait(timeout=120)
            assert health()["running"] == 1
            stream.close()  # the client goes away mid-stream
            until(lambda: health()["stopping"] == 1, "the server to notice the disconnect")
        finally:
            gate.release.set()
        until(lambda: health()["running"] == 0 and health()["queued"] == 0, "the stopped work to free the slot")
        assert gate.calls == 2 and health()["disconnected"] == 1
        # max_queue 0 and one slot: a request only gets in if the slot is free
        got = _client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert got.choices[0].text is not None


def test_openai_routes_share_the_queue_and_the_deadline(serve_layout):
    """One slot, no queue, a 0.5 s deadline: while a chat request is parked in retrieval, another gets OpenAI's error
    object with 503 and Retry-After; the parked one gets 504 once its deadline has passed."""
    import threading

    import rag

    with serving(rag.load(serve_layout["model"]), max_concurrency=1,
                 limits=ServeLimits(request_timeout=0.5, max_queue=0)) as (url, app):
        gate = GatedKB(app.state.slot.current, parks=lambda n: n == 1)
        app.state.slot.swap(gate)
        client = _client(url)
        out: dict = {}

        def first():
            try:
                client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": QUESTION}])
            except openai.APIStatusError as e:
                out["error"] = e

        t = threading.Thread(target=first)
        t.start()
        try:
            assert gate.parked.wait(timeout=120)
            with pytest.raises(openai.APIStatusError) as busy:
                client.completions.create(model="tiny", prompt=QUESTION, max_tokens=2)
            assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "1"
            assert "--max-queue" in busy.value.response.json()["error"]["message"]
            until(lambda: httpx.get(f"{url}/health", timeout=30).json()["requests"]["stopping"] == 1, "the deadline")
        finally:
            gate.release.set()
            t.join(timeout=120)
        assert out["error"].status_code == 504 and out["error"].response.json()["error"]["type"] == "timeout_error"
