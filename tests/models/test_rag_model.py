"""RagModel: retrieval + generator + marginal NLL, gradients, frozen/BM25 modes, checkpoints, bad input."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from model_support import sharpen

from rag.generation import marginalize as M
from rag.models.rag.model import CHECKPOINT_CONFIG, RagModel, RagModelConfig
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError, RagError

QUESTIONS = ["What is the atomic number of iron?", "Who discovered oxygen?", "Which element has symbol Na?"]
ANSWERS = ["26", "Joseph Priestley", "Sodium"]
K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_dpr_question_dir, tiny_dpr_context_dir, tiny_bart_dir):
    root = tmp_path_factory.mktemp("rag_model_sharp")
    return {
        "question": sharpen(tiny_dpr_question_dir, root / "q", "question", 0.2, 1),
        "context": sharpen(tiny_dpr_context_dir, root / "c", "context", 0.2, 2),
        "generator": sharpen(tiny_bart_dir, root / "g", "generator", 0.3, 3),
    }


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory, demo_passages, dirs):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("rag_model_kb") / "kb"
    KnowledgeBase.build(demo_passages[:30], TextEncoder(dirs["context"]), out, index="flat", bm25=True, show_progress=False)
    return str(out)


@pytest.fixture(scope="module")
def make_model(kb_dir, dirs):
    def make(**overrides) -> RagModel:
        torch.manual_seed(0)
        return RagModel.from_components(dirs["question"], dirs["generator"], kb_dir, n_docs=K, **overrides)

    return make


@pytest.fixture(scope="module")
def model(make_model):
    return make_model().eval()


def _brute_force_logprobs(model: RagModel, questions, answers):
    """Per-document target log-probs (B, K, T) and mask, one generator call per context, via the
    generator's own `labels=` shifting — independent of RagModel's loss code."""
    inputs = model.prepare_inputs(questions)
    tok = model.generator_tokenizer
    rows = []
    for b, answer in enumerate(answers):
        labels = tok([answer], return_tensors="pt")["input_ids"]
        per_doc = []
        for k in range(K):
            i = b * K + k
            m = inputs.context_attention_mask[i].bool()
            ids = inputs.context_input_ids[i][m].unsqueeze(0)
            logits = model.generator(input_ids=ids, labels=labels).logits  # (1, T, V)
            per_doc.append(torch.log_softmax(logits, -1)[0].gather(-1, labels[0].unsqueeze(-1)).squeeze(-1))
        rows.append(torch.stack(per_doc))
    return rows, inputs.doc_scores


def _with(model: RagModel, **changes) -> RagModel:
    model.config = dataclasses.replace(model.config, **changes)
    return model


def test_losses_equal_brute_force_eq1_and_eq2(model):
    per_doc, doc_scores = _brute_force_logprobs(model, QUESTIONS, ANSWERS)
    prior = torch.log_softmax(doc_scores, -1)
    seq = torch.stack([-torch.logsumexp(prior[b] + per_doc[b].sum(-1), 0) for b in range(3)])
    tok = torch.stack([-torch.logsumexp(prior[b].unsqueeze(-1) + per_doc[b], 0).sum() for b in range(3)])
    try:
        with torch.no_grad():
            out = _with(model, reduce_loss=False)(QUESTIONS, ANSWERS)
            token_loss = _with(model, marginalization="token")(QUESTIONS, ANSWERS).loss
            mean_loss = _with(model, marginalization="sequence", reduce_loss=True)(QUESTIONS, ANSWERS).loss
    finally:
        _with(model, marginalization="sequence", reduce_loss=True)
    assert out.loss.shape == (3,)
    torch.testing.assert_close(out.loss, seq, atol=1e-5, rtol=1e-5)  # RAG-Sequence, Eq. 1
    torch.testing.assert_close(token_loss, tok, atol=1e-5, rtol=1e-5)  # RAG-Token, Eq. 2
    torch.testing.assert_close(mean_loss, seq.mean(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seq, tok)


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_gathered_fast_path_equals_full_vocab_nll(model, marginalization):
    """Without smoothing the loss gathers target logits; it must equal marginalize's full-vocabulary NLL."""
    m = _with(model, marginalization=marginalization, reduce_loss=False)
    try:
        with torch.no_grad():
            inputs = m.prepare_inputs(QUESTIONS)
            labels, mask = m.tokenize_targets(ANSWERS)
            logits = m.generator_logits(inputs, labels)
            lp = torch.log_softmax(logits, -1)
            fn = M.rag_sequence_nll if marginalization == "sequence" else M.rag_token_nll
            losses = {}
            for exclude_bos in (False, True):
                _with(m, exclude_bos_score=exclude_bos)
                fast = m.loss_from_logits(logits, labels, mask, inputs.doc_scores)
                full = fn(lp, labels, M.doc_log_prior(inputs.doc_scores), mask=mask, reduce="none",
                          exclude_bos_score=exclude_bos, bos_token_id=m.bos_token_id)
                torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
                losses[exclude_bos] = fast
            assert torch.isfinite(losses[False]).all()
            assert not torch.allclose(losses[False], losses[True])  # BART targets start with <s>
    finally:
        _with(model, marginalization="sequence", reduce_loss=True, exclude_bos_score=False)


