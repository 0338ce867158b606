"""One pipeline for both readers: `rag.load` of a causal LM gives In-Context RALM generation with per-segment provenance,
BM25 / dense retrieval, `rag generate`, `rag serve` (real HTTP on loopback) and knowledge-base hot swap; a reader of
the wrong kind is a clear error naming the option."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import rag
from rag.generation.search import GenerationConfig
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.knowledge.passages import Passage
from rag.pipeline.api import RagPipeline, RalmReader
from rag.serve.app import ServeLimits, background_server, create_app
from rag.utils.errors import ConfigError

SETTINGS = dict(stride=4, query_length=8, max_length=96, doc_max_length=24)
PROMPTS = ["The capital of France is", "Oxygen was discovered by"]
TOKEN = "s3cret-admin-token-for-ralm-tests"


def _tagged(passages, tag):
    return [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in passages]


@pytest.fixture(scope="module")
def kbs(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir):
    """Knowledge bases A and B (same ids, texts tagged [A] / [B]) with BM25 and dense indexes, under one root."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    root = tmp_path_factory.mktemp("ralm_kbs")
    enc = TextEncoder(tiny_dpr_context_dir)
    out = {"root": root}
    for tag in "AB":
        out[tag] = KnowledgeBase.build(_tagged(demo_passages[:12], tag), enc, root / f"kb_{tag}", index="flat", bm25=True,
                                       query_encoder=tiny_dpr_question_dir, show_progress=False)
    return out


@pytest.fixture(scope="module")
def gpt2_512(tmp_path_factory, bpe_tokenizer):
    """A tiny GPT-2 whose window fits the default document length (256 + stride + 1)."""
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512, seed=3), bpe_tokenizer, tmp_path_factory.mktemp("gpt2_512"))


@pytest.fixture()
def pipe(tiny_gpt2_dir, kbs):
    return rag.load(tiny_gpt2_dir, knowledge_base=kbs["A"].path, **SETTINGS)


def test_load_recognises_a_causal_lm_and_generates_with_provenance(pipe, kbs, lm):
    from rag.generators.load import checkpoint_generator_kind
    from rag.knowledge.bm25 import BM25Retriever
    from rag.models.ralm.generate import ralm_generate
    from rag.models.ralm.model import InContextRALM, RalmConfig

    assert isinstance(pipe, RagPipeline) and isinstance(pipe.reader, RalmReader) and (pipe.method,
                                                                                      pipe.generator_kind) == ("ralm", "causal")
    assert checkpoint_generator_kind("smollm2") == "causal"  # the demo LM alias (not converted here)
    answers = pipe.generate(PROMPTS, max_new_tokens=9, min_new_tokens=9)
    kb = kbs["A"]
    ralm = InContextRALM(*lm, BM25Retriever(kb.bm25, kb.get_passages, kb.version, knowledge_base=kb), RalmConfig(**SETTINGS))
    expected = ralm_generate(ralm, PROMPTS, GenerationConfig(max_new_tokens=9, min_new_tokens=9))
    tok = lm[1]
    for a, c, prompt in zip(answers, expected, PROMPTS):
        assert a.question == prompt and a.kb_version == kb.version
        assert a.tokens == tok.convert_ids_to_tokens(c.token_ids) and a.score == pytest.approx(c.log_likelihood)
        assert [(s.start, s.end, s.passage_id, s.kb_version) for s in a.segments] == [(0, 4, *_id(c, 0)), (4, 8, *_id(c, 1)),
                                                                                      (8, 9, *_id(c, 2))]
        assert a.text == tok.decode(c.token_ids, skip_special_tokens=True)
        ids = [p.id for p in a.passages]
        assert ids == list(dict.fromkeys(s.passage_id for s in a.segments)) and all(p.text.startswith("[A] ") for p in a.passages)
        d = a.to_dict()
        assert d["segments"][0]["query"] == a.segments[0].query and json.dumps(d)


def _id(c, j):
    return c.segments[j].passage_id, c.segments[j].kb_version


def test_retrieval_kinds(pipe, kbs):
    bm25 = pipe.retrieve(["noble gas"], k=3)
    dense = pipe.retrieve(["noble gas"], k=3, retrieval="dense")
    assert bm25[0].kb_version == dense[0].kb_version == kbs["A"].version
    assert len(bm25[0].passages) == len(dense[0].passages) == 3
    assert sum(p.prior for p in dense[0].passages) == pytest.approx(1.0)
    expected = kbs["A"].bm25.search(["noble gas"], 3)[1][0].tolist()
    assert [p.id for p in bm25[0].passages] == [p.id for p in kbs["A"].get_passages([expected])[0]]
    [a] = pipe.generate(PROMPTS[:1], retrieval="dense", stride=3, max_new_tokens=6, min_new_tokens=6)
    assert [(s.start, s.end) for s in a.segments] == [(0, 3), (3, 6)] and a.kb_version == kbs["A"].version
    [s] = pipe.generate(PROMPTS[:1], do_sample=True, seed=5, max_new_tokens=6)
    [t] = pipe.generate(PROMPTS[:1], do_sample=True, seed=5, max_new_tokens=6)
    assert s.tokens == t.tokens


