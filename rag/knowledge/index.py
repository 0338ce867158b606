"""FAISS index specs for a knowledge base: build, save, load (mmap) and search.

Four kinds of index cover the trade-offs between exactness, speed and memory:

* ``flat``: exact (brute-force) search, 4·D bytes per vector. The reference.
* ``hnsw``: HNSW graph over the full float32 vectors (Malkov & Yashunin 2018).
  Approximate, tens of times faster than exact search on large corpora.
* ``hnsw_sq8``: the same graph over 8-bit scalar-quantised vectors: ~1/3 of the
  memory of ``hnsw`` at a small cost in recall.
* ``ivf_pq``: inverted file + product quantisation (Jégou et al. 2011): the smallest
  index (``pq_m`` bytes per vector), for corpora that do not fit in memory otherwise.

Maximum inner product search (``metric="ip"``: top-k of ``d(z)·q(x)``, Lewis et al.
2020 §2.2; RAG searches it with a FAISS HNSW index, §3) uses faiss's native
inner-product HNSW. The alternative, the reduction to L2 search of Bachrach et al.
(2014) used by DPR's released HNSW indexer (augment each vector with
``sqrt(M² - |x|²)`` and queries with 0), was measured and rejected: equal recall on
normalised embeddings, and far lower recall on unnormalised ones (recall@10 0.70 vs
0.995 at ef_search=64, N=20k, D=768; benchmarks/README_index.md), because the
augmented queries lie far off the data manifold the graph was built on.

Indexes are immutable once built (a knowledge-base directory is never modified in
place): build a new one rather than calling ``index.add`` on a loaded one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import faiss
import numpy as np
from tqdm.auto import tqdm

from rag.knowledge.faiss_gpu import build_on_gpu
from rag.knowledge.ivf_train import MIN_POINTS_PER_LIST as _MIN_POINTS_PER_LIST
from rag.knowledge.ivf_train import SEED as _SEED
from rag.knowledge.ivf_train import sample_rows as _sample_rows
from rag.knowledge.ivf_train import train_ivf_pq, train_sample_size
from rag.knowledge.vectors import ArrayVectors, Vectors
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError, RagError
from rag.utils.io import atomic_write_file
from rag.utils.validate import check_number, check_positive_int, is_integer

__all__ = [
    "IndexSpec",
    "build_index",
    "write_index",
    "read_index",
    "search_index",
    "bytes_per_vector",
    "faiss_threads",
    "INDEX_KINDS",
    "METRICS",
]

INDEX_KINDS = ("flat", "hnsw", "hnsw_sq8", "ivf_pq")
METRICS = ("ip", "l2")

# Which spec fields mean something for each kind (``parse`` rejects the others).
_KIND_KEYS = {
    "flat": ("metric",),
    "hnsw": ("metric", "m", "ef_construction", "ef_search"),
    "hnsw_sq8": ("metric", "m", "ef_construction", "ef_search"),
    "ivf_pq": ("metric", "nlist", "pq_m", "pq_nbits", "nprobe", "rescore"),
}
_RESCORE_DEFAULT = 100
_NULLABLE = ("nlist", "pq_m")

_ADD_CHUNK = 16_384  # rows per faiss add() call (one progress-bar step)
_TRAIN_SAMPLE_SQ = 100_000  # rows used to train the 8-bit scalar quantiser


@dataclass
class IndexSpec:
    """How to index a knowledge base's embeddings.

    ``parse("hnsw_sq8:m=48,ef_search=256")`` reads the compact string form used on
    the command line; :meth:`to_dict` / :meth:`from_dict` are the form stored in a
    knowledge base's manifest.
    """

    kind: Literal["flat", "hnsw", "hnsw_sq8", "ivf_pq"] = "hnsw"
    """Index type: flat (exact), hnsw, hnsw_sq8 (8-bit vectors) or ivf_pq (compressed)."""
    metric: Literal["ip", "l2"] = "ip"
    """Similarity: ip = inner product (RAG/DPR); l2 = Euclidean (scores are -|q-x|²)."""
    m: int = 32
    """HNSW graph degree (neighbours per node; level 0 keeps 2·m)."""
    ef_construction: int = 80
    """HNSW candidate-list size while building: higher = better graph, slower build."""
    ef_search: int = 128
    """HNSW candidate-list size while searching (raised to k when smaller)."""
    nlist: Optional[int] = None
    """IVF lists; None = round(sqrt(N)), at most N/39 so every list trains on ≥ 39 vectors."""
    pq_m: Optional[int] = None
    """PQ sub-quantisers (bytes per vector at 8 bits); must divide D. None = D/8 (or nearest divisor)."""
    pq_nbits: int = 8
    """Bits per PQ sub-quantiser code."""
    nprobe: int = 64
    """IVF lists visited per query (with ``rescore`` 100: recall@10 >= 0.95 on 100k MiniLM vectors, docs/scale-gpu.md)."""
    rescore: int = _RESCORE_DEFAULT
    """ivf_pq: candidates per query re-ranked by their exact score on the stored vectors (0 = the PQ ranking)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field and its valid values."""
        if self.kind not in INDEX_KINDS:
            raise ConfigError(
                f"index kind {self.kind!r} is not one of {', '.join(INDEX_KINDS)}"
            )
        if self.metric not in METRICS:
            raise ConfigError(f"index metric {self.metric!r} is not one of {', '.join(METRICS)}")
        for name, low, high in (
            ("m", 2, 512),
            ("ef_construction", 1, 1 << 16),
            ("ef_search", 1, 1 << 16),
            ("pq_nbits", 1, 16),
            ("nprobe", 1, 1 << 20),
            ("rescore", 0, 1 << 16),
        ):
            _check_int(name, getattr(self, name), low, high)
        if self.nlist is not None:
            _check_int("nlist", self.nlist, 1, 1 << 24)
        if self.pq_m is not None:
            _check_int("pq_m", self.pq_m, 1, 1 << 16)

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the manifest form; ``rescore`` only when it is not the default)."""
        d = dataclasses.asdict(self)
        if self.rescore == _RESCORE_DEFAULT:  # so that a spec's dict, and a knowledge base's version, predate it
            del d["rescore"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "IndexSpec":
        """Inverse of :meth:`to_dict`; missing keys take defaults, unknown keys raise ConfigError."""
        if not isinstance(d, dict):
            raise ConfigError(f"an index spec must be a dict, got {type(d).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                raise ConfigError(
                    f"unknown index spec key {key!r}; valid keys: {', '.join(valid)}"
                )
        return cls(**d)

    @classmethod
    def parse(cls, s: str) -> "IndexSpec":
        """Read ``"kind[:key=value,...]"``, e.g. ``"hnsw"``, ``"ivf_pq:nlist=1024,pq_m=64"``."""
        if not isinstance(s, str) or not s.strip():
            raise ConfigError(
                f"empty index spec {s!r}; expected kind[:key=value,...] with kind one of "
                f"{', '.join(INDEX_KINDS)}"
            )
        kind, _, rest = s.strip().partition(":")
        kind = kind.strip()
        if kind not in INDEX_KINDS:
            raise ConfigError(
                f"index spec {s!r}: unknown kind {kind!r}; valid kinds: {', '.join(INDEX_KINDS)}"
            )
        allowed = _KIND_KEYS[kind]
        values: dict[str, Any] = {"kind": kind}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, raw = (t.strip() for t in item.partition("="))
            if not eq or not raw:
                raise ConfigError(f"index spec {s!r}: {item!r} is not of the form key=value")
            if key not in allowed:
                raise ConfigError(
                    f"index spec {s!r}: key {key!r} does not apply to kind {kind!r}; "
                    f"valid keys: {', '.join(allowed)}"
                )
            if key in values:
                raise ConfigError(f"index spec {s!r}: key {key!r} is given twice")
            if key == "metric":
                values[key] = raw
            elif key in _NULLABLE and raw.lower() in ("none", "auto"):
                values[key] = None
            else:
                try:
                    values[key] = int(raw)
                except ValueError:
                    hint = " (or 'auto')" if key in _NULLABLE else ""
                    raise ConfigError(
                        f"index spec {s!r}: {key}={raw!r} is not an integer{hint}"
                    ) from None
        return cls(**values)

    def to_string(self) -> str:
        """The compact form :meth:`parse` reads, listing only the keys that apply to the kind."""
        keys = [k for k in _KIND_KEYS[self.kind]]
        parts = []
        for k in keys:
            v = getattr(self, k)
            parts.append(f"{k}={'auto' if v is None else v}")
        return f"{self.kind}:{','.join(parts)}" if parts else self.kind

    def __str__(self) -> str:
        return self.to_string()


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not is_integer(value):
        raise ConfigError(f"index spec field {name}={value!r} must be an integer in [{low}, {high}]")
    if not low <= value <= high:
        raise ConfigError(f"index spec field {name}={value} is out of range [{low}, {high}]")


# --------------------------------------------------------------------------- threads


@contextlib.contextmanager
def faiss_threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with faiss (OpenMP) using `n` threads, restoring the previous count.

    ``None`` leaves faiss's setting untouched. OpenMP's thread count is process-wide:
    do not nest this in concurrently running threads with different values.
    """
    if n is None:
        yield
        return
    check_positive_int(n, "threads (None: faiss's default)", error=ConfigError)
    old = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(n))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(old)


# --------------------------------------------------------------------------- build


def _check_matrix(x: Any, what: str, dim: Optional[int] = None) -> np.ndarray:
    """Validate a (N, D) float32 matrix of finite values; return it C-contiguous."""
    if not isinstance(x, np.ndarray):
        raise RagError(f"{what} must be a numpy array of shape (N, D), got {type(x).__name__}")
    if x.ndim != 2:
        raise RagError(f"{what} must have shape (N, D), got shape {tuple(x.shape)}")
    if x.dtype != np.float32:
        raise RagError(f"{what} must be float32, got {x.dtype}; convert with .astype(np.float32)")
    if x.shape[1] == 0:
        raise RagError(f"{what} has dimension 0")
    if dim is not None and x.shape[1] != dim:
        raise RagError(f"{what} have dimension {x.shape[1]} but the index has dimension {dim}")
    for start in range(0, x.shape[0], _ADD_CHUNK):
        block = x[start : start + _ADD_CHUNK]
        if not np.isfinite(block).all():
            bad = start + int(np.argwhere(~np.isfinite(block))[0, 0])
            raise RagError(f"{what} row {bad} contains NaN or inf; fix or drop that row")
    return np.ascontiguousarray(x)


def _auto_nlist(n: int) -> int:
    """round(sqrt(N)) lists, at most N/39 (k-means needs ~39 rows per centroid).

    faiss suggests 4-16·sqrt(N) for GPU-trained indexes, but the coarse k-means costs
    ∝ nlist·sample·D (sample: :func:`~rag.knowledge.ivf_train.coarse_sample_size`) and
    adding costs ∝ N·nlist·D: 4·sqrt(N) lists is 4-16x the work of sqrt(N), which on a
    few CPU cores is the practical choice. Recall at a fixed
    nprobe is higher with fewer, larger lists; PQ error, not nprobe, limits it.
    """
    return int(max(1, min(round(np.sqrt(n)), n // _MIN_POINTS_PER_LIST)))


def _auto_pq_m(d: int) -> int:
    """Sub-quantisers of ~8 dimensions each: the divisor of d closest to d/8."""
    divisors = [m for m in range(1, d + 1) if d % m == 0]
    return min(divisors, key=lambda m: (abs(d / m - 8), -m))


def _faiss_metric(spec: IndexSpec) -> int:
    return faiss.METRIC_INNER_PRODUCT if spec.metric == "ip" else faiss.METRIC_L2


def _reserve(index: faiss.Index, n: int) -> None:
    """Give the codes (and an HNSW graph's links) their final capacity before adding `n` vectors: growing them add by
    add would reallocate geometrically, holding the old and the grown buffer at once. A resize up then
    down keeps the capacity (std::vector semantics), so the adds never reallocate."""
    store = faiss.downcast_index(index.storage) if isinstance(index, faiss.IndexHNSW) else index
    vecs = [(store.codes, n * store.code_size)] if isinstance(store, faiss.IndexFlatCodes) else []
    if isinstance(index, faiss.IndexHNSW):  # level 0 holds 2m links, upper levels m/(m-1) on average, +1% margin
        m = index.hnsw.nb_neighbors(1)
        vecs.append((index.hnsw.neighbors, int(n * (2 * m + m / max(1, m - 1)) * 1.01) + 64 * m))
    for vec, size in vecs:
        if vec.size() == 0:
            vec.resize(size)
            vec.resize(0)


def _add_chunks(index: faiss.Index, src: Vectors, desc: str, show: bool) -> None:
    _reserve(index, src.shape[0])
    with tqdm(total=src.shape[0], desc=desc, unit="vec", disable=not show, leave=False) as bar:
        for start, block in src.blocks(_ADD_CHUNK):
            if not src.checked_finite and not np.isfinite(block).all():
                bad = start + int(np.argwhere(~np.isfinite(block))[0, 0])
                raise RagError(f"vectors row {bad} contains NaN or inf; fix or drop that row")
            index.add(block)
            bar.update(block.shape[0])


def _build_hnsw(src: Vectors, spec: IndexSpec, show: bool) -> faiss.Index:
    d, metric = src.shape[1], _faiss_metric(spec)
    if spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, spec.m, metric)
    else:
        index = faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_8bit, spec.m, metric)
        index.train(_sq_training_rows(src, show))
    index.hnsw.efConstruction = spec.ef_construction
    index.hnsw.efSearch = spec.ef_search  # only a default: search_index passes its own
    _add_chunks(index, src, f"index {spec.kind}", show)
    return index


def _sq_training_rows(src: Vectors, show: bool) -> np.ndarray:
    """A random sample plus, per dimension, the rows holding its min and max.

    The 8-bit quantiser learns a [min, max] range per dimension from its training
    rows and clips values outside it; including the extreme rows makes the range
    cover every vector of the corpus. One pass over `src` in blocks.
    """
    n = src.shape[0]
    lo = hi = lo_idx = hi_idx = None
    with tqdm(total=n, desc="scan for the quantiser's range", unit="vec", disable=not show, leave=False) as bar:
        for s, block in src.blocks(_ADD_CHUNK):
            if not src.checked_finite and not np.isfinite(block).all():
                bad = s + int(np.argwhere(~np.isfinite(block))[0, 0])
                raise RagError(f"vectors row {bad} contains NaN or inf; fix or drop that row")
            bmin, bmax = block.min(axis=0), block.max(axis=0)
            amin, amax = block.argmin(axis=0) + s, block.argmax(axis=0) + s
            if lo is None:
                lo, hi, lo_idx, hi_idx = bmin, bmax, amin, amax
            else:
                take_lo, take_hi = bmin < lo, bmax > hi
                lo = np.where(take_lo, bmin, lo)
                hi = np.where(take_hi, bmax, hi)
                lo_idx = np.where(take_lo, amin, lo_idx)
                hi_idx = np.where(take_hi, amax, hi_idx)
            bar.update(block.shape[0])
    rows = np.union1d(_sample_rows(n, _TRAIN_SAMPLE_SQ), np.concatenate([lo_idx, hi_idx]))
    return src.take(rows)


def check_fits(spec: IndexSpec, n: int, d: int) -> tuple[Optional[int], Optional[int]]:
    """Raise ConfigError/RagError unless `spec` can index `n` vectors of dimension `d`; returns ivf_pq's
    resolved (nlist, pq_m) (None, None for other kinds). Cheap: builders call it before encoding a corpus."""
    spec.validate()
    if spec.kind != "ivf_pq":
        return None, None
    nlist = spec.nlist if spec.nlist is not None else _auto_nlist(n)
    pq_m = spec.pq_m if spec.pq_m is not None else _auto_pq_m(d)
    if d % pq_m:
        raise ConfigError(
            f"ivf_pq: pq_m={pq_m} does not divide the dimension {d}; choose a divisor of {d} "
            f"(e.g. pq_m={_auto_pq_m(d)}) or pq_m=auto"
        )
    need = max(nlist, 1 << spec.pq_nbits)
    if n < need:
        raise RagError(
            f"ivf_pq cannot train on {n} vectors: nlist={nlist} lists and pq_nbits={spec.pq_nbits} "
            f"({1 << spec.pq_nbits} centroids per sub-quantiser) need at least {need}. "
            f"Use a smaller nlist/pq_nbits (e.g. 'ivf_pq:nlist={max(1, n // _MIN_POINTS_PER_LIST)}"
            f",pq_nbits={max(1, int(np.log2(max(n, 2))))}') or, for a corpus this small, "
            f"kind 'flat' or 'hnsw'"
        )
    return nlist, pq_m


def _build_ivf_pq(src: Vectors, spec: IndexSpec, show: bool, gpu: Optional[bool]) -> faiss.Index:
    n, d = src.shape
    nlist, pq_m = check_fits(spec, n, d)
    metric = _faiss_metric(spec)
    quantizer = faiss.IndexFlatIP(d) if spec.metric == "ip" else faiss.IndexFlatL2(d)
    index = faiss.IndexIVFPQ(quantizer, d, nlist, pq_m, spec.pq_nbits, metric)
    index.cp.seed = _SEED
    index.pq.cp.seed = _SEED
    index.nprobe = min(spec.nprobe, nlist)
    train = src.take(_sample_rows(n, train_sample_size(n, nlist, spec.pq_nbits)))
    if not src.checked_finite and not np.isfinite(train).all():
        raise RagError("the vectors' training sample contains NaN or inf; fix or drop those rows")
    if gpu is not False:  # faiss's GPU IVF-PQ trains both quantisers on the sample (it subsamples the PQ's itself)
        built = build_on_gpu(index, train, src, required=bool(gpu), add=lambda g: _add_chunks(g, src, "index ivf_pq (GPU)", show))
        if built is not None:
            return built
    with tqdm(total=1, desc=f"train ivf_pq on {len(train):,} vectors", disable=not show, leave=False) as bar:
        train_ivf_pq(index, train)  # k-means on the sample, the PQ on a subsample's residuals (ivf_train)
        bar.update(1)
    del train
    _add_chunks(index, src, "index ivf_pq", show)
    return index


def build_index(
    vectors: np.ndarray | Vectors,
    spec: IndexSpec,
    *,
    threads: Optional[int] = None,
    show_progress: bool = True,
    gpu: Optional[bool] = None,
) -> faiss.Index:
    """Build an index over `vectors` ``(N, D)`` float32; row i of `vectors` is id i.

    `vectors` is an array or a :class:`~rag.knowledge.vectors.Vectors` source (e.g. a
    ``.npy`` file read in blocks): the quantisers train on a sample (hnsw_sq8, ivf_pq)
    and the vectors are added in blocks of 16,384 rows with a progress bar, so beyond
    the index itself the build holds one block and the training sample. `threads` bounds faiss's OpenMP threads
    for the build (None = faiss default). The result's ``d`` is D for every kind.
    `gpu`: train and fill an ``ivf_pq`` index on GPU 0 and return its CPU copy
    (:func:`rag.knowledge.faiss_gpu.build_on_gpu`): None = when faiss sees a GPU, True =
    required (ConfigError without one), False = never. Flat and HNSW indexes are
    always built on the CPU (faiss has no GPU HNSW; a flat index is a copy).
    """
    if not isinstance(spec, IndexSpec):
        raise ConfigError(f"spec must be an IndexSpec, got {type(spec).__name__}")
    spec.validate()
    src = vectors if isinstance(vectors, Vectors) else ArrayVectors(_check_matrix(vectors, "vectors"), checked_finite=True)
    if src.shape[0] == 0:
        raise RagError("cannot build an index over 0 vectors; the corpus is empty")
    with faiss_threads(threads):
        if spec.kind == "flat":
            index = faiss.IndexFlatIP(src.shape[1]) if spec.metric == "ip" else faiss.IndexFlatL2(src.shape[1])
            _add_chunks(index, src, "index flat", show_progress)
        elif spec.kind in ("hnsw", "hnsw_sq8"):
            index = _build_hnsw(src, spec, show_progress)
        else:
            index = _build_ivf_pq(src, spec, show_progress, gpu)
    return index


# --------------------------------------------------------------------------- IO


def write_index(index: faiss.Index, path: str | os.PathLike) -> None:
    """Write `index` to `path` atomically (temporary file in the same directory, fsync, rename)."""
    atomic_write_file(path, lambda tmp: faiss.write_index(index, tmp))


def read_index(path: str | os.PathLike, *, mmap: bool = True) -> faiss.Index:
    """Load an index written by :func:`write_index`.

    With ``mmap=True`` the vector/code arrays are memory-mapped read-only (faiss
    ``IO_FLAG_MMAP_IFC | IO_FLAG_READ_ONLY``) instead of copied: loading is instant
    and processes share the page cache. The file must then not be modified in place
    while the index is in use (atomic replacement, as write_index does, is safe).
    A truncated or corrupt file raises IntegrityError naming the path.
    """
    path = Path(path)
    if not path.is_file():
        raise KnowledgeBaseError(f"index file {path} does not exist; rebuild the knowledge base index")
    flags = (faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY) if mmap else 0
    try:
        index = faiss.read_index(str(path), flags)
    except (RuntimeError, MemoryError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise IntegrityError(
            f"index file {path} is truncated or corrupt ({first[:200]}); rebuild the index"
        ) from None
    problem = _structural_problem(index)
    if problem:
        raise IntegrityError(f"index file {path} is corrupt ({problem}); rebuild the index")
    return index


def _structural_problem(index: faiss.Index) -> Optional[str]:
    """Cheap consistency checks that keep a corrupt (but parseable) file from crashing search."""
    n = index.ntotal
    if n < 0 or index.d <= 0:
        return f"ntotal={n}, d={index.d}"
    if isinstance(index, faiss.IndexHNSW):
        hnsw = index.hnsw
        if index.storage is None or index.storage.ntotal != n or index.storage.d != index.d:
            return "HNSW storage does not match the graph"
        if hnsw.levels.size() != n or hnsw.offsets.size() != n + 1:
            return "HNSW level table has the wrong size"
        if n:
            nb = faiss.rev_swig_ptr(hnsw.neighbors.data(), hnsw.neighbors.size())
            off = faiss.rev_swig_ptr(hnsw.offsets.data(), n + 1)
            if int(off[-1]) != nb.size or nb.size and (int(nb.min()) < -1 or int(nb.max()) >= n):
                return "HNSW neighbour lists point outside the index"
            if not 0 <= hnsw.entry_point < n:
                return "HNSW entry point is outside the index"
    elif isinstance(index, faiss.IndexIVF):
        lists = index.invlists
        if lists is None or lists.nlist != index.nlist:
            return "IVF inverted lists are missing"
        if sum(lists.list_size(i) for i in range(lists.nlist)) != n:
            return "IVF list sizes do not add up to ntotal"
    return None


# --------------------------------------------------------------------------- search


def _index_kind_metric(index: faiss.Index) -> tuple[str, str]:
    """(kind, metric) of an index built by :func:`build_index`."""
    if isinstance(index, faiss.IndexHNSWSQ):
        kind = "hnsw_sq8"
    elif isinstance(index, faiss.IndexHNSWFlat):
        kind = "hnsw"
    elif isinstance(index, faiss.IndexIVFPQ):
        kind = "ivf_pq"
    elif isinstance(index, faiss.IndexFlat):
        kind = "flat"
    else:
        raise ConfigError(f"unsupported faiss index type {type(index).__name__}; build it with build_index")
    if index.metric_type == faiss.METRIC_INNER_PRODUCT:
        return kind, "ip"
    if index.metric_type == faiss.METRIC_L2:
        return kind, "l2"
    raise ConfigError(f"unsupported faiss metric type {index.metric_type}; use metric ip or l2")


def _search(index: faiss.Index, q: np.ndarray, k: int, spec: IndexSpec, widen: int = 1):
    """One faiss search with per-call parameters: `widen` × ef_search (HNSW) or × nprobe (IVF)."""
    if isinstance(index, faiss.IndexHNSW):
        params = faiss.SearchParametersHNSW(efSearch=widen * max(spec.ef_search, k))
    elif isinstance(index, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(nprobe=min(widen * spec.nprobe, index.nlist))
    else:
        return index.search(q, k)
    return index.search(q, k, params=params)


def _exhaustive_search(index: faiss.Index, q: np.ndarray, k: int, spec: IndexSpec):
    """Search every stored vector: the fallback when an approximate search yields < k results."""
    if isinstance(index, faiss.IndexHNSW):
        return faiss.downcast_index(index.storage).search(q, k)  # brute force over the stored codes
    if isinstance(index, faiss.IndexIVF):
        return _search(index, q, k, spec, widen=index.nlist)
    return index.search(q, k)


def search_index(
    index: faiss.Index, queries: np.ndarray, k: int, spec: IndexSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows for each query: ``queries (B, D)`` float32 -> ``(scores (B, k) float32, rows (B, k) int64)``.

    Scores are best first: inner products ``q·x`` for metric "ip" (exact for flat
    and hnsw; computed on the quantised vectors for hnsw_sq8 / ivf_pq) and ``-|q-x|²``
    for metric "l2", so that higher is always better. ef_search / nprobe come from
    `spec` through per-call search parameters (the index is never mutated, so
    concurrent searches are safe). Every returned row is valid: when a graph search
    finds fewer than k results it is retried with a larger ef, then exhaustively.
    """
    if not isinstance(spec, IndexSpec):
        raise ConfigError(f"spec must be an IndexSpec, got {type(spec).__name__}")
    spec.validate()
    kind, metric = _index_kind_metric(index)
    if (kind, metric) != (spec.kind, spec.metric):
        raise ConfigError(
            f"the index is kind={kind}, metric={metric} but the spec says kind={spec.kind}, "
            f"metric={spec.metric}; pass the spec the index was built with"
        )
    n = int(index.ntotal)
    check_number(k, f"k (at most the corpus size, {n} vectors)", integer=True, low=1, high=n)
    k = int(k)
    q = _check_matrix(queries, "queries", dim=index.d)
    if q.shape[0] == 0:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    dist, rows = _search(index, q, k, spec)
    missing = (rows < 0).any(axis=1)
    if missing.any():  # tiny or badly connected graph: widen the beam, then go exhaustive
        sub = q[missing]
        d2, r2 = _search(index, sub, k, spec, widen=4)
        still = (r2 < 0).any(axis=1)
        if still.any():
            d3, r3 = _exhaustive_search(index, sub[still], k, spec)
            d2[still], r2[still] = d3, r3
        dist[missing], rows[missing] = d2, r2
    if (rows < 0).any():  # cannot happen for k <= ntotal; never hand -1 rows to callers
        raise RagError(f"the index returned fewer than k={k} results for a corpus of {n} vectors")
    scores = dist if metric == "ip" else -dist
    return np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(rows, dtype=np.int64)


def bytes_per_vector(index: faiss.Index) -> float:
    """Serialized size of `index` divided by its number of vectors (counted without writing)."""
    if index.ntotal <= 0:
        raise RagError("bytes_per_vector: the index is empty")
    total = 0

    def count(chunk: bytes) -> int:
        nonlocal total
        total += len(chunk)
        return len(chunk)

    writer = faiss.PyCallbackIOWriter(count)
    faiss.write_index(index, writer)
    del writer
    return total / index.ntotal
