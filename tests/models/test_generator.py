"""load_generator: one loader that tells seq2seq generators from causal LMs, through save_pretrained directories."""

import pytest

from rag.generators import tiny
from rag.generators.load import check_generator_kind, generator_kind, load_generator
from rag.utils.errors import ConfigError


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gens")
    tok = tiny.train_bpe_tokenizer(tiny.sample_texts(), vocab_size=300)
    bart = tiny.save(tiny.tiny_bart(tok), tok, root / "bart")
    gpt2 = tiny.save(tiny.tiny_gpt2(tok), tok, root / "gpt2")
    return {"bart": bart, "gpt2": gpt2, "tok": tok}


def test_kinds_are_recognised_from_the_saved_config(dirs):
    model, tok, kind = load_generator(dirs["bart"])
    assert kind == "seq2seq" and generator_kind(model) == "seq2seq" and not model.training
    model, tok, kind = load_generator(dirs["gpt2"])
    assert kind == "causal" and generator_kind(model) == "causal"
    assert tok.pad_token_id is not None


def test_wrong_kind_is_refused_with_the_fix(dirs):
    with pytest.raises(ConfigError, match="decoder-only.*seq2seq.*needed"):
        load_generator(dirs["gpt2"], kind="seq2seq")
    with pytest.raises(ConfigError, match="seq2seq.*decoder-only.*needed"):
        load_generator(dirs["bart"], kind="causal")
    model, _, _ = load_generator(dirs["gpt2"])
    with pytest.raises(ConfigError, match="rag.models.ralm.model"):
        check_generator_kind(model, "seq2seq", "RagModel")


def test_causal_tokenizer_without_pad_pads_with_eos(dirs, tmp_path):
    from transformers import GPT2TokenizerFast

    model, _, _ = load_generator(dirs["gpt2"])
    tok = GPT2TokenizerFast.from_pretrained(dirs["gpt2"])
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    _, loaded, _ = load_generator(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id is not None


def test_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a generator config"):
        load_generator(tmp_path / "nope")
