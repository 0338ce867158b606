"""Per-text perplexity records and the paired bootstrap difference the demos report."""

import math

import numpy as np

from rag.eval.perplexity import paired_difference, per_text_records, perplexity_totals
from rag.models.ralm.model import TextScore


def records(nlls, prefix="d"):
    return [{"id": f"{prefix}{i}", "nll": float(x), "bytes": 100} for i, x in enumerate(nlls)]


def test_per_text_records_sum_to_the_totals():
    scores = [TextScore(f"t{i}", np.log(np.full(5 + i, 0.25)), np.arange(5 + i), n_words=3, n_bytes=20 + i) for i in range(3)]
    recs = per_text_records(scores)
    assert [r["id"] for r in recs] == ["t0", "t1", "t2"] and [r["bytes"] for r in recs] == [20, 21, 22]
    tot = perplexity_totals(scores)
    bpb = sum(r["nll"] for r in recs) / math.log(2) / sum(r["bytes"] for r in recs)
    assert math.isclose(bpb, tot.bits_per_byte, rel_tol=1e-12)


def test_the_difference_is_paired_by_text_with_an_interval():
    base = records([100.0] * 20)
    better = records([100.0 - (i % 5) for i in range(20)])
    d = paired_difference(base, better)
    assert math.isclose(d["delta_bpb"], -40 / math.log(2) / 2000)  # 4 texts each 0..4 nats better
    assert d["low"] <= d["delta_bpb"] <= d["high"] < 0 and (d["texts"], d["texts_better"]) == (20, 16)
    same = paired_difference(base, base)
    assert same["low"] == same["high"] == same["delta_bpb"] == 0.0
    # a difference of mixed sign over texts: the interval straddles 0
    mixed = paired_difference(base, records([100.0 + (3 if i % 2 else -3) for i in range(20)]))
    assert mixed["low"] < 0 < mixed["high"]
    # other texts, or a run written before per-text records: no comparison
    assert paired_difference(base, better[:19]) is None
    assert paired_difference(base, records([100.0] * 20, prefix="e")) is None
    assert paired_difference(None, better) is None and paired_difference(base, []) is None
