"""Generator contexts: transformers' exact strings and ids, question-keeping truncation, question round trip."""

from __future__ import annotations

import pickle
import re
import warnings

import pytest
import torch

from rag.generation.contexts import (
    Context,
    ContextFormat,
    ContextTruncationWarning,
    build_contexts,
    question_round_trip,
    tokenize_contexts,
)
from rag.knowledge.passages import Passage
from rag.utils.errors import ConfigError, RagError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital and largest city of France.",
    "Who wrote Hamlet? William Shakespeare wrote it around 1600.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Hydrogen is the lightest element; helium is the second. / // \"quoted\"",
]
QUESTIONS = ["Who wrote  Hamlet?", "What is the capital of FRANCE?"]
PASSAGES = [
    [
        Passage("a", '"Hamlet"', "Hamlet is a tragedy  written by William Shakespeare. "),
        Passage("b", '"Quoted', 'a "title" that opens a quote'),
        Passage("c", 'plain"', "   three spaces lead this text"),
    ],
    [
        Passage("d", "Paris", "Paris is the capital of France."),
        Passage("e", '""', ""),
        Passage("f", "Water", "Water boils at 100 degrees."),
    ],
]


@pytest.fixture(scope="module")
def tokenizers():
    from rag.generators.tiny import train_bpe_tokenizer, train_wordpiece_tokenizer

    return train_bpe_tokenizer(TEXTS, vocab_size=300), train_wordpiece_tokenizer(TEXTS, vocab_size=200)


class _Recorder:
    """Wraps a tokenizer and records the strings transformers' retriever tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.tokenizer(texts, **kwargs)


def _hf_retriever(tokenizers, max_combined_length=300, **config_kwargs):
    """transformers' RagRetriever without an index: only its post-processing is used."""
    from transformers import BartConfig, DPRConfig, RagConfig, RagRetriever

    gen_tok, q_tok = tokenizers
    config = RagConfig.from_question_encoder_generator_configs(
        DPRConfig(vocab_size=len(q_tok)), BartConfig(vocab_size=len(gen_tok)),
        n_docs=3, max_combined_length=max_combined_length, **config_kwargs,
    )
    recorder = _Recorder(gen_tok)
    retriever = RagRetriever(config, question_encoder_tokenizer=q_tok, generator_tokenizer=recorder, index=object(),
                             init_retrieval=False)
    return retriever, recorder


def _hf_docs():
    return [{"title": [p.title for p in docs], "text": [p.text for p in docs]} for docs in PASSAGES]


# ----------------------------------------------------------------------------- strings


@pytest.mark.parametrize("prefix", [None, "answer: "])
def test_strings_match_transformers_retriever(tokenizers, prefix):
    retriever, recorder = _hf_retriever(tokenizers)
    retriever.postprocess_docs(_hf_docs(), QUESTIONS, prefix, 3, return_tensors=None)
    ours = build_contexts(QUESTIONS, PASSAGES, ContextFormat(prefix=prefix or ""))
    assert len(ours) == 6
    assert [str(c) for c in ours] == recorder.calls[0]
    assert ours == recorder.calls[0]  # a Context is the string itself


def test_join_literal_and_quirks():
    fmt = ContextFormat()
    assert fmt.join('"Paris"', "Paris is  the capital.",
                    "capital of france?") == "Paris / Paris is the capital. // capital of france?"
    # one quote stripped at each end only; three spaces collapse to two (a single replace pass)
    assert fmt.join('""x""', "a   b", "q") == '"x" / a  b // q'
    assert ContextFormat(title_sep=" | ", doc_sep=" || ", prefix="qa: ").join("T", "x", "q") == "qa: T | x || q"


def test_build_contexts_order_is_doc_major():
    contexts = build_contexts(["q0", "q1"], [[Passage(str(k), f"t{b}{k}", "x") for k in range(3)] for b in range(2)])
    assert [c.split(" / ")[0] for c in contexts] == ["t00", "t01", "t02", "t10", "t11", "t12"]
    assert [c.question_part for c in contexts] == [" // q0"] * 3 + [" // q1"] * 3


@pytest.mark.parametrize("text", ["ends with a space ", "ends with two  ", "x", ""])
@pytest.mark.parametrize("doc_sep", [" // ", "  //  ", "//"])
def test_context_parts_rebuild_the_string(text, doc_sep):
    fmt = ContextFormat(doc_sep=doc_sep)
    ctx = fmt.context("T", text, "why  so?")
    assert ctx.passage_part + ctx.question_part == ctx == fmt.join("T", text, "why  so?")
    assert ctx.question_part.endswith("why so?")
    restored = pickle.loads(pickle.dumps(ctx))
    assert restored == ctx and restored.question_start == ctx.question_start and isinstance(restored, Context)


