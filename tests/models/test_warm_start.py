"""The warm-started generator: frozen pretrained encoder + fresh BERT decoder with tied frozen embeddings."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rag.generators.warm_start import (
    WEIGHTS_FILE,
    build_warm_start_generator,
    cache_encoder_outputs,
    is_warm_start,
    load_seq2seq,
    load_warm_start,
    save_generator,
)
from rag.models.rag.model import RagModel, RagModelConfig
from rag.utils.errors import ConfigError, IntegrityError

CONTEXTS = ["Iron / Symbol: Fe. Atomic number: 26. // what is the symbol of iron?", "Neon / a noble gas // which gas?"]
TARGETS = ["Fe", "noble gas"]


@pytest.fixture(scope="module", params=["plain", "pointer", "continuation", "bigram"])
def built(tiny_bert_dir, request):
    continuation = {"continuation": True, "bigram": "bigram"}.get(request.param, False)
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=2, pointer=request.param != "plain",
                                          continuation=continuation, seed=0)
    with torch.no_grad():  # move the decoder away from its initialisation so round trips are meaningful
        for p in gen.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    return gen.eval(), tok


def _logits(gen, tok, contexts=CONTEXTS, targets=TARGETS):
    enc = tok(list(contexts), padding=True, return_tensors="pt")
    lab = tok(list(targets), padding=True, return_tensors="pt")["input_ids"]
    return gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=lab, use_cache=False).logits


def test_encoder_and_embeddings_frozen_and_tied(built):
    gen, tok = built
    assert is_warm_start(gen)
    assert not any(p.requires_grad for p in gen.encoder.parameters())
    emb = gen.decoder.bert.embeddings.word_embeddings.weight
    assert gen.decoder.cls.predictions.decoder.weight is emb and not emb.requires_grad
    assert torch.equal(emb, gen.encoder.embeddings.word_embeddings.weight)
    assert gen.config.decoder_start_token_id == tok.cls_token_id and gen.config.eos_token_id == tok.sep_token_id
    trainable = {n for n, p in gen.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("decoder.", "copy_")) for n in trainable)


def test_save_load_round_trip_keeps_only_trained_weights(built, tmp_path):
    from safetensors import safe_open

    gen, tok = built
    save_generator(gen, tok, tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
    assert keys and not any(k.startswith("encoder.") for k in keys)
    assert "decoder.bert.embeddings.word_embeddings.weight" not in keys
    loaded, ltok = load_seq2seq(tmp_path)
    assert is_warm_start(loaded)
    torch.testing.assert_close(_logits(loaded, ltok), _logits(gen, tok), rtol=0, atol=0)
    assert not any(p.requires_grad for p in loaded.encoder.parameters())


def test_a_whole_model_save_pretrained_directory_loads(built, tmp_path):
    """transformers' save_pretrained of the whole generator (frozen encoder included) is a generator directory too: it
    loads with the same logits instead of failing with 'save the generator again'."""
    gen, tok = built
    gen.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_seq2seq(tmp_path)
    assert is_warm_start(loaded)
    torch.testing.assert_close(_logits(loaded, ltok), _logits(gen, tok), rtol=0, atol=1e-6)


def test_load_refuses_other_encoder_weights_and_altered_files(built, tmp_path):
    gen, tok = built
    save_generator(gen, tok, tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rag_warm_start"]["fingerprint"] = "0" * 64
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError, match="fingerprint"):
        load_warm_start(tmp_path)

    save_generator(gen, tok, tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / WEIGHTS_FILE))
    state.pop(sorted(state)[0])
    save_file(state, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(IntegrityError, match="missing"):
        load_warm_start(tmp_path)
    os.remove(tmp_path / WEIGHTS_FILE)
    with pytest.raises(IntegrityError, match=WEIGHTS_FILE):
        load_warm_start(tmp_path)


def test_cached_encoder_gives_identical_logits_and_encodes_each_context_once(built):
    gen, tok = built
    want = _logits(gen, tok)
    calls = []
    hook = gen.encoder.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        with cache_encoder_outputs(gen) as cache:
            first = _logits(gen, tok)
            again = _logits(gen, tok, CONTEXTS[::-1], TARGETS[::-1])
    finally:
        hook.remove()
    assert len(cache) == 2 and len(calls) == 1
    torch.testing.assert_close(first, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(again, want.flip(0), rtol=0, atol=1e-6)
    assert type(gen.encoder).__name__ != "_CachedEncoder"  # restored


def test_cache_refused_for_trainable_encoder(tiny_bert_dir):
    gen, _ = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, seed=0)
    gen.encoder.requires_grad_(True)
    with pytest.raises(ConfigError, match="trainable"):
        with cache_encoder_outputs(gen):
            pass


def test_greedy_decoding_matches_transformers_generate(built):
    """Our decoder (generic KV-cache path, one context, prior 1) emits transformers' greedy tokens."""
    from rag.generation.decoding import GenerationConfig, encode_contexts, rag_token_generate

    gen, tok = built
    enc = tok(CONTEXTS, padding=True, return_tensors="pt")
    ours = rag_token_generate(gen, encode_contexts(gen, enc["input_ids"], enc["attention_mask"]), torch.zeros(2, 1),
                              GenerationConfig(num_beams=1, max_new_tokens=8))
    ref = gen.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=8, do_sample=False,
                       num_beams=1)
    width = min(ours.sequences.shape[1], ref.shape[1])
    assert torch.equal(ours.sequences[:, :width], ref[:, :width])


