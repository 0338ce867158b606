"""RAG decoding: token parity with transformers' RAG classes, brute-force scores, hand-made unambiguous cases."""

from __future__ import annotations

import math

import pytest
import torch

from rag.generation.decoding import (
    EncodedContexts,
    GenerationConfig,
    encode_contexts,
    generate_per_document,
    rag_sequence_generate,
    rag_token_generate,
    teacher_forced_logprobs,
)
from rag.utils.errors import ConfigError, RagError

TEXTS = [
    "the quick brown fox jumps over the lazy dog", "hydrogen is the lightest element",
    "oxygen has atomic number eight", "helium is a noble gas", "iron is a metal used in steel",
    "carbon forms many compounds", "gold is a precious yellow metal", "neon lights glow red",
    "sodium reacts with water", "mercury is liquid at room temperature",
]
EOS, PAD = 2, 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls on a shared, busy CPU run far faster without intra-op threads; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    """Tiny random BART (weights N(0, 0.25), EOS logit bias so lengths vary) + BPE tokenizer + DPR encoder."""
    from rag.generators.tiny import tiny_bart, tiny_dpr, train_bpe_tokenizer

    tok = train_bpe_tokenizer(TEXTS * 3, vocab_size=300)
    gen = tiny_bart(tok, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in gen.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
        gen.final_logits_bias[0, tok.eos_token_id] += 4.0
    qenc = tiny_dpr(tok, seed=0).eval()
    assert (tok.eos_token_id, tok.pad_token_id) == (EOS, PAD)
    return tok, gen, qenc


def _hf_models(tiny, n_docs):
    from transformers import RagConfig, RagSequenceForGeneration, RagTokenForGeneration

    tok, gen, qenc = tiny
    cfg = RagConfig.from_question_encoder_generator_configs(
        qenc.config, gen.config, n_docs=n_docs, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, decoder_start_token_id=tok.eos_token_id)
    return (RagTokenForGeneration(cfg, question_encoder=qenc, generator=gen).eval(),
            RagSequenceForGeneration(cfg, question_encoder=qenc, generator=gen).eval())


def _contexts(tok, batch, n_docs, padded, duplicate=False):
    """`batch * n_docs` contexts; unpadded ones are all truncated to the same length (mask all ones)."""
    ctx = [f"{TEXTS[(3 * i + i // n_docs) % len(TEXTS)]} // question {i // n_docs}" for i in range(batch * n_docs)]
    if duplicate:  # a repeated passage guarantees identical hypotheses across passages
        ctx[2] = ctx[0]
    if padded:
        enc = tok(ctx, return_tensors="pt", padding=True)
        assert not enc.attention_mask.all()
    else:
        enc = tok(ctx, return_tensors="pt", truncation=True, max_length=10, padding="max_length")
        assert enc.attention_mask.all()
    scores = torch.randn(batch, n_docs, generator=torch.Generator().manual_seed(batch * 10 + n_docs)) * 2
    return enc.input_ids, enc.attention_mask, scores


def _generated_lengths(seqs):
    """Tokens after the start token up to and including the first EOS (or the full width)."""
    out = []
    for row in seqs[:, 1:].tolist():
        out.append(row.index(EOS) + 1 if EOS in row else len(row))
    return out


# ----------------------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("options", [
    dict(max_length=12),
    dict(max_length=12, min_length=5, no_repeat_ngram_size=2),
])
def test_rag_token_greedy_matches_transformers(tiny, options):
    tok, gen, _ = tiny
    ids, mask, scores = _contexts(tok, batch=3, n_docs=3, padded=True)
    rag_token, _ = _hf_models(tiny, 3)
    ref = rag_token.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=3, **options)
    out = rag_token_generate(gen, encode_contexts(gen, ids, mask), scores, GenerationConfig(**options))
    assert torch.equal(out.sequences, ref)
    assert len({tuple(r) for r in out.sequences.tolist()}) > 1  # questions differ
    assert torch.allclose(out.scores, out.log_likelihood) and (out.scores < 0).all()


