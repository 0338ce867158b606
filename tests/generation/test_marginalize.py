"""RAG marginalization: brute force (Eq. 1 / Eq. 2), parity with transformers' RAG classes, gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from rag.generation.marginalize import (
    doc_log_prior,
    gather_target_logprobs,
    hf_shift_targets,
    rag_nll_from_logits,
    rag_sequence_log_likelihood,
    rag_sequence_nll,
    rag_token_log_likelihood,
    rag_token_nll,
    sequence_log_likelihoods,
    shift_right,
    target_logprobs_from_logits,
    target_mask,
    token_marginal_logprobs,
)
from rag.utils.errors import ConfigError, RagError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital and largest city of France.",
    "Who wrote Hamlet? William Shakespeare wrote it around 1600.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Hydrogen is the lightest element; helium is the second.",
]
PAD, BOS, EOS = 1, 0, 2  # BART layout (rag.generators.tiny.BART_SPECIALS)
START = EOS  # BART's decoder_start_token_id


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; several threads on a busy shared CPU stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_rag():
    """A tiny random BART + DPR question encoder wrapped in transformers' two RAG classes."""
    from transformers import RagConfig, RagSequenceForGeneration, RagTokenForGeneration

    from rag.generators.tiny import tiny_bart, tiny_dpr, train_bpe_tokenizer, train_wordpiece_tokenizer

    gen_tok = train_bpe_tokenizer(TEXTS, vocab_size=300)
    q_tok = train_wordpiece_tokenizer(TEXTS, vocab_size=200)
    generator = tiny_bart(gen_tok, seed=0).eval()
    question_encoder = tiny_dpr(q_tok, seed=1).eval()
    config = RagConfig.from_question_encoder_generator_configs(question_encoder.config, generator.config, n_docs=3)
    models = {
        "sequence": RagSequenceForGeneration(config, question_encoder=question_encoder, generator=generator).eval(),
        "token": RagTokenForGeneration(config, question_encoder=question_encoder, generator=generator).eval(),
    }
    assert models["sequence"].generator is generator and models["token"].generator is generator
    return generator, models


