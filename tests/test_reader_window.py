"""A RAG reader paired with a knowledge base measures once whether its window holds the passages
(rag.pipeline.windows), for a causal and a seq2seq generator alike, and says so in one line when it does not."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import rag
from rag.cli import main
from rag.generators.base import QUESTION_TOKENS
from rag.generators.load import as_generator, load_generator
from rag.generators.tiny import save, tiny_gpt2
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.models.rag.model import RagModel, RagModelConfig
from rag.pipeline.windows import CHARS_PER_TOKEN, PassageWindowWarning, passage_window, warn_cut_passages


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("window_gpt2"))


@pytest.fixture(scope="module")
def kb_dir(build_hybrid_kb):
    return build_hybrid_kb(30, "window_kb")


def _generators(gpt2_dir, tiny_bart_dir):
    return {"causal": gpt2_dir, "seq2seq": tiny_bart_dir}


def _question(tokenizer) -> str:
    """A question of exactly QUESTION_TOKENS tokens in `tokenizer`."""
    count = lambda q: len(tokenizer(q, add_special_tokens=False)["input_ids"])  # noqa: E731
    q = next(q for n in range(1, QUESTION_TOKENS + 1) for end in ("", "?", " ?", "x")
             if count(q := " ".join(["x"] * n) + end) == QUESTION_TOKENS)
    assert len(tokenizer(q, add_special_tokens=False)["input_ids"]) == QUESTION_TOKENS
    return q


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_the_count_is_what_the_generator_cuts_reading_each_passage(kind, gpt2_dir, tiny_bart_dir, kb_dir):
    model = RagModel.from_components(None, _generators(gpt2_dir, tiny_bart_dir)[kind], kb_dir,
                                     RagModelConfig(n_docs=2, max_context_length=400))
    kb, lm = model.knowledge_base, model.lm
    passages = kb.all_passages()
    lengths = lm.prompt_lengths(passages, model.config)
    window = sorted(lengths)[len(lengths) // 2]  # about half of the passages are cut
    model.config = RagModelConfig(n_docs=2, max_context_length=window)
    question = _question(lm.tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read = lm.contexts([question], [passages], model.config)  # every passage read once, with that question
    found = passage_window(lm, model.config, kb)
    assert found.cut == read.n_truncated > 0 and found.measured == found.passages == len(passages) == 30
    assert found.longest == max(lengths) and not found.from_manifest and not found.sampled
    with pytest.warns(PassageWindowWarning) as caught:
        assert warn_cut_passages(model) == found
    [line] = [str(w.message) for w in caught]
    assert "\n" not in line and f"{found.cut} of its 30 passages" in line and f"max_context_length={window}" in line
    assert "--max-passage-tokens" in line and f"{found.fraction:.0%}" in line
    model.config = RagModelConfig(n_docs=2, max_context_length=max(lengths))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all fit: nothing said
        assert warn_cut_passages(model).cut == 0


def test_a_large_knowledge_base_is_measured_on_a_fixed_sample_and_says_so(gpt2_dir, kb_dir):
    model = RagModel.from_components(None, gpt2_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=64))
    first = passage_window(model.lm, model.config, model.knowledge_base, limit=10)
    assert first == passage_window(model.lm, model.config, model.knowledge_base, limit=10)
    assert (first.measured, first.passages, first.sampled) == (10, 30, True) and first.cut > 0
    assert "of a random sample of 10 of its 30 passages" in first.summary("kb", "tok")


def test_rag_load_warns_once_and_rag_generate_says_it_in_its_one_end_of_run_line(gpt2_dir, kb_dir, tmp_path, capsys):
    out = tmp_path / "model"
    RagModel.from_components(None, gpt2_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=64)).save_pretrained(out)
    with pytest.warns(PassageWindowWarning, match="max_context_length=64"):
        rag.load(out)
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "Who discovered oxygen?", "--max-new-tokens", "2", "--json"]) == 0
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if "longer than the reader's window" in ln]  # once, in the end-of-run line
    assert line.startswith("rag generate: ") and len(err.strip().splitlines()) == 1 and "PassageWindowWarning" not in err, err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rag.load(out, max_context_length=1024)  # a window that holds them: no word


def test_a_knowledge_base_built_for_the_window_is_taken_at_its_manifest(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    long = " ".join(f"Sentence {i} has five words." for i in range(40))
    corpus.write_text(json.dumps({"id": "a", "title": "A", "text": long}) + "\n"
                      + json.dumps({"id": "b", "title": "B", "text": "Short."}) + "\n")
    kb = tmp_path / "kb"
    assert main(["index", "build", "--corpus", str(corpus), "--encoder", "minilm", "--out", str(kb), "--index", "flat",
                 "--quiet", "--max-passage-tokens", "120", "--tokenizer", gpt2_dir]) == 0
    # the default reader's layout (its system prompt; a tokenizer without a chat template leaves it out)
    model = RagModel.from_components(None, gpt2_dir, kb, RagModelConfig(
        n_docs=1, max_context_length=120, system_prompt="Answer with a few words taken from the passage."))
    recorded = passage_window(model.lm, model.config, model.knowledge_base)
    assert recorded.from_manifest and recorded.cut == 0 and recorded.longest <= 120
    other = RagModelConfig(n_docs=1, max_context_length=120, prompt_template="{passage}\nQ: {question}\nA:")
    measured = passage_window(model.lm, other, model.knowledge_base)  # another layout: measured, not taken on trust
    assert not measured.from_manifest and measured.measured == len(model.knowledge_base) and measured.cut == 0
    narrow = passage_window(model.lm, RagModelConfig(n_docs=1, max_context_length=80, system_prompt=model.config.system_prompt),
                            model.knowledge_base)  # narrower than the build's window: measured
    assert not narrow.from_manifest and narrow.cut > 0


def test_a_whole_document_is_measured_up_to_a_bound(gpt2_dir, tmp_path):
    huge = Passage("book", "Book", "word " * 200_000)  # a million characters: a corpus read with --words-per-passage 0
    passages = [huge, Passage("short", "S", "A short one.")]
    kb = KnowledgeBase.from_embeddings(passages, np.eye(2, 4, dtype=np.float32), {"name": "synthetic", "dim": 4,
                                       "fingerprint": "synthetic-4"}, tmp_path / "kb", index="flat", show_progress=False)
    model, tok, _ = load_generator(gpt2_dir)
    generator, settings = as_generator(model, tok), RagModelConfig(max_context_length=64)
    found = passage_window(generator, settings, kb)
    bounded = Passage("book", "Book", huge.text[:CHARS_PER_TOKEN * 64])
    assert (found.cut, found.measured) == (1, 2) and found.longest == generator.prompt_lengths([bounded], settings)[0] > 64
