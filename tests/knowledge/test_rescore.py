"""ivf_pq's candidates re-ranked by the exact score on the stored vectors: the function and the knowledge base's default."""

from __future__ import annotations

import numpy as np
import pytest

from rag.knowledge.index import IndexSpec
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.knowledge.rescore import rescore_candidates
from rag.utils.errors import ConfigError


def _clustered(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((32, d))
    x = centres[rng.integers(0, 32, n)] + 0.4 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_rescore_keeps_the_exact_best_of_the_candidates(metric):
    x, q = _clustered(500, 16, 0), _clustered(7, 16, 1)
    rows = np.random.default_rng(2).choice(500, size=(7, 40))
    scores, best = rescore_candidates(q, rows, x, 5, metric)
    exact = q @ x.T if metric == "ip" else -((q[:, None, :] - x[None]) ** 2).sum(-1)
    for b in range(7):
        cand = exact[b, rows[b]]
        want = np.sort(cand)[::-1][:5]
        np.testing.assert_allclose(scores[b], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(exact[b, best[b]], scores[b], rtol=1e-5, atol=1e-5)  # the rows carry those scores
        assert set(best[b]) <= set(rows[b])


def test_an_ivf_pq_knowledge_base_ranks_its_candidates_exactly_by_default(tmp_path):
    n, d = 4000, 32
    x, q = _clustered(n, d, 3), _clustered(50, d, 4)
    passages = [Passage(id=str(i), title=f"t{i}", text=f"passage {i}") for i in range(n)]
    exact_rows = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :10]

    def recall(kb):
        _, rows = kb.search(q, 10)
        return np.mean([len(set(r) & set(e)) / 10 for r, e in zip(rows, exact_rows)]), kb.search(q, 10)

    spec = "ivf_pq:nlist=40,pq_m=4,nprobe=8"
    pq_only = KnowledgeBase.from_embeddings(passages, x, {"name": "x"}, tmp_path / "pq", index=spec + ",rescore=0",
                                            show_progress=False)
    default = KnowledgeBase.from_embeddings(passages, x, {"name": "x"}, tmp_path / "re", index=spec, show_progress=False)
    r0, _ = recall(pq_only)
    r1, (scores, rows) = recall(default)
    assert r1 > r0 + 0.2 and r1 >= 0.9  # 4-byte PQ codes alone rank poorly; the exact re-ranking of 100 recovers
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, rows, 1), rtol=1e-5, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    # the default is not written into the spec's dict (versions of knowledge bases built before it are unchanged)
    assert "rescore" not in IndexSpec.parse(spec).to_dict()
    assert IndexSpec.parse(spec + ",rescore=0").to_dict()["rescore"] == 0
    assert KnowledgeBase.open(tmp_path / "re").search(q, 10)[1].tolist() == rows.tolist()


def test_rescore_applies_to_ivf_pq_only():
    with pytest.raises(ConfigError, match="key 'rescore' does not apply to kind 'hnsw'"):
        IndexSpec.parse("hnsw:rescore=10")
    with pytest.raises(ConfigError, match="rescore"):
        IndexSpec(kind="ivf_pq", rescore=-1)
