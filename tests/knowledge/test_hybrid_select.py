"""benchmarks/hybrid_recall.py --select: the rule that chose BM25's title weight and the fusion's β on development sets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_recall.py"


def load():
    spec = importlib.util.spec_from_file_location("hybrid_recall_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(dense, bm25s: dict, hybrids: dict) -> dict:
    out = {"n": 10, "dense R@1": dense[0], "dense R@3": dense[1]}
    for t, (r1, r3) in bm25s.items():
        out[f"title×{t} bm25 R@1"], out[f"title×{t} bm25 R@3"] = r1, r3
    for (t, b), (r1, r3) in hybrids.items():
        out[f"title×{t} hybrid β={b} R@1"], out[f"title×{t} hybrid β={b} R@3"] = r1, r3
    return out


def test_select_keeps_settings_at_least_as_good_as_either_retriever_then_takes_the_best_mean(tmp_path):
    bench = load()
    # title×1 β=0.5 has the best mean but loses to BM25 on one set and count; title×2 and ×3 at β=1 tie: the smaller wins
    a = {"sets": {"s1": row((50, 80), {1: (60, 90), 2: (70, 90), 3: (70, 90)},
                            {(1, 0.5): (95, 100), (2, 1.0): (80, 95), (3, 1.0): (80, 95), (2, 0.5): (60, 95)})}}
    b = {"sets": {"s2": row((70, 90), {1: (50, 95), 2: (60, 95), 3: (60, 95)},
                            {(1, 0.5): (90, 94), (2, 1.0): (75, 95), (3, 1.0): (75, 95), (2, 0.5): (90, 96)})}}
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    result = bench.select(paths)
    by = {c["setting"]: c for c in result["candidates"]}
    assert by["title×1 hybrid β=0.5"]["min_margin"] == -1.0 and by["title×2 hybrid β=0.5"]["min_margin"] == -10.0
    assert by["title×2 hybrid β=1.0"]["min_margin"] == 0.0 and by["title×2 hybrid β=1.0"]["mean"] == 86.25
    assert result["chosen"]["setting"] == "title×2 hybrid β=1.0"
    assert (result["chosen"]["title_weight"], result["chosen"]["bm25_weight"]) == (2, 1.0)
    assert len(result["sets"]) == 2
