"""faiss-gpu search: a GPU copy of a knowledge base's CPU index, on one GPU or all of them, with a CPU fallback.

The stored index is always a CPU index (``index.faiss``); :func:`to_gpu` clones it onto GPUs for search, either
replicated (each GPU holds every vector; queries are split between them) or sharded (each GPU holds 1/G of the
vectors; every query goes to all), optionally storing vectors / codes as float16 on the GPU. faiss implements flat
and IVF indexes on GPUs but not HNSW graphs: ``hnsw`` / ``hnsw_sq8`` knowledge bases, a faiss without GPU support
(faiss-cpu) or no visible CUDA device all keep searching on the CPU, with one warning saying why.
Install the GPU build with ``pip install -e ".[gpu]"`` (faiss-gpu-cu12, for CUDA 12 drivers).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import numpy as np

from rag.errors import ConfigError, RagError
from rag.knowledge.index import IndexSpec, _check_matrix

logger = logging.getLogger(__name__)

__all__ = ["gpu_count", "to_gpu", "GpuIndex"]

GPU_KINDS = ("flat", "ivf_pq")


def gpu_count() -> int:
    """GPUs faiss can use: 0 for faiss-cpu or without a visible CUDA device."""
    import faiss

    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None and hasattr(faiss, "StandardGpuResources") else 0


class GpuIndex:
    """A CPU index cloned onto GPUs; :meth:`search` as :func:`rag.knowledge.index.search_index`."""

    def __init__(self, index, spec: IndexSpec, devices: list[int], shard: bool, fp16: bool, resources: list) -> None:
        self.index, self.spec, self.devices, self.shard, self.fp16 = index, spec, devices, shard, fp16
        self._resources = resources  # kept alive as long as the GPU index

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(B, D)`` float32 queries -> scores ``(B, k)`` float32 (higher is better), rows ``(B, k)`` int64."""
        n = int(self.index.ntotal)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
            raise RagError(f"k={k!r} must be an integer between 1 and the corpus size ({n} vectors)")
        q = _check_matrix(queries, "queries", dim=self.index.d)
        dist, rows = self.index.search(q, int(k))
        if (rows < 0).any():
            raise RagError(f"the GPU index returned fewer than k={k} results (nprobe={self.spec.nprobe} too small for this "
                           "corpus?); raise the index spec's nprobe")
        scores = dist if self.spec.metric == "ip" else -dist
        return np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(rows, dtype=np.int64)


def to_gpu(index, spec: IndexSpec, devices: Union[str, int, Sequence[int]] = "all", *, shard: bool = False,
           fp16: bool = False) -> Optional[GpuIndex]:
    """Clone the CPU `index` onto `devices` (``"all"``, one GPU id, or a list); None with a warning when it must stay on
    the CPU (faiss without GPU support, no CUDA device, or an HNSW index).

    `shard`: split the vectors over the GPUs instead of replicating them. `fp16`: store vectors (flat) or look-up
    tables (IVF-PQ) as float16 on the GPU: half the memory; scores differ from the CPU's by fp16 rounding.
    Raises ConfigError for a GPU id that does not exist.
    """
    if spec.kind not in GPU_KINDS:
        logger.warning("index kind %s has no faiss GPU implementation (GPU search supports %s); searching on the CPU",
                       spec.kind, ", ".join(GPU_KINDS))
        return None
    n_gpus = gpu_count()
    if n_gpus == 0:
        logger.warning("no GPU for faiss (faiss without GPU support, or no CUDA device visible); searching on the CPU — "
                       "install the GPU build with pip install -e \".[gpu]\"")
        return None
    ids = list(range(n_gpus)) if devices == "all" else [devices] if isinstance(devices, int) else list(devices)
    bad = [d for d in ids if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < n_gpus]
    if bad or not ids:
        raise ConfigError(f"GPU device(s) {bad or ids} do not exist: faiss sees {n_gpus} GPU(s) (ids 0..{n_gpus - 1})")
    import faiss

    resources = [faiss.StandardGpuResources() for _ in ids]
    if len(ids) == 1:
        opts = faiss.GpuClonerOptions()
        opts.useFloat16 = fp16
        gpu = faiss.index_cpu_to_gpu(resources[0], ids[0], index, opts)
    else:
        opts = faiss.GpuMultipleClonerOptions()
        opts.useFloat16 = fp16
        opts.shard = shard
        gpu = faiss.index_cpu_to_gpu_multiple_py(resources, index, opts, ids)
    if spec.kind == "ivf_pq":
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", int(spec.nprobe))
    logger.info("index %s on GPU(s) %s (%s, fp16=%s)", spec.kind, ids, "sharded" if shard and len(ids) > 1 else "replicated", fp16)
    return GpuIndex(gpu, spec, ids, shard, fp16, resources)
