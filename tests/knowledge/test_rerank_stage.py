"""The rerank stage (rag.knowledge.rerank): a cross-encoder over any sequence-classification directory rescoring the top K,
composed by the retriever factory and applied by every reader; its bad input; the distilled reranker's round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rag.cli import main
from rag.demo.model import CHECKPOINTS_DIR
from rag.eval.runner import evaluate
from rag.generators.tiny import save
from rag.knowledge.bm25 import BM25Retriever
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.rerank import MANIFEST, CrossEncoder, Rerank, RerankingRetriever, passage_text, rerank_stage
from rag.knowledge.retriever_kinds import KnowledgeBaseRetrievers, retriever_for_kind
from rag.models.rag.model import RagModel
from rag.pipeline.api import RagPipeline, load
from rag.training.rerank_distill import RerankDistillModule, teacher_posteriors
from rag.training.reranker import RerankExample, collate
from rag.utils.errors import ConfigError, IntegrityError

QUESTIONS = ["what is the atomic number of argon?", "which element has the symbol Fe?"]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, wordpiece_tokenizer) -> str:
    """A random tiny BertForSequenceClassification (one logit) with its tokenizer, as save_pretrained writes it."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(3)
    config = BertConfig(vocab_size=len(wordpiece_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256, num_labels=1)
    return save(BertForSequenceClassification(config), wordpiece_tokenizer, tmp_path_factory.mktemp("ce") / "ce")


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir) -> CrossEncoder:
    return CrossEncoder.load(cross_encoder_dir)


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_dpr_context_dir, tiny_dpr_question_dir, demo_passages):
    return KnowledgeBase.build(demo_passages[:20], TextEncoder(tiny_dpr_context_dir, role="context"),
                               tmp_path_factory.mktemp("rr") / "kb", index="flat", query_encoder=tiny_dpr_question_dir,
                               bm25=True, show_progress=False)


def _one_by_one(cross_encoder: CrossEncoder, question: str, passages) -> list[float]:
    """Each pair scored alone by the HF model (no batching, no padding): the reference the stage must agree with."""
    model, tok = cross_encoder.model.eval(), cross_encoder.tokenizer
    with torch.no_grad():
        return [float(model(**tok(question, passage_text(p), truncation="only_second", max_length=cross_encoder.max_length,
                                  return_tensors="pt")).logits[0, 0]) for p in passages]


def test_reranking_retriever_keeps_the_cross_encoders_best(cross_encoder, demo_passages):
    bm25 = BM25Retriever.from_passages(demo_passages, show_progress=False)
    candidates = bm25.retrieve(QUESTIONS, 8)
    got = RerankingRetriever(bm25, cross_encoder, candidates=8).retrieve(QUESTIONS, 3)
    for b, q in enumerate(QUESTIONS):
        ref = _one_by_one(cross_encoder, q, candidates.passages[b])
        order = sorted(range(8), key=lambda i: -ref[i])[:3]
        assert [p.id for p in got.passages[b]] == [candidates.passages[b][i].id for i in order]
        assert got.rows[b].tolist() == [int(candidates.rows[b, i]) for i in order]
        # float32 pair logits, batched with padding vs alone: agree to float rounding of a 2-layer model
        assert got.scores[b].tolist() == pytest.approx([ref[i] for i in order], abs=1e-4)
    assert got.rows.shape == got.scores.shape == (2, 3) and got.kb_version == candidates.kb_version


def test_the_factory_composes_it_for_every_kind_and_keeps_rows_aligned(kb, cross_encoder):
    stage = Rerank(cross_encoder, 6)
    for kind in ("dense", "bm25", "hybrid"):
        retriever = retriever_for_kind(kind, kb, rerank=stage)
        assert isinstance(retriever, RerankingRetriever)
        got = retriever.retrieve(QUESTIONS, 2)
        assert [[p.id for p in ps] for ps in got.passages] == [[p.id for p in ps] for ps in kb.get_passages(got.rows)]
        if got.doc_embeds is not None:  # the stored vectors of the kept rows, in the kept order
            stored = torch.as_tensor(kb.get_embeddings(got.rows)).view(2, 2, -1)
            assert torch.allclose(got.doc_embeds, stored)
    assert not isinstance(retriever_for_kind("bm25", kb), RerankingRetriever)


