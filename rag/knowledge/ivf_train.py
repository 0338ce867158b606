"""How an ``ivf_pq`` index trains in memory that does not grow with the corpus: the sample rule and the two-step train.

The coarse quantizer (k-means, nlist centroids) trains on a sample of :func:`coarse_sample_size` rows: a fixed
65,536 (= 256 x 256) rows until nlist passes 65,536 / 39 = 1,680 lists, then 39 rows per list. faiss's k-means wants
39 to 256 rows per centroid (it warns below 39 and subsamples above 256), so the floor is what faiss itself would use
for 256 lists and keeps at least 39 rows per list up to 1,680 lists (N ~ 2.8M at the default nlist = sqrt(N)); above
that the sample grows only as 39·nlist. The product quantiser then trains on the residuals of a random subsample of
:func:`pq_sample_size` rows (40 per PQ centroid, 10,240 at 8 bits), so no second copy of the whole sample is made.
"""

from __future__ import annotations

from typing import Optional

import faiss
import numpy as np

__all__ = ["COARSE_SAMPLE_FLOOR", "coarse_sample_size", "pq_sample_size", "train_sample_size", "train_bytes",
           "sample_rows", "train_ivf_pq", "SEED"]

COARSE_SAMPLE_FLOOR = 65_536  # rows the coarse k-means trains on at least (256 rows for 256 lists: faiss's own cap)
MIN_POINTS_PER_LIST = 39  # faiss's k-means warns below this many rows per centroid
PQ_POINTS_PER_CODE = 40  # rows per PQ centroid the sub-quantisers train on
SEED = 1234


def coarse_sample_size(n: int, nlist: int) -> int:
    """Rows the coarse k-means of an index over `n` vectors with `nlist` lists trains on (at most `n`)."""
    return min(n, max(COARSE_SAMPLE_FLOOR, MIN_POINTS_PER_LIST * nlist))


def pq_sample_size(n: int, pq_nbits: int) -> int:
    """Rows (a subsample of the training sample) whose residuals the product quantiser trains on (at most `n`)."""
    return min(n, PQ_POINTS_PER_CODE << pq_nbits)


def train_sample_size(n: int, nlist: int, pq_nbits: int) -> int:
    """Rows of the corpus a build holds to train: the coarse sample, or the PQ's if that is larger (at most `n`)."""
    return max(coarse_sample_size(n, nlist), pq_sample_size(n, pq_nbits))


def train_bytes(n: int, d: int, nlist: int, pq_nbits: int) -> int:
    """An upper bound on the bytes training holds beyond the index: the sample with k-means' per-row assignment and
    distance (8 + 4 bytes) and one 4,096-row block of distances to the centroids, then the PQ subsample's copy and its
    residuals (4·d bytes each per row, with an assignment)."""
    rows, sub = train_sample_size(n, nlist, pq_nbits), pq_sample_size(n, pq_nbits)
    return rows * (d * 4 + 12) + 4096 * max(nlist, 1024) * 4 + sub * (2 * d * 4 + 8)


def sample_rows(n: int, size: int, seed: int = SEED) -> np.ndarray:
    """`size` distinct row numbers of ``range(n)`` drawn with `seed`, sorted (all of them when ``size >= n``)."""
    if size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def train_ivf_pq(index: faiss.IndexIVFPQ, sample: np.ndarray, pq_rows: Optional[int] = None) -> None:
    """Train the untrained `index` on `sample` ``(R, D)`` float32: the coarse quantizer by faiss's k-means on all R rows
    (the index's own clustering parameters and seed, so the centroids equal what ``index.train(sample)`` learns), then
    the product quantiser on the residuals of `pq_rows` random rows of it (default :func:`pq_sample_size`)."""
    nlist = index.nlist
    clustering = faiss.Clustering(index.d, nlist, index.cp)
    clustering.train(sample, index.quantizer)  # leaves the nlist centroids in the flat quantizer
    index.quantizer.is_trained = True
    if pq_rows is None:
        pq_rows = pq_sample_size(len(sample), index.pq.nbits)
    sub = sample if pq_rows >= len(sample) else sample[sample_rows(len(sample), pq_rows)]
    index.train(sub)  # faiss skips a quantizer with nlist centroids: only the PQ trains, on these rows' residuals