@pytest.mark.parametrize("options", [
    dict(max_length=12, num_beams=4, num_return_sequences=4),
    dict(max_length=14, num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping=True, no_repeat_ngram_size=2),
    dict(max_length=13, num_beams=3, num_return_sequences=3, length_penalty=1.5, early_stopping="never", min_length=4),
])
def test_rag_token_beam_search_matches_transformers(tiny, options):
    tok, gen, _ = tiny
    ids, mask, scores = _contexts(tok, batch=3, n_docs=4, padded=True)
    rag_token, _ = _hf_models(tiny, 4)
    ref = rag_token.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=4,
                             output_scores=True, return_dict_in_generate=True, **options)
    out = rag_token_generate(gen, encode_contexts(gen, ids, mask), scores, GenerationConfig(**options))
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.allclose(out.scores, ref.sequences_scores, atol=1e-5)
    r = options["num_return_sequences"]
    per_q = out.sequences.view(3, r, -1)
    assert all(len({tuple(s) for s in q.tolist()}) == r for q in per_q)  # beams are distinct hypotheses
    assert (out.scores.view(3, r)[:, :-1] >= out.scores.view(3, r)[:, 1:]).all()  # best first


@pytest.mark.parametrize("num_beams,ret", [(4, 3), (1, 2)])
@pytest.mark.parametrize("dedup", [True, False])
def test_rag_sequence_thorough_matches_transformers(tiny, num_beams, ret, dedup):
    tok, gen, _ = tiny
    batch, n_docs = 2, 5
    # transformers' per-passage search ignores context_attention_mask (see rag_sequence_generate): unpadded contexts.
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=False, duplicate=True)
    _, rag_seq = _hf_models(tiny, n_docs)
    options = dict(max_length=12, num_beams=num_beams, num_return_sequences=ret)
    ref = rag_seq.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=n_docs,
                           do_deduplication=dedup, **options)
    contexts = encode_contexts(gen, ids, mask)
    out = rag_sequence_generate(gen, contexts, scores, GenerationConfig(**options), dedup=dedup)
    assert torch.equal(out.sequences, ref)
    # Not trivially true: the candidate pool has duplicates and several distinct answers, lengths vary.
    hyps = generate_per_document(gen, contexts, GenerationConfig(**options)).sequences.reshape(batch, n_docs * num_beams, -1)
    distinct = [len({tuple(h) for h in q.tolist()}) for q in hyps]
    assert all(1 < d < n_docs * num_beams for d in distinct)
    assert len(set(_generated_lengths(hyps.reshape(-1, hyps.shape[-1])))) > 1
    top = out.sequences.view(batch, ret, -1)
    if dedup:
        assert all(len({tuple(s) for s in q.tolist()}) == ret for q in top)
    assert torch.allclose(out.doc_posteriors.sum(-1), torch.ones(batch * ret))


@pytest.mark.parametrize("num_beams", [4, 1])
def test_unmasked_search_matches_transformers_on_padded_contexts(tiny, num_beams):
    """transformers searches each passage with no attention mask (padded contexts attend to their pads) and rescores
    with the mask: `search_contexts=unmasked_contexts(...)` reproduces that token for token, where the default
    (masked) search gives other answers; fast decoding pools the unmasked search's hypotheses."""
    from rag.models.rag.generate import unmasked_contexts

    tok, gen, _ = tiny
    batch, n_docs = 2, 5
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=True, duplicate=True)
    _, rag_seq = _hf_models(tiny, n_docs)
    options = dict(max_length=12, num_beams=num_beams, num_return_sequences=2)
    config = GenerationConfig(**options)
    ref = rag_seq.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=n_docs, **options)
    contexts = encode_contexts(gen, ids, mask)
    unmasked = unmasked_contexts(gen, tok, ids, mask, ids.shape[1])
    assert unmasked.attention_mask.shape == ids.shape and unmasked.attention_mask.all()  # already padded to width
    out = rag_sequence_generate(gen, contexts, scores, config, search_contexts=unmasked)
    assert torch.equal(out.sequences, ref)
    masked = rag_sequence_generate(gen, contexts, scores, config)
    assert not torch.equal(masked.sequences, ref)
    fast = rag_sequence_generate(gen, contexts, scores, config, decoding="fast", search_contexts=unmasked)
    pool = generate_per_document(gen, unmasked, config).sequences.reshape(batch, n_docs * num_beams, -1)
    for q, row in enumerate(fast.sequences.view(batch, 2, -1)):
        assert all((pool[q] == seq).all(1).any() for seq in row)
    assert not torch.equal(fast.sequences, rag_sequence_generate(gen, contexts, scores, config, decoding="fast").sequences)


