"""The generator as a type: a RagModel reads through its Generator (seq2seq or causal), which owns what it caches, and
every reader names its method and its generator."""

from __future__ import annotations

import copy

import pytest

from rag.generation.decoding import GenerationConfig
from rag.generators.causal import CausalGenerator
from rag.generators.load import load_generator
from rag.generators.seq2seq import Seq2SeqGenerator
from rag.models.rag.generate import generate_for_questions
from rag.models.rag.model import RagModel, RagModelConfig
from rag.pipeline.api import RagPipeline
from rag.pipeline.readers import RalmReader

QUESTIONS = ["What is the atomic number of iron?", "Who discovered oxygen?"]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("generator_type"))


def causal_model(gpt2_dir, kb_dir) -> RagModel:
    return RagModel.from_components(None, gpt2_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=96)).eval()


def test_each_family_is_its_own_generator(gpt2_dir, tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir):
    causal = causal_model(gpt2_dir, tiny_kb_dir)
    seq2seq = RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2)
    assert isinstance(causal.lm, CausalGenerator) and isinstance(seq2seq.lm, Seq2SeqGenerator)
    assert (causal.generator_kind, causal.is_causal, causal.lm.sequence_convention) == ("causal", True, "paper")
    assert (seq2seq.generator_kind, seq2seq.is_causal, seq2seq.lm.sequence_convention) == ("seq2seq", False, "transformers")
    assert causal.lm.model is causal.generator and causal.lm.tokenizer is causal.generator_tokenizer
    assert causal.decoder_start_token_id is None
    assert seq2seq.decoder_start_token_id == seq2seq.generator.config.decoder_start_token_id


def test_the_causal_generator_owns_its_caches_and_a_replaced_generator_starts_empty(gpt2_dir, tiny_kb_dir):
    model = causal_model(gpt2_dir, tiny_kb_dir)
    cfg = GenerationConfig(max_new_tokens=3, num_beams=2)
    first = generate_for_questions(model, QUESTIONS, cfg, marginalization="sequence").output
    cache = model.lm.prefix_cache
    assert cache is not None and len(cache) > 0 and model._prefix_cache is cache and "_prefix_cache" not in model.__dict__
    texts = model.lm.token_texts()
    model.generator = copy.deepcopy(model.generator)  # new weights object (as LoRA wrapping does): nothing cached survives
    assert model.lm.model is model.generator and model.lm.prefix_cache is None and isinstance(model.lm, CausalGenerator)
    assert model.lm.token_texts() is texts  # the tokenizer did not change
    again = generate_for_questions(model, QUESTIONS, cfg, marginalization="sequence").output
    assert (again.sequences == first.sequences).all()
    model.train()
    assert len(model.lm.prefix_cache) == 0


def test_readers_name_their_method_and_generator(gpt2_dir, tiny_kb_dir):
    rag = RagPipeline(causal_model(gpt2_dir, tiny_kb_dir))
    assert (rag.method, rag.generator_kind, rag.reader.description()["reader"]) == ("rag", "causal", "rag")
    assert not hasattr(rag, "kind") and not hasattr(rag.reader, "kind")  # one name per thing: method, generator_kind
    assert rag.reader.generator is rag.model.lm and not rag.reader.continues_prompts
    model, tok, _ = load_generator(gpt2_dir, kind="causal")
    ralm = RagPipeline(RalmReader(model, tok, tiny_kb_dir))
    assert (ralm.method, ralm.generator_kind, ralm.reader.description()["reader"]) == ("ralm", "causal", "ralm")
    assert ralm.reader.generator.tokenizer is tok and ralm.reader.generator.model is model and ralm.reader.continues_prompts
