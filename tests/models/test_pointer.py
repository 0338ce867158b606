"""The copy (pointer) head: its mixture math, the token ids carried by the encoder output, and that it copies."""

from __future__ import annotations

import pytest
import torch

from rag.generation.kv_cache import output_cache
from rag.generators.pointer import attach_ids, copy_log_probs, split_memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_ids_survive_the_encoder_output_in_every_float_dtype(dtype):
    ids = torch.tensor([[0, 1, 255, 256, 30521, 65535]])
    states = torch.randn(1, 6, 4).to(dtype)
    memory = attach_ids(states, ids)
    assert memory.shape == (1, 6, 6) and memory.dtype == dtype
    back, got = split_memory(memory)
    assert torch.equal(got, ids) and torch.equal(back, states)


def _inputs(gate: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, t, s, v = 2, 3, 5, 11
    vocab = torch.randn(n, t, v, generator=g)
    scores = torch.randn(n, t, s, generator=g)
    ids = torch.tensor([[4, 7, 4, 2, 0], [9, 9, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    return vocab, torch.full((n, t, 1), gate), scores, ids, mask


def test_mixture_is_a_distribution_that_reduces_to_each_part():
    vocab, _, scores, ids, mask = _inputs(0.0)
    for gate in (-3.0, 0.0, 2.0):
        out = copy_log_probs(vocab, torch.full((2, 3, 1), gate), scores, ids, mask)
        torch.testing.assert_close(out.logsumexp(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
    # all generation: the vocabulary distribution
    torch.testing.assert_close(copy_log_probs(vocab, torch.full((2, 3, 1), 50.0), scores, ids, mask),
                               vocab.log_softmax(-1), atol=1e-5, rtol=0)
    # all copying: the attention mass of each id, summed over its positions; padding gets none
    copy = copy_log_probs(vocab, torch.full((2, 3, 1), -50.0), scores, ids, mask).exp()
    attn = scores.masked_fill(mask[:, None, :] == 0, float("-inf")).softmax(-1)
    torch.testing.assert_close(copy[0, :, 4], attn[0, :, 0] + attn[0, :, 2], atol=1e-5, rtol=0)
    torch.testing.assert_close(copy[1, :, 9], attn[1, :, 0] + attn[1, :, 1], atol=1e-5, rtol=0)
    assert float(copy[1, :, 0].max()) < 1e-6  # id 0 sits only on padding in row 1
    assert float(copy[0, :, 3].max()) < 1e-6  # an id not in the context


def test_gradients_are_finite_where_the_copy_distribution_is_zero():
    vocab, gate, scores, ids, mask = _inputs(0.5)
    for x in (vocab, gate, scores):
        x.requires_grad_(True)
    out = copy_log_probs(vocab, gate, scores, ids, mask)
    (out[..., 3].sum() + out[..., 4].sum()).backward()  # 3 is never copyable, 4 is
    for x in (vocab, gate, scores):
        assert torch.isfinite(x.grad).all()
    assert scores.grad.abs().sum() > 0 and float(scores.grad[mask[:, None, :].expand_as(scores) == 0].abs().max()) == 0


def test_pointer_generator_learns_to_copy_tokens_it_never_saw_as_targets(tiny_bert_dir):
    """Trained to answer 'key X' with X for 100 steps on half the vocabulary, a pointer generator copies
    tokens from the other half; without the copy head the same training does not."""
    from rag.generators.warm_start import build_warm_start_generator

    def train_and_test(pointer: bool) -> float:
        gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=pointer, seed=0)
        words = sorted(w for w in tok.get_vocab() if w.isalpha() and len(w) > 2 and not w.startswith("#"))
        assert len(words) >= 40
        seen, unseen = words[0::2], words[1::2]
        rng = torch.Generator().manual_seed(0)

        def batch(pool, n=16):
            picks = [[pool[int(i)] for i in torch.randint(len(pool), (4,), generator=rng)] for _ in range(n)]
            key = [int(i) for i in torch.randint(4, (n,), generator=rng)]
            ctx = [" ".join(f"{'key' if j == k else 'pad'} {w}" for j, w in enumerate(p)) for p, k in zip(picks, key)]
            return tok(ctx, padding=True, return_tensors="pt"), [p[k] for p, k in zip(picks, key)]

        opt = torch.optim.AdamW([p for p in gen.parameters() if p.requires_grad], lr=3e-3)
        gen.train()
        for _ in range(100):
            enc, answers = batch(seen)
            target = torch.tensor([tok.convert_tokens_to_ids(a) for a in answers])
            start = torch.full((len(answers), 1), tok.cls_token_id)
            logits = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=start).logits
            loss = torch.nn.functional.cross_entropy(logits[:, 0], target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        gen.eval()
        enc, answers = batch(unseen, 64)
        with torch.no_grad():
            start = torch.full((len(answers), 1), tok.cls_token_id)
            logits = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=start).logits
        got = tok.convert_ids_to_tokens(logits[:, 0].argmax(-1).tolist())
        return sum(g == a for g, a in zip(got, answers)) / len(answers)

    torch.manual_seed(0)
    with_pointer, without = train_and_test(True), train_and_test(False)
    assert with_pointer >= 0.6, with_pointer  # measured 0.94
    assert without <= 0.1, without  # measured 0.0


def test_continuation_matches_mark_the_token_after_each_occurrence_of_the_previous_output():
    from rag.generators.pointer import continuation_matches

    source = torch.tensor([[101, 5, 6, 5, 7, 102]])
    previous = torch.tensor([[101, 5, 7, 0]])  # decoder start, then tokens 5 and 7, then padding
    m = continuation_matches(source, previous, ignore=(101, 0))
    assert m.shape == (1, 4, 6)
    assert m[0, 0].sum() == 0 and m[0, 3].sum() == 0  # ignored previous tokens continue nothing
    assert m[0, 1].tolist() == [0, 0, 1, 0, 1, 0]  # after each 5: positions 2 (6) and 4 (7)
    assert m[0, 2].tolist() == [0, 0, 0, 0, 0, 1]  # after the 7
    assert continuation_matches(source, torch.tensor([[102]]))[0, 0].sum() == 0  # the last token is followed by nothing


def test_bigram_matches_mark_only_the_continuation_of_the_last_two_output_tokens():
    from rag.generators.pointer import bigram_continuation_matches, continuation_matches

    source = torch.tensor([[101, 8, 5, 6, 9, 5, 7, 102]])  # token 5 occurs twice: after 8 and after 9
    history = torch.tensor([[101, 9, 5, 7, 0]])  # decoder start, then 9 5 7, then padding
    m = bigram_continuation_matches(source, history, 5, ignore=(101, 0))
    assert m.shape == (1, 5, 8)
    assert m[0, 0].sum() == 0 and m[0, 1].sum() == 0  # nothing before the start; (start, 9) contains an ignored token
    assert m[0, 2].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]  # after "9 5" only the 7, where the unigram marks the 6 too
    assert continuation_matches(source, history, ignore=(101, 0))[0, 2].tolist() == [0, 0, 0, 1, 0, 0, 1, 0]
    assert m[0, 3].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]  # after "5 7"
    assert m[0, 4].sum() == 0  # padding continues nothing
    for t in range(1, 5):  # with a KV cache: one step, the tokens before it from the history
        assert torch.equal(bigram_continuation_matches(source, history[:, : t + 1], 1, ignore=(101, 0))[:, 0], m[:, t])


@pytest.mark.parametrize("continuation", [True, "bigram"], ids=["unigram", "bigram"])
def test_continuation_bias_makes_cached_decoding_and_a_full_forward_agree(tiny_bert_dir, continuation):
    """With the continuation head, step-by-step decoding with a KV cache (one previous token per step; for the bigram
    head the tokens so far as copy_history) gives the logits of one teacher-forced forward over the whole sequence, and
    the head changes them."""
    from rag.generators.warm_start import build_warm_start_generator

    bigram = continuation == "bigram"
    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation=continuation, seed=0)
    gen.eval()
    enc = tok(["alpha beta gamma delta beta epsilon gamma delta"], return_tensors="pt")
    target = tok(["beta gamma delta"], return_tensors="pt")["input_ids"][:, :-1]  # [CLS] beta gamma delta
    with torch.no_grad():
        full = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits
        memory = gen.encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        past, steps = None, []
        for t in range(target.shape[1]):
            history = {"copy_history": target[:, : t + 1]} if bigram else {}
            out = gen(encoder_outputs=memory, attention_mask=enc["attention_mask"], decoder_input_ids=target[:, : t + 1],
                      past_key_values=past, use_cache=True) if past is None else \
                gen(encoder_outputs=memory, attention_mask=enc["attention_mask"], decoder_input_ids=target[:, t : t + 1],
                    past_key_values=past, use_cache=True, **history)
            past = output_cache(out)  # by the installed transformers' field name (rag.generation.kv_cache)
            steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-4)
        if bigram:
            with pytest.raises(ValueError, match="copy_history"):  # a cached step without the tokens before it
                gen(encoder_outputs=memory, attention_mask=enc["attention_mask"], decoder_input_ids=target[:, -1:],
                    past_key_values=past, use_cache=True)
            gen.copy_continue_bigram.bias.fill_(0.0)
            unigram = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits
            assert torch.allclose(unigram[:, :2], full[:, :2], atol=1e-5)  # no two output tokens before steps 0 and 1
            assert not torch.allclose(unigram[:, 2:], full[:, 2:], atol=1e-3)
        gen.copy_continue.bias.fill_(0.0)
        off = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits
    assert torch.allclose(off[:, 0], full[:, 0], atol=1e-5)  # after the decoder start nothing is continued
    assert not torch.allclose(off[:, 1:], full[:, 1:], atol=1e-3)


