"""Length buckets: run a row-independent model on padded rows at a cost that follows the real tokens.

The generator encoder sees the ``B·K`` contexts of a batch (question × retrieved passage), padded to
the longest one. With 100-word passages the contexts vary from ~170 to 300 tokens, so one long
passage makes every row pay for 300 tokens. Here the rows are sorted by length and split into a few
contiguous *buckets*; each bucket is run padded only to its own longest row, and the outputs are put
back in the original row order.

This is exact (up to float summation order) for any model whose rows are independent given the
attention mask and whose positions count from the first column: BART/mBART/Pegasus (learned absolute
positions ``0..L-1``), T5 (relative position buckets depend only on ``j - i``). Columns cut off are
padding of every row in the bucket; padded keys get zero attention weight, so dropping them changes
nothing for the real tokens. Only *trailing* columns are cut: a row's extent is one past its last
real token, so left-padded rows are simply never shortened (their positions would shift).

Pure functions; shapes: ``N`` rows, ``L`` columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from rag.utils.errors import RagError
from rag.utils.validate import check_positive_int

__all__ = [
    "Bucket",
    "row_extents",
    "length_buckets",
    "take_bucket",
    "scatter_buckets",
    "run_in_buckets",
    "encode_in_buckets",
]

DEFAULT_MAX_BUCKETS = 4
"""Most buckets: each is one model call, so more buckets trade smaller matrix products for less padding."""
DEFAULT_MIN_GAIN = 0.02
"""An extra bucket must save at least this fraction of the unbucketed ``N · L`` tokens."""


@dataclass(frozen=True)
class Bucket:
    """One group of rows run together."""

    rows: Tensor
    """(n,) int64 row indices into the ``N`` rows, longest first (on the mask's device)."""
    length: int
    """Columns kept: the largest extent (one past the last real token) among ``rows``; at least 1."""


def row_extents(attention_mask: Tensor) -> Tensor:
    """One past the last real token of each row: ``(N, L)`` mask -> ``(N,)`` int64 (0 for an all-padding row).

    Equals the row's length for right padding; a left-padded row's extent is ``L``.
    """
    if attention_mask.dim() != 2:
        raise RagError(f"attention_mask must be (rows, columns), got shape {tuple(attention_mask.shape)}")
    n, width = attention_mask.shape
    real = attention_mask.ne(0)
    cols = torch.arange(1, width + 1, device=attention_mask.device).expand(n, width)
    return (cols * real).amax(dim=1) if width else torch.zeros(n, dtype=torch.long, device=attention_mask.device)


def length_buckets(attention_mask: Tensor, max_buckets: int = DEFAULT_MAX_BUCKETS,
                   min_gain: float = DEFAULT_MIN_GAIN) -> list[Bucket]:
    """Split the ``(N, L)`` rows into at most `max_buckets` groups of similar extent.

    Rows are sorted by extent (longest first; ties by row index) and cut into contiguous runs; a
    run costs ``rows × its longest extent`` tokens. The split minimises that padded-token total
    exactly (dynamic programming over the sorted extents, ``O(max_buckets · N²)`` arithmetic)
    plus a charge of ``min_gain · N · max_extent`` tokens per bucket beyond the first, so a bucket
    is only added where it saves at least that fraction of the unbucketed work. Every row is in
    exactly one bucket; the buckets come longest first.

    Args:
        attention_mask: ``(N, L)``, nonzero on real tokens (only the extents matter).
        max_buckets: most buckets (>= 1); 1 gives a single bucket trimmed to the longest extent.
        min_gain: in ``[0, 1)``; 0 splits whenever any padding is saved.

    Returns:
        Buckets whose ``rows`` partition ``range(N)``.
    """
    check_positive_int(max_buckets, "max_buckets")
    if not 0.0 <= float(min_gain) < 1.0:
        raise RagError(f"min_gain must be in [0, 1), got {min_gain!r}")
    extents = row_extents(attention_mask).clamp_min(1)
    device = extents.device
    n = extents.shape[0]
    if n == 0:
        return []
    ext = extents.cpu().numpy().astype(np.int64)
    order = np.lexsort((np.arange(n), -ext))  # longest first, stable
    s = ext[order].astype(np.float64)  # (N,) descending
    n_buckets = min(max_buckets, n, len(np.unique(s)))

    # cost[k, j]: fewest padded tokens for the first j sorted rows in exactly k buckets;
    # a bucket holding sorted rows [i, j) costs (j - i) * s[i] (s[i] is its longest).
    cost = np.full((n_buckets + 1, n + 1), np.inf)
    cost[0, 0] = 0.0
    start = np.zeros((n_buckets + 1, n + 1), dtype=np.int64)
    idx = np.arange(n)
    for j in range(1, n + 1):
        cand = cost[:-1, :j] + (j - idx[:j]) * s[:j]  # (n_buckets, j): last bucket starts at i
        start[1:, j] = cand.argmin(axis=1)
        cost[1:, j] = cand[np.arange(n_buckets), start[1:, j]]
    charge = float(min_gain) * n * s[0]
    total = cost[1:, n] + charge * np.arange(n_buckets)
    k = int(np.argmin(total)) + 1  # the fewest buckets among equal totals

    bounds = []
    j = n
    for kk in range(k, 0, -1):
        i = int(start[kk, j])
        bounds.append((i, j))
        j = i
    order_t = torch.from_numpy(order).to(device)
    return [Bucket(rows=order_t[i:j], length=int(s[i])) for i, j in reversed(bounds)]


def take_bucket(tensor: Tensor, bucket: Bucket) -> Tensor:
    """The bucket's rows of a ``(N, L, ...)`` tensor, trimmed to ``(n, bucket.length, ...)``."""
    return tensor[bucket.rows, : bucket.length]


def scatter_buckets(parts: Sequence[Tensor], buckets: Sequence[Bucket], length: Optional[int] = None) -> Tensor:
    """Put per-bucket outputs back in row order (differentiable).

    Args:
        parts: one tensor per bucket, ``(n_b, ...)`` with rows in ``bucket.rows`` order.
        buckets: the buckets, partitioning ``range(N)``.
        length: if given, every part is ``(n_b, l_b, ...)`` with ``l_b <= length`` and is zero-padded
            along dim 1 to ``length`` (e.g. encoder states back to the full ``L``); otherwise the parts
            must agree beyond dim 0 (e.g. decoder logits ``(n_b, T, V)``).

    Returns:
        ``(N, length, ...)`` or ``(N, ...)``: row ``buckets[b].rows[i]`` holds ``parts[b][i]``.
    """
    if len(parts) != len(buckets) or not parts:
        raise RagError(f"got {len(parts)} outputs for {len(buckets)} buckets; give one output per bucket")
    for p, b in zip(parts, buckets):
        if p.shape[0] != b.rows.shape[0]:
            raise RagError(f"a bucket of {b.rows.shape[0]} rows got an output of {p.shape[0]} rows")
    if length is not None:
        padded = []
        for p in parts:
            if p.dim() < 2 or p.shape[1] > length:
                raise RagError(f"cannot pad an output of shape {tuple(p.shape)} to length {length} along dim 1")
            extra = length - p.shape[1]
            if extra:
                p = torch.cat([p, p.new_zeros((p.shape[0], extra, *p.shape[2:]))], dim=1)
            padded.append(p)
        parts = padded
    order = torch.cat([b.rows for b in buckets]).to(parts[0].device)
    n = order.shape[0]
    if order.min() < 0 or torch.bincount(order, minlength=n).ne(1).any():
        raise RagError("the buckets do not cover rows 0..N-1 exactly once; build them with length_buckets")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=order.device)
    stacked = parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)
    return stacked[inverse]  # advanced indexing (index_select is slow on multi-threaded CPU), differentiable