def test_format_from_transformers_config():
    from transformers import BartConfig, DPRConfig, RagConfig

    config = RagConfig.from_question_encoder_generator_configs(
        DPRConfig(), BartConfig(prefix="summarize: "), title_sep=" :: ", doc_sep=" ## ", prefix="ignored by transformers"
    )
    assert ContextFormat.from_hf_config(config) == ContextFormat(title_sep=" :: ", doc_sep=" ## ", prefix="summarize: ")
    assert ContextFormat.from_hf_config(RagConfig.from_question_encoder_generator_configs(DPRConfig(),
                                                                                          BartConfig())) == ContextFormat()


def test_build_contexts_rejects_misaligned_input():
    with pytest.raises(RagError, match="2 questions but 1"):
        build_contexts(["a", "b"], [PASSAGES[0]])
    with pytest.raises(RagError, match="question 1 has 2 passages"):
        build_contexts(["a", "b"], [PASSAGES[0], PASSAGES[1][:2]])


# ----------------------------------------------------------------------------- token ids


def _long_case():
    long_text = " ".join(["Hamlet is a tragedy written by William Shakespeare."] * 12)
    passages = [[Passage("a", "Hamlet", long_text), Passage("b", "Paris", "Paris is the capital of France.")]]
    return ["Who wrote Hamlet?"], passages


@pytest.mark.parametrize("long", [False, True])
def test_hf_truncation_matches_transformers_ids(tokenizers, long):
    max_length = 40
    questions, passages = _long_case() if long else (QUESTIONS, PASSAGES)
    n_docs = len(passages[0])
    retriever, _ = _hf_retriever(tokenizers, max_combined_length=max_length)
    docs = [{"title": [p.title for p in row], "text": [p.text for p in row]} for row in passages]
    hf_ids, hf_mask = retriever.postprocess_docs(docs, questions, None, n_docs, return_tensors="pt")
    contexts = build_contexts(questions, passages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextTruncationWarning)
        ours = tokenize_contexts(tokenizers[0], contexts, max_length, truncation="hf", padding="max_length")
    assert torch.equal(ours["input_ids"], hf_ids) and torch.equal(ours["attention_mask"], hf_mask)
    lengths = [len(row) for row in tokenizers[0]([str(c) for c in contexts])["input_ids"]]
    assert ours["truncated"].tolist() == [n > max_length for n in lengths]
    assert ours["truncated"].any() and not ours["truncated"].all()
    # plain right truncation by the tokenizer itself
    plain = tokenizers[0]([str(c) for c in contexts], truncation=True, max_length=max_length)["input_ids"]
    assert [row[: len(p)].tolist() for row, p in zip(ours["input_ids"], plain)] == plain


