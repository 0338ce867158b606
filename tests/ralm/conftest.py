"""Fixtures of the In-Context RALM tests: a tiny random GPT-2 saved and loaded back, BM25 over the demo passages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, bpe_tokenizer) -> str:
    from rag.models.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=256), bpe_tokenizer, tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def lm(tiny_gpt2_dir):
    from rag.models.generator import load_generator

    model, tok, _ = load_generator(tiny_gpt2_dir, kind="causal")
    return model, tok


@pytest.fixture(scope="session")
def bm25(demo_passages):
    from rag.knowledge.bm25 import BM25Retriever

    return BM25Retriever.from_passages(demo_passages, show_progress=False)
