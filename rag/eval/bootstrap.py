"""The paired bootstrap: a 95% confidence interval of a statistic of paired items, by resampling items with
replacement (Efron & Tibshirani 1993; Koehn 2004 for comparing two systems on the same test items).

`statistic(indices)` recomputes the statistic (a difference of two systems' totals or means) on a resample given as a
list of item indices; the interval is the 2.5th and 97.5th percentiles of `resamples` such recomputations, drawn with
``random.Random(seed)``: the same inputs give the same interval.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

__all__ = ["bootstrap_interval", "paired_mean_difference"]


def bootstrap_interval(n: int, statistic: Callable[[Sequence[int]], float], *, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """(low, high): the 95% percentile interval of `statistic` over `resamples` resamples of ``range(n)``."""
    rng = random.Random(seed)
    boot = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]


def paired_mean_difference(base: Sequence[float], run: Sequence[float], *, resamples: int = 2000,
                           seed: int = 0) -> dict:
    """mean(run) - mean(base) over paired items (same length, same order), its 95% bootstrap interval, and how many
    items `run` scores higher and lower: ``{"delta", "low", "high", "n", "better", "worse"}``."""
    n = len(base)

    def delta(idx: Sequence[int]) -> float:
        return sum(run[i] - base[i] for i in idx) / len(idx)

    low, high = bootstrap_interval(n, delta, resamples=resamples, seed=seed)
    return {"delta": delta(range(n)), "low": low, "high": high, "n": n,
            "better": sum(r > b for b, r in zip(base, run)), "worse": sum(r < b for b, r in zip(base, run))}