def test_short_contexts_pad_to_longest_without_warning(tokenizers):
    gen_tok = tokenizers[0]
    contexts = build_contexts(QUESTIONS, PASSAGES)
    plain = gen_tok([str(c) for c in contexts])["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tokenize_contexts(gen_tok, contexts, max_length=300)
        hf = tokenize_contexts(gen_tok, contexts, max_length=300, truncation="hf")
    width = max(len(p) for p in plain)
    assert out["input_ids"].shape == (6, width) and width < 300
    assert torch.equal(out["input_ids"], hf["input_ids"])
    for row, mask, p in zip(out["input_ids"], out["attention_mask"], plain):
        assert row[: len(p)].tolist() == p and mask.sum() == len(p)
        assert (row[len(p):] == gen_tok.pad_token_id).all()
    assert not out["truncated"].any()


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    from rag.generators.tiny import train_sentencepiece_tokenizer

    return train_sentencepiece_tokenizer(TEXTS * 3, vocab_size=80, workdir=tmp_path_factory.mktemp("spm"))


@pytest.mark.parametrize("which", ["bpe", "sentencepiece"])
def test_keep_question_keeps_the_question(tokenizers, sentencepiece_tokenizer, which):
    tok = tokenizers[0] if which == "bpe" else sentencepiece_tokenizer
    max_length = 48  # the short context (38 / 46 tokens) fits, the long one (~480) does not
    questions, passages = _long_case()
    contexts = build_contexts(questions, passages)
    with pytest.warns(ContextTruncationWarning, match="question is kept"):
        out = tokenize_contexts(tok, contexts, max_length)
    assert out["truncated"].tolist() == [True, False]
    ids = out["input_ids"][0].tolist()
    assert len(ids) <= max_length and out["attention_mask"][0].sum() == max_length
    content = tok(str(contexts[0]), add_special_tokens=False)["input_ids"]
    tail = tok(contexts[0].question_part, add_special_tokens=False)["input_ids"]
    with_specials = tok("x")["input_ids"]
    before = with_specials[: with_specials.index(tok("x", add_special_tokens=False)["input_ids"][0])]
    after = with_specials[len(before) + len(tok("x", add_special_tokens=False)["input_ids"]) :]
    kept = ids[len(before) : max_length - len(after)]
    # a prefix of the passage's own tokens, then the question's tokens, then the closing specials
    assert kept[len(kept) - len(tail) :] == tail and content[: len(kept) - len(tail)] == kept[: len(kept) - len(tail)]
    assert ids[:len(before)] == before and ids[max_length - len(after):] == after
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded.startswith("Hamlet") and "Who wrote Hamlet?" in decoded

    with pytest.warns(ContextTruncationWarning, match="can remove the question"):
        hf = tokenize_contexts(tok, contexts, max_length, truncation="hf")
    assert "Who wrote Hamlet?" not in tok.decode(hf["input_ids"][0], skip_special_tokens=True)
    # the short context is untouched by either mode
    assert out["input_ids"][1].tolist() == hf["input_ids"][1].tolist()


def test_overlong_question_and_plain_strings_never_crash(tokenizers):
    gen_tok = tokenizers[0]
    question = " ".join(["why is the water boiling at sea level"] * 10)
    contexts = build_contexts([question], [[Passage("a", "Water", "Water boils.")]])
    with pytest.warns(ContextTruncationWarning) as record:
        out = tokenize_contexts(gen_tok, contexts, 16)
    assert any("questions are longer" in str(w.message) for w in record)
    assert out["input_ids"].shape == (1, 16) and out["truncated"].tolist() == [True]
    assert out["input_ids"][0, -1].item() == gen_tok.eos_token_id

    with pytest.warns(ContextTruncationWarning) as record:
        plain = tokenize_contexts(gen_tok, [str(contexts[0])], 16)
    assert [str(w.message).startswith("Over-long contexts given as plain strings") for w in record] == [True]
    assert torch.equal(plain["input_ids"], torch.tensor([gen_tok(str(contexts[0]), truncation=True, max_length=16)["input_ids"]]))


def test_tokenize_rejects_bad_options(tokenizers):
    gen_tok = tokenizers[0]
    with pytest.raises(ConfigError, match="truncation"):
        tokenize_contexts(gen_tok, ["x"], 10, truncation="left")
    with pytest.raises(ConfigError, match="max_length=2"):
        tokenize_contexts(gen_tok, ["x"], 2)
    empty = tokenize_contexts(gen_tok, [], 10)
    assert empty["input_ids"].shape == (0, 0) and empty["truncated"].shape == (0,)


# ----------------------------------------------------------------------------- question round trip


def test_question_round_trip_matches_transformers(tokenizers):
    retriever, _ = _hf_retriever(tokenizers)
    q_tok = tokenizers[1]
    question_input_ids = q_tok(QUESTIONS, padding=True, return_tensors="pt")["input_ids"]
    # what RagRetriever.__call__ does before joining
    expected = retriever.question_encoder_tokenizer.decode(question_input_ids, skip_special_tokens=True)
    ours = question_round_trip(q_tok, QUESTIONS)
    assert ours == expected
    assert ours[1] == ours[1].lower() and ours[0] != QUESTIONS[0]
    assert len(q_tok(question_round_trip(q_tok, QUESTIONS, max_length=4)[1], add_special_tokens=False)["input_ids"]) == 2


# ---------------------------------------------------------------------------- passage focus

PAGE = ("abash: cause to be embarrassed. abatable: capable of being abated. abator: a person who abates a nuisance. "
        "abbacy: the jurisdiction or office of an abbot. abbess: the superior of a group of nuns.")


def _sentences(text: str) -> list[str]:
    return sorted(re.split(r"(?<=[.])\s+", text.strip()))


@pytest.mark.parametrize("term", ["abator", "abbacy", "abbess"])
def test_focus_starts_at_the_entry_the_question_names_and_keeps_every_sentence(term):
    from rag.generation.contexts import focus_on_question

    out = focus_on_question(PAGE, f"What does {term} mean?")
    assert out.startswith(f"{term}:")
    assert _sentences(out) == _sentences(PAGE)
    # a rotation: the entries after the named one follow it in order, the ones before it come last
    start = PAGE.index(f"{term}:")
    assert out == PAGE[start:] + " " + PAGE[:start].rstrip()


@pytest.mark.parametrize("question", ["What does abash mean?", "Who are you?", "What does it mean?", ""])
def test_focus_leaves_the_passage_alone_when_its_start_is_best_or_nothing_is_shared(question):
    from rag.generation.contexts import focus_on_question

    assert focus_on_question(PAGE, question) == PAGE
    assert focus_on_question("One sentence about abator only", "What does abator mean?") == "One sentence about abator only"


def test_focus_weighs_rare_question_words_over_words_every_sentence_has():
    from rag.generation.contexts import focus_on_question

    text = "Iron is a metal. Iron rusts in water. Iron was discovered in antiquity."
    # "iron" is in every sentence; "discovered" names the one sentence that answers
    assert focus_on_question(text, "When was iron discovered?").startswith("Iron was discovered")
    # a longer shared word outweighs a shorter one, frame words ("what", "does") count for nothing
    text = "Salt: sodium chloride. Sodium: a soft metal. Soft: not hard."
    assert focus_on_question(text, "What does sodium mean, soft?").startswith("Sodium: a soft metal")
