"""REPLUG with a black-box LM, for real: `CompletionsLMScorer` pointed at `rag serve --model <causal LM>`'s
/v1/completions returns the local scorer's log-likelihoods, and `rag lm-eval --ensemble K --lm-endpoint` through the same
server reports the local run's perplexity (float tolerance: float32 LM passes of different batch shapes agree to
~1e-5). A llama.cpp server is compared in tests/serve/test_serve_llamacpp.py (opt-in)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag.models.replug.lm_scorer import CompletionsLMScorer, LMEndpointError, LocalLMScorer, document_logprobs, replug_prompt
from rag.serve.app import background_server, create_app

PAIRS = [("Hydrogen\nHydrogen is the lightest element.\n\nThe lightest element is", " hydrogen."),
         ("Helium is a noble gas.\n\nA noble gas", " does not react."),
         ("Carbon forms four bonds.", " Diamond and graphite are carbon."),
         ("Iron", " is a metal; its symbol is Fe, its atomic number 26.")]
ARGS = ["--max-length", "96", "--doc-max-length", "40", "--stride", "4", "--query-length", "8"]


@pytest.fixture(scope="module")
def lm_server(serve_layout, tiny_gpt2_dir):
    """`rag serve --model <tiny GPT-2>` (its In-Context RALM reader needs a knowledge base; scoring does not read it)."""
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, max_length=96, doc_max_length=24)
    with background_server(create_app(pipe, model_name="tiny-gpt2")) as url:
        yield f"{url}/v1", pipe


def test_completions_scorer_through_rag_serve_equals_the_local_scorer(lm_server):
    url, pipe = lm_server
    local = LocalLMScorer(pipe.reader.model, pipe.reader.tokenizer)
    remote = CompletionsLMScorer(url, "tiny-gpt2", batch_size=3, timeout=60)
    prompts, conts = [p for p, _ in PAIRS], [c for _, c in PAIRS]
    want = local.continuation_logprobs(prompts, conts)
    got = remote.continuation_logprobs(prompts, conts)
    assert remote.requests == 2  # 4 pairs, 3 per request
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.shape[0] > 1
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    docs = ["Hydrogen is light.", "Helium is inert."]
    got = document_logprobs(remote, docs, ["The lightest element is"] * 2, [" hydrogen."] * 2)
    want = local.continuation_logprobs([replug_prompt(d, "The lightest element is") for d in docs], [" hydrogen."] * 2)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_token_id_windows_score_as_the_local_lm(lm_server):
    import torch

    url, pipe = lm_server
    model, tok = pipe.reader.model, pipe.reader.tokenizer
    windows = [tok("Oxygen was discovered by Priestley and Scheele.", add_special_tokens=False)["input_ids"],
               [tok.eos_token_id] + tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]]
    positions = [list(range(1, len(w))) for w in windows]
    got = CompletionsLMScorer(url, "tiny-gpt2").token_logprobs(windows, positions)
    for w, pos, lp in zip(windows, positions, got):
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids=torch.tensor([w])).logits[0].double(), -1)
        np.testing.assert_allclose(lp, [float(full[t - 1, w[t]]) for t in pos], atol=2e-5, rtol=0)


def test_wrong_model_name_is_a_clear_error(lm_server):
    url, _ = lm_server
    with pytest.raises(LMEndpointError, match="404.*not served here"):
        CompletionsLMScorer(url, "other", max_retries=0).continuation_logprobs(*zip(PAIRS[0]))


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory, demo_passages):
    p = tmp_path_factory.mktemp("replug_eval") / "eval.jsonl"
    p.write_text("".join(json.dumps({"id": q.id, "title": q.title, "text": q.text}) + "\n" for q in demo_passages[20:23]),
                 encoding="utf-8")
    return str(p)


def test_lm_eval_ensemble_through_rag_serve_matches_the_local_run(capsys, lm_server, serve_layout, tiny_gpt2_dir, eval_data):
    from rag.cli import main

    url, _ = lm_server
    base = ["lm-eval", "--model", tiny_gpt2_dir, "--kb", str(serve_layout["kbs"]["kb_a"].path), "--data", eval_data,
            "--retrieval", "bm25", "--ensemble", "3", "--json", *ARGS]
    assert main(base) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(base + ["--lm-endpoint", url, "--lm-endpoint-model", "tiny-gpt2", "--batch-size", "16"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote["settings"]["lm_endpoint"] == url and local["settings"]["ensemble"] == 3
    assert remote["tokens"] == local["tokens"] > 100 and remote["retrieved_chunks"] == local["retrieved_chunks"] > 0
    for key in ("perplexity", "word_perplexity", "bits_per_byte"):
        assert remote[key] == pytest.approx(local[key], rel=1e-5, abs=0), key


def test_lm_eval_endpoint_needs_a_model_name(capsys, serve_layout, tiny_gpt2_dir, eval_data):
    from rag.cli import main

    code = main(["lm-eval", "--model", tiny_gpt2_dir, "--kb", str(serve_layout["kbs"]["kb_a"].path), "--data", eval_data,
                 "--lm-endpoint", "http://127.0.0.1:9/v1", *ARGS])
    assert code == 2 and "--lm-endpoint-model" in capsys.readouterr().err