def _contexts(batch: int, n_docs: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    length = 12
    ids = torch.randint(4, vocab - 1, (batch * n_docs, length), generator=g)
    ids[:, 0], ids[:, -1] = BOS, EOS
    mask = torch.ones_like(ids)
    for row in range(0, batch * n_docs, 2):  # every other context is padded
        ids[row, 8:] = PAD
        ids[row, 7] = EOS
        mask[row, 8:] = 0
    doc_scores = 2.0 * torch.randn(batch, n_docs, generator=g)
    return ids, mask, doc_scores


def _labels(style: str, vocab: int, seed: int) -> torch.Tensor:
    """Two rows of different lengths (so the shorter is padded) in one of three layouts."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(4, vocab - 1, (6,), generator=g).tolist()
    rows = {
        # decoder start + BOS + answer + EOS: transformers' fine-tuning layout (use_bos)
        "start_bos": [[START, BOS, y[0], y[1], y[2], EOS], [START, BOS, y[3], EOS, PAD, PAD]],
        # what `tokenizer(text_target=...)` gives: BOS + answer + EOS
        "bos": [[BOS, y[0], y[1], y[2], EOS, PAD], [BOS, y[3], y[4], y[5], y[0], EOS]],
        # second row has a single scored target token: transformers drops its doc prior
        "one_token_row": [[START, BOS, y[0], y[1], EOS], [START, y[2], PAD, PAD, PAD]],
    }[style]
    return torch.tensor(rows)


def _per_doc_logprobs(generator, ctx_ids, ctx_mask, decoder_input_ids, n_docs):
    """Run the generator on every (input, doc) context: (B, K, T, V) log-probabilities."""
    batch = decoder_input_ids.shape[0]
    logits = generator(
        input_ids=ctx_ids, attention_mask=ctx_mask, decoder_input_ids=decoder_input_ids.repeat_interleave(n_docs, 0)
    ).logits
    return logits.log_softmax(-1).view(batch, n_docs, *logits.shape[1:])


def _hf_loss(model, kind, ctx_ids, ctx_mask, doc_scores, labels, n_docs, eps, exclude_bos, reduce):
    model.config.label_smoothing = eps
    extra = {"exclude_bos_score": exclude_bos} if kind == "sequence" else {}
    out = model(
        context_input_ids=ctx_ids, context_attention_mask=ctx_mask, doc_scores=doc_scores, labels=labels,
        n_docs=n_docs, reduce_loss=reduce, **extra,
    )
    return out.loss


NLL = {"sequence": rag_sequence_nll, "token": rag_token_nll}


# ----------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("n_docs", [1, 3])
@pytest.mark.parametrize("style", ["start_bos", "bos", "one_token_row"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("exclude_bos", [False, True])
@pytest.mark.parametrize("reduce", [False, True])
def test_hf_compat_matches_transformers(tiny_rag, kind, n_docs, style, eps, exclude_bos, reduce):
    generator, models = tiny_rag
    vocab = generator.config.vocab_size
    ctx_ids, ctx_mask, doc_scores = _contexts(2, n_docs, vocab, seed=n_docs)
    labels = _labels(style, vocab, seed=7)
    with torch.no_grad():
        expected = _hf_loss(models[kind], kind, ctx_ids, ctx_mask, doc_scores, labels, n_docs, eps, exclude_bos, reduce)
        lp = _per_doc_logprobs(generator, ctx_ids, ctx_mask, labels, n_docs)
    got = NLL[kind](
        lp, hf_shift_targets(labels, PAD), doc_log_prior(doc_scores), pad_token_id=PAD, epsilon=eps,
        reduce="sum" if reduce else "none", exclude_bos_score=exclude_bos, bos_token_id=BOS, hf_compat=True,
    )
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("n_docs", [1, 3])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("style", ["start_bos", "bos"])
def test_default_equals_transformers_where_it_has_no_defect(tiny_rag, kind, n_docs, eps, style):
    generator, models = tiny_rag
    vocab = generator.config.vocab_size
    ctx_ids, ctx_mask, doc_scores = _contexts(2, n_docs, vocab, seed=3)
    labels = _labels(style, vocab, seed=11)
    with torch.no_grad():
        expected = _hf_loss(models[kind], kind, ctx_ids, ctx_mask, doc_scores, labels, n_docs, eps, False, False)
        lp = _per_doc_logprobs(generator, ctx_ids, ctx_mask, labels, n_docs)
    got = NLL[kind](lp, hf_shift_targets(labels, PAD), doc_log_prior(doc_scores), pad_token_id=PAD, epsilon=eps, reduce="none")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_transformers_drops_the_sequence_prior_of_a_one_token_target(tiny_rag):
    """Defect 2: no gradient reaches doc_scores; the default keeps the prior and matches Eq. 1."""
    generator, models = tiny_rag
    vocab, n_docs = generator.config.vocab_size, 3
    ctx_ids, ctx_mask, doc_scores = _contexts(2, n_docs, vocab, seed=5)
    labels = _labels("one_token_row", vocab, seed=13)
    scores = doc_scores.clone().requires_grad_(True)
    _hf_loss(models["sequence"], "sequence", ctx_ids, ctx_mask, scores, labels, n_docs, 0.0, False, False)[1].backward()
    assert torch.count_nonzero(scores.grad) == 0  # transformers: the retriever learns nothing from this row

    with torch.no_grad():
        lp = _per_doc_logprobs(generator, ctx_ids, ctx_mask, labels, n_docs)
    target = hf_shift_targets(labels, PAD)
    scores = doc_scores.clone().requires_grad_(True)
    loss = rag_sequence_nll(lp, target, doc_log_prior(scores), pad_token_id=PAD, reduce="none")
    loss[1].backward()
    assert torch.count_nonzero(scores.grad[1]) == n_docs
    # the one scored token y: -log Σ_z p(z|x) p(y|x,z)
    y = target[1, 0]
    brute = -torch.logsumexp(doc_log_prior(doc_scores)[1] + lp[1, :, 0, y], dim=0)
    torch.testing.assert_close(loss[1].detach(), brute)
    # the RAG-Sequence and RAG-Token losses of a length-one target agree (paper §2.1); transformers' do not
    tok = rag_token_nll(lp, target, doc_log_prior(doc_scores), pad_token_id=PAD, reduce="none")
    torch.testing.assert_close(tok[1], loss[1].detach())
    hf_seq = rag_sequence_nll(lp, target, doc_log_prior(doc_scores), pad_token_id=PAD, reduce="none", hf_compat=True)
    assert not torch.allclose(hf_seq[1], tok[1])


@pytest.mark.parametrize("n_docs", [1, 3])
def test_transformers_single_token_labels_score_nothing(tiny_rag, n_docs):
    """Defect 1: labels of one token -> RAG-Token loss 0 and RAG-Sequence loss -log K; the default scores the token."""
    generator, models = tiny_rag
    vocab = generator.config.vocab_size
    ctx_ids, ctx_mask, doc_scores = _contexts(2, n_docs, vocab, seed=9)
    labels = torch.tensor([[17], [42]])
    with torch.no_grad():
        hf_tok = _hf_loss(models["token"], "token", ctx_ids, ctx_mask, doc_scores, labels, n_docs, 0.0, False, False)
        hf_seq = _hf_loss(models["sequence"], "sequence", ctx_ids, ctx_mask, doc_scores, labels, n_docs, 0.0, False, False)
        lp_hf = _per_doc_logprobs(generator, ctx_ids, ctx_mask, labels, n_docs)
    assert torch.equal(hf_tok, torch.zeros(2))
    torch.testing.assert_close(hf_seq, torch.full((2,), -math.log(n_docs)))
    prior = doc_log_prior(doc_scores)
    target_hf = hf_shift_targets(labels, PAD)
    torch.testing.assert_close(rag_token_nll(lp_hf, target_hf, prior, pad_token_id=PAD, reduce="none", hf_compat=True), hf_tok)
    torch.testing.assert_close(rag_sequence_nll(lp_hf, target_hf, prior, pad_token_id=PAD, reduce="none", hf_compat=True), hf_seq)

    # default convention: decoder reads [start], target is the label itself
    with torch.no_grad():
        lp = _per_doc_logprobs(generator, ctx_ids, ctx_mask, shift_right(labels, START, PAD), n_docs)
    brute = -torch.logsumexp(prior + lp[torch.arange(2), :, 0, labels[:, 0]], dim=1)
    for nll in (rag_sequence_nll, rag_token_nll):
        loss = nll(lp, labels, prior, pad_token_id=PAD, reduce="none")
        torch.testing.assert_close(loss, brute)
        assert bool((loss > 0).all())


# ----------------------------------------------------------------------------- brute force


def _random_case(batch=2, n_docs=3, length=4, vocab=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(batch, n_docs, length, vocab, generator=g, dtype=dtype).log_softmax(-1)
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, length - 2:] = False  # second row padded
    prior = doc_log_prior(torch.randn(batch, n_docs, generator=g, dtype=dtype))
    return lp, target, mask, prior


def _brute_sequence(lp, target, mask, prior):
    """Eq. 1 with explicit loops: log Σ_z p(z|x) Π_i p(y_i | x, z, y_<i)."""
    out = []
    for b in range(lp.shape[0]):
        total = 0.0
        for z in range(lp.shape[1]):
            prob = math.exp(prior[b, z])
            for i in range(lp.shape[2]):
                if mask[b, i]:
                    prob *= math.exp(lp[b, z, i, target[b, i]])
            total += prob
        out.append(math.log(total))
    return torch.tensor(out, dtype=torch.float64)


def _brute_token(lp, target, mask, prior):
    """Eq. 2 with explicit loops: Σ_i log Σ_z p(z|x) p(y_i | x, z, y_<i)."""
    out = []
    for b in range(lp.shape[0]):
        total = 0.0
        for i in range(lp.shape[2]):
            if mask[b, i]:
                total += math.log(sum(math.exp(prior[b, z] + lp[b, z, i, target[b, i]]) for z in range(lp.shape[1])))
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equations_match_brute_force(seed):
    lp, target, mask, prior = _random_case(seed=seed)
    tlp = gather_target_logprobs(lp, target)
    torch.testing.assert_close(rag_sequence_log_likelihood(tlp, prior, mask=mask), _brute_sequence(lp, target, mask, prior))
    torch.testing.assert_close(rag_token_log_likelihood(tlp, prior, mask=mask), _brute_token(lp, target, mask, prior))
    # losses with eps=0 are the negatives
    torch.testing.assert_close(rag_sequence_nll(lp, target, prior, mask=mask, reduce="none"),
                               -_brute_sequence(lp, target, mask, prior))
    torch.testing.assert_close(rag_token_nll(lp, target, prior, mask=mask, reduce="none"), -_brute_token(lp, target, mask, prior))


def test_label_smoothing_matches_brute_force():
    lp, target, mask, prior = _random_case(seed=4)
    eps, (batch, n_docs, length, vocab) = 0.1, lp.shape
    seq, tok = [], []
    for b in range(batch):
        smooth_terms = []
        for z in range(n_docs):
            s = vocab * prior[b, z]
            for i in range(length):
                if mask[b, i]:
                    s += sum(lp[b, z, i, v] for v in range(vocab))
            smooth_terms.append(s)
        smooth = math.log(sum(math.exp(s) for s in smooth_terms))
        seq.append(-(1 - eps) * _brute_sequence(lp, target, mask, prior)[b] - eps / vocab * smooth)
        total = 0.0
        for i in range(length):
            if mask[b, i]:
                marginal = [math.log(sum(math.exp(prior[b, z] + lp[b, z, i, v]) for z in range(n_docs))) for v in range(vocab)]
                total += (1 - eps) * -marginal[target[b, i]] + eps / vocab * -sum(marginal)
        tok.append(total)
    torch.testing.assert_close(rag_sequence_nll(lp, target, prior, mask=mask, epsilon=eps, reduce="none"), torch.stack(seq))
    torch.testing.assert_close(rag_token_nll(lp, target, prior, mask=mask, epsilon=eps, reduce="none"),
                               torch.tensor(tok, dtype=torch.float64))


def test_token_marginal_is_a_distribution_and_matches_brute_force():
    lp, _, _, prior = _random_case(seed=5)
    marginal = token_marginal_logprobs(lp, prior)
    assert marginal.shape == (lp.shape[0], lp.shape[2], lp.shape[3])
    torch.testing.assert_close(marginal.logsumexp(-1), torch.zeros(marginal.shape[:2], dtype=torch.float64))
    for b, i, v in itertools.product(range(lp.shape[0]), range(lp.shape[2]), range(lp.shape[3])):
        brute = math.log(sum(math.exp(prior[b, z] + lp[b, z, i, v]) for z in range(lp.shape[1])))
        assert marginal[b, i, v].item() == pytest.approx(brute, abs=1e-12)
    # one decoding step (B, K, V) works too; with K=1 the marginal is the document's own distribution
    torch.testing.assert_close(token_marginal_logprobs(lp[:, :, 0], prior), marginal[:, 0])
    torch.testing.assert_close(token_marginal_logprobs(lp[:, :1], torch.zeros(lp.shape[0], 1, dtype=lp.dtype)), lp[:, 0])


def test_sequence_log_likelihoods_are_per_document_sums():
    lp, target, mask, _ = _random_case(seed=6)
    tlp = gather_target_logprobs(lp, target)
    expected = torch.stack([torch.stack([tlp[b, z][mask[b]].sum() for z in range(lp.shape[1])]) for b in range(lp.shape[0])])
    torch.testing.assert_close(sequence_log_likelihoods(tlp, mask), expected)


# ----------------------------------------------------------------------------- K = 1 is the plain generator


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_single_document_equals_cross_entropy(kind, eps):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 1, 5, 11, generator=g, dtype=torch.float64)
    target = torch.randint(3, 11, (3, 5), generator=g)
    target[0, 3:] = PAD
    target[2, 1:] = -100
    got = NLL[kind](logits.log_softmax(-1), target, torch.zeros(3, 1, dtype=torch.float64), pad_token_id=PAD, epsilon=eps,
                    reduce="sum")
    flat_target = target.masked_fill(target == PAD, -100).view(-1)
    expected = F.cross_entropy(logits.view(-1, 11), flat_target, ignore_index=-100, label_smoothing=eps, reduction="sum")
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_single_document_equals_bart_loss(tiny_rag, kind):
    """K=1 with the default convention reproduces BART's own `labels=` loss; `shift_right` is BART's shift."""
    from transformers.models.bart.modeling_bart import shift_tokens_right

    generator, _ = tiny_rag
    ctx_ids, ctx_mask, _ = _contexts(2, 1, generator.config.vocab_size, seed=12)
    labels = _labels("bos", generator.config.vocab_size, seed=3)
    labels = labels.masked_fill(labels == PAD, -100)
    assert torch.equal(shift_right(labels, START, PAD), shift_tokens_right(labels, PAD, START))
    with torch.no_grad():
        expected = generator(input_ids=ctx_ids, attention_mask=ctx_mask, labels=labels).loss
        lp = _per_doc_logprobs(generator, ctx_ids, ctx_mask, shift_right(labels, START, PAD), 1)
    got = NLL[kind](lp, labels, torch.zeros(2, 1), reduce="sum") / (labels != -100).sum()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- gradients and numerics


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_gradients_reach_doc_scores(kind, eps):
    lp, target, mask, _ = _random_case(seed=10)
    scores = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    NLL[kind](lp, target, doc_log_prior(scores), mask=mask, epsilon=eps).backward()
    assert torch.isfinite(scores.grad).all() and torch.count_nonzero(scores.grad) == scores.numel()
    # the loss depends on scores only through a softmax: shifting a row changes nothing
    torch.testing.assert_close(scores.grad.sum(-1), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("hf_compat", [False, True])
def test_gradcheck(kind, hf_compat):
    lp, target, mask, _ = _random_case(batch=2, n_docs=2, length=3, vocab=4, seed=11)
    logits = lp.clone().requires_grad_(True)
    scores = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)

    def f(logits, scores):
        return NLL[kind](logits.log_softmax(-1), target, doc_log_prior(scores), mask=mask, epsilon=0.1, hf_compat=hf_compat)

    assert torch.autograd.gradcheck(f, (logits, scores))


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_extreme_values_stay_finite(kind):
    lp, target, mask, _ = _random_case(seed=12, dtype=torch.float32)
    lp = (lp * 1e3).log_softmax(-1)  # log-probs down to about -1e4
    lp[..., 0] = float("-inf")  # a banned vocabulary entry ...
    target = target.masked_fill(~mask, 0)  # ... which padded positions point at
    target[mask & (target == 0)] = 1
    scores = (1e4 * torch.randn(2, 3)).requires_grad_(True)
    logits = lp.clone().requires_grad_(True)
    loss = NLL[kind](logits, target, doc_log_prior(scores), mask=mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(scores.grad).all() and torch.isfinite(logits.grad).all()


def test_half_precision_is_promoted():
    lp, target, mask, prior = _random_case(seed=13, dtype=torch.float32)
    full = rag_sequence_nll(lp, target, prior, mask=mask, epsilon=0.1)
    half = rag_sequence_nll(lp.bfloat16(), target, prior.bfloat16(), mask=mask, epsilon=0.1)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.02)


# ----------------------------------------------------------------------------- masking, options, errors


def test_pad_id_ignore_index_and_explicit_mask_agree():
    lp, target, mask, prior = _random_case(seed=14)
    target = target.clamp_min(2)
    padded = target.masked_fill(~mask, PAD)
    ignored = target.masked_fill(~mask, -100)
    for nll in NLL.values():
        a = nll(lp, padded, prior, pad_token_id=PAD, reduce="none")
        torch.testing.assert_close(nll(lp, ignored, prior, reduce="none"), a)
        torch.testing.assert_close(nll(lp, target, prior, mask=mask, reduce="none"), a)
    assert torch.equal(target_mask(padded, pad_token_id=PAD), mask)


def test_reductions():
    lp, target, mask, prior = _random_case(seed=15)
    per_example = rag_token_nll(lp, target, prior, mask=mask, reduce="none")
    assert per_example.shape == (2,)
    torch.testing.assert_close(rag_token_nll(lp, target, prior, mask=mask, reduce="sum"), per_example.sum())
    torch.testing.assert_close(rag_token_nll(lp, target, prior, mask=mask), per_example.mean())
    with pytest.raises(ConfigError, match="reduce"):
        rag_token_nll(lp, target, prior, reduce="tokens")
    with pytest.raises(ConfigError, match="epsilon"):
        rag_sequence_nll(lp, target, prior, epsilon=1.5)


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_exclude_bos_is_per_row_by_default(kind):
    lp, target, mask, prior = _random_case(seed=16)
    target[0, 0] = BOS  # only the first row starts with BOS
    target[1, 0] = 3
    base = NLL[kind](lp, target, prior, mask=mask, reduce="none")
    excl = NLL[kind](lp, target, prior, mask=mask, reduce="none", exclude_bos_score=True, bos_token_id=BOS)
    no_first = mask.clone()
    no_first[0, 0] = False
    torch.testing.assert_close(excl, NLL[kind](lp, target, prior, mask=no_first, reduce="none"))
    torch.testing.assert_close(excl[1], base[1])
    assert not torch.allclose(excl[0], base[0])
    if kind == "sequence":  # transformers only excludes when every row starts with BOS
        hf = rag_sequence_nll(lp, target, prior, mask=mask, reduce="none", exclude_bos_score=True, bos_token_id=BOS,
                              hf_compat=True)
        hf_base = rag_sequence_nll(lp, target, prior, mask=mask, reduce="none", hf_compat=True)
        torch.testing.assert_close(hf, hf_base)


def test_shape_errors_name_the_argument():
    lp, target, mask, prior = _random_case(seed=17)
    with pytest.raises(RagError, match="doc_log_prior"):
        rag_sequence_nll(lp, target, prior[:, :2])
    with pytest.raises(RagError, match="target"):
        rag_token_nll(lp, target[:, :2], prior)
    with pytest.raises(RagError, match="mask"):
        rag_sequence_nll(lp, target, prior, mask=mask[:, :2])
    with pytest.raises(RagError, match="doc_scores"):
        doc_log_prior(torch.zeros(3))


def test_target_conventions():
    labels = torch.tensor([[START, BOS, 7, EOS], [START, BOS, EOS, PAD]])
    assert hf_shift_targets(labels, PAD).tolist() == [[BOS, 7, EOS, PAD], [BOS, EOS, PAD, PAD]]
    plain = torch.tensor([[BOS, 7, EOS], [BOS, EOS, -100]])
    assert shift_right(plain, START, PAD).tolist() == [[START, BOS, 7], [START, BOS, EOS]]


# ----------------------------------------------------------------------------- loss from logits, temperature, document mask


def test_doc_log_prior_temperature_and_mask_hand_computed():
    # τ = 2: log_softmax([0.5, 1.5]) = [-log(1 + e), -log(1 + e^-1)]
    got = doc_log_prior(torch.tensor([[1.0, 3.0]]), temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([[-1.3132617, -0.3132617]]))
    # masked middle document: -inf, and the others renormalise: log_softmax([1, 3])
    got = doc_log_prior(torch.tensor([[1.0, 2.0, 3.0]]), doc_mask=torch.tensor([[True, False, True]]))
    assert got[0, 1] == float("-inf")
    torch.testing.assert_close(got[0, [0, 2]], torch.tensor([-2.1269280, -0.1269280]))
    # both at once: scores / 0.5 = [2, 6] over the kept documents
    got = doc_log_prior(torch.tensor([[1.0, 2.0, 3.0]]), temperature=0.5, doc_mask=torch.tensor([[True, False, True]]))
    torch.testing.assert_close(got[0, [0, 2]], torch.tensor([-4.0181499, -0.0181499]))


def test_doc_log_prior_default_is_bit_identical_to_log_softmax():
    scores = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 7
    assert torch.equal(doc_log_prior(scores), torch.log_softmax(scores, dim=-1))
    assert torch.equal(doc_log_prior(scores, temperature=1.0), torch.log_softmax(scores, dim=-1))
    assert torch.equal(doc_log_prior(scores, doc_mask=torch.ones(4, 6, dtype=torch.bool)), torch.log_softmax(scores, dim=-1))


def test_doc_log_prior_rejects_bad_temperature_and_empty_rows():
    scores = torch.zeros(2, 3)
    for bad in (0.0, -1.0, True, "2"):
        with pytest.raises(ConfigError, match="temperature"):
            doc_log_prior(scores, temperature=bad)
    with pytest.raises(RagError, match="without any document"):
        doc_log_prior(scores, doc_mask=torch.tensor([[True, False, False], [False, False, False]]))
    with pytest.raises(RagError, match="doc_mask"):
        doc_log_prior(scores, doc_mask=torch.ones(2, 2, dtype=torch.bool))


def _logits_case(seed=0, b=3, k=4, t=5, v=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k, t, v, generator=g) * 3
    labels = torch.randint(3, v, (b, t), generator=g)
    labels[0, 0] = BOS
    labels[1, 0] = BOS
    label_mask = torch.ones(b, t, dtype=torch.bool)
    label_mask[2, 3:] = False
    labels[2, 3:] = PAD
    scores = torch.randn(b, k, generator=g)
    return logits, labels, label_mask, scores


def test_target_logprobs_from_logits_equal_the_gathered_log_softmax():
    logits, labels, _, _ = _logits_case()
    torch.testing.assert_close(target_logprobs_from_logits(logits, labels),
                               gather_target_logprobs(logits.log_softmax(-1), labels))


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("exclude_bos", [False, True])
@pytest.mark.parametrize("reduce", ["mean", "sum", "none"])
def test_rag_nll_from_logits_default_path_is_bit_identical_to_the_previous_model_loss(kind, exclude_bos, reduce):
    """The computation RagModel.loss_from_logits did inline before it became a thin call, step by step."""
    logits, labels, label_mask, scores = _logits_case(1)
    b, k, t, _ = logits.shape
    index = labels.unsqueeze(1).expand(b, k, t).unsqueeze(-1)
    target_lp = logits.gather(-1, index).squeeze(-1).float() - torch.logsumexp(logits.float(), dim=-1)
    mask = label_mask.bool()
    if exclude_bos:
        mask = mask.clone()
        mask[:, 0] &= labels[:, 0].ne(BOS)
    ll_fn = rag_sequence_log_likelihood if kind == "sequence" else rag_token_log_likelihood
    before = -ll_fn(target_lp, torch.log_softmax(scores, dim=-1), mask=mask)
    before = before.mean() if reduce == "mean" else before.sum() if reduce == "sum" else before
    got = rag_nll_from_logits(logits, labels, label_mask, scores, marginalization=kind, reduce=reduce,
                              exclude_bos_score=exclude_bos, bos_token_id=BOS, pad_token_id=PAD)
    assert torch.equal(got, before)


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("hf_compat", [False, True])
def test_rag_nll_from_logits_smoothing_and_hf_paths_are_the_nll_functions(kind, hf_compat):
    logits, labels, label_mask, scores = _logits_case(2)
    got = rag_nll_from_logits(logits, labels, label_mask, scores, marginalization=kind, label_smoothing=0.1, reduce="none",
                              bos_token_id=BOS, pad_token_id=PAD, hf_compat=hf_compat)
    want = NLL[kind](logits.log_softmax(-1), labels, doc_log_prior(scores), mask=None if hf_compat else label_mask,
                     pad_token_id=PAD, epsilon=0.1, reduce="none", bos_token_id=BOS, hf_compat=hf_compat)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_masked_documents_drop_out_of_the_loss_and_get_no_gradient(kind, eps):
    logits, labels, label_mask, scores = _logits_case(3)
    scores.requires_grad_(True)
    keep = torch.tensor([True, False, True, True])
    doc_mask = keep.expand(scores.shape[0], -1)
    kw = dict(marginalization=kind, label_smoothing=eps, reduce="none", pad_token_id=PAD, temperature=0.7)
    masked = rag_nll_from_logits(logits, labels, label_mask, scores, doc_mask=doc_mask, **kw)
    dropped = rag_nll_from_logits(logits[:, keep], labels, label_mask, scores[:, keep], **kw)
    torch.testing.assert_close(masked, dropped)
    masked.sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.all(scores.grad[:, 1] == 0) and torch.all(scores.grad[:, keep].abs().sum(1) > 0)


def test_temperature_scales_the_retrieval_logits():
    logits, labels, label_mask, scores = _logits_case(4)
    kw = dict(marginalization="sequence", reduce="none", pad_token_id=PAD)
    torch.testing.assert_close(rag_nll_from_logits(logits, labels, label_mask, scores, temperature=0.25, **kw),
                               rag_nll_from_logits(logits, labels, label_mask, scores * 4, **kw))