def test_contexts_padded_to_longest_and_built_from_retrieved_passages(model):
    inputs = model.prepare_inputs(QUESTIONS)
    assert inputs.context_input_ids.shape[0] == 3 * K
    width = inputs.context_input_ids.shape[1]
    assert width < model.config.max_context_length  # not padded to a fixed 300
    assert inputs.context_attention_mask.sum(1).max() == width  # the longest context fills the width
    p = inputs.retrieved.passages[1][2]
    assert str(inputs.context_strings[1 * K + 2]) == f"{p.title} / {p.text} // {QUESTIONS[1]}"
    assert inputs.retrieved.rows.shape == (3, K)


def test_doc_scores_are_q_dot_stored_doc_embeds(model, kb_dir):
    from rag.knowledge.knowledge_base import KnowledgeBase

    retrieved, doc_scores = model.retrieve(QUESTIONS)
    q = torch.from_numpy(model.question_encoder.encode(QUESTIONS, show_progress=False))
    stored = KnowledgeBase.open(kb_dir).get_embeddings(retrieved.rows)
    torch.testing.assert_close(doc_scores.detach(), torch.einsum("bd,bkd->bk", q, stored), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(doc_scores.detach(), retrieved.scores, atol=1e-4, rtol=1e-4)  # flat index agrees


def test_gradients_reach_query_encoder_only_through_doc_scores(make_model):
    m = make_model().train()
    out = m(QUESTIONS[:2], ANSWERS[:2])
    assert out.doc_scores.requires_grad
    assert out.retrieved.doc_embeds is None or not out.retrieved.doc_embeds.requires_grad
    q_params = [p for p in m.question_encoder.parameters()]
    g_scores = torch.autograd.grad(out.loss, out.doc_scores, retain_graph=True)[0]
    out.loss.backward()
    grads = [p.grad for p in q_params]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.generator.parameters())
    # Invariant: the query encoder's gradient is exactly the one flowing through doc_scores.
    m.zero_grad()
    out2 = m(QUESTIONS[:2], ANSWERS[:2])
    via_scores = torch.autograd.grad(out2.doc_scores, q_params, grad_outputs=g_scores, allow_unused=True)
    for g, v in zip(grads, via_scores):
        if g is None:
            assert v is None or v.abs().sum() == 0
        else:
            torch.testing.assert_close(g, v, atol=1e-6, rtol=1e-4)
    assert set(map(id, m.parameter_groups()["query_encoder"])) == set(map(id, q_params))


def test_frozen_query_encoder_gets_no_gradient(make_model):
    m = make_model(freeze_query_encoder=True).train()
    assert not m.question_encoder.training  # frozen encoder stays deterministic
    out = m(QUESTIONS, ANSWERS)
    assert not out.doc_scores.requires_grad
    out.loss.backward()
    assert all(p.grad is None for p in m.question_encoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.generator.parameters())
    assert m.parameter_groups()["query_encoder"] == []
    assert len(m.parameter_groups()["generator"]) == len(list(m.generator.parameters()))