def test_rag_sequence_with_options_matches_transformers(tiny):
    tok, gen, _ = tiny
    ids, mask, scores = _contexts(tok, 3, 3, padded=False)
    _, rag_seq = _hf_models(tiny, 3)
    options = dict(max_length=14, num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping=True,
                   no_repeat_ngram_size=2, min_length=3)
    ref = rag_seq.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=3, **options)
    out = rag_sequence_generate(gen, encode_contexts(gen, ids, mask), scores, GenerationConfig(**options))
    assert torch.equal(out.sequences, ref)


def test_per_document_search_matches_generator_generate_with_padding(tiny):
    """The per-passage search equals the generator's own beam search / greedy, attention mask included."""
    tok, gen, _ = tiny
    ids, mask, _ = _contexts(tok, 2, 3, padded=True)
    contexts = encode_contexts(gen, ids, mask)
    for options in (dict(max_length=12, num_beams=4), dict(max_length=12)):
        ref = gen.generate(ids, attention_mask=mask, num_return_sequences=options.get("num_beams", 1),
                           output_scores=True, return_dict_in_generate=True, **options)
        hyp = generate_per_document(gen, contexts, GenerationConfig(**options))
        assert torch.equal(hyp.sequences.reshape(ref.sequences.shape), ref.sequences)
        if options.get("num_beams", 1) > 1:
            assert torch.allclose(hyp.scores.reshape(-1), ref.sequences_scores, atol=1e-5)
    unmasked = generate_per_document(gen, encode_contexts(gen, ids, torch.ones_like(mask)), GenerationConfig(**options))
    assert not torch.equal(unmasked.sequences, hyp.sequences)  # the mask matters for these contexts


def test_t5_generator_rag_token_matches_transformers():
    from transformers import RagConfig, RagTokenForGeneration

    from rag.generators.tiny import tiny_dpr, tiny_t5

    class _Vocab:
        def __init__(self, n):
            self.n, self.pad_token_id, self.eos_token_id = n, 0, 1

        def __len__(self):
            return self.n

    gen = tiny_t5(_Vocab(120), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in gen.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    qenc = tiny_dpr(_Vocab(50)).eval()
    cfg = RagConfig.from_question_encoder_generator_configs(qenc.config, gen.config, n_docs=3, eos_token_id=1,
                                                            pad_token_id=0, decoder_start_token_id=0)
    rag_token = RagTokenForGeneration(cfg, question_encoder=qenc, generator=gen).eval()
    ids = torch.randint(2, 120, (6, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    scores = torch.randn(2, 3, generator=g)
    contexts = encode_contexts(gen, ids, mask)
    for options in (dict(max_length=10), dict(max_length=10, num_beams=3, num_return_sequences=3)):
        ref = rag_token.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=3, **options)
        assert torch.equal(rag_token_generate(gen, contexts, scores, GenerationConfig(**options)).sequences, ref)


# ----------------------------------------------------------------------------------------------------------
# Scores against brute force


def _brute_force_doc_logliks(gen, ids, mask, seqs, question, n_docs):
    """`log p(y|x, z)` (paper: tokens up to the first EOS) by re-encoding every (candidate, passage) pair."""
    out = torch.empty(len(seqs), n_docs)
    with torch.no_grad():
        for c, seq in enumerate(seqs):
            n = _generated_lengths(seq[None])[0]
            for k in range(n_docs):
                row = question[c] * n_docs + k
                logits = gen(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1],
                             decoder_input_ids=seq[None, :n]).logits[0]
                out[c, k] = torch.log_softmax(logits, -1).gather(1, seq[1:n + 1, None]).sum()
    return out


def test_thorough_scores_equal_brute_force_marginal_likelihood(tiny):
    tok, gen, _ = tiny
    batch, n_docs, ret = 2, 3, 3
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=True)
    config = GenerationConfig(max_length=10, num_beams=3, num_return_sequences=ret)
    contexts = encode_contexts(gen, ids, mask)
    out = rag_sequence_generate(gen, contexts, scores, config, convention="paper", rescore_batch_size=5)
    question = torch.arange(batch).repeat_interleave(ret)
    doc_ll = _brute_force_doc_logliks(gen, ids, mask, out.sequences, question, n_docs)
    terms = torch.log_softmax(scores, 1)[question] + doc_ll
    assert torch.allclose(out.scores, torch.logsumexp(terms, 1), atol=1e-4)  # Eq. 1
    assert torch.allclose(out.doc_posteriors, torch.softmax(terms, 1), atol=1e-4)
    assert (out.scores.view(batch, ret)[:, :-1] >= out.scores.view(batch, ret)[:, 1:]).all()

    # The transformers convention equals -loss of RagSequenceForGeneration(labels=..., exclude_bos_score=True).
    _, rag_seq = _hf_models(tiny, n_docs)
    hf = rag_sequence_generate(gen, contexts, scores, config)
    with torch.no_grad():
        for q in range(batch):
            rows = slice(q * ret, (q + 1) * ret)
            loss = rag_seq(context_input_ids=ids[q * n_docs:(q + 1) * n_docs].repeat(ret, 1),
                           context_attention_mask=mask[q * n_docs:(q + 1) * n_docs].repeat(ret, 1),
                           doc_scores=scores[q:q + 1].repeat(ret, 1), labels=hf.sequences[rows],
                           exclude_bos_score=True, n_docs=n_docs).loss
            assert torch.allclose(hf.scores[rows], -loss, atol=1e-4)


