"""Length buckets: partition properties, optimality, and exactness on BART and T5 (outputs, losses, gradients)."""

from __future__ import annotations

import itertools

import pytest
import torch

from rag.generation.buckets import (
    Bucket,
    encode_in_buckets,
    length_buckets,
    row_extents,
    run_in_buckets,
    scatter_buckets,
    take_bucket,
)
from rag.utils.errors import RagError

PAD = 1


def right_padded(lengths, width=None, vocab=100, seed=0):
    """(N, L) random ids (>= 3) right-padded with PAD, and their mask."""
    width = width or max(lengths)
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width).expand(len(lengths), width) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g) * mask + PAD * (1 - mask)
    return ids, mask


def padded_tokens(buckets):
    return sum(len(b.rows) * b.length for b in buckets)


def check_partition(buckets, mask, max_buckets):
    n = mask.shape[0]
    rows = torch.cat([b.rows for b in buckets]).tolist()
    assert sorted(rows) == list(range(n))  # every row exactly once
    assert 1 <= len(buckets) <= max_buckets
    ext = row_extents(mask).clamp_min(1)
    for b in buckets:
        assert b.length == int(ext[b.rows].max())  # trimmed to its longest row, and no row cut short
    lengths = [b.length for b in buckets]
    assert lengths == sorted(lengths, reverse=True)


# --------------------------------------------------------------------------- bucketing logic


def test_row_extents_right_left_and_empty_rows():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    assert row_extents(mask).tolist() == [2, 4, 0, 3]  # left padding is never shortened


@pytest.mark.parametrize("lengths", [
    [5, 17, 9, 30, 12, 30, 2, 25, 7, 21],
    [12],  # a single row
    [8, 8, 8, 8],  # equal lengths
    list(range(1, 41)),
])
@pytest.mark.parametrize("max_buckets", [1, 3, 8])
def test_buckets_cover_every_row_once_and_trim_to_their_longest(lengths, max_buckets):
    _, mask = right_padded(lengths, width=max(lengths) + 3)  # extra all-padding columns are cut too
    buckets = length_buckets(mask, max_buckets=max_buckets, min_gain=0.0)
    check_partition(buckets, mask, max_buckets)
    if len(set(lengths)) == 1:
        assert len(buckets) == 1 and buckets[0].length == lengths[0]
    assert padded_tokens(buckets) <= len(lengths) * max(lengths)


def test_split_is_optimal_against_brute_force_over_all_assignments():
    lengths = [3, 11, 7, 12, 4, 9]
    _, mask = right_padded(lengths)
    for k in (1, 2, 3):
        best = min(
            sum(max((lengths[i] for i in range(6) if a[i] == g), default=0) * a.count(g) for g in range(k))
            for a in itertools.product(range(k), repeat=6)
        )
        assert padded_tokens(length_buckets(mask, max_buckets=k, min_gain=0.0)) == best


def test_min_gain_refuses_buckets_that_save_little():
    _, mask = right_padded([20, 20, 20, 19, 19, 19])  # a split saves 3 of 120 tokens (2.5%)
    assert len(length_buckets(mask, max_buckets=4, min_gain=0.0)) == 2
    assert len(length_buckets(mask, max_buckets=4, min_gain=0.05)) == 1
    _, mask = right_padded([40, 10, 10, 10, 10, 10])  # a split saves half
    assert len(length_buckets(mask, max_buckets=4, min_gain=0.05)) == 2


def test_empty_rows_and_bad_arguments():
    mask = torch.zeros(3, 5, dtype=torch.long)
    [b] = length_buckets(mask)
    assert b.length == 1 and sorted(b.rows.tolist()) == [0, 1, 2]
    assert length_buckets(torch.zeros(0, 4)) == []
    with pytest.raises(RagError, match="max_buckets"):
        length_buckets(mask, max_buckets=0)
    with pytest.raises(RagError, match="min_gain"):
        length_buckets(mask, min_gain=1.0)
    with pytest.raises(RagError, match="rows, columns"):
        length_buckets(torch.ones(4))


def test_scatter_restores_row_order_pads_and_rejects_bad_buckets():
    x = torch.arange(5 * 4, dtype=torch.float).view(5, 4)
    buckets = [Bucket(rows=torch.tensor([3, 0]), length=4), Bucket(rows=torch.tensor([4, 1, 2]), length=2)]
    parts = [take_bucket(x, b) for b in buckets]
    assert [tuple(p.shape) for p in parts] == [(2, 4), (3, 2)]
    out = scatter_buckets(parts, buckets, length=4)
    expected = x.clone()
    expected[[4, 1, 2], 2:] = 0
    assert torch.equal(out, expected)
    assert torch.equal(scatter_buckets([x[[3, 0]], x[[4, 1, 2]]], buckets), x)  # no length: rows reordered only
    dup = [Bucket(rows=torch.tensor([3, 0]), length=4), Bucket(rows=torch.tensor([0, 1, 2]), length=2)]
    with pytest.raises(RagError, match="exactly once"):
        scatter_buckets(parts, dup, length=4)
    with pytest.raises(RagError, match="one output per bucket"):
        scatter_buckets(parts[:1], buckets)


# --------------------------------------------------------------------------- exactness on real models


def tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     pad_token_id=PAD, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, init_std=0.2)
    return BartForConditionalGeneration(cfg).eval()


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=PAD,
                   eos_token_id=2, decoder_start_token_id=PAD, initializer_factor=1.0)
    return T5ForConditionalGeneration(cfg).eval()