def test_bm25_retrieval_uses_bm25_scores_as_logits(make_model, kb_dir):
    from rag.knowledge.knowledge_base import KnowledgeBase

    m = make_model(retrieval="bm25").train()
    out = m(QUESTIONS, ANSWERS)
    scores, rows = KnowledgeBase.open(kb_dir).bm25.search(QUESTIONS, K)
    assert torch.equal(out.retrieved.rows, torch.from_numpy(rows))
    torch.testing.assert_close(out.doc_scores, torch.from_numpy(scores).float())
    assert out.retrieved.passages[2][0].title == "Sodium"  # BM25 finds the symbol "Na" question's element
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is None for p in m.question_encoder.parameters())
    assert any(p.grad is not None for p in m.generator.parameters())


def test_bm25_needs_a_bm25_index(tmp_path, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir, tiny_bart_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    KnowledgeBase.build(demo_passages[:5], TextEncoder(tiny_dpr_context_dir), tmp_path / "kb", index="flat", show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="no BM25 index"):
        RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tmp_path / "kb", retrieval="bm25")


def test_kb_dimension_mismatch_fails_at_construction(tmp_path, demo_passages, tiny_dpr_question_dir, tiny_bart_dir):
    from rag.knowledge.knowledge_base import KnowledgeBase

    vectors = np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32)
    KnowledgeBase.from_embeddings(demo_passages[:5], vectors, {"name": "other", "dim": 16, "fingerprint": "x"},
                                  tmp_path / "kb16", index="flat", show_progress=False)
    with pytest.raises(KnowledgeBaseError, match=r"dim=16.*dim=32"):
        RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tmp_path / "kb16")


def test_save_load_round_trip_gives_identical_loss(model, tmp_path, kb_dir):
    from rag.knowledge.knowledge_base import KnowledgeBase

    model.save_pretrained(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / CHECKPOINT_CONFIG).read_text())
    kb = KnowledgeBase.open(kb_dir)
    assert meta["knowledge_base"]["version"] == kb.version
    assert (tmp_path / "ckpt" / meta["knowledge_base"]["path"]).resolve() == kb.path.resolve()  # relative: it is near
    assert meta["config"] == model.config.to_dict()
    assert "generator/model.safetensors" in meta["files"] and "question_encoder/model.safetensors" in meta["files"]
    assert not list((tmp_path / "ckpt").rglob("*.npy")) and not list((tmp_path / "ckpt").rglob("*.faiss"))  # KB not copied
    loaded = RagModel.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == model.config
    with torch.no_grad():
        assert torch.equal(loaded(QUESTIONS, ANSWERS).loss, model(QUESTIONS, ANSWERS).loss)
    overridden = RagModel.from_pretrained(tmp_path / "ckpt", n_docs=2)
    assert overridden.config.n_docs == 2 and overridden.retrieve(QUESTIONS)[1].shape == (3, 2)
    model.save_pretrained(tmp_path / "ckpt")  # re-saving over an earlier checkpoint is allowed
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(RagError, match="not a RagModel checkpoint"):
        model.save_pretrained(tmp_path / "other")


def test_altered_or_missing_weights_raise_integrity_error(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "generator" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"generator/model\.safetensors.*SHA-256"):
        RagModel.from_pretrained(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "question_encoder" / "model.safetensors").unlink()
    with pytest.raises(IntegrityError, match=r"question_encoder/model\.safetensors.*missing"):
        RagModel.from_pretrained(tmp_path / "ckpt")


def test_knowledge_base_override_checks_embedding_space(model, tmp_path, demo_passages, tiny_bert_dir, caplog):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    model.save_pretrained(tmp_path / "ckpt")
    other = tmp_path / "kb_other"
    KnowledgeBase.build(demo_passages[:8], TextEncoder(tiny_bert_dir), other, index="flat", show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="allow_encoder_change"):
        RagModel.from_pretrained(tmp_path / "ckpt", knowledge_base=other)
    with caplog.at_level(logging.WARNING):
        m = RagModel.from_pretrained(tmp_path / "ckpt", knowledge_base=other, allow_encoder_change=True)
    assert m.knowledge_base.path == other and "version" in caplog.text
    assert m.retrieve(QUESTIONS[:1])[0].passages[0][0] in demo_passages[:8]