def test_teacher_forced_logprobs_reuse_encoder_states(tiny):
    """Scoring 2 sequences under 3 passages each runs the encoder 0 more times than encoding the passages did (the
    states are reused for all 6 rows), and gives the log-probs of a full forward pass over each row."""
    tok, gen, _ = tiny
    ids, mask, _ = _contexts(tok, 1, 3, padded=True)
    seqs = torch.tensor([[EOS, 40, 41, 42, EOS], [EOS, 50, EOS, PAD, PAD]])
    index = torch.tensor([[0, 1, 2], [2, 0, 1]])
    calls = []
    hook = gen.get_encoder().register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        contexts = encode_contexts(gen, ids, mask)
        encoded = len(calls)
        lp = teacher_forced_logprobs(gen, contexts, seqs, index, batch_size=4)
        rescored = len(calls) - encoded
    finally:
        hook.remove()
    assert encoded >= 1 and rescored == 0, (encoded, rescored)  # the hook sees the encoder; scoring never runs it
    with torch.no_grad():
        for c in range(2):
            for k in range(3):
                r = int(index[c, k])
                ref = torch.log_softmax(gen(input_ids=ids[r:r + 1], attention_mask=mask[r:r + 1],
                                            decoder_input_ids=seqs[c:c + 1, :-1]).logits[0], -1)
                assert torch.allclose(lp[c, k], ref.gather(1, seqs[c, 1:, None])[:, 0], atol=1e-5)


def test_fast_decoding_uses_only_beam_candidates_and_scores(tiny):
    tok, gen, _ = tiny
    batch, n_docs, beams, ret = 2, 4, 3, 4
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=True, duplicate=True)
    config = GenerationConfig(max_length=10, num_beams=beams, num_return_sequences=ret)
    contexts = encode_contexts(gen, ids, mask)
    hyps = generate_per_document(gen, contexts, config)
    fast = rag_sequence_generate(gen, contexts, scores, config, decoding="fast")
    thorough = rag_sequence_generate(gen, contexts, scores, config, decoding="thorough", convention="paper")
    log_prior = torch.log_softmax(scores, 1)
    seqs = hyps.sequences.view(batch, n_docs, beams, -1)
    shared = 0
    for q in range(batch):
        for r in range(ret):
            cand = fast.sequences[q * ret + r]
            producers = {k: float(hyps.log_likelihood.view(batch, n_docs, beams)[q, k, b])
                         for k in range(n_docs) for b in range(beams) if torch.equal(seqs[q, k, b], cand)}
            assert producers, "fast decoding returned a sequence no passage's beam produced"
            shared += len(producers) > 1
            expected = torch.logsumexp(torch.tensor([log_prior[q, k] + ll for k, ll in producers.items()]), 0)
            assert math.isclose(float(fast.scores[q * ret + r]), float(expected), abs_tol=1e-5)
            assert set(fast.doc_posteriors[q * ret + r].nonzero().flatten().tolist()) == set(producers)
    assert shared > 0  # some candidate came from several passages (the duplicated one at least)
    # Beam log-likelihoods are the teacher-forced ones, so fast <= thorough (it drops non-producing passages).
    doc_ll = _brute_force_doc_logliks(gen, ids, mask, fast.sequences, torch.arange(batch).repeat_interleave(ret), n_docs)
    full = torch.logsumexp(log_prior.repeat_interleave(ret, 0) + doc_ll, 1)
    assert (fast.scores <= full + 1e-4).all() and (fast.scores < full - 1e-3).any()
    assert not torch.equal(fast.sequences, thorough.sequences) or not torch.allclose(fast.scores, thorough.scores)


