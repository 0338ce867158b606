"""Every path's decoding defaults come from the one table, ``rag.generation.options.FALLBACK_DEFAULTS``: change an entry
and the CLI's help, the HTTP and OpenAI requests, the readers' resolved search settings and training's validation
decoding all follow it."""

import argparse
from types import SimpleNamespace

import pytest

from rag.cli import build_parser
from rag.cli.options import generation_options
from rag.generation import options as opts
from rag.generation.options import GenerationConfig, GenerationOptions, resolve_generation
from rag.models.rag.config import RagModelConfig
from rag.pipeline.readers import RagReader
from rag.serve.bodies import GenerateRequest
from rag.serve.openai_schema import ChatRequest, plan_generation
from rag.training.reader_modes import generation_config
from rag.training.settings import Decoding
from rag.utils.errors import ConfigError

PATCHED = {"num_beams": 3, "max_new_tokens": 7, "length_penalty": 0.5, "decoding": "fast", "no_repeat_ngram_size": 4}


@pytest.fixture
def patched(monkeypatch):
    for name, value in PATCHED.items():
        monkeypatch.setitem(opts.FALLBACK_DEFAULTS, name, value)


def _search(config: GenerationConfig) -> tuple:
    return config.num_beams, config.max_new_tokens, config.length_penalty, config.no_repeat_ngram_size


def _subparser(name: str) -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def test_every_path_reads_the_one_table(patched):
    expected = (3, 7, 0.5, 4)
    # the CLI: the help says the table's value, and a flag nobody typed resolves to it
    generate = _subparser("generate")
    help_text = " ".join(generate.format_help().split())
    assert "else 7)" in help_text and "else 3)" in help_text and "default fast" in help_text
    args = generate.parse_args(["what is argon?"])
    assert _search(generation_options(args).resolve()) == expected
    # POST /generate and the OpenAI routes: an unset field is not sent to the reader, which resolves it from the table
    body = GenerateRequest.model_validate({"questions": ["what is argon?"]})
    assert _search(GenerationOptions(**body.options()).resolve()) == expected
    plan = plan_generation(ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "q"}]}), None)
    assert _search(GenerationOptions(**plan.kw).resolve()) == expected
    # the RAG reader, over a model storing nothing, and over one storing num_beams (the stored setting wins)
    reader = SimpleNamespace(model=SimpleNamespace(config=RagModelConfig()))
    assert _search(RagReader._generation_config(reader, None, None, 1, {})) == expected
    reader.model.config = RagModelConfig(generation={"num_beams": 5})
    assert _search(RagReader._generation_config(reader, None, None, 1, {})) == (5, 7, 0.5, 4)
    # training's validation decoding, and the export it stores
    assert Decoding().resolved() == {"num_beams": 3, "max_new_tokens": 7, "length_penalty": 0.5, "sequence_decoding": "fast"}
    assert _search(generation_config(SimpleNamespace(config=RagModelConfig()))) == expected


def test_resolution_order_and_the_one_check():
    stored = {"num_beams": 4, "max_length": 20, "no_repeat_ngram_size": 3}
    config = resolve_generation({"num_beams": None}, stored)
    assert (config.num_beams, config.max_length, config.no_repeat_ngram_size) == (4, 20, 3)
    config = GenerationOptions(max_new_tokens=5, num_beams=2).resolve(stored)  # a call's length replaces the stored one
    assert (config.num_beams, config.max_length, config.max_new_tokens) == (2, None, 5)
    assert resolve_generation({}, None, trained=False).no_repeat_ngram_size == 0  # imported or frozen: no n-gram guard
    assert resolve_generation({}, None).no_repeat_ngram_size == opts.FALLBACK_DEFAULTS["no_repeat_ngram_size"]
    # one range per option: a call's bound (--num-beams at most 16), the resolved form's domain, training's YAML field
    with pytest.raises(ConfigError, match=r"num_beams=17 \(--num-beams 17\)"):
        GenerationOptions(num_beams=17)
    assert GenerationConfig(num_beams=17).num_beams == 17  # the per-call bound is not the value's domain
    with pytest.raises(ConfigError, match="GenerationConfig.num_beams must be an integer >= 1"):
        GenerationConfig(num_beams=0)
    with pytest.raises(ConfigError, match="GenerationConfig.top_p must be a number between"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(ConfigError, match="model.decoding.num_beams must be an integer >= 1"):
        Decoding(num_beams=0)
    with pytest.raises(ConfigError, match="model.decoding.sequence_decoding must be one of"):
        Decoding(sequence_decoding="slow")


def test_stored_settings_are_checked_when_the_config_is_made():
    """A model's stored decoding settings (``rag.generation`` of a recipe, ``rag_config.json`` of an export) fail when
    the config is made, naming the key, not at the first decoding after a training run's first validation."""
    assert RagModelConfig(generation={"extractive": True, "num_beams": 17}).generation["num_beams"] == 17
    with pytest.raises(ConfigError, match=r"RagModelConfig.generation.num_beams=0 must be an integer >= 1"):
        RagModelConfig(generation={"num_beams": 0})
    # `--model.rag.generation.extractive true` reaches the mapping as the string 'true': the error says how to write it
    with pytest.raises(ConfigError, match=r"generation.extractive must be true or false, got the string 'true'; "
                                          r"write it unquoted .*--model.rag.generation '\{extractive: true\}'"):
        RagModelConfig(generation={"extractive": "true"})
