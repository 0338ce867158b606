"""GPU search and GPU index builds: a GPU copy of a knowledge base's CPU index, on one GPU or all of them, with a CPU fallback.

The stored index is always a CPU index (``index.faiss``). For search, :func:`to_gpu` copies it onto GPUs, either
replicated (each GPU holds every vector; queries are split between them) or sharded (each GPU holds 1/G of the
vectors; every query goes to all and the top-k are merged), optionally storing vectors / codes as float16:

* ``flat`` (exact search) runs in PyTorch (:class:`TorchFlatIndex`: one matrix product and a top-k per block of
  rows), on any GPU PyTorch supports, with no faiss GPU build needed;
* ``ivf_pq`` runs in faiss's GPU IVF-PQ (``pip install -e ".[gpu]"``: faiss-gpu-cu12). The PyPI faiss-gpu-cu12 wheels
  carry kernels for compute capability 7.0-8.9 only: on a Hopper (H100/H200, 9.0) or newer GPU their first kernel
  launch *aborts the process*. Before faiss touches a GPU, :func:`~rag.knowledge.faiss_gpu.faiss_gpu_problem` therefore runs a
  tiny search in a child process; when it fails, search and builds stay on the CPU with a warning that says why;
* ``hnsw`` / ``hnsw_sq8``: faiss has no GPU HNSW; search stays on the CPU with a warning.

:func:`rag.knowledge.faiss_gpu.build_on_gpu` trains and fills an IVF-PQ index on a GPU (k-means and the PQ encoding are what makes
a large build slow) and hands back its CPU copy.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import numpy as np

from rag.knowledge.faiss_gpu import faiss_gpu_problem, gpu_count
from rag.knowledge.index import IndexSpec, _check_matrix
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number, is_integer

logger = logging.getLogger(__name__)

__all__ = ["gpu_count", "faiss_gpu_problem", "to_gpu", "GpuIndex", "TorchFlatIndex"]

GPU_KINDS = ("flat", "ivf_pq")
_SCORE_BYTES = 1 << 28  # scores of one (queries x rows) block: 256 MiB


def _torch_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class GpuIndex:
    """A faiss CPU index cloned onto GPUs; :meth:`search` as :func:`rag.knowledge.index.search_index`."""

    def __init__(self, index, spec: IndexSpec, devices: list[int], shard: bool, fp16: bool, resources: list) -> None:
        self.index, self.spec, self.devices, self.shard, self.fp16 = index, spec, devices, shard, fp16
        self._resources = resources  # kept alive as long as the GPU index

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(B, D)`` float32 queries -> scores ``(B, k)`` float32 (higher is better), rows ``(B, k)`` int64."""
        n = int(self.index.ntotal)
        _check_k(k, n)
        q = _check_matrix(queries, "queries", dim=self.index.d)
        dist, rows = self.index.search(q, int(k))
        if (rows < 0).any():
            raise RagError(f"the GPU index returned fewer than k={k} results (nprobe={self.spec.nprobe} too small for this "
                           "corpus?); raise the index spec's nprobe")
        scores = dist if self.spec.metric == "ip" else -dist
        return np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(rows, dtype=np.int64)


def _check_k(k, n: int) -> None:
    check_number(k, f"k (at most the corpus size, {n} vectors)", integer=True, low=1, high=n)


