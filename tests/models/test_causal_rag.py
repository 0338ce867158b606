"""RAG over a causal (decoder-only) generator: the same RagModel, losses and decoders as for BART, checked against
brute-force Eq. 1 / Eq. 2 computed with one forward pass per (question, passage), and against REPLUG's search."""

from __future__ import annotations

import math

import pytest
import torch
from model_support import sharpen

from rag.generation.decoding import GenerationConfig
from rag.generation.prompts import tokenize_prompts
from rag.models.rag.model import RagModel, RagModelConfig
from rag.utils.errors import ConfigError

QUESTIONS = ["What is the atomic number of iron?", "Who discovered oxygen?", "Which element has symbol Na?"]
ANSWERS = ["26", "Joseph Priestley", "Sodium"]
K = 3
# float32 LM passes over different batch shapes (other BLAS kernels, other padding) agree to ~1e-5 per token
TOL = dict(atol=2e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    root = tmp_path_factory.mktemp("causal_rag")
    plain = save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, root / "plain")
    return sharpen(plain, root / "sharp", "causal", 0.4, 5)


@pytest.fixture(scope="module")
def kb_dir(build_hybrid_kb):
    return build_hybrid_kb(30, "causal_rag_kb")


def make(gpt2_dir, kb_dir, **overrides) -> RagModel:
    cfg = dict(n_docs=K, max_context_length=96, reduce_loss=False, retrieval_temperature=0.5)
    cfg.update(overrides)
    return RagModel.from_components(None, gpt2_dir, kb_dir, RagModelConfig(**cfg))


def prompt_rows(model, questions, passages):
    """The unpadded prompt token lists, as RagModel builds them."""
    return tokenize_prompts(model.generator_tokenizer, model.config.prompt_format, questions, passages,
                            model.config.max_context_length).ids


def brute_force_logprobs(model, prompt: list[int], target: list[int]) -> torch.Tensor:
    """log p(y_t | prompt, y_<t) of every target token, one unpadded forward pass."""
    ids = torch.tensor([prompt + target[:-1]])
    with torch.no_grad():
        logits = model.generator(input_ids=ids).logits[0, len(prompt) - 1:].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(target)[:, None]).squeeze(-1)


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_marginal_nll_equals_brute_force_eq1_eq2(gpt2_dir, kb_dir, marginalization):
    model = make(gpt2_dir, kb_dir, marginalization=marginalization).eval()
    with torch.no_grad():
        out = model(QUESTIONS, ANSWERS)
    retrieved, scores = model.retrieve(QUESTIONS)
    prompts = prompt_rows(model, QUESTIONS, retrieved.passages)
    labels, mask = model.tokenize_targets(ANSWERS)
    prior = torch.log_softmax(scores.double() / 0.5, -1)
    for b in range(len(QUESTIONS)):
        target = labels[b][mask[b]].tolist()
        assert target[-1] == model.generator_tokenizer.eos_token_id  # the answer ends with EOS, which is scored
        lp = torch.stack([brute_force_logprobs(model, prompts[b * K + k], target) for k in range(K)])  # (K, T)
        if marginalization == "sequence":  # Eq. 1
            want = -torch.logsumexp(prior[b] + lp.sum(-1), 0)
        else:  # Eq. 2
            want = -torch.logsumexp(prior[b][:, None] + lp, 0).sum()
        torch.testing.assert_close(out.loss[b].double(), want, **TOL)
    per_doc = torch.stack([brute_force_logprobs(model, prompts[k], labels[0][mask[0]].tolist()).sum() for k in range(K)])
    assert float(per_doc.max() - per_doc.min()) > 0.5  # the passages matter: Eq. 1 and Eq. 2 differ on these weights


def test_only_answer_tokens_are_scored(gpt2_dir, kb_dir):
    """Changing the prompt's own tokens' targets cannot change the loss: the loss is a function of answer positions only,
    and a longer answer scores one more token."""
    model = make(gpt2_dir, kb_dir).eval()
    labels, mask = model.tokenize_targets(["Sodium", "Sodium chloride"])
    assert mask.sum(1).tolist()[1] > mask.sum(1).tolist()[0]
    with torch.no_grad():
        short = model(["Which element has symbol Na?"], ["Sodium"]).loss
        longer = model(["Which element has symbol Na?"], ["Sodium chloride"]).loss
    assert not torch.allclose(short, longer)


