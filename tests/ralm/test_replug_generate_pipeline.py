"""REPLUG generation through the user's API: `rag.load(causal_lm, knowledge_base=...).generate(prompts, ensemble=K)`,
`rag generate --ensemble K` and `rag serve`'s POST /generate, with the K documents and their weights λ on every answer."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import rag
from rag.generation.search import GenerationConfig
from rag.knowledge.passages import Passage
from rag.models.ralm.model import doc_text
from rag.models.replug.ensemble import replug_generate
from rag.serve.app import ServeLimits, background_server, create_app
from rag.utils.errors import ConfigError, RagError

SETTINGS = dict(stride=4, query_length=8, max_length=96, doc_max_length=24)
PROMPTS = ["The capital of France is", "Oxygen was discovered by"]


@pytest.fixture(scope="module")
def kb(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    return KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), tmp_path_factory.mktemp("replug_kb") / "kb",
                               index="flat", bm25=True, query_encoder=tiny_dpr_question_dir, show_progress=False)


@pytest.fixture(scope="module")
def pipe(tiny_gpt2_dir, kb):
    return rag.load(tiny_gpt2_dir, knowledge_base=kb.path, **SETTINGS)


def test_ensemble_of_one_equals_in_context_ralm_with_that_document(pipe):
    """One document, retrieved once (stride >= new tokens): REPLUG is In-Context RALM; λ = 1."""
    for kw in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        plain = pipe.generate(PROMPTS, stride=8, max_new_tokens=8, min_new_tokens=8, **kw)
        one = pipe.generate(PROMPTS, stride=8, max_new_tokens=8, min_new_tokens=8, ensemble=1, **kw)
        assert len(one) == len(plain) == 2 * kw.get("num_return_sequences", 1)
        for a, b in zip(one, plain):
            assert a.tokens == b.tokens and a.text == b.text and a.score == pytest.approx(b.score, abs=1e-4)
            assert [p.id for p in a.passages] == [b.segments[0].passage_id] and a.passages[0].prior == pytest.approx(1.0)
            assert a.kb_version == b.kb_version


def test_ensemble_answers_carry_k_weighted_documents_and_match_replug_generate(pipe, kb, lm):
    model, tok = lm
    for kw in ({}, {"num_beams": 2}):
        answers = pipe.generate(PROMPTS, max_new_tokens=6, min_new_tokens=6, ensemble=3, retrieval_temperature=0.5, **kw)
        hits = pipe.retrieve(PROMPTS, k=3, retrieval="bm25")  # the prompts are shorter than ℓ: the same queries
        docs = [[doc_text(Passage(p.id, p.title, p.text)) for p in h.passages] for h in hits]
        scores = torch.tensor([[p.score for p in h.passages] for h in hits])
        seqs, loglik = replug_generate(model, tok, PROMPTS, docs, scores, retrieval_temperature=0.5, doc_max_length=24,
                                       config=GenerationConfig(max_new_tokens=6, min_new_tokens=6, **kw))
        for i, (a, h) in enumerate(zip(answers, hits)):
            assert [p.id for p in a.passages] == [p.id for p in h.passages] and a.kb_version == kb.version
            lam = torch.softmax(scores[i] / 0.5, 0)
            assert [p.prior for p in a.passages] == pytest.approx(lam.tolist(), abs=1e-6)
            assert [p.score for p in a.passages] == pytest.approx(scores[i].tolist())
            assert a.tokens == tok.convert_ids_to_tokens(seqs[i, -6:].tolist())
            assert a.score == pytest.approx(float(loglik[i]), abs=1e-4)
            assert json.dumps(a.to_dict())


def test_sampling_is_seeded(pipe):
    a = pipe.generate(PROMPTS[:1], ensemble=2, do_sample=True, seed=5, max_new_tokens=8, min_new_tokens=8)
    b = pipe.generate(PROMPTS[:1], ensemble=2, do_sample=True, seed=5, max_new_tokens=8, min_new_tokens=8)
    others = {tuple(pipe.generate(PROMPTS[:1], ensemble=2, do_sample=True, seed=s, max_new_tokens=8, min_new_tokens=8)[0].tokens)
              for s in range(6, 10)}
    assert a[0].tokens == b[0].tokens and len(others | {tuple(a[0].tokens)}) > 1


def test_bad_ensemble_input_names_the_option(pipe, kb):
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="ensemble"):
            pipe.generate(PROMPTS[:1], ensemble=bad)
    with pytest.raises(RagError, match=f"ensemble=13 exceeds the {len(kb)} passages"):
        pipe.generate(PROMPTS[:1], ensemble=13)
    with pytest.raises(ConfigError, match="retrieval_temperature"):
        pipe.generate(PROMPTS[:1], ensemble=2, retrieval_temperature=0.0)
    for prompts in ([""], ["   "], []):
        with pytest.raises(RagError):
            pipe.generate(prompts, ensemble=2)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        pipe.generate(PROMPTS[:1], ensemble=2, max_length=20)


def test_cli_generate_ensemble_json(capsys, tiny_gpt2_dir, kb):
    from rag.cli import main

    base = ["generate", "--model", tiny_gpt2_dir, "--kb", str(kb.path), "--doc-max-length", "24", "--max-length", "96",
            PROMPTS[0]]
    code = main(base + ["--ensemble", "2", "--retrieval-temperature", "2", "--max-new-tokens", "5", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    got = json.loads(out.strip().splitlines()[-1])
    assert len(got["passages"]) == 2 and sum(p["prior"] for p in got["passages"]) == pytest.approx(1.0)
    assert got["kb_version"] == kb.version and got["passages"][0]["prior"] >= got["passages"][1]["prior"]
    want = rag.load(tiny_gpt2_dir, knowledge_base=kb.path, doc_max_length=24, max_length=96).generate(
        [PROMPTS[0]], ensemble=2, retrieval_temperature=2.0, max_new_tokens=5)[0]
    assert got["text"] == want.text and [p["id"] for p in got["passages"]] == [p.id for p in want.passages]
    assert main(base + ["--ensemble", "0"]) == 2 and "--ensemble 0" in capsys.readouterr().err
    assert main(base + ["--ensemble", "2", "--retrieval-temperature", "-1"]) == 2
    assert "--retrieval-temperature" in capsys.readouterr().err


def test_serve_generate_ensemble_is_bounded(pipe, kb):
    app = create_app(pipe, limits=ServeLimits(request_timeout=None, max_n_docs=3))
    with background_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/generate",
                        json={"questions": PROMPTS[:1], "ensemble": 2, "retrieval_temperature": 0.5, "max_new_tokens": 4})
        assert r.status_code == 200, r.text
        [a] = r.json()["answers"]
        want = pipe.generate(PROMPTS[:1], ensemble=2, retrieval_temperature=0.5, max_new_tokens=4)[0]
        assert a["text"] == want.text and [p["prior"] for p in a["passages"]] == pytest.approx([p.prior for p in want.passages])
        r = client.post("/generate", json={"questions": PROMPTS[:1], "ensemble": 4})
        assert r.status_code == 422 and "max_n_docs" in r.text
        for bad in ({"ensemble": 0}, {"ensemble": 2, "retrieval_temperature": 0}):
            assert client.post("/generate", json={"questions": PROMPTS[:1], **bad}).status_code == 422


def test_new_tokens_that_cannot_fit_the_window_are_named(pipe):
    with pytest.raises(ConfigError, match="--max-new-tokens"):  # window 96, documents <= 24 tokens
        pipe.generate(PROMPTS[:1], ensemble=2, max_new_tokens=90)
