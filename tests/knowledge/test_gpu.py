"""GPU search and builds: the CPU fallback everywhere; the torch flat search's algorithm on CPU tensors; GPU equality with
the CPU index where a GPU exists (marker `gpu`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from rag.knowledge import gpu as gpu_module
from rag.knowledge.gpu import TorchFlatIndex, faiss_gpu_problem, gpu_count, to_gpu
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_FAISS_GPU_PROBLEM = faiss_gpu_problem(0) if torch.cuda.is_available() else "no CUDA device"
needs_gpu = pytest.mark.skipif(
    _FAISS_GPU_PROBLEM is not None,
    reason="IVF-PQ search and builds on a GPU run in faiss's own CUDA kernels, which only faiss's GPU build has (the "
           "[gpu] extra, faiss-gpu-cu12: kernels for compute capability 7.0-8.9, so not on an H100/H200); the torch "
           f"flat search does not stand in for them (flat-on-GPU is tested above). Here: {_FAISS_GPU_PROBLEM}")
"""The three IVF-PQ tests below. Every other GPU test needs only a CUDA device: the flat search runs in torch, and a
faiss that cannot use the GPU (faiss-cpu, or a GPU build without this GPU's kernels) must leave IVF on the CPU."""


def _kb(tmp_path, index: str, n: int = 2000, d: int = 32) -> KnowledgeBase:
    rng = np.random.default_rng(0)
    passages = [Passage(f"p{i}", "", f"text {i}") for i in range(n)]
    return KnowledgeBase.from_embeddings(passages, rng.standard_normal((n, d)).astype(np.float32), {"name": "random", "dim": d},
                                         tmp_path / index.split(":")[0], index=index, show_progress=False)


@pytest.mark.parametrize("index", ["flat", "hnsw"])
def test_without_a_usable_gpu_search_stays_on_the_cpu_with_a_warning(tmp_path, caplog, index):
    if index == "flat" and torch.cuda.is_available():
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


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("shard", [False, True])
def test_torch_flat_search_equals_faiss_flat_search(monkeypatch, metric, shard):
    """The GPU flat search's algorithm (blocks of rows, top-k merged across blocks and shards) on CPU tensors."""
    import faiss

    from rag.knowledge.index import IndexSpec, search_index

    monkeypatch.setattr(gpu_module, "_SCORE_BYTES", 4 * 7 * 50)  # 50-row blocks for 7 queries: many merges
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1003, 16)).astype(np.float32)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    index = faiss.IndexFlatIP(16) if metric == "ip" else faiss.IndexFlatL2(16)
    index.add(x)
    spec = IndexSpec.parse(f"flat:metric={metric}")
    want = search_index(index, q, 10, spec)
    got = TorchFlatIndex(gpu_module._flat_vectors(index), metric, ["cpu", "cpu", "cpu"], shard=shard, chunk=100).search(q, 10)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3)


def test_a_search_process_that_dies_is_reported_not_inherited():
    from rag.knowledge.faiss_gpu import _child_problem

    assert _child_problem("pass") is None
    assert "signal 6" in _child_problem("import os; os.abort()")
    assert "no kernel image" in _child_problem("raise RuntimeError('no kernel image is available')")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shard", [False, True])
def test_gpu_flat_search_equals_cpu(tmp_path, shard):
    kb = _kb(tmp_path, "flat")
    q = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    want = kb.search(q, 10)
    assert kb.use_gpu("all", shard=shard)
    got = kb.search(q, 10)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert kb.use_gpu(0, fp16=True)
    half = kb.search(q, 10)
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(half[1], want[1])]) > 0.95


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(_FAISS_GPU_PROBLEM is None, reason="the installed faiss runs on this GPU")
def test_a_faiss_that_cannot_run_on_this_gpu_leaves_ivf_search_and_builds_on_the_cpu(tmp_path, caplog):
    """On a GPU machine with faiss-cpu (the default install) or a faiss GPU build without kernels for this GPU."""
    kb = _kb(tmp_path, "ivf_pq:nlist=16,nprobe=16")
    q = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    want = kb.search(q, 5)
    with caplog.at_level(logging.WARNING, logger="rag.knowledge.gpu"):
        assert kb.use_gpu(0) is False
    why = "no GPU for faiss" if gpu_count() == 0 else "failed a test search"
    assert why in caplog.text and "searching on the CPU" in caplog.text
    got = kb.search(q, 5)  # still answers, on the CPU: the same rows
    np.testing.assert_array_equal(got[1], want[1])


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
@needs_cuda
def test_a_gpu_id_that_does_not_exist_is_a_config_error(tmp_path):
    from rag.utils.errors import ConfigError

    kb = _kb(tmp_path, "flat", n=100)
    with pytest.raises(ConfigError, match="do not exist"):
        to_gpu(kb._index, kb.index_spec, [torch.cuda.device_count()])