def _copy_only_generator(tiny_bert_dir, continuation):
    """A warm-start generator whose head only copies, attending uniformly, with a unigram continuation bias of 10; and
    five distinct single-token words of its vocabulary."""
    from rag.generators.warm_start import build_warm_start_generator

    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation=continuation, seed=0)
    gen.eval()
    with torch.no_grad():
        for layer in (gen.copy_query, gen.copy_gate):
            layer.weight.zero_()
            layer.bias.zero_()
        gen.copy_gate.bias.fill_(-50.0)  # copy only
        gen.copy_continue.bias.fill_(10.0)
    return gen, tok, sorted(w for w in tok.get_vocab() if w.isalpha() and len(w) > 3)[:5]


def test_bigram_bias_continues_the_copied_span_not_another_occurrence_of_its_last_token(tiny_bert_dir):
    """A copy-only head that attends uniformly: after "w1 w2" in a passage holding w2 twice (w0 w2 w4 ... w1 w2 w3), the
    unigram bias alone splits between the tokens after both w2s; with the bigram bias it continues with w3."""
    gen, tok, w = _copy_only_generator(tiny_bert_dir, "bigram")
    with torch.no_grad():
        gen.copy_continue_bigram.bias.fill_(5.0)
    enc = tok([f"{w[0]} {w[2]} {w[4]} {w[1]} {w[2]} {w[3]}"], return_tensors="pt")
    ids = {word: tok.convert_tokens_to_ids(word) for word in w}
    target = torch.tensor([[tok.cls_token_id, ids[w[1]], ids[w[2]]]])
    with torch.no_grad():
        probs = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits.exp()
        assert probs[0, 2, ids[w[3]]] > 0.99
        gen.copy_continue_bigram.bias.fill_(0.0)
        probs = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits.exp()
    assert 0.4 < probs[0, 2, ids[w[3]]] < 0.6 and 0.4 < probs[0, 2, ids[w[4]]] < 0.6


