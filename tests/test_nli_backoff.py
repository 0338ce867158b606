"""The RetRobust NLI back-off (Yoran et al. 2024, §2.1): planted NLI models that say "entailed" / "not entailed" pick the
retrieval / no-retrieval answer, for RAG (seq2seq) and In-Context RALM (causal) readers; both generations run in one
batch; the no-retrieval answers equal transformers' generate on the bare question / prompt; multi-step verdicts; bad
thresholds and label-less models; `rag generate --nli --json`, `rag serve` and hot-swap evaluation carry the fields."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rag.generation.options import FALLBACK_DEFAULTS
from rag.pipeline.api import RagPipeline, RalmReader
from rag.retrobust.backoff import check_steps
from rag.retrobust.nli import NLIScorer
from rag.utils.errors import ConfigError, RagError

DEFAULT_NO_REPEAT_NGRAM = FALLBACK_DEFAULTS["no_repeat_ngram_size"]
NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
QUESTIONS = ["what is the atomic number of argon?", "which element has the symbol He?"]
PROMPTS = ["The capital of France is", "Oxygen was discovered by"]
RALM = dict(stride=4, query_length=8, max_length=96, doc_max_length=24)


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_dpr_context_dir, tiny_dpr_question_dir, demo_passages):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    return KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), tmp_path_factory.mktemp("kb") / "kb",
                               index="flat", bm25=True, query_encoder=tiny_dpr_question_dir, show_progress=False)


@pytest.fixture(scope="module")
def rag_pipe(kb, tiny_dpr_question_dir, tiny_bart_dir):
    from rag.models.rag.model import RagModel

    torch.manual_seed(0)
    return RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, n_docs=3))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=128, seed=3), bpe_tokenizer, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def ralm_pipe(gpt2_dir, kb):
    return RagPipeline(RalmReader.load(gpt2_dir, kb, retrieval="bm25", **RALM))


GEN = dict(max_new_tokens=6, min_new_tokens=6)


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_rag_backoff_picks_the_branch_the_nli_model_says(rag_pipe, nli_dirs, marginalization):
    kw = dict(GEN, marginalization=marginalization, num_beams=2)
    plain = rag_pipe.generate(QUESTIONS, **kw)
    kept = rag_pipe.generate(QUESTIONS, nli=nli_dirs["yes"], **kw)
    assert [a.answered_with for a in kept] == ["retrieval"] * 2
    assert [a.text for a in kept] == [a.text for a in plain]  # the retrieval half of the batch is the plain answer
    for a, p in zip(kept, plain):
        assert len(a.passages) == 3 and [x.id for x in a.passages] == [x.id for x in p.passages]
        assert math.isclose(a.score, p.score, rel_tol=1e-4, abs_tol=1e-4)
        [probs] = a.nli_entailment
        assert set(probs) == {"entailment", "neutral", "contradiction"} and probs["entailment"] > 0.99
        assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)
    backed = rag_pipe.generate(QUESTIONS, nli=nli_dirs["no"], **kw)
    assert [a.answered_with for a in backed] == ["no_retrieval"] * 2
    assert all(a.passages == [] and a.nli_entailment[0]["entailment"] < 0.01 for a in backed)
    assert [a.question for a in backed] == QUESTIONS


def test_rag_no_retrieval_answer_is_the_generator_on_the_bare_question(rag_pipe, nli_dirs):
    """RAG-Token greedy over K identical bare contexts = transformers' greedy generate of the generator alone."""
    gen, tok = rag_pipe.model.generator, rag_pipe.model.generator_tokenizer
    answers = rag_pipe.generate(QUESTIONS, nli=nli_dirs["no"], marginalization="token", **GEN)
    for q, a in zip(QUESTIONS, answers):
        enc = tok([q], return_tensors="pt")
        ref = gen.generate(**enc, max_new_tokens=6, min_new_tokens=6, num_beams=1, do_sample=False,
                           no_repeat_ngram_size=DEFAULT_NO_REPEAT_NGRAM)  # the reader's default
        assert a.token_ids == ref[0].tolist()[:len(a.token_ids)] and len(a.token_ids) >= 6
        assert math.isfinite(a.score) and a.score <= 0


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generation_without_retrieval_is_the_generator_alone_and_retrieves_nothing(rag_pipe, ralm_pipe, num_beams, monkeypatch):
    """generate(retrieval=False) (`rag generate --no-retrieval`, the closed-book baseline): the same answers as the
    no-retrieval half of the back-off's batch (RAG: transformers' generate of the generator alone), no passages, and no
    retrieval at all (for both readers)."""
    gen, tok = rag_pipe.model.generator, rag_pipe.model.generator_tokenizer
    _, bare = rag_pipe.reader.generate_with_and_without_retrieval(QUESTIONS, num_beams=num_beams, **GEN)
    _, ralm_bare = ralm_pipe.reader.generate_with_and_without_retrieval(QUESTIONS, num_beams=num_beams, **GEN)

    def no_retrieval(*a, **k):
        raise AssertionError("retrieved")

    monkeypatch.setattr(rag_pipe.model, "prepare_inputs", no_retrieval)
    monkeypatch.setattr(rag_pipe.model, "retrieve", no_retrieval)
    monkeypatch.setattr(ralm_pipe.reader.retriever, "pin", no_retrieval)
    answers = rag_pipe.generate(QUESTIONS, retrieval=False, num_beams=num_beams, **GEN)
    assert [a.token_ids for a in answers] == [a.token_ids for a in bare]
    assert all(a.passages == [] and a.answered_with == "no_retrieval" for a in answers)
    for q, a in zip(QUESTIONS, answers):
        ref = gen.generate(**tok([q], return_tensors="pt"), max_new_tokens=6, min_new_tokens=6, num_beams=num_beams,
                           do_sample=False,
                           no_repeat_ngram_size=DEFAULT_NO_REPEAT_NGRAM)
        assert a.token_ids == ref[0].tolist()[:len(a.token_ids)]
    monkeypatch.undo()
    from rag.knowledge.bm25 import BM25Retriever
    from rag.knowledge.retriever import DenseRetriever

    monkeypatch.setattr(BM25Retriever, "retrieve", no_retrieval)
    monkeypatch.setattr(DenseRetriever, "retrieve", no_retrieval)
    ralm_answers = ralm_pipe.generate(QUESTIONS, retrieval=False, num_beams=num_beams, **GEN)
    assert [a.token_ids for a in ralm_answers] == [a.token_ids for a in ralm_bare]
    assert all(a.passages == [] and not a.segments and a.answered_with == "no_retrieval" for a in ralm_answers)