def test_keep_question_truncation_vs_hf_right_truncation(make_model):
    keep = make_model(max_context_length=24)
    right = make_model(max_context_length=24, truncation="hf")
    tok = keep.generator_tokenizer
    q_ids = tok(" // " + QUESTIONS[0], add_special_tokens=False)["input_ids"]
    with pytest.warns(UserWarning):
        a = keep.prepare_inputs(QUESTIONS[:1])
    with pytest.warns(UserWarning):
        b = right.prepare_inputs(QUESTIONS[:1])
    assert a.n_truncated == b.n_truncated == K
    for row in a.context_input_ids.tolist():
        assert row[-1 - len(q_ids):-1] == q_ids  # question kept just before </s>
    assert all(row[-1 - len(q_ids):-1] != q_ids for row in b.context_input_ids.tolist())
    assert a.context_input_ids.shape[1] == b.context_input_ids.shape[1] == 24


def test_bad_inputs_raise_rag_error_naming_the_item(model):
    with pytest.raises(RagError, match=r"questions\[1\] is empty"):
        model(["ok?", "  "], ["a", "b"])
    with pytest.raises(RagError, match=r"targets\[0\] is empty"):
        model(["ok?", "fine?"], ["", "b"])
    with pytest.raises(RagError, match="2 questions but 1 targets"):
        model(["ok?", "fine?"], ["a"])
    with pytest.raises(RagError, match="single string"):
        model("ok?", ["a"])
    with pytest.raises(RagError, match=r"questions\[0\] is int, not a string"):
        model([3], ["a"])
    with pytest.raises(RagError, match="questions is empty"):
        model([], [])
    with pytest.raises(RagError, match="n_docs"):
        model(["ok?"], ["a"], n_docs=0)
    with pytest.raises(RagError, match=r"k \(passages to return; .* holds 30\) must be an integer between 1 and 30, got 31"):
        model(["ok?"], ["a"], n_docs=31)


def test_config_validation():
    with pytest.raises(ConfigError, match="marginalization"):
        RagModelConfig(marginalization="doc")
    with pytest.raises(ConfigError, match="label_smoothing"):
        RagModelConfig(label_smoothing=1.0)
    with pytest.raises(ConfigError, match="n_docs"):
        RagModelConfig(n_docs=0)
    with pytest.raises(ConfigError, match="unknown field"):
        RagModelConfig.from_dict({"n_doc": 3})
    assert RagModelConfig(hf_compat=True).effective_truncation == "hf"
    assert RagModelConfig().mask_padded_contexts is True  # only the transformers importer turns it off
    with pytest.raises(ConfigError, match="mask_padded_contexts must be true or false"):
        RagModelConfig(mask_padded_contexts="no")


def test_label_smoothing_changes_loss_and_keeps_gradients(make_model):
    smooth = make_model(label_smoothing=0.1).eval()
    b = smooth(QUESTIONS[:2], ANSWERS[:2])
    with torch.no_grad():
        a = _with(smooth, label_smoothing=0.0)(QUESTIONS[:2], ANSWERS[:2]).loss
    assert torch.isfinite(b.loss) and not torch.allclose(a, b.loss)
    b.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in smooth.question_encoder.parameters())


def test_t5_generator_works_and_has_no_bos_to_exclude(tmp_path, demo_texts, kb_dir, dirs):
    from rag.generators.tiny import save, tiny_t5, train_sentencepiece_tokenizer

    sp = train_sentencepiece_tokenizer(demo_texts, vocab_size=300, workdir=tmp_path)
    t5_dir = save(tiny_t5(sp), sp, tmp_path / "t5")
    m = RagModel.from_components(dirs["question"], t5_dir, kb_dir, n_docs=2).train()
    labels, mask = m.tokenize_targets(ANSWERS[:2])
    assert m.bos_token_id is None and labels[0, mask[0]].tolist()[-1] == sp.eos_token_id
    out = m(QUESTIONS[:2], ANSWERS[:2])
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.question_encoder.parameters())
    with torch.no_grad():
        m.eval()
        assert torch.equal(m(QUESTIONS[:2], ANSWERS[:2]).loss, _with(m, exclude_bos_score=True)(QUESTIONS[:2], ANSWERS[:2]).loss)