def run_in_buckets(fn: Callable[[Bucket], Tensor], buckets: Sequence[Bucket], length: Optional[int] = None) -> Tensor:
    """``scatter_buckets([fn(b) for b in buckets], buckets, length)``: one call of `fn` per bucket."""
    return scatter_buckets([fn(b) for b in buckets], buckets, length)


def encode_in_buckets(encoder, input_ids: Tensor, attention_mask: Tensor, buckets: Optional[Sequence[Bucket]] = None,
                      **bucket_options) -> Tensor:
    """Encoder states ``(N, L, d)`` of ``(N, L)`` inputs, computed bucket by bucket.

    `encoder` is a transformers encoder (``generator.get_encoder()``) called as
    ``encoder(input_ids=..., attention_mask=..., return_dict=True)``. Real positions equal the
    unbucketed encoder's up to float noise; columns past a bucket's length are zero (they are padding,
    masked by `attention_mask`, which callers keep using unchanged). Gradients flow. `buckets` default
    to ``length_buckets(attention_mask, **bucket_options)``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise RagError(f"input_ids and attention_mask must both be (rows, columns); got {tuple(input_ids.shape)} "
                       f"and {tuple(attention_mask.shape)}")
    if buckets is None:
        buckets = length_buckets(attention_mask, **bucket_options)

    def run(b: Bucket) -> Tensor:
        out = encoder(input_ids=take_bucket(input_ids, b), attention_mask=take_bucket(attention_mask, b), return_dict=True)
        return out.last_hidden_state

    return run_in_buckets(run, buckets, length=input_ids.shape[1])
