"""The copy (pointer) head: its mixture math, the token ids carried by the encoder output, and that it copies."""

from __future__ import annotations

import pytest
import torch

from rag.models.pointer import attach_ids, copy_log_probs, split_memory


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
    from rag.models.warm_start import build_warm_start_generator

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
