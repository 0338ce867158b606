"""faiss-gpu search: the CPU fallback everywhere; GPU equality with the CPU index where a GPU exists (marker `gpu`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rag.knowledge.gpu import gpu_count, to_gpu
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage

needs_gpu = pytest.mark.skipif(gpu_count() == 0, reason="needs faiss with GPU support and a CUDA device")


def _kb(tmp_path, index: str, n: int = 2000, d: int = 32) -> KnowledgeBase:
    rng = np.random.default_rng(0)
    passages = [Passage(f"p{i}", "", f"text {i}") for i in range(n)]
    return KnowledgeBase.from_embeddings(passages, rng.standard_normal((n, d)).astype(np.float32), {"name": "random", "dim": d},
                                         tmp_path / index.split(":")[0], index=index, show_progress=False)


@pytest.mark.parametrize("index", ["flat", "hnsw"])
def test_without_a_usable_gpu_search_stays_on_the_cpu_with_a_warning(tmp_path, caplog, index):
    if index == "flat" and gpu_count() > 0:
        pytest.skip("a GPU is present: the fallback is not taken")
    kb = _kb(tmp_path, index, n=300)
    q = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    before = kb.search(q, 5)
    with caplog.at_level(logging.WARNING, logger="rag.knowledge.gpu"):
        assert kb.use_gpu() is False
    assert "searching on the CPU" in caplog.text
    after = kb.search(q, 5)
    np.testing.assert_array_equal(after[1], before[1])
    np.testing.assert_array_equal(after[0], before[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shard", [False, True])
def test_gpu_flat_search_equals_cpu(tmp_path, shard):
    kb = _kb(tmp_path, "flat")
    q = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    want = kb.search(q, 10)
    assert kb.use_gpu("all", shard=shard)
    got = kb.search(q, 10)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_gpu_ivf_pq_search_matches_cpu_recall(tmp_path):
    kb = _kb(tmp_path, "ivf_pq:nlist=16,nprobe=16")
    q = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    cpu_rows = kb.search(q, 10)[1]
    assert kb.use_gpu(0, fp16=True)
    gpu_rows = kb.search(q, 10)[1]
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(cpu_rows, gpu_rows)])
    assert overlap > 0.9  # the same codes searched exhaustively (nprobe = nlist); fp16 look-up tables round


@pytest.mark.gpu
@needs_gpu
def test_a_gpu_id_that_does_not_exist_is_a_config_error(tmp_path):
    from rag.errors import ConfigError

    kb = _kb(tmp_path, "flat", n=100)
    with pytest.raises(ConfigError, match="do not exist"):
        to_gpu(kb._index, kb.index_spec, [gpu_count()])