@pytest.mark.parametrize("pointer", [False, True], ids=["plain", "pointer"])
def test_rag_model_checkpoint_references_the_encoder(tiny_bert_dir, tmp_path, demo_passages, pointer):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_bert_dir), tmp_path / "kb", index="flat", show_progress=False)
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=pointer, seed=0)
    model = RagModel(TextEncoder(tiny_bert_dir), gen, tok, kb, RagModelConfig(n_docs=2, max_context_length=64)).train()
    assert not model.generator.encoder.training  # the frozen encoder stays deterministic
    generator_params = {id(p) for p in model.parameter_groups()["generator"]}
    assert not generator_params & {id(p) for p in gen.encoder.parameters()}
    questions, answers = ["which element is a noble gas?"], ["neon"]
    loss = model(questions, answers).loss
    model.eval()
    want = model(questions, answers).loss
    model.save_pretrained(tmp_path / "ck")
    saved = {p.relative_to(tmp_path / "ck").as_posix() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert "generator/model.safetensors" in saved
    loaded = RagModel.from_pretrained(tmp_path / "ck")
    assert type(loaded.generator) is type(gen)
    torch.testing.assert_close(loaded(questions, answers).loss, want, rtol=0, atol=1e-6)
    assert torch.isfinite(loss)


def test_generator_loss_on_the_retrieved_passage_equals_the_rag_loss_with_one_document(tiny_bert_dir, tmp_path, demo_passages):
    """RagModel.generator_loss with the top-1 passage is the RAG loss at n_docs=1 (prior p(z|x) = 1)."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_bert_dir), tmp_path / "kb", index="flat", show_progress=False)
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, seed=0)
    questions, answers = ["which element is a noble gas?", "what is the symbol of iron?"], ["neon", "Fe"]
    for marg in ("sequence", "token"):
        model = RagModel(TextEncoder(tiny_bert_dir), gen, tok, kb, RagModelConfig(n_docs=1, marginalization=marg)).eval()
        retrieved, _ = model.retrieve(questions, n_docs=1)
        top = [ps[0] for ps in retrieved.passages]
        torch.testing.assert_close(model.generator_loss(questions, answers, top), model(questions, answers).loss, rtol=0,
                                   atol=1e-5)
    # closed book: the question alone is the input
    enc = tok(questions, padding=True, return_tensors="pt")
    lab = tok(answers, padding=True, return_tensors="pt")
    dec_in = torch.cat([torch.full((2, 1), tok.cls_token_id), lab["input_ids"][:, :-1]], 1)
    logp = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=dec_in).logits.log_softmax(-1)
    nll = -(logp.gather(-1, lab["input_ids"][..., None]).squeeze(-1) * lab["attention_mask"]).sum(1).mean()
    torch.testing.assert_close(model.generator_loss(questions, answers), nll, rtol=0, atol=1e-5)
    with pytest.raises(Exception, match="one target"):
        model.generator_loss(questions, answers[:1])


def test_continuation_needs_the_copy_head(tiny_bert_dir, tmp_path):
    with pytest.raises(ConfigError, match="continuation needs warm_start.pointer"):
        build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=False, continuation=True)
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=False, seed=0)
    save_generator(gen, tok, tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rag_warm_start"]["continuation"] = True  # an edited config.json
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError, match="continuation needs pointer"):
        load_warm_start(tmp_path)


def test_bigram_continuation_is_recorded_and_checked(tiny_bert_dir, tmp_path):
    """``continuation: bigram`` adds a second continuation head, recorded as such; a unigram generator (``true``, as saved
    before the option existed) loads without it; an unknown value or a record that disagrees with the weights is refused."""
    with pytest.raises(ConfigError, match="'bigram'"):
        build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation="trigram")
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation="bigram", seed=0)
    assert gen.copy_continue is not None and gen.copy_continue_bigram is not None and gen.needs_copy_history
    save_generator(gen, tok, tmp_path / "bigram")
    assert json.loads((tmp_path / "bigram" / "config.json").read_text())["rag_warm_start"]["continuation"] == "bigram"
    loaded, _ = load_warm_start(tmp_path / "bigram")
    torch.testing.assert_close(loaded.copy_continue_bigram.bias, gen.copy_continue_bigram.bias, rtol=0, atol=0)
    unigram, utok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation=True, seed=0)
    save_generator(unigram, utok, tmp_path / "unigram")
    loaded, _ = load_warm_start(tmp_path / "unigram")
    assert loaded.copy_continue is not None and loaded.copy_continue_bigram is None and not loaded.needs_copy_history
    cfg_file = tmp_path / "bigram" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rag_warm_start"]["continuation"] = True  # the bigram head's weights, recorded as unigram
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError):
        load_warm_start(tmp_path / "bigram")
    cfg["rag_warm_start"]["continuation"] = "trigram"
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError, match="trigram"):
        load_warm_start(tmp_path / "bigram")
