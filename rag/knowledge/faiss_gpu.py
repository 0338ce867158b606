"""What faiss can do on this machine's GPUs: whether its GPU build runs here at all (a probe in a child process), and
IVF-PQ builds on a GPU. Imports nothing of rag's index code, so :mod:`rag.knowledge.index` can build through it and
:mod:`rag.knowledge.gpu` can search through it."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from typing import Callable, Optional

import numpy as np

from rag.utils.errors import ConfigError

logger = logging.getLogger("rag.knowledge.gpu")  # one logger for GPU search and builds

__all__ = ["gpu_count", "faiss_gpu_problem", "build_on_gpu"]


def gpu_count() -> int:
    """GPUs faiss can use: 0 for faiss-cpu or without a visible CUDA device."""
    import faiss

    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None and hasattr(faiss, "StandardGpuResources") else 0


_PROBE = """
import numpy as np, faiss
x = np.arange(64 * 8, dtype="float32").reshape(64, 8) / 512
cpu = faiss.IndexFlatL2(8)
cpu.add(x)
gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), {device}, cpu)
rows = gpu.search(x[:4], 2)[1]
if not (rows[:, 0] == np.arange(4)).all():  # not an assert: PYTHONOPTIMIZE, inherited, would skip it
    raise SystemExit(f"the GPU search returned wrong neighbours: {{rows[:, 0].tolist()}} instead of [0, 1, 2, 3]")
"""


def _child_problem(code: str, timeout: float = 300.0) -> Optional[str]:
    """Run `code` in a fresh Python; None if it exits 0, else the last line it printed to stderr (or how it died)."""
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return f"a test search did not finish within {timeout:.0f} s"
    if run.returncode == 0:
        return None
    lines = [ln.strip() for ln in run.stderr.splitlines() if ln.strip()]
    how = f"killed by signal {-run.returncode}" if run.returncode < 0 else f"exit status {run.returncode}"
    return f"{lines[-1] if lines else 'no message'} ({how})"


@functools.lru_cache(maxsize=None)
def faiss_gpu_problem(device: int = 0) -> Optional[str]:
    """Why faiss cannot search on GPU `device`, or None when it can.

    A tiny search in a child process (a few seconds, once per process and device): a faiss build without kernels for
    this GPU's architecture aborts the process that launches one, so the first launch must not be ours.
    """
    n = gpu_count()
    if n == 0:
        return "faiss sees no GPU (faiss-cpu installed, or no CUDA device visible)"
    if not 0 <= device < n:
        return f"GPU {device} does not exist: faiss sees {n} GPU(s)"
    problem = _child_problem(_PROBE.format(device=int(device)))
    if problem is None:
        return None
    try:
        import torch

        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
        arch = f"; this GPU has compute capability {cc} (the PyPI faiss-gpu-cu12 wheels support 7.0-8.9)"
    except Exception:  # torch without CUDA: no capability to report
        arch = ""
    return f"faiss's GPU build failed a test search on GPU {device}: {problem}{arch}"


def build_on_gpu(index, train: np.ndarray, x: np.ndarray, *, required: bool, add: Callable, device: int = 0):
    """Train the untrained CPU IVF index `index` on `train` rows and add `x` on GPU `device`; return the CPU copy.

    ``add(gpu_index)`` adds `x` (the caller's chunked, progress-reporting loop). None, with a warning, when it must be
    built on the CPU instead: no usable faiss GPU (:func:`faiss_gpu_problem`; ConfigError if `required`), or faiss
    refuses this index on a GPU (e.g. a sub-quantiser size its GPU IVF-PQ lacks). float16 look-up tables are used
    where the GPU needs them; they only affect GPU search, not the codes, so the CPU copy equals a CPU-built index up to
    k-means' randomness.
    """
    problem = faiss_gpu_problem(device)
    if problem is not None:
        if required:
            raise ConfigError(f"a GPU build was asked for (gpu=True) but {problem}: install the GPU build with "
                              "pip install -e \".[gpu]\" on a machine with a supported CUDA device, or build on the CPU "
                              "(gpu=None/False)")
        if gpu_count() > 0:  # a GPU that faiss cannot use is worth a word; no GPU at all is the normal CPU build
            logger.warning("building the index on the CPU: %s", problem)
        return None
    import faiss

    resources = faiss.StandardGpuResources()
    opts = faiss.GpuClonerOptions()
    opts.useFloat16 = True  # IVF-PQ: float16 look-up tables, needed for many sub-quantisers; search-time only
    try:
        gpu = faiss.index_cpu_to_gpu(resources, device, index, opts)
        gpu.train(train)
        add(gpu)
        cpu = faiss.index_gpu_to_cpu(gpu)
    except RuntimeError as err:  # faiss's C++ exceptions (unsupported settings, GPU memory)
        reason = (str(err).strip().splitlines() or ["unknown error"])[-1]
        if required:
            raise ConfigError(f"faiss cannot build this index on a GPU: {reason}") from err
        logger.warning("building the index on the CPU: faiss cannot build it on a GPU (%s)", reason)
        return None
    cpu.nprobe = index.nprobe
    logger.info("index built on GPU %d (%d vectors), stored as a CPU index", device, cpu.ntotal)
    return cpu