def test_encoder_runs_once_per_question_passage_pair(tiny):
    tok, gen, _ = tiny
    batch, n_docs = 2, 5
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=True)
    rows = []
    handle = gen.get_encoder().register_forward_hook(
        lambda mod, args, kwargs, out: rows.append(out.last_hidden_state.shape[0]), with_kwargs=True)
    try:
        contexts = encode_contexts(gen, ids, mask)
        config = GenerationConfig(max_length=10, num_beams=4, num_return_sequences=2)
        rag_sequence_generate(gen, contexts, scores, config, decoding="thorough", rescore_batch_size=16)
        rag_sequence_generate(gen, contexts, scores, config, decoding="fast")
        rag_token_generate(gen, contexts, scores, config)
        rag_token_generate(gen, contexts, scores, GenerationConfig(max_length=10))
    finally:
        handle.remove()
    assert rows == [batch * n_docs]


def _count_cross_attention_rows(gen):
    """Hooks on every decoder layer's cross-attention key projection: rows of encoder states projected."""
    seen = []
    handles = [layer.encoder_attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
               for layer in gen.model.decoder.layers]
    return seen, handles


def test_cross_attention_keys_values_computed_once_per_context(tiny):
    """Cross-attention K/V are projected once per (question, passage), never per beam, step or rescored row."""
    tok, gen, _ = tiny
    batch, n_docs, layers = 2, 3, len(gen.model.decoder.layers)
    ids, mask, scores = _contexts(tok, batch, n_docs, padded=True)
    contexts = encode_contexts(gen, ids, mask)
    config = GenerationConfig(max_length=10, num_beams=4, num_return_sequences=2)
    seen, handles = _count_cross_attention_rows(gen)
    try:
        calls = [
            lambda: rag_token_generate(gen, contexts, scores, config),
            lambda: rag_token_generate(gen, contexts, scores, GenerationConfig(max_length=10)),
            lambda: rag_sequence_generate(gen, contexts, scores, config, rescore_batch_size=4),
            lambda: generate_per_document(gen, contexts, config),
        ]
        for call in calls:
            seen.clear()
            out = call()
            assert seen == [batch * n_docs] * layers
        seqs = out.sequences.reshape(batch * n_docs * 4, -1)[:5]
        seen.clear()
        teacher_forced_logprobs(gen, contexts, seqs, torch.tensor([[0, 2], [2, 4], [4, 0], [0, 2], [2, 2]]), batch_size=3)
        assert seen == [3] * layers  # only the three contexts used, once each
    finally:
        for h in handles:
            h.remove()


def test_rescoring_stops_at_eos_and_matches_full_pass(tiny):
    """The internal rescoring pass (length-sorted chunks cropped at EOS) equals the full pass up to each EOS."""
    from rag.generation.seq2seq import teacher_forced as _teacher_forced

    tok, gen, _ = tiny
    ids, mask, _ = _contexts(tok, 1, 3, padded=True)
    contexts = encode_contexts(gen, ids, mask)
    seqs = torch.tensor([[EOS, 40, EOS, PAD, PAD, PAD], [EOS, 50, 51, 52, 53, 54], [EOS, 60, 61, EOS, PAD, PAD]])
    index = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 1, 0]])
    full = teacher_forced_logprobs(gen, contexts, seqs, index, batch_size=4)
    cropped = _teacher_forced(gen, contexts, seqs, index, 2, cross_kv=None, eos=EOS)
    for c, n in enumerate([2, 5, 3]):  # targets up to and including the first EOS (or all)
        assert torch.allclose(cropped[c, :, :n], full[c, :, :n], atol=1e-5)
        assert (cropped[c, :, n:] == 0).all() and (full[c, :, n:] != 0).all()


# ----------------------------------------------------------------------------------------------------------
# Hand-made generator: answers are known exactly


class _PositionCache:
    def __init__(self, length):
        self.length = length

    def reorder_cache(self, rows):
        pass  # the toy decoder depends on the position only


