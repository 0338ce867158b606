"""Causal-LM decoding seam: greedy / beam search token-identical to `model.generate`, sampling, continuation scores."""

from __future__ import annotations

import pytest
import torch

from rag.generation.causal import CausalLMDecoder, causal_generate, continuation_logprobs
from rag.generation.search import GenerationConfig, resolve_spec, sample
from rag.utils.errors import ConfigError, RagError

TEXTS = [
    "the quick brown fox jumps over the lazy dog", "hydrogen is the lightest element",
    "oxygen has atomic number eight", "helium is a noble gas", "iron is a metal used in steel",
    "carbon forms many compounds", "gold is a precious yellow metal", "neon lights glow red",
]
PROMPTS = ["hydrogen is", "the quick brown fox jumps over", "gold"]  # different lengths: left padding
PAD, EOS = 1, 2


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """Tiny random GPT-2 (weights N(0, 0.3) so tokens vary, EOS made likely), saved and loaded back as a user would."""
    from transformers import AutoModelForCausalLM

    from rag.generators.tiny import tiny_gpt2, train_bpe_tokenizer

    tok = train_bpe_tokenizer(TEXTS * 3, vocab_size=300)
    tok.padding_side = "left"
    model = tiny_gpt2(tok, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        eos_row = model.transformer.wte.weight[EOS]  # output layer tied to it: this bias adds 6.5 to the EOS logit
        model.transformer.ln_f.bias.copy_(6.5 * eos_row / eos_row.dot(eos_row))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD, EOS)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert not enc.attention_mask.all() and bool(enc.attention_mask[:, -1].all())
    return tok, model, enc.input_ids, enc.attention_mask


def test_greedy_matches_generate(lm):
    _, model, ids, mask = lm
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=1,
                         pad_token_id=PAD)
    seqs, loglik = causal_generate(model, ids, mask, GenerationConfig(max_new_tokens=10, pad_token_id=PAD))
    assert torch.equal(seqs, ref)
    assert len({tuple(r) for r in seqs[:, ids.shape[1]:].tolist()}) == 3  # the prompts lead to different outputs
    assert (loglik < 0).all()


@pytest.mark.parametrize("options", [
    dict(max_new_tokens=9, num_beams=4, num_return_sequences=4),
    dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping=True,
         no_repeat_ngram_size=2),
    dict(max_new_tokens=8, num_beams=3, num_return_sequences=3, length_penalty=1.5, early_stopping="never",
         min_new_tokens=3),
])
def test_beam_search_matches_generate(lm, options):
    _, model, ids, mask = lm
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                         output_scores=True, return_dict_in_generate=True, **options)
    seqs, scores = causal_generate(model, ids, mask, GenerationConfig(pad_token_id=PAD, **options))
    assert torch.equal(seqs, ref.sequences)
    assert torch.allclose(scores, ref.sequences_scores, atol=1e-5)
    r = options["num_return_sequences"]
    assert all(len({tuple(s) for s in q.tolist()}) == r for q in seqs.view(3, r, -1))  # distinct beams
    assert (scores.view(3, r)[:, :-1] >= scores.view(3, r)[:, 1:]).all()  # best first


def test_some_beam_hypotheses_end_with_eos(lm):
    """The beam parity cases above exercise finished hypotheses, not only length cut-offs."""
    _, model, ids, mask = lm
    seqs, _ = causal_generate(model, ids, mask, GenerationConfig(max_new_tokens=9, num_beams=4, num_return_sequences=4,
                                                                 pad_token_id=PAD))
    assert (seqs[:, ids.shape[1]:] == EOS).any()


def _sample(model, ids, mask, seed, **options):
    config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=PAD, **options)
    return causal_generate(model, ids, mask, config, rng=torch.Generator().manual_seed(seed))[0]


def test_sampling_is_deterministic_per_seed(lm):
    _, model, ids, mask = lm
    first = _sample(model, ids, mask, 7, temperature=1.5)
    assert torch.equal(first, _sample(model, ids, mask, 7, temperature=1.5))
    others = [_sample(model, ids, mask, seed, temperature=1.5) for seed in range(8, 12)]
    assert any(not torch.equal(first, o) for o in others)  # the seed matters


def test_top_k_sampling_emits_only_top_k_tokens(lm):
    """Every sampled token is among the k most likely under the model at its step (nonzero top-k probability)."""
    _, model, ids, mask = lm
    k, prompt_len = 3, ids.shape[1]
    for seed in range(4):
        seqs = _sample(model, ids, mask, seed, top_k=k, temperature=2.0)
        full_mask = torch.cat([mask, torch.ones_like(seqs[:, prompt_len:])], 1)
        logits = model(input_ids=seqs, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
        for t in range(prompt_len, seqs.shape[1]):
            step = logits[:, t - 1]
            chosen = step.gather(1, seqs[:, t:t + 1])
            rank = (step > chosen).sum(1)
            running = ~(seqs[:, prompt_len:t] == EOS).any(1)  # rows still generating at step t
            assert (rank[running] < k).all()


def test_sampling_matches_generate_under_the_same_global_seed(lm):
    _, model, ids, mask = lm
    options = dict(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9)
    torch.manual_seed(5)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, pad_token_id=PAD, **options)
    torch.manual_seed(5)
    seqs, _ = causal_generate(model, ids, mask, GenerationConfig(do_sample=True, pad_token_id=PAD, **options))
    assert torch.equal(seqs, ref)


def test_continuation_logprobs_score_the_greedy_output(lm):
    """Teacher-forced log-probs of the greedy continuation sum to its search log-likelihood, per row and in a batch."""
    _, model, ids, mask = lm
    seqs, loglik = causal_generate(model, ids, mask, GenerationConfig(max_new_tokens=10, pad_token_id=PAD))
    cont = seqs[:, ids.shape[1]:]
    after_eos = (cont == EOS).long().cumsum(1) - (cont == EOS).long() > 0
    cmask = (~after_eos).long()
    lp = continuation_logprobs(model, ids, mask, cont, cmask)
    assert torch.allclose(lp.sum(1), loglik, atol=1e-4)
    assert (lp[cmask == 0] == 0).all()
    for r in range(3):  # each row alone, without padding, scores the same
        real = mask[r].bool()
        alone = continuation_logprobs(model, ids[r:r + 1, real], None, cont[r:r + 1], cmask[r:r + 1])
        assert torch.allclose(alone, lp[r:r + 1], atol=1e-4)


def test_errors_name_the_fix(lm):
    _, model, ids, mask = lm
    right_padded = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    with pytest.raises(RagError, match="left-padded"):
        causal_generate(model, ids, right_padded)
    decoder = CausalLMDecoder(model, ids, mask)
    with pytest.raises(RagError, match="prompt's last tokens"):
        decoder.step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="do_sample"):
        GenerationConfig(do_sample=True, num_beams=2)
    with pytest.raises(ConfigError, match="start tokens"):
        sample(decoder, ids[:, :2], resolve_spec(GenerationConfig(do_sample=True), model, prompt_len=ids.shape[1],
                                                  pad_fallback=EOS))