def test_generation_without_retrieval_refuses_retrieval_options(rag_pipe, ralm_pipe, nli_dirs):
    with pytest.raises(ConfigError, match="--n-docs"):
        rag_pipe.generate(QUESTIONS, retrieval=False, n_docs=2)
    with pytest.raises(ConfigError, match="--stride"):
        ralm_pipe.generate(QUESTIONS, retrieval=False, stride=2)
    with pytest.raises(ConfigError, match="--no-retrieval.*--nli"):
        rag_pipe.generate(QUESTIONS, retrieval=False, nli=nli_dirs["yes"])


def test_both_generations_are_one_batch(rag_pipe, ralm_pipe, nli_dirs, monkeypatch):
    import rag.generators.seq2seq as answer_mod  # where a seq2seq generator encodes its contexts
    import rag.pipeline.readers as ralm_mod  # where the In-Context RALM reader looks ralm_generate up

    calls = []
    real_encode = answer_mod.encode_contexts
    monkeypatch.setattr(answer_mod, "encode_contexts", lambda g, ids, mask: calls.append(ids.shape[0])
                        or real_encode(g, ids, mask))
    rag_pipe.generate(QUESTIONS, nli=nli_dirs["no"], **GEN)
    assert calls == [2 * len(QUESTIONS) * 3]  # one encoder batch: B questions x K passages, with and without retrieval

    prompts = []
    real_generate = ralm_mod.ralm_generate
    monkeypatch.setattr(ralm_mod, "ralm_generate", lambda ralm, p, config, **kw: prompts.append(list(p))
                        or real_generate(ralm, p, config, **kw))
    ralm_pipe.generate(PROMPTS, nli=nli_dirs["no"], **GEN)
    assert prompts == [PROMPTS + PROMPTS]