class _TableGenerator(torch.nn.Module):
    """A seq2seq 'model' whose next-token distribution depends only on (passage id, position).

    Context row `[doc, ...]` -> `p(y_t | z=doc) = table[doc, t - 1]`; ids: 0 bos, 1 pad, 2 eos, 3.. words.
    """

    def __init__(self, table):
        super().__init__()
        self.table = table.log()  # (docs, positions, vocab) probabilities -> log-probs
        self.config = type("C", (), dict(decoder_start_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=0))()
        self.encoder_rows = 0

    def get_encoder(self):
        from transformers.modeling_outputs import BaseModelOutput

        def encode(input_ids, attention_mask=None, return_dict=True):
            self.encoder_rows += input_ids.shape[0]
            return BaseModelOutput(last_hidden_state=input_ids[:, :, None].float())

        return encode

    def forward(self, encoder_outputs, decoder_input_ids, past_key_values=None, use_cache=False, **_):
        from transformers.modeling_outputs import Seq2SeqLMOutput

        from rag.generation.kv_cache import cache_field

        doc = encoder_outputs.last_hidden_state[:, 0, 0].long()
        start = past_key_values.length if past_key_values is not None else 0
        pos = (start + torch.arange(decoder_input_ids.shape[1])).clamp(max=self.table.shape[1] - 1)
        logits = self.table[doc][:, pos]
        cache = _PositionCache(start + decoder_input_ids.shape[1]) if use_cache else None
        return Seq2SeqLMOutput(logits=logits, **{cache_field(): cache})  # the installed transformers' field name


def _table(rows):
    """`rows[doc][position] = {token: prob}`; the remaining mass goes evenly to the other tokens (vocab 8)."""
    vocab = 8
    out = torch.empty(len(rows), len(rows[0]), vocab)
    for d, doc in enumerate(rows):
        for t, probs in enumerate(doc):
            rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
            out[d, t] = torch.tensor([probs.get(v, rest) for v in range(vocab)])
    return out


A, B_, C = 3, 4, 5
END = {EOS: 0.97}


def _contexts_for(doc_ids):
    ids = torch.tensor([[d, 7, 7] for d in doc_ids])
    return ids, torch.ones_like(ids)


def test_handmade_thorough_and_fast_pick_different_known_answers():
    # Greedy per passage: doc0 -> "A", doc1 -> "B", doc2 -> "C". "A" is nearly as likely under doc1/doc2.
    table = _table([
        [{A: 0.50, B_: 0.22, C: 0.22}, END, END],
        [{B_: 0.52, A: 0.44}, END, END],
        [{C: 0.51, A: 0.44}, END, END],
    ])
    gen = _TableGenerator(table)
    ids, mask = _contexts_for([0, 1, 2])
    contexts = encode_contexts(gen, ids, mask)
    config = GenerationConfig(max_length=5, num_beams=1, num_return_sequences=3)
    uniform = torch.zeros(1, 3)
    answer = {A: [EOS, A, EOS], B_: [EOS, B_, EOS], C: [EOS, C, EOS]}
    log_p = {tok: [math.log(table[d, 0, tok]) + math.log(0.97) for d in range(3)] for tok in (A, B_, C)}

    thorough = rag_sequence_generate(gen, contexts, uniform, config, convention="paper")
    assert thorough.sequences.tolist() == [answer[A], answer[B_], answer[C]]
    expected_a = math.log(sum(math.exp(v) for v in log_p[A]) / 3)
    assert math.isclose(float(thorough.scores[0]), expected_a, rel_tol=1e-5)

    fast = rag_sequence_generate(gen, contexts, uniform, config, decoding="fast")
    assert fast.sequences.tolist() == [answer[B_], answer[C], answer[A]]  # only producing passages count
    assert math.isclose(float(fast.scores[0]), log_p[B_][1] - math.log(3), rel_tol=1e-5)
    assert fast.doc_posteriors[0].tolist() == [0.0, 1.0, 0.0]

    # A confident retriever overrides the generator: doc1's prior makes "B" the thorough answer.
    confident = rag_sequence_generate(gen, contexts, torch.tensor([[0.0, 6.0, 0.0]]), config, convention="paper")
    assert confident.sequences[0].tolist() == answer[B_]
    assert gen.encoder_rows == 3

    # More requested than candidates: the missing rows are all padding with score -inf (transformers raises).
    extra = rag_sequence_generate(gen, contexts, uniform, GenerationConfig(max_length=5, num_return_sequences=4))
    assert extra.sequences[3].tolist() == [PAD] * 3 and extra.scores[3] == -math.inf
    assert extra.doc_posteriors[3].sum() == 0 and extra.sequences[:3].tolist() == thorough.sequences.tolist()