MODELS = {"bart": tiny_bart, "t5": tiny_t5}
LENGTHS = [23, 5, 40, 12, 31, 8, 40, 17, 3, 26]


def masked(h, mask):
    """Real positions only: (tokens, d)."""
    return h[mask.bool()]


@pytest.fixture(scope="module", params=sorted(MODELS))
def generator(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("lengths", [LENGTHS, [19], [14, 14, 14]], ids=["mixed", "one_row", "equal"])
def test_encoder_states_equal_unbucketed(generator, lengths):
    ids, mask = right_padded(lengths, width=max(lengths) + 2)
    encoder = generator.get_encoder()
    buckets = length_buckets(mask, max_buckets=3, min_gain=0.0)
    assert len(buckets) == min(3, len(set(lengths)))
    with torch.no_grad():
        full = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        bucketed = encode_in_buckets(encoder, ids, mask, buckets=buckets)
    assert bucketed.shape == full.shape
    torch.testing.assert_close(masked(bucketed, mask), masked(full, mask), atol=1e-5, rtol=1e-5)
    assert masked(full, mask).abs().mean() > 0.1  # not a trivially small output
    for b in buckets:  # columns past a bucket's length are zero
        assert bucketed[b.rows, b.length:].abs().sum() == 0


def test_encoder_states_equal_unbucketed_with_left_padding(generator):
    ids, mask = right_padded(LENGTHS)
    ids, mask = ids.flip(1), mask.flip(1)
    encoder = generator.get_encoder()
    with torch.no_grad():
        full = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        bucketed = encode_in_buckets(encoder, ids, mask, max_buckets=3, min_gain=0.0)
    torch.testing.assert_close(masked(bucketed, mask), masked(full, mask), atol=1e-5, rtol=1e-5)


def _seq2seq_loss(generator, ids, mask, labels, buckets):
    """Mean target NLL of every row with the generator run per bucket (None: one call, untrimmed)."""
    dec = torch.cat([torch.full((labels.shape[0], 1), generator.config.decoder_start_token_id), labels[:, :-1]], 1)

    def run(b):
        kw = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        if b is not None:
            kw = dict(input_ids=take_bucket(ids, b), attention_mask=take_bucket(mask, b), decoder_input_ids=dec[b.rows])
        return generator(**kw, use_cache=False).logits

    logits = run(None) if buckets is None else run_in_buckets(run, buckets)
    lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return -lp.mean(), logits


def test_seq2seq_loss_and_gradients_equal_unbucketed(generator):
    ids, mask = right_padded(LENGTHS, width=44)
    labels = torch.randint(3, 100, (len(LENGTHS), 6), generator=torch.Generator().manual_seed(1))
    buckets = length_buckets(mask, max_buckets=4, min_gain=0.0)
    assert len(buckets) == 4
    results = []
    for bk in (None, buckets):
        generator.zero_grad()
        loss, logits = _seq2seq_loss(generator, ids, mask, labels, bk)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in generator.named_parameters() if p.grad is not None}
        results.append((loss.detach(), logits.detach(), grads))
    (l0, z0, g0), (l1, z1, g1) = results
    torch.testing.assert_close(z1, z0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
    assert sum(g.abs().sum() for g in g0.values()) > 0


# --------------------------------------------------------------------------- RagModel uses them


@pytest.fixture(scope="module")
def rag_model(tmp_path_factory, demo_passages, tiny_dpr_question_dir, tiny_dpr_context_dir, tiny_bart_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.rag.model import RagModel

    kb = tmp_path_factory.mktemp("buckets_kb") / "kb"
    KnowledgeBase.build(demo_passages[:40], TextEncoder(tiny_dpr_context_dir), kb, index="flat", show_progress=False)
    torch.manual_seed(0)
    return RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, str(kb), n_docs=4)


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_rag_model_loss_and_gradients_equal_unbucketed(rag_model, marginalization):
    torch.manual_seed(0)  # dropout-free, but keep the run independent of earlier tests' random state
    m = rag_model.train()
    m.config.marginalization = marginalization
    questions = ["Which element has symbol Fe?", "Who discovered oxygen?", "What is the atomic weight of neon?"]
    targets = ["Iron", "Joseph Priestley", "20.18"]
    inputs = m.prepare_inputs(questions)
    assert len(length_buckets(inputs.context_attention_mask)) > 1  # the demo passages do get bucketed
    labels, label_mask = m.tokenize_targets(targets)
    params = [p for p in m.parameters() if p.requires_grad]
    results = []
    for max_buckets in (1, 4):
        m.zero_grad()
        logits = m.generator_logits(inputs, labels, max_buckets=max_buckets)
        loss = m.loss_from_logits(logits, labels, label_mask, inputs.doc_scores)
        loss.backward(retain_graph=True)  # doc_scores' graph is shared by both passes
        results.append((loss.detach(), [None if p.grad is None else p.grad.clone() for p in params]))
    (l1, g1), (l4, g4) = results
    torch.testing.assert_close(l4, l1, atol=1e-5, rtol=1e-5)
    assert sum(g is not None for g in g1) > 10
    # float32 sums over differently padded shapes (and threads) differ in summation order; an embedding gradient is a
    # sum of many cancelling terms, so its noise follows the model's gradient scale, not its own (3e-5 seen on entries
    # near 1e-6): allow 1e-4 of the largest gradient entry.
    atol = 1e-4 * max(a.abs().max().item() for a in g1 if a is not None)
    for a, b in zip(g1, g4):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=atol, rtol=1e-4)
    m.config.marginalization = "sequence"