def test_wrong_kind_is_a_clear_error(pipe, kbs, tiny_bart_dir, tiny_dpr_question_dir, tiny_gpt2_dir):
    from rag.models.rag.model import RagModel

    with pytest.raises(ConfigError, match=r"marginalization= \(--marginalization\).*seq2seq"):
        pipe.generate(PROMPTS, marginalization="token")
    with pytest.raises(ConfigError, match=r"n_docs= \(--n-docs\)"):
        pipe.generate(PROMPTS, n_docs=2)
    seq2seq = RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kbs["A"], n_docs=2))
    assert (seq2seq.method, seq2seq.generator_kind) == ("rag", "seq2seq")
    with pytest.raises(ConfigError, match=r"stride= \(--stride\).*causal LM"):
        seq2seq.generate(["what is argon?"], stride=4)
    # a RAG model takes another retriever for a call too (dense | bm25 | hybrid); an unknown one names the choices
    with pytest.raises(ConfigError, match=r"retrieval=.*\(--retrieval .*'hybrid'"):
        seq2seq.retrieve(["argon"], k=2, retrieval="sparse")
    with pytest.raises(ConfigError, match="seq2seq generator.*--model.generator"):
        rag.load(tiny_bart_dir, knowledge_base=kbs["A"].path)
    with pytest.raises(ConfigError, match="knowledge_base=.*--kb"):
        rag.load(tiny_gpt2_dir)
    with pytest.raises(ConfigError, match="takes no.*n_docs"):
        rag.load(tiny_gpt2_dir, knowledge_base=kbs["A"].path, n_docs=3)
    with pytest.raises(ConfigError, match="--stride"):
        rag.load(tiny_gpt2_dir, knowledge_base=kbs["A"].path, stride=0)


def test_hot_swap_under_the_ralm_reader(pipe, kbs):
    """Every answer names the version it used; a swap landing mid-generation does not mix versions in one answer."""
    slot = KnowledgeBaseSlot.for_model(pipe)
    assert slot.retriever is pipe.retriever and slot.version == kbs["A"].version
    [before] = pipe.generate(PROMPTS[:1], max_new_tokens=8, min_new_tokens=8)
    served = pipe.retriever.pin()
    inner = served.retriever("bm25")

    class SwapOnFirstCall:
        calls = 0

        def retrieve(self, queries, k):
            SwapOnFirstCall.calls += 1
            if SwapOnFirstCall.calls == 1:
                slot.swap(kbs["B"].path)
            return inner.retrieve(queries, k)

    served._built["bm25"] = SwapOnFirstCall()
    try:
        [during] = pipe.generate(PROMPTS[:1], max_new_tokens=8, min_new_tokens=8)
        assert SwapOnFirstCall.calls == 2 and slot.version == kbs["B"].version
        assert during.kb_version == kbs["A"].version and {s.kb_version for s in during.segments} == {kbs["A"].version}
        assert during.tokens == before.tokens
        [after] = pipe.generate(PROMPTS[:1], max_new_tokens=8, min_new_tokens=8)
        assert after.kb_version == kbs["B"].version and all(p.text.startswith("[B] ") for p in after.passages)
        assert {s.kb_version for s in after.segments} == {kbs["B"].version}
        assert pipe.retrieve(["argon"], k=2, retrieval="dense")[0].kb_version == kbs["B"].version
    finally:
        served._built["bm25"] = inner
        slot.swap_back()
    assert pipe.generate(PROMPTS[:1], max_new_tokens=8, min_new_tokens=8)[0].kb_version == kbs["A"].version


def test_swap_refuses_a_knowledge_base_without_bm25(pipe, kbs, tmp_path, tiny_dpr_context_dir, demo_passages):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.utils.errors import KnowledgeBaseError

    dense_only = KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), tmp_path / "dense", index="flat",
                                     show_progress=False)
    slot = KnowledgeBaseSlot.for_model(pipe)
    with pytest.raises(KnowledgeBaseError, match="still serving.*no BM25 index"):
        slot.swap(dense_only.path)
    assert pipe.kb_version == kbs["A"].version