def _recall_at_10(index, spec, x: np.ndarray, q: np.ndarray) -> float:
    from rag.knowledge.index import search_index

    exact = np.argsort(-(q @ x.T), axis=1)[:, :10]
    got = search_index(index, q, 10, spec)[1]
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, got)]))


def _clustered(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, d)).astype(np.float32)
    x = centres[rng.integers(0, 64, n)] + 0.3 * rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_a_required_gpu_build_without_a_gpu_is_a_config_error_and_auto_builds_on_the_cpu():
    if gpu_count() > 0:
        pytest.skip("a GPU is present")
    from rag.knowledge.index import IndexSpec, build_index
    from rag.utils.errors import ConfigError

    x = _clustered(3000, 32, 0)
    spec = IndexSpec.parse("ivf_pq:nlist=16,pq_m=8,nprobe=4")
    with pytest.raises(ConfigError, match="faiss sees no GPU"):
        build_index(x, spec, gpu=True, show_progress=False)
    auto, cpu = build_index(x, spec, show_progress=False), build_index(x, spec, gpu=False, show_progress=False)
    q = x[:50] + 0.01
    from rag.knowledge.index import search_index

    np.testing.assert_array_equal(search_index(auto, q, 10, spec)[1], search_index(cpu, q, 10, spec)[1])


@pytest.mark.gpu
@needs_gpu
def test_an_ivf_pq_index_built_on_the_gpu_is_a_cpu_index_as_good_as_a_cpu_build(tmp_path):
    from rag.knowledge.index import IndexSpec, build_index, read_index, write_index

    x, q = _clustered(20000, 64, 0), _clustered(200, 64, 1)
    spec = IndexSpec.parse("ivf_pq:nlist=64,pq_m=16,nprobe=16")
    gpu_built = build_index(x, spec, gpu=True, show_progress=False)
    cpu_built = build_index(x, spec, gpu=False, show_progress=False)
    assert "Gpu" not in type(gpu_built).__name__ and gpu_built.ntotal == len(x)
    write_index(gpu_built, tmp_path / "index.faiss")
    reread = read_index(tmp_path / "index.faiss")
    r_gpu, r_cpu = _recall_at_10(reread, spec, x, q), _recall_at_10(cpu_built, spec, x, q)
    assert r_gpu > 0.5 and abs(r_gpu - r_cpu) < 0.05, (r_gpu, r_cpu)


@pytest.mark.gpu
@needs_cuda  # built on the GPU where faiss can, else (automatically) on the CPU: either way it must search the same
def test_a_knowledge_base_built_where_a_gpu_is_searches_like_one_built_on_the_cpu(tmp_path):
    x = _clustered(5000, 32, 0)
    passages = [Passage(f"p{i}", "", f"text {i}") for i in range(len(x))]
    enc = {"name": "random", "dim": 32}
    spec = "ivf_pq:nlist=32,pq_m=16,nprobe=32"
    on_gpu = KnowledgeBase.from_embeddings(passages, x, enc, tmp_path / "g", index=spec, show_progress=False)
    on_cpu = KnowledgeBase.from_embeddings(passages, x, enc, tmp_path / "c", index=spec, show_progress=False, gpu=False)
    reopened = KnowledgeBase.open(tmp_path / "g")
    q = x[:100]
    exact = np.argsort(-(q @ x.T), axis=1)[:, :10]

    def recall(kb) -> float:
        return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, kb.search(q, 10)[1])]))

    r_gpu, r_cpu = recall(reopened), recall(on_cpu)
    assert r_cpu > 0.5 and abs(r_gpu - r_cpu) < 0.05, (r_gpu, r_cpu)  # 16-byte codes: recall, not self-retrieval
    if _FAISS_GPU_PROBLEM is not None:  # faiss could not build on this GPU: built on the CPU, the same index
        np.testing.assert_array_equal(reopened.search(q, 10)[1], on_cpu.search(q, 10)[1])
    del on_gpu