def test_gradients_reach_the_query_encoder_and_only_the_adapters_of_the_generator(gpt2_dir, kb_dir):
    from rag.generators.lora import LoraSettings, apply_lora

    model = make(gpt2_dir, kb_dir, reduce_loss=True)
    model.generator = apply_lora(model.generator, LoraSettings(r=4, target_modules=["c_attn"]))
    model.train()
    model(QUESTIONS, ANSWERS).loss.backward()
    q_grads = [p.grad for p in model.question_encoder.parameters() if p.grad is not None]
    assert q_grads and sum(float(g.abs().sum()) for g in q_grads) > 0
    named = dict(model.generator.named_parameters())
    trained = [n for n, p in named.items() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)
    assert any(float(named[n].grad.abs().sum()) > 0 for n in trained if "lora_B" in n)  # B starts at 0, A gets no gradient yet


def test_rag_token_decoding_of_a_frozen_causal_generator_is_the_replug_search(gpt2_dir, kb_dir):
    """One implementation: RAG-Token decoding over the K prompts equals REPLUG's ensemble search on the same prompts and
    weights (greedy and beam search), token for token."""
    from rag.models.rag.generate import generate_for_questions
    from rag.models.replug.ensemble import replug_search

    model = make(gpt2_dir, kb_dir).eval()
    retrieved, scores = model.retrieve(QUESTIONS)
    prompts = prompt_rows(model, QUESTIONS, retrieved.passages)
    eos, pad = model.generator_tokenizer.eos_token_id, model.pad_token_id
    for beams in (1, 3):
        cfg = GenerationConfig(max_new_tokens=6, num_beams=beams, num_return_sequences=beams, eos_token_id=eos)
        ours = generate_for_questions(model, QUESTIONS, cfg, marginalization="token").output
        windows = [[prompts[b * K + k] for k in range(K)] for b in range(len(QUESTIONS))]
        streams = [[w[0][-1]] for w in windows]  # the search starts from the prompts' common last token
        log_prior = torch.log_softmax(model.retrieval_logits(scores).float(), -1)
        seqs, beam_scores = replug_search(model.generator, streams, windows, log_prior, cfg, pad=pad)
        assert torch.equal(ours.sequences, seqs)
        torch.testing.assert_close(ours.scores, beam_scores, atol=1e-5, rtol=1e-5)


# max_new_tokens 1: a one-token answer, whose prior transformers' get_nll convention would drop (as it does for every
# one-token answer of a reader whose pad id is its EOS, SmolLM2's): its score must still be Eq. 1, below 0
@pytest.mark.parametrize("max_new_tokens", [5, 1])
def test_rag_sequence_thorough_scores_are_eq1_of_the_returned_answers(gpt2_dir, kb_dir, max_new_tokens):
    from rag.models.rag.generate import generate_for_questions

    model = make(gpt2_dir, kb_dir).eval()
    eos = model.generator_tokenizer.eos_token_id
    found = generate_for_questions(model, QUESTIONS,
                                   GenerationConfig(max_new_tokens=max_new_tokens, num_beams=2, eos_token_id=eos),
                                   marginalization="sequence", decoding="thorough")
    retrieved, scores = found.inputs.retrieved, found.inputs.doc_scores
    prompts = prompt_rows(model, QUESTIONS, retrieved.passages)
    prior = torch.log_softmax(model.retrieval_logits(scores).double(), -1)
    for b, row in enumerate(found.output.sequences.tolist()):
        gen = row[1:]
        target = gen[:gen.index(eos) + 1] if eos in gen else gen
        lp = torch.stack([brute_force_logprobs(model, prompts[b * K + k], target).sum() for k in range(K)])
        torch.testing.assert_close(found.output.scores[b].double(), torch.logsumexp(prior[b] + lp, 0), **TOL)
        assert found.output.scores[b] <= 0
        assert row[0] == prompts[b * K][-1]  # sequences start with the start token: the prompt's last token


@pytest.mark.parametrize("marginalization,decoding,beams", [("sequence", "thorough", 2), ("token", "thorough", 2),
                                                            ("sequence", "fast", 1)])
def test_sharing_the_prompt_kv_cache_changes_no_answer(gpt2_dir, kb_dir, marginalization, decoding, beams):
    from rag.models.rag.generate import generate_for_questions

    model = make(gpt2_dir, kb_dir).eval()
    cfg = GenerationConfig(max_new_tokens=5, num_beams=beams, eos_token_id=model.generator_tokenizer.eos_token_id)
    shared, fresh = (generate_for_questions(model, QUESTIONS, cfg, marginalization=marginalization, decoding=decoding,
                                            share_cache=s).output for s in (True, False))
    assert torch.equal(shared.sequences, fresh.sequences)
    torch.testing.assert_close(shared.scores, fresh.scores, atol=1e-4, rtol=1e-5)