def test_cli_generate(capsys, gpt2_512, kbs):
    from rag.cli import main

    code = main(["generate", "--model", gpt2_512, "--kb", str(kbs["A"].path), PROMPTS[0], "--stride", "4", "--query-length", "8",
                 "--max-new-tokens", "6", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    got = json.loads(out.strip().splitlines()[-1])
    expected = rag.load(gpt2_512, knowledge_base=kbs["A"].path, stride=4, query_length=8).generate([PROMPTS[0]],
                                                                                                   max_new_tokens=6)[0]
    assert got["text"] == expected.text and got["kb_version"] == kbs["A"].version
    assert [(s["start"], s["end"], s["passage_id"]) for s in got["segments"]] == [(s.start, s.end, s.passage_id)
                                                                                  for s in expected.segments]
    code = main(["generate", "--model", gpt2_512, "--kb", str(kbs["A"].path), PROMPTS[0], "--retrieval", "dense",
                 "--max-new-tokens", "5"])
    text = capsys.readouterr().out
    assert code == 0 and "tokens   0-4" in text and kbs["A"].version in text
    assert main(["generate", "--model", gpt2_512, "--kb", str(kbs["A"].path), PROMPTS[0], "--marginalization", "token"]) == 2
    assert "--marginalization" in capsys.readouterr().err
    assert main(["generate", "--model", gpt2_512, "--kb", str(kbs["A"].path), PROMPTS[0], "--stride", "0"]) == 2
    assert "--stride 0" in capsys.readouterr().err


def test_serve_generate_retrieve_and_swap(tiny_gpt2_dir, kbs):
    pipe = rag.load(tiny_gpt2_dir, knowledge_base=kbs["A"].path, **SETTINGS)
    app = create_app(pipe, kb_roots=[kbs["root"]], admin_token=TOKEN, limits=ServeLimits(request_timeout=None))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with background_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/generate", json={"questions": PROMPTS, "stride": 3, "max_new_tokens": 7, "min_new_tokens": 7})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["kb_version"] == kbs["A"].version and len(body["answers"]) == 2
        direct = pipe.generate(PROMPTS, stride=3, max_new_tokens=7, min_new_tokens=7)
        for got, want in zip(body["answers"], direct):
            assert got["text"] == want.text and [s["start"] for s in got["segments"]] == [0, 3, 6]
            assert [s["passage_id"] for s in got["segments"]] == [s.passage_id for s in want.segments]
        r = client.post("/retrieve", json={"questions": ["argon"], "k": 2})
        assert r.status_code == 200 and r.json()["kb_version"] == kbs["A"].version
        r = client.post("/generate", json={"questions": PROMPTS, "marginalization": "token"})
        assert r.status_code == 400 and "--marginalization" in r.json()["detail"]
        r = client.post("/generate", json={"questions": PROMPTS, "stride": 0})
        assert r.status_code == 422
        r = client.post("/admin/swap", json={"path": "kb_B"}, headers=auth)
        assert r.status_code == 200, r.text
        r = client.post("/generate", json={"questions": PROMPTS[:1], "max_new_tokens": 5, "retrieval": "dense"})
        assert r.status_code == 200 and r.json()["kb_version"] == kbs["B"].version
        a = r.json()["answers"][0]
        assert {s["kb_version"] for s in a["segments"]} == {kbs["B"].version} and a["passages"][0]["text"].startswith("[B] ")
        assert client.get("/health").json()["kb_version"] == kbs["B"].version
        assert client.post("/admin/swap_back", json={}, headers=auth).status_code == 200


def test_python_reader_from_components(lm, kbs):
    """A RalmReader built in Python (an open KnowledgeBase, a default retrieval) behaves as the loaded one."""
    from rag.models.ralm.model import RalmConfig

    reader = RalmReader(*lm, kbs["A"], RalmConfig(**SETTINGS), retrieval="dense")
    pipe = RagPipeline(reader)
    assert pipe.model is lm[0] and pipe.knowledge_base is kbs["A"]
    [a] = pipe.generate(PROMPTS[:1], max_new_tokens=5, min_new_tokens=5)
    [b] = pipe.generate(PROMPTS[:1], max_new_tokens=5, min_new_tokens=5, retrieval="dense")
    assert a.tokens == b.tokens and [s.passage_id for s in a.segments] == [s.passage_id for s in b.segments]
    with torch.no_grad():
        assert pipe.retrieve(["argon"], k=1)[0].passages[0].id == pipe.retrieve(["argon"], k=1,
                                                                                retrieval="dense")[0].passages[0].id
