"""Passages fitted to a reader's window at build time (`rag index build --max-passage-tokens N [--tokenizer DIR]`), and
the default reader's window covering its knowledge base's passages."""

from __future__ import annotations

import json

import pytest

from rag.cli import main
from rag.cli.passage_window import QUESTION_TOKENS, demo_reader_window, fit_to_window, prompt_overhead
from rag.demo import load_demo_corpus
from rag.demo.model import demo_checkpoint_dir
from rag.generation.prompts import PromptFormat, tokenize_prompts
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage, fit_passages
from rag.utils.errors import ConfigError

WORDS = lambda texts: [len(t.split()) for t in texts]  # noqa: E731 - a tokenizer whose tokens are words


def test_fit_passages_cuts_at_sentence_ends_keeps_order_title_and_every_word():
    text = "One two three. Four five six seven. Eight nine. " + " ".join(f"w{i}" for i in range(9)) + "."
    p = Passage("doc", "T", text)
    out = list(fit_passages([p, Passage("short", "S", "a b")], lambda _: 4, WORDS))
    assert [q.id for q in out] == ["doc-0", "doc-1", "doc-2", "doc-3", "doc-4", "doc-5", "short"]
    assert all(len(q.text.split()) <= 4 for q in out) and {q.title for q in out[:-1]} == {"T"}
    assert out[0].text == "One two three." and out[1].text == "Four five six seven."
    assert " ".join(q.text for q in out[:-1]).split() == text.split()  # nothing lost, nothing repeated


def test_a_sentence_over_the_budget_is_cut_at_words_into_the_fewest_pieces():
    words = [f"w{i}" for i in range(1000)]
    out = list(fit_passages([Passage("d", "T", " ".join(words))], lambda _: 7, WORDS))
    assert [len(p.text.split()) for p in out] == [7] * 142 + [6] and " ".join(p.text for p in out).split() == words


def test_fit_passages_keeps_a_passage_that_fits_unchanged():
    p = Passage("x", "T", "a b c. d e.")
    assert list(fit_passages([p], lambda _: 5, WORDS)) == [p]


def test_every_fitted_prompt_fits_the_window(tiny_bart_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bart_dir)
    fmt = PromptFormat()
    passages = load_demo_corpus()[:20]
    window = prompt_overhead(tok, fmt, "Praseodymium") + 40
    fitted, record = fit_to_window(passages, window, tok, "tiny", fmt)
    assert record["split"] == len(fitted) - len(passages) > 0
    question = "what is it?"  # the window keeps QUESTION_TOKENS for a question: this one's difference is given back
    extra = len(tok(question, add_special_tokens=False)["input_ids"]) - QUESTION_TOKENS
    found = tokenize_prompts(tok, fmt, [question] * len(fitted), [[p] for p in fitted], window + extra)
    assert not any(found.truncated)
    assert record["longest_prompt"] <= window


def test_index_build_splits_to_the_window_and_records_it(tmp_path, tiny_bart_dir):
    corpus = tmp_path / "c.jsonl"
    long = " ".join(f"Sentence {i} has five words." for i in range(30))
    corpus.write_text(json.dumps({"id": "a", "title": "A", "text": long}) + "\n"
                      + json.dumps({"id": "b", "title": "B", "text": "Short."}) + "\n")
    out = tmp_path / "kb"
    assert main(["index", "build", "--corpus", str(corpus), "--encoder", "minilm", "--out", str(out), "--index", "flat",
                 "--quiet", "--max-passage-tokens", "120", "--tokenizer", tiny_bart_dir]) == 0
    kb = KnowledgeBase.open(out)
    record = kb.manifest.build["passage_tokens"]
    assert record["max_passage_tokens"] == 120 and record["longest_prompt"] <= 120 and 0 < record["split"] <= len(kb) - 2
    assert [p.id for p in kb.all_passages()][-1] == "b"


def test_a_window_smaller_than_the_template_is_one_line(tmp_path, tiny_bart_dir, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"title": "A", "text": "x y"}) + "\n")
    assert main(["index", "build", "--corpus", str(corpus), "--encoder", "minilm", "--out", str(tmp_path / "kb"),
                 "--quiet", "--max-passage-tokens", "10", "--tokenizer", tiny_bart_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-passage-tokens 10 is smaller than the prompt template" in err
    assert not (tmp_path / "kb").exists()
    with pytest.raises(ConfigError, match="raise it above"):
        fit_to_window([], 3, __import__("transformers").AutoTokenizer.from_pretrained(tiny_bart_dir), "tiny")


def test_the_default_readers_window_reads_every_demo_passage_whole():
    """The default model's stored window (checkpoints/demo_causal) holds each demo passage's prompt with a 32-token
    question, in the demo LM's own tokenizer (read from its GGUF file)."""
    from rag.generators.demo_lm import build_gguf_tokenizer, find_gguf, read_gguf_tokenizer

    tok = build_gguf_tokenizer(read_gguf_tokenizer(find_gguf()))
    stored = json.loads((demo_checkpoint_dir() / "rag_config.json").read_text())["config"]["max_context_length"]
    assert stored >= demo_reader_window(tok)