def test_continuation_bias_alone_copies_a_span_in_order(tiny_bert_dir):
    """A copy head that attends uniformly and only copies: the continuation bias alone makes the next context token after
    each previous output token the likeliest output, so the head walks the passage in order."""
    gen, tok, words = _copy_only_generator(tiny_bert_dir, True)
    enc = tok([" ".join(words)], return_tensors="pt")
    source = enc["input_ids"][0].tolist()  # [CLS] w0 w1 w2 w3 w4 [SEP]
    assert len(source) == 7 and len(set(source)) == 7
    target = torch.tensor([[tok.cls_token_id, *source[2:5]]])  # [CLS] w1 w2 w3: teacher-forced previous tokens
    with torch.no_grad():
        probs = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], decoder_input_ids=target).logits.exp()
    for t in (1, 2, 3):  # after w1 -> w2, after w2 -> w3, after w3 -> w4
        assert probs[0, t].argmax().item() == source[t + 2] and probs[0, t, source[t + 2]] > 0.99
    assert probs[0, 0].max() < 0.5  # after the decoder start nothing is continued: uniform over the context


@pytest.mark.parametrize("num_beams", [1, 3])
def test_bigram_search_scores_equal_a_forward_without_cache(tiny_bert_dir, num_beams):
    """Greedy and beam search with the bigram continuation head (KV cache, copy_history kept and reordered with the
    beams) score every hypothesis as a teacher-forced forward over the whole sequence does (no self-attention cache);
    RAG-Sequence thorough and fast decoding run on it, and greedy decoding emits transformers' generate tokens."""
    from rag.generation.decoding import (
        GenerationConfig,
        encode_contexts,
        generate_per_document,
        rag_sequence_generate,
        rag_token_generate,
        teacher_forced_logprobs,
    )
    from rag.generators.warm_start import build_warm_start_generator

    gen, tok = build_warm_start_generator(tiny_bert_dir, decoder_layers=1, pointer=True, continuation="bigram", seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in gen.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        gen.copy_gate.bias.fill_(-3.0)  # mostly copy, so the continuation heads decide the tokens
        gen.copy_continue_bigram.bias.fill_(4.0)
    gen.eval()
    passages = ["alpha beta gamma beta delta gamma beta epsilon", "one two one three two one four",
                "beta gamma beta gamma delta", "red green blue green red blue"]
    enc = tok(passages, padding=True, return_tensors="pt")
    contexts = encode_contexts(gen, enc["input_ids"], enc["attention_mask"])
    config = GenerationConfig(num_beams=num_beams, num_return_sequences=num_beams, max_new_tokens=8)
    hyps = generate_per_document(gen, contexts, config)
    n, m, width = hyps.sequences.shape
    seqs = hyps.sequences.reshape(n * m, width)
    lp = teacher_forced_logprobs(gen, contexts, seqs, torch.arange(n).repeat_interleave(m)[:, None])[:, 0]
    targets = seqs[:, 1:]
    is_eos = (targets == gen.config.eos_token_id).long()
    counted = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
    want = (lp * counted).sum(1).view(n, m)
    found = torch.isfinite(hyps.log_likelihood)
    assert found.any()
    torch.testing.assert_close(hyps.log_likelihood[found], want[found], rtol=1e-4, atol=1e-4)
    doc_scores = torch.zeros(2, 2)
    for decoding in ("thorough", "fast"):
        out = rag_sequence_generate(gen, contexts, doc_scores, config, decoding=decoding)
        assert out.sequences.shape[0] == 2 * num_beams and torch.isfinite(out.scores[::num_beams]).all()
    if num_beams == 1:
        ours = rag_token_generate(gen, contexts, torch.zeros(4, 1), config).sequences
        ref = gen.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=8,
                           do_sample=False, num_beams=1)
        width = min(ours.shape[1], ref.shape[1])
        assert torch.equal(ours[:, :width], ref[:, :width])