def test_handmade_rag_token_combines_passages():
    # doc0 is sure about the first word (A) and doc1 about the second (B); each alone says something else.
    table = _table([
        [{A: 0.90, C: 0.05}, {C: 0.60, B_: 0.35}, END, END],
        [{C: 0.55, A: 0.40}, {B_: 0.90, C: 0.05}, END, END],
    ])
    gen = _TableGenerator(table)
    ids, mask = _contexts_for([0, 1])
    contexts = encode_contexts(gen, ids, mask)
    uniform = torch.zeros(1, 2)
    per_doc = generate_per_document(gen, contexts, GenerationConfig(max_length=6))
    assert per_doc.sequences[:, 0].tolist() == [[EOS, A, C, EOS], [EOS, C, B_, EOS]]

    mixed = [EOS, A, B_, EOS]
    greedy = rag_token_generate(gen, contexts, uniform, GenerationConfig(max_length=6))
    assert greedy.sequences.tolist() == [mixed]
    step = [math.log((table[0, t, tok] + table[1, t, tok]) / 2) for t, tok in enumerate((A, B_, EOS))]
    assert math.isclose(float(greedy.log_likelihood[0]), sum(step), rel_tol=1e-5)

    beam = rag_token_generate(gen, contexts, uniform, GenerationConfig(max_length=6, num_beams=2, num_return_sequences=2))
    assert beam.sequences[0].tolist() == mixed
    assert math.isclose(float(beam.scores[0]), sum(step) / 3, rel_tol=1e-5)  # length penalty 1: / 3 tokens

    # RAG-Sequence cannot mix: its answer is one of the single-passage sequences.
    seq = rag_sequence_generate(gen, contexts, uniform, GenerationConfig(max_length=6), convention="paper")
    assert seq.sequences[0].tolist() in per_doc.sequences[:, 0].tolist()


# ----------------------------------------------------------------------------------------------------------
# Input validation


def test_invalid_configuration_and_shapes_raise(tiny):
    tok, gen, _ = tiny
    for bad in (dict(num_beams=0), dict(max_length=1), dict(early_stopping="sometimes"), dict(early_stopping=1),
                dict(no_repeat_ngram_size=-1),
                dict(length_penalty=float("nan"))):
        with pytest.raises(ConfigError):
            GenerationConfig(**bad)
    ids, mask, scores = _contexts(tok, 2, 3, padded=True)
    contexts = encode_contexts(gen, ids, mask)
    with pytest.raises(ConfigError, match="num_return_sequences"):
        rag_token_generate(gen, contexts, scores, GenerationConfig(num_beams=2, num_return_sequences=3))
    with pytest.raises(RagError, match="batch \\* n_docs"):
        rag_token_generate(gen, contexts, scores[:, :2], GenerationConfig())
    with pytest.raises(ConfigError, match="decoding"):
        rag_sequence_generate(gen, contexts, scores, decoding="slow")
    with pytest.raises(RagError):
        encode_contexts(gen, ids, mask[:, :-1])
    assert isinstance(contexts, EncodedContexts) and len(contexts) == 6


def test_t5_teacher_forced_logprobs_match_full_forward():
    """The generic (non-BART) rescoring path: per-context cross-attention K/V copied to rows, chunked."""
    from rag.generators.tiny import tiny_t5

    class _Vocab:
        def __init__(self, n):
            self.n, self.pad_token_id, self.eos_token_id = n, 0, 1

        def __len__(self):
            return self.n

    gen = tiny_t5(_Vocab(60), seed=0).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 60, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    seqs = torch.tensor([[0, 5, 6, 1, 0], [0, 7, 8, 9, 10]])
    index = torch.tensor([[0, 2, 3], [3, 1, 2]])
    lp = teacher_forced_logprobs(gen, encode_contexts(gen, ids, mask), seqs, index, batch_size=4)
    with torch.no_grad():
        for c in range(2):
            for k in range(3):
                r = int(index[c, k])
                ref = torch.log_softmax(gen(input_ids=ids[r:r + 1], attention_mask=mask[r:r + 1],
                                            decoder_input_ids=seqs[c:c + 1, :-1]).logits[0], -1)
                assert torch.allclose(lp[c, k], ref.gather(1, seqs[c, 1:, None])[:, 0], atol=1e-5)
