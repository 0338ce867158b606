"""Helpers shared by the model tests: tiny random models with sharper weights."""

from __future__ import annotations

import torch

_KINDS = ("question", "context", "generator", "causal")


def sharpen(src: str, out, kind: str, std: float, seed: int) -> str:
    """Copy the tiny random model at `src` (`kind`: question / context encoder, seq2seq or causal generator) to `out`
    with its matrices re-drawn at a larger `std`.

    The conftest models (init std 0.02) embed every passage almost identically and their generators barely read
    their context; sharper weights make doc scores and per-passage likelihoods differ visibly, so tests can tell
    RAG-Sequence from RAG-Token and see gradients of a useful size.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, DPRContextEncoder, DPRQuestionEncoder

    cls = dict(zip(_KINDS, (DPRQuestionEncoder, DPRContextEncoder, AutoModelForSeq2SeqLM, AutoModelForCausalLM)))[kind]
    model = cls.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)