def test_ralm_backoff(ralm_pipe, nli_dirs):
    plain = ralm_pipe.generate(PROMPTS, **GEN)
    kept = ralm_pipe.generate(PROMPTS, nli=nli_dirs["yes"], **GEN)
    assert [a.answered_with for a in kept] == ["retrieval"] * 2
    assert [(a.text, [s.passage_id for s in a.segments]) for a in kept] == [(a.text, [s.passage_id for s in a.segments])
                                                                            for a in plain]
    backed = ralm_pipe.generate(PROMPTS, nli=nli_dirs["no"], **GEN)
    assert [a.answered_with for a in backed] == ["no_retrieval"] * 2
    assert all(a.passages == [] and not a.segments for a in backed)
    model, tok = ralm_pipe.reader.model, ralm_pipe.reader.tokenizer
    for p, a in zip(PROMPTS, backed):  # the LM on [BOS] + prompt alone, as transformers generates it
        ids = torch.tensor([[tok.bos_token_id] + tok(p, add_special_tokens=False)["input_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        assert tok.convert_tokens_to_ids(a.tokens) == ref[0, ids.shape[1]:].tolist()


def test_multi_step_needs_every_step_entailed(wordpiece_tokenizer, tmp_path):
    from rag.generators.tiny import save, tiny_bert_classifier

    scorer = NLIScorer.from_pretrained(save(tiny_bert_classifier(wordpiece_tokenizer, NLI_LABELS, seed=5), wordpiece_tokenizer,
                                            tmp_path / "m"))
    steps = [("Argon. Atomic number: 18.", "what is the atomic number of argon?", "18"),
             ("Helium. Symbol: He.", "which element has the symbol He?", "Helium"),
             ("Iron. Symbol: Fe.", "who discovered iron?", "nobody"),
             ("Neon. Atomic number: 10.", "what is the atomic number of neon?", "12")]
    from rag.retrobust.nli import nli_hypothesis

    p = scorer.entailment_probs([s[0] for s in steps], [nli_hypothesis(s[1], s[2]) for s in steps]).tolist()
    order = sorted(range(4), key=lambda i: p[i])
    assert p[order[0]] < p[order[1]]  # a random model separates them
    t = (p[order[0]] + p[order[1]]) / 2
    hi = [steps[i] for i in order[1:]]
    verdicts = check_steps(scorer, [hi, hi[:1] + [steps[order[0]]], [steps[order[0]]]], threshold=t)
    assert [v.entailed for v in verdicts] == [True, False, False]
    assert [len(v.probs) for v in verdicts] == [3, 2, 1]
    assert math.isclose(verdicts[0].probs[0]["entailment"], p[order[1]], rel_tol=1e-5)
    with pytest.raises(RagError, match="no .premise, question, answer. step"):
        check_steps(scorer, [[]])


def test_bad_threshold_and_a_model_without_entailment_label(rag_pipe, nli_dirs, planted_nli, wordpiece_tokenizer, tmp_path):
    for bad in (1.5, -0.1, float("nan"), "x"):
        with pytest.raises(ConfigError, match="nli_threshold"):
            rag_pipe.generate(QUESTIONS, nli=nli_dirs["yes"], nli_threshold=bad, **GEN)
    nolabel = planted_nli(wordpiece_tokenizer, tmp_path / "nolabel", 0, {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})
    with pytest.raises(ConfigError, match="no entailment label"):
        rag_pipe.generate(QUESTIONS, nli=nolabel, **GEN)
    with pytest.raises(ConfigError, match="nli= takes"):
        rag_pipe.generate(QUESTIONS, nli=3, **GEN)


def test_cli_generate_json_carries_the_fields(capsys, gpt2_dir, kb, nli_dirs, tmp_path, monkeypatch):
    from rag.cli import main

    base = ["generate", "--model", gpt2_dir, "--kb", str(kb.path), *PROMPTS, "--stride", "4", "--query-length", "8",
            "--max-length", "96", "--doc-max-length", "24", "--max-new-tokens", "5", "--json"]
    for model, branch in (("yes", "retrieval"), ("no", "no_retrieval")):
        assert main(base + ["--nli", nli_dirs[model]]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert [r["answered_with"] for r in rows] == [branch] * 2
        assert all(set(r["nli_entailment"][0]) == {"entailment", "neutral", "contradiction"} for r in rows)
    assert main(base[:-1] + ["--nli", nli_dirs["no"]]) == 0
    assert "answered with no_retrieval" in capsys.readouterr().out
    assert main(base + ["--nli", nli_dirs["yes"], "--nli-threshold", "2"]) == 2
    assert "--nli-threshold" in capsys.readouterr().err
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "empty_cache"))
    assert main(base + ["--nli"]) == 2  # no value: the default model, not built here
    assert "rag nli prepare" in capsys.readouterr().err


def test_cli_generate_no_retrieval(capsys, gpt2_dir, kb):
    from rag.cli import main

    base = ["generate", "--model", gpt2_dir, "--kb", str(kb.path), *PROMPTS, "--max-length", "96", "--doc-max-length", "24",
            "--max-new-tokens", "5", "--no-retrieval"]
    assert main(base + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(rows) == 2 and all(r["passages"] == [] and r["answered_with"] == "no_retrieval" for r in rows)
    assert main(base) == 0
    assert "answered without retrieval" in capsys.readouterr().out
    assert main(base + ["--stride", "4"]) == 2
    assert "drop --stride" in capsys.readouterr().err


def test_serve_returns_the_fields(rag_pipe, nli_dirs):
    from fastapi.testclient import TestClient

    from rag.serve.app import create_app

    with TestClient(create_app(rag_pipe, nli=NLIScorer.from_pretrained(nli_dirs["no"]))) as client:
        r = client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 4})
        assert r.status_code == 200, r.text
        assert [a["answered_with"] for a in r.json()["answers"]] == ["no_retrieval"] * 2
        assert r.json()["answers"][0]["nli_entailment"][0]["entailment"] < 0.01
        r = client.post("/generate", json={"questions": QUESTIONS, "max_new_tokens": 4, "nli_threshold": 0.0})
        assert [a["answered_with"] for a in r.json()["answers"]] == ["retrieval"] * 2  # P >= 0 always holds
        r = client.post("/generate", json={"questions": QUESTIONS[:1], "max_new_tokens": 4, "nli": False})
        assert r.json()["answers"][0]["answered_with"] is None and r.json()["answers"][0]["passages"]
        assert client.post("/generate", json={"questions": QUESTIONS, "nli_threshold": 1.5}).status_code == 422
        assert client.post("/generate", json={"questions": QUESTIONS, "nli": "yes"}).status_code == 422
    with TestClient(create_app(rag_pipe)) as client:
        r = client.post("/generate", json={"questions": QUESTIONS, "nli": True})
        assert r.status_code == 400 and "rag serve --nli" in r.json()["detail"]
        assert client.post("/generate",
                           json={"questions": QUESTIONS[:1], "max_new_tokens": 3}).json()["answers"][0]["answered_with"] is None
    with pytest.raises(ConfigError, match="NLIScorer"):
        create_app(rag_pipe, nli=nli_dirs["no"])


def test_hotswap_eval_records_the_branch(rag_pipe, kb, nli_dirs, tmp_path):
    from rag.eval.hotswap_eval import evaluate_hotswap

    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answers": ["x"]}) + "\n" for q in QUESTIONS))
    for model, share in (("yes", 1.0), ("no", 0.0)):
        res = evaluate_hotswap(rag_pipe, [kb.path], [qa], max_new_tokens=3, show_progress=False, nli=nli_dirs[model])
        assert res.answered_with_retrieval == [[share]]
        assert "answered with retrieval" in res.table() and res.settings["nli_threshold"] == 0.5
    assert evaluate_hotswap(rag_pipe, [kb.path], [qa], max_new_tokens=3, show_progress=False).answered_with_retrieval is None


def test_rag_answers_do_not_repeat_bigrams_by_default(rag_pipe):
    """The reader's default generation config forbids repeated bigrams (no "tasks tasks tasks tasks"); explicit options
    and an imported transformers checkpoint (hf_compat) keep transformers' 0."""
    reader = rag_pipe.reader
    assert reader._generation_config(None, None, 1, {}).no_repeat_ngram_size == DEFAULT_NO_REPEAT_NGRAM == 2
    assert reader._generation_config(None, None, 1, {"no_repeat_ngram_size": 0}).no_repeat_ngram_size == 0
    reader.model.config.hf_compat = True
    try:
        assert reader._generation_config(None, None, 1, {}).no_repeat_ngram_size == 0
    finally:
        reader.model.config.hf_compat = False
    for a in rag_pipe.generate(QUESTIONS, max_new_tokens=12, min_new_tokens=12):
        ids = a.token_ids
        bigrams = list(zip(ids, ids[1:]))
        assert len(bigrams) == len(set(bigrams)), ids