def flat_topk(x, sq_norms, q, k: int, l2: bool):
    """Exact top-`k` of queries `q` `(B, D)` over rows `x` `(N, D)` (same device and dtype), in blocks of rows.

    Scores are ``q · x`` (inner product) or ``-|q - x|²`` (`l2`, with `sq_norms` `(N,)` = ``|x|²`` in float32).
    Each block's scores `(B, rows)` stay within :data:`_SCORE_BYTES`; its top-k are merged with the best so far.
    Returns float32 scores `(B, k)` and int64 rows `(B, k)`, best first, on `x`'s device.
    """
    import torch

    n = x.shape[0]
    block = max(k, _SCORE_BYTES // (4 * max(1, q.shape[0])))
    best_s = best_i = None
    for lo in range(0, n, block):
        s = (q @ x[lo:lo + block].T).float()  # (B, rows)
        if l2:
            s = 2 * s - sq_norms[lo:lo + block]
        v, i = s.topk(min(k, s.shape[1]), dim=1)
        i = i + lo
        if best_s is not None:
            v, j = torch.cat([best_s, v], 1).topk(k, dim=1)
            i = torch.cat([best_i, i], 1).gather(1, j)
        best_s, best_i = v, i
    if l2:
        best_s = best_s - q.float().pow(2).sum(1, keepdim=True)
    return best_s, best_i


class TorchFlatIndex:
    """Exact (flat) search on GPUs with PyTorch: the vectors as tensors on each device, float32 or float16.

    Replicated: every device holds all rows and takes a contiguous share of the queries. Sharded: device g holds rows
    ``[g N / G, (g + 1) N / G)``, every query is searched on every device and the G top-k lists are merged.
    :meth:`search` as :func:`rag.knowledge.index.search_index` (scores higher-is-better; ``-L2²`` for ``l2``).
    """

    def __init__(self, vectors, metric: str, devices: Sequence, *, shard: bool = False, fp16: bool = False,
                 chunk: int = 1 << 20) -> None:
        import torch

        self.metric, self.shard, self.fp16 = metric, bool(shard) and len(devices) > 1, fp16
        self.devices = [torch.device(d) for d in devices]
        self.ntotal, self.d = int(vectors.shape[0]), int(vectors.shape[1])
        dtype = torch.float16 if fp16 else torch.float32
        bounds = ([(g * self.ntotal // len(devices), (g + 1) * self.ntotal // len(devices)) for g in range(len(devices))]
                  if self.shard else [(0, self.ntotal)] * len(devices))
        self.parts = []  # (device, first row, rows (n_g, D), |rows|² (n_g,) float32)
        for dev, (lo, hi) in zip(self.devices, bounds):
            rows = torch.empty((hi - lo, self.d), dtype=dtype, device=dev)
            norms = torch.empty(hi - lo, dtype=torch.float32, device=dev)
            for s in range(lo, hi, chunk):  # uploaded in chunks: no second host copy of the whole matrix
                block = torch.from_numpy(np.ascontiguousarray(vectors[s:min(hi, s + chunk)], dtype=np.float32)).to(dev)
                rows[s - lo:s - lo + block.shape[0]] = block.to(dtype)
                norms[s - lo:s - lo + block.shape[0]] = block.pow(2).sum(1)
            self.parts.append((dev, lo, rows, norms))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(B, D)`` float32 queries -> scores ``(B, k)`` float32 (higher is better), rows ``(B, k)`` int64."""
        import torch

        _check_k(k, self.ntotal)
        q = torch.from_numpy(_check_matrix(queries, "queries", dim=self.d))
        l2 = self.metric == "l2"
        with torch.no_grad():
            if self.shard:
                found = []
                for dev, lo, rows, norms in self.parts:
                    kk = min(int(k), rows.shape[0])
                    s, i = flat_topk(rows, norms, q.to(dev, rows.dtype), kk, l2)
                    found.append((s.cpu(), (i + lo).cpu()))
                s, j = torch.cat([f[0] for f in found], 1).topk(int(k), dim=1)
                i = torch.cat([f[1] for f in found], 1).gather(1, j)
            else:
                shares = torch.tensor_split(q, len(self.parts))
                outs = [flat_topk(rows, norms, share.to(dev, rows.dtype), int(k), l2)
                        for (dev, _, rows, norms), share in zip(self.parts, shares) if share.shape[0]]
                s = torch.cat([o[0].cpu() for o in outs]) if outs else torch.empty((0, int(k)))
                i = torch.cat([o[1].cpu() for o in outs]) if outs else torch.empty((0, int(k)), dtype=torch.long)
        return np.ascontiguousarray(s.numpy(), dtype=np.float32), np.ascontiguousarray(i.numpy(), dtype=np.int64)


def _flat_vectors(index):
    """The `(N, D)` float32 rows of a faiss flat index, without a copy."""
    import faiss

    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def _device_ids(devices, n: int, what: str) -> list[int]:
    ids = list(range(n)) if devices == "all" else [devices] if isinstance(devices, int) else list(devices)
    bad = [d for d in ids if not is_integer(d) or not 0 <= d < n]
    if bad or not ids:
        raise ConfigError(f"GPU device(s) {bad or ids} do not exist: {what} sees {n} GPU(s) (ids 0..{n - 1})")
    return ids


def to_gpu(index, spec: IndexSpec, devices: Union[str, int, Sequence[int]] = "all", *, shard: bool = False,
           fp16: bool = False) -> Union[GpuIndex, TorchFlatIndex, None]:
    """Copy the CPU `index` onto `devices` (``"all"``, one GPU id, or a list); None with a warning when search must stay
    on the CPU (no CUDA device; for ``ivf_pq`` a faiss without working GPU support; an HNSW index).

    `shard`: split the vectors over the GPUs instead of replicating them. `fp16`: store vectors (flat) or look-up
    tables (IVF-PQ) as float16 on the GPU: half the memory; scores differ from the CPU's by fp16 rounding.
    Raises ConfigError for a GPU id that does not exist.
    """
    if spec.kind not in GPU_KINDS:
        logger.warning("index kind %s has no GPU implementation (GPU search supports %s); searching on the CPU",
                       spec.kind, ", ".join(GPU_KINDS))
        return None
    if spec.kind == "flat":
        n_gpus = _torch_gpus()
        if n_gpus == 0:
            logger.warning("no CUDA device visible to PyTorch; searching on the CPU")
            return None
        ids = _device_ids(devices, n_gpus, "PyTorch")
        gpu = TorchFlatIndex(_flat_vectors(index), spec.metric, [f"cuda:{i}" for i in ids], shard=shard, fp16=fp16)
        logger.info("flat index on GPU(s) %s (%s, fp16=%s)", ids, "sharded" if gpu.shard else "replicated", fp16)
        return gpu
    n_gpus = gpu_count()
    if n_gpus == 0:
        logger.warning("no GPU for faiss (faiss without GPU support, or no CUDA device visible); searching on the CPU — "
                       "install the GPU build with pip install -e \".[gpu]\"")
        return None
    ids = _device_ids(devices, n_gpus, "faiss")
    problems = [p for p in map(faiss_gpu_problem, ids) if p]
    if problems:
        logger.warning("%s; searching on the CPU", problems[0])
        return None
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
    faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", int(spec.nprobe))
    logger.info("index %s on GPU(s) %s (%s, fp16=%s)", spec.kind, ids, "sharded" if shard and len(ids) > 1 else "replicated",
                fp16)
    return GpuIndex(gpu, spec, ids, shard, fp16, resources)