def test_knowledge_base_retrievers_rerank_every_kind_after_use_rerank(kb, cross_encoder):
    served = KnowledgeBaseRetrievers(kb, "bm25")
    assert not isinstance(served.pin().retriever("bm25"), RerankingRetriever)
    served.use_rerank(Rerank(cross_encoder, 5))
    assert isinstance(served.pin().retriever("bm25"), RerankingRetriever)
    assert isinstance(served.pin().retriever("dense"), RerankingRetriever)
    assert isinstance(served.prepare_knowledge_base(kb).retriever("bm25"), RerankingRetriever)  # a swap keeps the stage


@pytest.fixture(scope="module")
def model_dir(kb, tiny_dpr_question_dir, tiny_bart_dir, tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm") / "m"
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, n_docs=2).save_pretrained(out)
    return out


def test_a_rag_model_reads_the_reranked_passages_with_their_scores_as_prior(kb, cross_encoder, model_dir):
    pipe = load(model_dir, knowledge_base=kb.path, rerank=6, reranker=cross_encoder.name)
    plain = RagPipeline(RagModel.from_pretrained(model_dir, knowledge_base=kb.path))
    cands = plain.retrieve(QUESTIONS, k=6)
    [hits] = pipe.retrieve(QUESTIONS[:1], k=2)
    ref = _one_by_one(cross_encoder, QUESTIONS[0], [type("P", (), {"title": p.title, "text": p.text}) for p in cands[0].passages])
    order = sorted(range(6), key=lambda i: -ref[i])[:2]
    assert [p.id for p in hits.passages] == [cands[0].passages[i].id for i in order]
    tau = pipe.model.retrieval_temperature
    z = [ref[i] / tau for i in order]
    prior = [math.exp(v - max(z)) / sum(math.exp(u - max(z)) for u in z) for v in z]
    assert [p.prior for p in hits.passages] == pytest.approx(prior, abs=1e-4)
    [answer] = pipe.generate(QUESTIONS[:1], max_new_tokens=3)
    assert [p.id for p in answer.passages] == [p.id for p in hits.passages]


@pytest.mark.parametrize("kwargs, match", [
    ({"candidates": 4, "reranker": None}, "add --reranker DIR"),
    ({"candidates": None, "reranker": "x"}, "add --rerank K"),
    ({"candidates": 0, "reranker": "x"}, "rerank"),
])
def test_stage_options_refused_in_one_line(kwargs, match, cross_encoder_dir):
    if kwargs["reranker"] == "x":
        kwargs["reranker"] = cross_encoder_dir
    with pytest.raises(ConfigError, match=match) as e:
        rerank_stage(kwargs["candidates"], kwargs["reranker"])
    assert "\n" not in str(e.value)


def test_k_above_the_candidates_and_directories_that_are_not_cross_encoders(cross_encoder, demo_passages, tiny_bert_dir,
                                                                           tmp_path):
    bm25 = BM25Retriever.from_passages(demo_passages, show_progress=False)
    with pytest.raises(ConfigError, match="give --rerank at least 5"):
        RerankingRetriever(bm25, cross_encoder, candidates=3).retrieve(QUESTIONS, 5)
    with pytest.raises(ConfigError, match="not a sequence-classification model") as e:
        rerank_stage(8, tiny_bert_dir)  # a BertModel: no classification head
    assert "\n" not in str(e.value) and tiny_bert_dir in str(e.value)
    with pytest.raises(ConfigError, match="no config.json"):
        rerank_stage(8, str(tmp_path))
    with pytest.raises(ConfigError, match="no such directory"):
        rerank_stage(8, str(tmp_path / "missing"))


