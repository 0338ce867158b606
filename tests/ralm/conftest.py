"""Fixtures of the In-Context RALM and REPLUG tests: a tiny random GPT-2 saved and loaded back, BM25 over the demo passages,
an OpenAI-compatible completions server on loopback serving the tiny GPT-2's log-probs."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, bpe_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=256), bpe_tokenizer, tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def lm(tiny_gpt2_dir):
    from rag.generators.load import load_generator

    model, tok, _ = load_generator(tiny_gpt2_dir, kind="causal")
    return model, tok


@pytest.fixture(scope="session")
def bm25(demo_passages):
    from rag.knowledge.bm25 import BM25Retriever

    return BM25Retriever.from_passages(demo_passages, show_progress=False)


def _app(model, tok):
    from fastapi import FastAPI, HTTPException

    app = FastAPI()
    state = {"calls": 0}
    ctx = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    @app.post("/v1/completions")
    def completions(body: dict):
        state["calls"] += 1
        name = body["model"]
        if name == "broken":
            raise HTTPException(status_code=503, detail="overloaded")
        if name == "slow":
            time.sleep(1.0)
        if name == "flaky" and state["calls"] % 2 == 1:
            raise HTTPException(status_code=500, detail="try again")
        if name == "unknown":
            raise HTTPException(status_code=404, detail="no such model")
        assert body["echo"] is True and body["max_tokens"] == 0 and body["logprobs"] == 1
        choices = []
        for i, text in enumerate(body["prompt"]):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([[ctx] + ids])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            token_lp = [float(lp[t, ids[t]]) for t in range(len(ids))]
            offsets = [len(tok.decode(ids[:t])) for t in range(len(ids))]
            lps = None if name == "nologprobs" else {"tokens": [tok.decode([t]) for t in ids], "token_logprobs": token_lp,
                                                     "text_offset": offsets, "top_logprobs": None}
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": "length"})
        return {"id": "cmpl-test", "object": "text_completion", "model": name, "choices": choices}

    return app, state


@pytest.fixture(scope="module")
def server(lm):
    import uvicorn

    app, state = _app(*lm)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1", state
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()
