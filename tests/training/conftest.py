"""Fixtures of the training tests: a tiny DPR knowledge base over the demo corpus and a
RagModule factory on the shared tiny models (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_kb_dir(tmp_path_factory, tiny_dpr_context_dir, tiny_dpr_question_dir, demo_passages) -> str:
    """The 137 demo passages encoded by the tiny random DPR context encoder (dim 32), flat index."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("kb") / "tiny_kb"
    KnowledgeBase.build(demo_passages, TextEncoder(tiny_dpr_context_dir, role="context"), out, index="flat",
                        query_encoder=tiny_dpr_question_dir, show_progress=False)
    return str(out)


@pytest.fixture
def make_module(tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir):
    """RagModule on the tiny BART + tiny DPR + tiny KB, with test-sized defaults."""
    from rag.training.modules import RagModule

    def make(**kw):
        args = dict(
            generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
            rag={"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "max_question_length": 16},
            query_encoder_lr=1e-3, generator_lr=2e-3, max_new_tokens=3, recall_at=[1, 3],
        )
        args.update(kw)
        return RagModule(**args)

    return make


@pytest.fixture
def make_data():
    from rag.training.data import QADataModule

    def make(**kw):
        args = dict(train="demo:train", val="demo:dev", test="demo:test", batch_size=4, eval_batch_size=4, max_eval_examples=8)
        args.update(kw)
        return QADataModule(**args)

    return make


@pytest.fixture
def trainer_kw(tmp_path):
    """Quiet single-CPU Trainer options writing under tmp_path."""
    return dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path), num_sanity_val_steps=0)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op parallelism, and on a shared, busy CPU
    OpenMP spin-waiting multiplies their CPU time; restore the setting afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