def test_from_pretrained_of_a_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such RagModel checkpoint directory"):
        RagModel.from_pretrained(tmp_path / "nowhere")


def test_unchanged_query_encoder_is_saved_by_reference_and_verified_on_load(tmp_path, kb_dir, dirs):
    import shutil

    from rag.knowledge.encoders import TextEncoder

    qdir = tmp_path / "qenc"  # a private copy: the test alters it below
    shutil.copytree(dirs["question"], qdir)
    m = RagModel.from_components(str(qdir), dirs["generator"], kb_dir, n_docs=K, freeze_query_encoder=True).eval()
    m.save_pretrained(tmp_path / "ckpt", reference_query_encoder=True)
    meta = json.loads((tmp_path / "ckpt" / CHECKPOINT_CONFIG).read_text())
    entry = meta["question_encoder"]
    assert entry["reference"] is True and entry["name"] == str(qdir) and "dir" not in entry
    assert entry["fingerprint"] == m.question_encoder.identity()["fingerprint"]
    assert not (tmp_path / "ckpt" / "question_encoder").exists()
    assert meta["files"] and all(f.startswith("generator/") for f in meta["files"])
    loaded = RagModel.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(QUESTIONS, ANSWERS).loss, m(QUESTIONS, ANSWERS).loss)

    # Weights changed in memory (as end-to-end training would): referencing is refused.
    changed = RagModel.from_components(str(qdir), dirs["generator"], kb_dir, n_docs=K)
    with torch.no_grad():
        next(changed.question_encoder.parameters()).add_(0.01)
    with pytest.raises(RagError, match="weights differ"):
        changed.save_pretrained(tmp_path / "ckpt2", reference_query_encoder=True)
    assert not (tmp_path / "ckpt2").exists()

    # The referenced encoder changes on disk: loading names it and refuses, unless told to trust it.
    altered = TextEncoder(str(qdir))
    with torch.no_grad():
        next(altered.model.parameters()).mul_(1.5)
    altered.save_pretrained(qdir, overwrite=True)
    with pytest.raises(IntegrityError, match="fingerprint"):
        RagModel.from_pretrained(tmp_path / "ckpt")
    assert RagModel.from_pretrained(tmp_path / "ckpt",
                                    verify="none").question_encoder.identity()["fingerprint"] != entry["fingerprint"]
    shutil.rmtree(qdir)
    with pytest.raises(ConfigError, match="references the query encoder"):
        RagModel.from_pretrained(tmp_path / "ckpt")


def test_save_never_replaces_other_data_even_with_overwrite(model, tmp_path):
    """A checkpoint save replaces an earlier checkpoint, never a folder of the user's files (overwrite or not)."""
    from rag.utils.io import atomic_directory

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "n.txt").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(RagError, match="never replaced"):
            model.save_pretrained(notes, overwrite=overwrite)
    assert (notes / "n.txt").read_text() == "precious" and sorted(p.name for p in notes.iterdir()) == ["n.txt"]
    model.save_pretrained(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "ckpt")  # an earlier checkpoint is replaced
    assert (tmp_path / "ckpt" / CHECKPOINT_CONFIG).is_file()
    with pytest.raises(TypeError, match="replaces="):  # every writer must say what it may replace
        with atomic_directory(tmp_path / "x", overwrite=True):
            pass