def test_answers_carry_provenance_and_token_posteriors(gpt2_dir, kb_dir, tmp_path):
    from rag.pipeline.api import RagPipeline, plot_token_posterior

    pipe = RagPipeline(make(gpt2_dir, kb_dir))
    [a] = pipe.generate(QUESTIONS[:1], marginalization="token", max_new_tokens=4)
    assert len(a.passages) == K and abs(sum(p.prior for p in a.passages) - 1) < 1e-5
    assert a.token_doc_posterior and all(abs(sum(row) - 1) < 1e-4 for row in a.token_doc_posterior)
    assert len(a.tokens) == len(a.token_doc_posterior)
    assert plot_token_posterior(a, tmp_path / "h.png").stat().st_size > 0
    [s] = pipe.generate(QUESTIONS[:1], marginalization="sequence", max_new_tokens=4)
    assert abs(sum(p.posterior for p in s.passages) - 1) < 1e-4
    [bare] = pipe.generate(QUESTIONS[:1], retrieval=False, max_new_tokens=4)
    assert bare.passages == [] and bare.answered_with == "no_retrieval"


def test_long_contexts_are_shortened_keeping_the_question_and_counted(gpt2_dir, kb_dir):
    from rag.generation.contexts import ContextTruncationWarning

    model = make(gpt2_dir, kb_dir, max_context_length=40)
    question = "Which element has symbol Na?"
    with pytest.warns(ContextTruncationWarning):
        inputs = model.prepare_inputs([question])
    assert inputs.n_truncated == K
    tok = model.generator_tokenizer
    q_ids = tok(" " + question, add_special_tokens=False)["input_ids"]  # after "Question:"
    for ids, mask in zip(inputs.context_input_ids, inputs.context_attention_mask):
        row = ids[mask.bool()].tolist()
        assert len(row) == 40
        text = tok.decode(row)
        assert question in text and text.rstrip().endswith("Answer:")
        assert any(row[i:i + len(q_ids)] == q_ids for i in range(len(row)))
    with pytest.warns(ContextTruncationWarning):
        out = model([question], ["Sodium"])
    assert out.n_truncated == K


def test_a_chat_template_wraps_the_prompt_and_the_answer_follows_the_generation_header(gpt2_dir, kb_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt2_dir)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    chat_dir = tmp_path / "chat"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(gpt2_dir).save_pretrained(chat_dir)
    tok.save_pretrained(chat_dir)
    model = make(str(chat_dir), kb_dir, system_prompt="Be brief.")
    inputs = model.prepare_inputs(QUESTIONS[:1])
    text = inputs.context_strings[0]
    assert text.startswith("<s>system\nBe brief.</s>\n<s>user\n") and text.endswith("Answer:</s>\n<s>assistant\n")
    labels, mask = model.tokenize_targets(["Sodium"])
    assert tok.decode(labels[0][mask[0]]) == "Sodium</s>"  # no space after the header's newline; EOS ends it
    plain = make(str(chat_dir), kb_dir, chat_template=False)
    assert not plain.prepare_inputs(QUESTIONS[:1]).context_strings[0].startswith("<s>")
    assert tok.decode(plain.tokenize_targets(["Sodium"])[0][0]).startswith(" Sodium")  # after "Answer:" a space


@pytest.mark.parametrize("field,value", [("prompt_template", "Question: {question}"), ("prompt_template", "{passage} only"),
                                         ("closed_book_template", "no question"), ("prompt_template", 3)])
def test_a_template_without_its_placeholders_is_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"RagModelConfig.{field}"):
        RagModelConfig(**{field: value})


def test_a_base_that_is_not_causal_or_not_loadable_is_one_line_naming_the_path(tmp_path, tiny_bart_dir):
    from rag.generators.load import load_generator
    from rag.generators.lora import LoraSettings, apply_lora

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ConfigError) as e:
        load_generator(broken)
    assert str(broken) in str(e.value) and "\n" not in str(e.value)
    bart, _, _ = load_generator(tiny_bart_dir)
    with pytest.raises(ConfigError, match="model.generator_lora needs a decoder-only"):
        apply_lora(bart, LoraSettings())


def test_hf_compat_is_refused_for_a_causal_generator(gpt2_dir, kb_dir):
    with pytest.raises(ConfigError, match="hf_compat"):
        make(gpt2_dir, kb_dir, hf_compat=True)