def test_evaluate_records_the_stage_and_refuses_it_without_a_model(kb, cross_encoder, model_dir, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": ["x"]}) + "\n" for q in QUESTIONS))
    evaluate(str(model_dir), str(data), tmp_path / "run", knowledge_base=kb.path, ks=(1, 2), progress=False,
             rerank=6, reranker=cross_encoder.name, max_new_tokens=2)
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["rerank"] == {"candidates": 6, "reranker": cross_encoder.name}
    with pytest.raises(ConfigError, match="give --model"):
        evaluate(None, str(data), tmp_path / "run2", knowledge_base=kb.path, rerank=6, reranker=cross_encoder.name)
    with pytest.raises(ConfigError, match="give --rerank at least 2"):  # K below the model's n_docs, before any question
        load(model_dir, knowledge_base=kb.path, rerank=1, reranker=cross_encoder.name)


@pytest.mark.parametrize("argv", [["generate", "what is argon?"], ["serve", "--no-auth"],
                                  ["evaluate", "--model", "demo", "--data", "demo:test", "--out", "{tmp}/run"]])
def test_cli_refuses_rerank_without_reranker_before_loading(argv, capsys, tmp_path):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--rerank", "4"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "add --reranker DIR" in errors[0]


def test_distilled_reranker_round_trip_and_damage(tiny_bert_dir, tmp_path):
    torch.manual_seed(0)
    module = RerankDistillModule(base=tiny_bert_dir, lora_r=4, lora_alpha=8, lora_dropout=0.0, max_length=64)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    docs = [["Argon\nargon is a noble gas", "Iron\niron is a metal", "Neon\nneon glows"]] * 2
    batch = {"prefixes": QUESTIONS, "docs": docs, "lm_loglik": torch.log(torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]]))}
    before = float(module._step(batch, "train"))
    for _ in range(5):  # a few steps of the distillation loss move the adapters and the head
        opt.zero_grad()
        module._step(batch, "train").backward()
        opt.step()
    assert float(module._step(batch, "train")) < before
    out = module.export(tmp_path / "reranker")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["base"]["name"] == tiny_bert_dir and "adapter_model.safetensors" in manifest["files"]
    loaded = CrossEncoder.load(out)
    module.net.eval()
    with torch.no_grad():
        want = module.cross_encoder.pair_texts_logits(QUESTIONS, docs)
    got = loaded.pair_texts_logits(QUESTIONS, docs)
    assert torch.allclose(got, want, atol=1e-4)  # the adapter merged into the base: the same function up to rounding
    adapter = out / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 1
    adapter.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="SHA-256 does not match"):
        CrossEncoder.load(out)


def test_teacher_posterior_is_prior_times_the_readers_likelihood(kb, model_dir):
    model = RagModel.from_pretrained(model_dir, knowledge_base=kb.path, reduce_loss=False).eval()
    answers = ["argon", "iron"]
    examples = teacher_posteriors(model, QUESTIONS, answers, 2)
    retrieved, doc_scores = model.retrieve(QUESTIONS, n_docs=2)
    log_prior = torch.log_softmax(model.retrieval_logits(doc_scores), -1)
    for b, ex in enumerate(examples):
        assert ex.prefix == QUESTIONS[b] and ex.docs == [passage_text(p) for p in retrieved.passages[b]]
        with torch.no_grad():  # -log p(y | x, z) of each passage alone, through the generator's own loss path
            nll = torch.stack([model.generator_loss([QUESTIONS[b]], [answers[b]], passages=[p])[0]
                               for p in retrieved.passages[b]])
        want = torch.log_softmax(log_prior[b] - nll, -1)
        assert ex.lm_loglik == pytest.approx(want.tolist(), abs=1e-4)  # float32 sums over a handful of tokens
        assert sum(math.exp(v) for v in ex.lm_loglik) == pytest.approx(1.0, abs=1e-5)


def test_distillation_trains_under_lightning_and_exports(tiny_bert_dir, tmp_path):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    docs = ["Argon\nargon is a noble gas", "Iron\niron is a metal", "Neon\nneon glows"]
    examples = [RerankExample(q, docs, [math.log(0.8 if i == j else 0.1) for i in range(3)]) for j, q in enumerate(QUESTIONS)]
    module = RerankDistillModule(base=tiny_bert_dir, lora_r=2, lora_alpha=4, max_length=64, export_dir=str(tmp_path / "out"))
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    loader = DataLoader(examples, batch_size=2, collate_fn=collate)
    trainer.fit(module, loader, loader)
    assert {"val/loss", "val/kl", "val/top1"} <= set(trainer.callback_metrics)
    assert float(trainer.callback_metrics["val/kl"]) >= -1e-6  # a KL divergence
    module.net.eval()  # Lightning leaves it in training mode (dropout)
    with torch.no_grad():
        got = CrossEncoder.load(tmp_path / "out").pair_texts_logits(QUESTIONS, [docs] * 2)
        want = module.cross_encoder.pair_texts_logits(QUESTIONS, [docs] * 2)
    assert torch.allclose(got, want, atol=1e-4)


def test_the_shipped_demo_reranker_loads_verified(demo_passages):
    encoder = CrossEncoder.load(CHECKPOINTS_DIR / "reranker_demo")  # every file's SHA-256 and the base's checked
    assert encoder.max_length == 128 and not encoder.model.training
    scores = encoder.score(QUESTIONS, [demo_passages[:3]] * 2)
    assert scores.shape == (2, 3) and bool(torch.isfinite(scores).all())