# ---------------------------------------------------------------- retrieval temperature τ: p(z|x) = softmax(s / τ)
@pytest.mark.parametrize("tau", [0.5, 0.05])
def test_temperature_divides_scores_in_both_marginalizations(make_model, tau):
    model = make_model(retrieval_temperature=tau, reduce_loss=False).eval()
    per_doc, doc_scores = _brute_force_logprobs(model, QUESTIONS, ANSWERS)
    prior = torch.log_softmax(doc_scores / tau, -1)
    seq = torch.stack([-torch.logsumexp(prior[b] + per_doc[b].sum(-1), 0) for b in range(3)])
    tok = torch.stack([-torch.logsumexp(prior[b].unsqueeze(-1) + per_doc[b], 0).sum() for b in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(model(QUESTIONS, ANSWERS).loss, seq, atol=1e-5, rtol=1e-5)
        token = make_model(retrieval_temperature=tau, reduce_loss=False, marginalization="token").eval()
        torch.testing.assert_close(token(QUESTIONS, ANSWERS).loss, tok, atol=1e-5, rtol=1e-5)
        plain = make_model(reduce_loss=False).eval()
        assert not torch.allclose(plain(QUESTIONS, ANSWERS).loss, seq, atol=1e-4)  # τ changes the loss


@pytest.mark.parametrize("marginalization", ["token", "sequence"])
def test_decoding_and_provenance_use_the_temperature(make_model, marginalization):
    from rag.generation.decoding import encode_contexts, rag_sequence_generate, rag_token_generate
    from rag.generation.search import GenerationConfig
    from rag.models.rag.generate import generate_for_questions
    from rag.pipeline.readers import RagReader

    tau = 0.05
    model = make_model(retrieval_temperature=tau, marginalization=marginalization).eval()
    config = GenerationConfig(num_beams=2, max_length=6)
    got = generate_for_questions(model, QUESTIONS, config)
    contexts = encode_contexts(model.generator, got.inputs.context_input_ids, got.inputs.context_attention_mask)
    logits = got.inputs.doc_scores / tau
    if marginalization == "token":
        want = rag_token_generate(model.generator, contexts, logits, config)
    else:
        want = rag_sequence_generate(model.generator, contexts, logits, config)
    assert torch.equal(got.output.sequences, want.sequences)
    # provenance: raw retrieval scores, priors from scores / τ
    [retrieval] = RagReader(model).retrieve(QUESTIONS[:1], k=3)
    scores = torch.tensor([p.score for p in retrieval.passages])
    torch.testing.assert_close(torch.tensor([p.prior for p in retrieval.passages]), torch.softmax(scores / tau, 0))
    [answer] = RagReader(model).generate(QUESTIONS[:1], n_docs=3, max_new_tokens=5)
    priors = torch.tensor([p.prior for p in answer.passages])
    torch.testing.assert_close(priors, torch.softmax(torch.tensor([p.score for p in answer.passages]) / tau, 0))


def test_learned_temperature_trains_and_is_saved_as_its_value(make_model, tmp_path):
    model = make_model(learn_retrieval_temperature=True, retrieval_temperature=0.5)
    assert model.retrieval_temperature == pytest.approx(0.5)
    param = model.log_retrieval_temperature
    assert any(p is param for p in model.parameter_groups()["query_encoder"])
    model(QUESTIONS, ANSWERS).loss.backward()
    assert param.grad is not None and param.grad.abs() > 0
    with torch.no_grad():
        param.fill_(torch.log(torch.tensor(0.2)))
        param.grad = None
    model.eval()
    model.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / CHECKPOINT_CONFIG).read_text())["config"]
    assert saved["retrieval_temperature"] == pytest.approx(0.2) and saved["learn_retrieval_temperature"] is True
    loaded = RagModel.from_pretrained(tmp_path / "ckpt").eval()
    assert loaded.retrieval_temperature == pytest.approx(0.2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(QUESTIONS, ANSWERS).loss, model(QUESTIONS, ANSWERS).loss)
    fixed = RagModel.from_pretrained(tmp_path / "ckpt", learn_retrieval_temperature=False)
    assert fixed.retrieval_temperature == pytest.approx(0.2) and not hasattr(fixed, "log_retrieval_temperature")


@pytest.mark.parametrize("bad", [0, -1.0, 1000, True, "0.1"])
def test_bad_temperature_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError, match="retrieval_temperature"):
        RagModelConfig(retrieval_temperature=bad)
    with pytest.raises(ConfigError, match="learn_retrieval_temperature"):
        RagModelConfig(learn_retrieval_temperature="yes")