def test_closed_book_loss_reads_the_question_alone(gpt2_dir, kb_dir):
    model = make(gpt2_dir, kb_dir, reduce_loss=True).eval()
    with torch.no_grad():
        loss = model.generator_loss(QUESTIONS[:1], ANSWERS[:1])
    labels, mask = model.tokenize_targets(ANSWERS[:1])
    prompt = tokenize_prompts(model.generator_tokenizer, model.config.prompt_format, QUESTIONS[:1], None, 96).ids[0]
    want = -brute_force_logprobs(model, prompt, labels[0][mask[0]].tolist()).sum()
    assert math.isclose(float(loss), float(want), rel_tol=1e-5, abs_tol=2e-4)


def test_passage_prefixes_are_prefilled_once_and_reused_across_calls(gpt2_dir, kb_dir):
    """The header + passage part of a prompt does not depend on the question: its KV cache, kept by token ids, serves the
    next question reading that passage, with the same answers as prefilling everything; training clears it."""
    from rag.models.rag.generate import generate_for_questions

    model = make(gpt2_dir, kb_dir).eval()
    cfg = GenerationConfig(max_new_tokens=5, num_beams=2, eos_token_id=model.generator_tokenizer.eos_token_id)
    inputs = model.prepare_inputs(QUESTIONS[:1])
    assert inputs.prefix_width > 0 and all(inputs.context_strings[k].startswith(p.title) for k, p in
                                          enumerate(inputs.retrieved.passages[0]))
    cold = generate_for_questions(model, QUESTIONS, cfg, marginalization="sequence", share_cache=False).output
    first = generate_for_questions(model, QUESTIONS, cfg, marginalization="sequence").output
    cache = model._prefix_cache
    assert cache.misses > 0 and len(cache) == cache.misses
    misses = cache.misses
    again = generate_for_questions(model, QUESTIONS, cfg, marginalization="sequence").output
    assert cache.misses == misses and cache.hits >= len(QUESTIONS) * K  # every passage's prefix came from the cache
    for out in (first, again):
        assert torch.equal(out.sequences, cold.sequences)
        torch.testing.assert_close(out.scores, cold.scores, atol=1e-4, rtol=1e-5)
    model.train()
    assert len(cache) == 0


@pytest.mark.parametrize("marginalization,decoding,beams", [("sequence", "fast", 1), ("sequence", "thorough", 2),
                                                            ("token", "thorough", 2)])
def test_extractive_answers_are_word_spans_of_the_passages_read(gpt2_dir, kb_dir, marginalization, decoding, beams):
    import re

    from rag.knowledge.bm25 import TOKEN_PATTERN
    from rag.pipeline.api import RagPipeline

    def is_span(text, passages):  # from a word (or the bracket or quote before it) to a word's end (or what closes it)
        def bounds(t):
            words = [m.span() for m in re.finditer(TOKEN_PATTERN, t)]
            starts = {s for s, _ in words} | {s - 1 for s, _ in words if s and t[s - 1] in "([{\"'"}
            return starts, {e for _, e in words} | {e + 1 for _, e in words if e < len(t) and t[e] in ")]}\"'%"}
        return any(t.startswith(text, s) and s + len(text) in bounds(t)[1]
                   for p in passages for t in (p.title, p.text) for s in bounds(t)[0])

    pipe = RagPipeline(make(gpt2_dir, kb_dir).eval())
    opts = dict(marginalization=marginalization, decoding=decoding, num_beams=beams, max_new_tokens=6)
    free = pipe.generate(QUESTIONS, **opts)
    assert not all(is_span(a.text, a.passages) for a in free)  # the random LM writes text no passage holds
    spans = pipe.generate(QUESTIONS, extractive=True, **opts)
    assert all(a.text and is_span(a.text, a.passages) for a in spans), [a.text for a in spans]
    if (marginalization, decoding) == ("sequence", "thorough"):  # p(y|x, z) = 0 where z does not state y
        held = [(p.posterior, is_span(a.text, [p])) for a in spans for p in a.passages]
        assert all(post == 0.0 for post, ok in held if not ok) and any(post > 0 for post, ok in held if ok)
    # and none starts with a word of its own question
    first = [re.findall(TOKEN_PATTERN, a.text)[0].lower() for a in spans]
    assert not any(w in {x.lower() for x in re.findall(TOKEN_PATTERN, q)} for w, q in zip(first, QUESTIONS)), first
