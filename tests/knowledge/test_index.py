"""FAISS index layer: exact scores, approximate recall, IO round trips, corrupt files, specs, bounds."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

import rag.knowledge.ivf_train as ivf_train
from rag.knowledge.index import (
    IndexSpec,
    _auto_nlist,
    build_index,
    bytes_per_vector,
    faiss_threads,
    read_index,
    search_index,
    write_index,
)
from rag.knowledge.ivf_train import coarse_sample_size, pq_sample_size, train_ivf_pq, train_sample_size
from rag.knowledge.vectors import ArrayVectors
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError, RagError


def clustered(n: int, dim: int = 64, latent: int = 16, clusters: int = 50, seed: int = 0) -> np.ndarray:
    """Normalised vectors from a Gaussian mixture on a random `latent`-dim subspace (embedding-like)."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(np.random.default_rng(99).standard_normal((dim, latent)))[0].T
    centres = np.random.default_rng(98).standard_normal((clusters, latent))
    z = centres[rng.integers(clusters, size=n)] + 0.5 * rng.standard_normal((n, latent))
    v = z @ basis + 0.05 * rng.standard_normal((n, dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def exact_top(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :k]


def recall_at(rows: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(rows, truth)]))


@pytest.fixture(scope="module")
def corpus() -> tuple[np.ndarray, np.ndarray]:
    return clustered(4000, seed=1), clustered(100, seed=2)


# ----------------------------------------------------------------------------- exact search


def test_flat_inner_product_returns_known_order_and_scores():
    x = np.array([[1, 0, 0, 0], [0, 2, 0, 0], [1, 1, 0, 0], [0, 0, 0, 3], [-1, 0, 0, 0]], np.float32)
    q = np.array([[1.0, 0.5, 0, 0], [0, 0, 0, -1]], np.float32)
    spec = IndexSpec(kind="flat")
    scores, rows = search_index(build_index(x, spec, show_progress=False), q, 3, spec)
    # q0 · x = [1, 1, 1.5, 0, -1]  -> 2, then 0 and 1 tie at 1.0; q1 · x = [0, 0, 0, -3, 0]
    assert rows.dtype == np.int64 and scores.dtype == np.float32
    assert rows[0, 0] == 2 and set(rows[0, 1:]) == {0, 1}
    np.testing.assert_allclose(scores[0], [1.5, 1.0, 1.0], rtol=1e-6)
    assert 3 not in rows[1]
    np.testing.assert_allclose(scores[1], [0.0, 0.0, 0.0], atol=1e-6)


def test_flat_l2_scores_are_negative_squared_distances():
    x = np.array([[0, 0], [3, 4], [1, 0]], np.float32)
    spec = IndexSpec(kind="flat", metric="l2")
    scores, rows = search_index(build_index(x, spec, show_progress=False), np.array([[0, 0]], np.float32), 3, spec)
    assert rows.tolist() == [[0, 2, 1]]
    np.testing.assert_allclose(scores, [[0.0, -1.0, -25.0]], atol=1e-6)


@pytest.mark.parametrize("kind", ["hnsw", "flat"])
def test_inner_product_scores_are_exact_for_unquantised_kinds(corpus, kind):
    x, q = corpus
    spec = IndexSpec(kind=kind)
    scores, rows = search_index(build_index(x, spec, show_progress=False), q, 10, spec)
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", q, x[rows]), rtol=1e-5, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all(), "scores must be best first"


def test_unnormalised_inner_product_search_ranks_by_dot_product():
    # Norms vary by 10x: inner-product (not cosine, not L2) order is what HNSW must return.
    rng = np.random.default_rng(3)
    x = (clustered(2000, seed=3) * rng.uniform(0.3, 3.0, size=(2000, 1))).astype(np.float32)
    q = clustered(50, seed=4)
    spec = IndexSpec(kind="hnsw")
    _, rows = search_index(build_index(x, spec, show_progress=False), q, 10, spec)
    assert recall_at(rows, exact_top(x, q, 10)) >= 0.95


# ----------------------------------------------------------------------------- recall


@pytest.mark.parametrize(
    "spec_str, threshold",
    [("hnsw", 0.97), ("hnsw_sq8", 0.93), ("ivf_pq:nlist=16,pq_m=8,nprobe=4", 0.55)],
)
def test_approximate_recall_against_exact(corpus, spec_str, threshold):
    x, q = corpus
    if spec_str.startswith("ivf_pq"):
        x = x[:2000]  # PQ training (8 x 25 k-means runs to 256 centroids) dominates otherwise
    spec = IndexSpec.parse(spec_str)
    scores, rows = search_index(build_index(x, spec, show_progress=False), q, 10, spec)
    assert recall_at(rows, exact_top(x, q, 10)) >= threshold
    assert (rows >= 0).all() and (np.diff(scores, axis=1) <= 1e-5).all()


def test_larger_ef_search_does_not_lower_recall(corpus):
    x, q = corpus
    spec = IndexSpec(kind="hnsw", m=8, ef_construction=16)
    index = build_index(x, spec, show_progress=False)
    truth = exact_top(x, q, 10)
    low = recall_at(search_index(index, q, 10, IndexSpec(kind="hnsw", m=8, ef_search=10))[1], truth)
    high = recall_at(search_index(index, q, 10, IndexSpec(kind="hnsw", m=8, ef_search=200))[1], truth)
    assert high >= low and high >= 0.97
    assert index.hnsw.efSearch == spec.ef_search, "search must not mutate the index"


# ----------------------------------------------------------------------------- IO


@pytest.mark.parametrize("spec_str", ["flat", "hnsw", "hnsw_sq8", "ivf_pq:nlist=16,pq_m=8,pq_nbits=6"])
@pytest.mark.parametrize("mmap", [True, False])
def test_write_read_round_trip_gives_identical_results(tmp_path, corpus, spec_str, mmap):
    x, q = corpus
    spec = IndexSpec.parse(spec_str)
    index = build_index(x[:1000], spec, show_progress=False)
    path = tmp_path / "kb" / "index.faiss"
    write_index(index, path)
    assert [p.name for p in path.parent.iterdir()] == ["index.faiss"], "no temporary files left behind"
    loaded = read_index(path, mmap=mmap)
    assert loaded.ntotal == 1000 and loaded.d == x.shape[1]
    s0, r0 = search_index(index, q, 5, spec)
    s1, r1 = search_index(loaded, q, 5, spec)
    np.testing.assert_array_equal(r0, r1)
    np.testing.assert_array_equal(s0, s1)


def test_mmapped_index_survives_atomic_replacement_of_its_file(tmp_path, corpus):
    x, q = corpus
    spec = IndexSpec(kind="hnsw")
    path = tmp_path / "index.faiss"
    write_index(build_index(x[:500], spec, show_progress=False), path)
    loaded = read_index(path, mmap=True)
    before = search_index(loaded, q, 5, spec)
    write_index(build_index(x[500:1200], spec, show_progress=False), path)  # new file, same name
    after = search_index(loaded, q, 5, spec)
    np.testing.assert_array_equal(before[1], after[1])
    assert read_index(path).ntotal == 700


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999])
def test_truncated_index_file_raises_integrity_error(tmp_path, corpus, mmap, fraction):
    x, _ = corpus
    path = tmp_path / "index.faiss"
    write_index(build_index(x[:300], IndexSpec(kind="hnsw"), show_progress=False), path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(IntegrityError, match="index.faiss.*rebuild"):
        read_index(path, mmap=mmap)


def test_garbage_and_missing_index_files(tmp_path):
    bad = tmp_path / "index.faiss"
    bad.write_bytes(b"this is not a faiss index" * 10)
    with pytest.raises(IntegrityError, match="rebuild"):
        read_index(bad)
    with pytest.raises(KnowledgeBaseError, match="does not exist"):
        read_index(tmp_path / "missing.faiss")


def test_graph_pointing_outside_the_index_is_rejected_not_searched(tmp_path, corpus):
    x, _ = corpus
    index = build_index(x[:200], IndexSpec(kind="hnsw"), show_progress=False)
    neighbours = faiss.rev_swig_ptr(index.hnsw.neighbors.data(), index.hnsw.neighbors.size())
    neighbours[0] = 10**6  # a parseable file whose graph would make search read out of bounds
    path = tmp_path / "index.faiss"
    write_index(index, path)
    with pytest.raises(IntegrityError, match="index.faiss.*(out of range|outside the index).*rebuild"):
        read_index(path)


def test_bytes_per_vector_reflects_compression(corpus):
    x, _ = corpus
    d = x.shape[1]
    ivf = "ivf_pq:nlist=8,pq_m=8,pq_nbits=6"
    sizes = {k: bytes_per_vector(build_index(x[:1000], IndexSpec.parse(k), show_progress=False))
             for k in ["flat", "hnsw", "hnsw_sq8", ivf]}
    assert 4 * d <= sizes["flat"] < 4 * d + 1
    assert sizes["hnsw"] > sizes["flat"] + 4 * 32  # vectors + graph (>= m links of 4 bytes)
    assert abs((sizes["hnsw"] - sizes["hnsw_sq8"]) - 3 * d) < 1  # 1 byte instead of 4 per coordinate
    assert sizes[ivf] < 40  # 6 code bytes + 8-byte id + shared tables


# ----------------------------------------------------------------------------- specs


def test_spec_parse_to_dict_round_trip():
    spec = IndexSpec.parse("hnsw_sq8:m=48,ef_search=256")
    assert (spec.kind, spec.m, spec.ef_search, spec.metric) == ("hnsw_sq8", 48, 256, "ip")
    assert IndexSpec.from_dict(spec.to_dict()) == spec
    assert IndexSpec.parse(spec.to_string()) == spec
    ivf = IndexSpec.parse("ivf_pq:nlist=1024,pq_m=64,metric=l2")
    assert (ivf.nlist, ivf.pq_m, ivf.metric) == (1024, 64, "l2")
    assert IndexSpec.parse(ivf.to_string()) == ivf
    assert IndexSpec.parse("ivf_pq:nlist=auto").nlist is None
    assert IndexSpec.parse(" hnsw ") == IndexSpec()
    assert IndexSpec.parse("flat").to_string() == "flat:metric=ip"


@pytest.mark.parametrize(
    "text, match",
    [
        ("hnws", "unknown kind 'hnws'.*flat, hnsw, hnsw_sq8, ivf_pq"),
        ("hnsw:ef=64", "key 'ef'.*valid keys: metric, m, ef_construction, ef_search"),
        ("flat:nprobe=4", "does not apply to kind 'flat'"),
        ("hnsw:m=many", "m='many' is not an integer"),
        ("hnsw:m=1", r"m=1 is out of range \[2, 512\]"),
        ("hnsw:metric=cosine", "metric 'cosine' is not one of ip, l2"),
        ("ivf_pq:nlist", "not of the form key=value"),
        ("hnsw:m=8,m=16", "given twice"),
        ("", "empty index spec"),
    ],
)
def test_bad_spec_strings(text, match):
    with pytest.raises(ConfigError, match=match):
        IndexSpec.parse(text)


def test_from_dict_is_strict():
    with pytest.raises(ConfigError, match="unknown index spec key 'efsearch'.*ef_search"):
        IndexSpec.from_dict({"kind": "hnsw", "efsearch": 5})
    with pytest.raises(ConfigError, match="ef_search=True must be an integer"):
        IndexSpec.from_dict({"ef_search": True})
    with pytest.raises(ConfigError, match="nprobe=2.5"):
        IndexSpec.from_dict({"nprobe": 2.5})
    assert IndexSpec.from_dict({}) == IndexSpec()


# ----------------------------------------------------------------------------- bounds & errors


def test_k_bounds_name_k_and_corpus_size(corpus):
    x, q = corpus
    spec = IndexSpec(kind="hnsw")
    index = build_index(x[:20], spec, show_progress=False)
    for k in (0, -1, 21):
        with pytest.raises(RagError,
                           match=rf"k \(at most the corpus size, 20 vectors\) must be an integer between 1 and 20, got {k}"):
            search_index(index, q, k, spec)
    scores, rows = search_index(index, q, 20, spec)
    assert sorted(rows[0].tolist()) == list(range(20))


@pytest.mark.parametrize("kind", ["hnsw", "hnsw_sq8", "flat"])
@pytest.mark.parametrize("n", [1, 3])
def test_tiny_corpora_never_return_missing_rows(kind, n):
    x = clustered(n, dim=8, latent=4, seed=5)
    spec = IndexSpec(kind=kind)
    scores, rows = search_index(build_index(x, spec, show_progress=False), x, n, spec)
    assert rows.shape == (n, n) and (rows >= 0).all()
    assert all(sorted(r) == list(range(n)) for r in rows.tolist())


def test_disconnected_graph_falls_back_to_valid_rows():
    # 300 copies of one vector: HNSW's neighbour pruning disconnects the graph, and a
    # plain faiss search returns -1 ids; search_index must still return k distinct valid rows.
    rng = np.random.default_rng(0)
    x = np.vstack([np.tile(rng.standard_normal((1, 8)), (300, 1)), rng.standard_normal((20, 8))]).astype(np.float32)
    spec = IndexSpec(kind="hnsw", m=2, ef_construction=4, ef_search=8)
    index = build_index(x, spec, show_progress=False)
    raw = index.search(x, 50, params=faiss.SearchParametersHNSW(efSearch=50))[1]
    assert (raw < 0).any(), "precondition: the raw graph search misses results"
    scores, rows = search_index(index, x, 50, spec)
    assert (rows >= 0).all() and all(len(set(r)) == 50 for r in rows.tolist())
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", x, x[rows]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["build", "search"])
def test_nan_inputs_are_rejected_with_the_row(corpus, where):
    x, q = corpus
    bad = x[:50].copy()
    bad[7, 3] = np.nan
    spec = IndexSpec(kind="flat")
    with pytest.raises(RagError, match="row 7 contains NaN or inf"):
        if where == "build":
            build_index(bad, spec, show_progress=False)
        else:
            search_index(build_index(x[:50], spec, show_progress=False), bad, 1, spec)


def test_bad_input_shapes_and_types(corpus):
    x, q = corpus
    spec = IndexSpec(kind="flat")
    with pytest.raises(RagError, match="float32"):
        build_index(x.astype(np.float64), spec)
    with pytest.raises(RagError, match=r"shape \(N, D\)"):
        build_index(x[0], spec)
    with pytest.raises(RagError, match="0 vectors"):
        build_index(np.zeros((0, 8), np.float32), spec)
    index = build_index(x, spec, show_progress=False)
    with pytest.raises(RagError, match="dimension 32 but the index has dimension 64"):
        search_index(index, q[:, :32].copy(), 1, spec)
    with pytest.raises(ConfigError, match="kind=flat, metric=ip but the spec says kind=hnsw"):
        search_index(index, q, 1, IndexSpec(kind="hnsw"))
    s, r = search_index(index, q[:0], 3, spec)
    assert s.shape == (0, 3) and r.shape == (0, 3)


def test_ivf_pq_too_small_corpus_and_bad_pq_m(corpus):
    x, _ = corpus
    with pytest.raises(RagError, match="ivf_pq cannot train on 100 vectors.*smaller nlist.*'flat' or 'hnsw'"):
        build_index(x[:100], IndexSpec(kind="ivf_pq"), show_progress=False)
    with pytest.raises(ConfigError, match="pq_m=10 does not divide the dimension 64"):
        build_index(x, IndexSpec(kind="ivf_pq", pq_m=10), show_progress=False)


def test_threads_scope_restores_faiss_setting(corpus):
    x, _ = corpus
    before = faiss.omp_get_max_threads()
    build_index(x[:200], IndexSpec(kind="hnsw"), threads=1, show_progress=False)
    assert faiss.omp_get_max_threads() == before
    with faiss_threads(1):
        assert faiss.omp_get_max_threads() == 1
    assert faiss.omp_get_max_threads() == before
    with pytest.raises(ConfigError, match=r"threads .*must be a positive integer, got 0"):
        build_index(x[:200], IndexSpec(kind="flat"), threads=0)


def test_ivf_with_too_few_probed_vectors_still_returns_k_valid_rows(corpus):
    x, q = corpus
    spec = IndexSpec.parse("ivf_pq:nlist=16,pq_m=8,pq_nbits=4,nprobe=1")
    index = build_index(x[:1000], spec, show_progress=False)
    raw = index.search(q, 200, params=faiss.SearchParametersIVF(nprobe=1))[1]
    assert (raw < 0).any(), "precondition: one list holds fewer than k vectors"
    scores, rows = search_index(index, q, 200, spec)
    assert (rows >= 0).all() and all(len(set(r)) == 200 for r in rows.tolist())
    assert (np.diff(scores, axis=1) <= 1e-5).all()


# ----------------------------------------------------------------------------- ivf_pq training in bounded memory


def test_ivf_pq_training_sample_is_constant_in_n_until_past_1680_lists():
    floor = ivf_train.COARSE_SAMPLE_FLOOR
    at_default = {n: coarse_sample_size(n, _auto_nlist(n)) for n in (70_000, 100_000, 1_000_000, 2_000_000)}
    assert set(at_default.values()) == {floor}, at_default  # 100k and 1M train on the same rows
    assert coarse_sample_size(10_000, _auto_nlist(10_000)) == 10_000  # never above n
    lists = floor // 39  # 1,680: the most lists the floor gives 39 rows each
    assert coarse_sample_size(10**8, lists) == floor and coarse_sample_size(10**8, lists + 1) == 39 * (lists + 1)
    assert coarse_sample_size(21_000_000, _auto_nlist(21_000_000)) == 39 * 4583  # then only 39 rows per list
    assert pq_sample_size(10**6, 8) == 10_240 and pq_sample_size(5000, 8) == 5000
    assert train_sample_size(10**6, 1000, 8) == floor and train_sample_size(10**6, 1000, 12) == 40 << 12


class TakeSpy(ArrayVectors):
    def __init__(self, x):
        super().__init__(x)
        self.taken = []

    def take(self, idx):
        self.taken.append(len(idx))
        return super().take(idx)


def test_ivf_pq_trains_the_quantizer_on_the_sample_then_the_pq_on_a_subsample(corpus, monkeypatch):
    x, q = corpus  # 4,000 x 64
    monkeypatch.setattr(ivf_train, "COARSE_SAMPLE_FLOOR", 2048)  # the rule's floor at this scale: a sample of half
    seen = []
    real_train = faiss.IndexIVFPQ.train

    def spy(index, rows):
        seen.append((len(rows), index.quantizer.ntotal))
        return real_train(index, rows)

    monkeypatch.setattr(faiss.IndexIVFPQ, "train", spy)
    spec = IndexSpec.parse("ivf_pq:nlist=16,pq_m=8,pq_nbits=5,nprobe=4")
    src = TakeSpy(x)
    index = build_index(src, spec, show_progress=False)
    assert src.taken == [2048]  # only the coarse sample is read into memory for training
    assert seen == [(40 << 5, 16)]  # the PQ alone, on 1,280 rows, after the quantizer has its 16 centroids
    full = faiss.IndexIVFPQ(faiss.IndexFlatIP(64), 64, 16, 8, 5, faiss.METRIC_INNER_PRODUCT)
    full.cp.seed = full.pq.cp.seed = ivf_train.SEED
    real_train(full, x)  # the old way: both quantisers on every row
    full.add(x)
    truth = exact_top(x, q, 10)
    got = recall_at(search_index(index, q, 10, spec)[1], truth)
    ref = recall_at(search_index(full, q, 10, spec)[1], truth)
    # 5-bit PQ codes limit both (~0.3); a recall over 1,000 hits has a standard error of ~0.015: 0.05 is ~3 of them
    assert got >= ref - 0.05, (got, ref)


def test_separately_trained_quantizer_equals_what_index_train_learns(corpus):
    x, _ = corpus
    sample = x[:1500]
    for metric, flat in ((faiss.METRIC_INNER_PRODUCT, faiss.IndexFlatIP), (faiss.METRIC_L2, faiss.IndexFlatL2)):
        a, b = (faiss.IndexIVFPQ(flat(64), 64, 24, 8, 4, metric) for _ in range(2))
        for ix in (a, b):
            ix.cp.seed = ix.pq.cp.seed = ivf_train.SEED
        a.train(sample)
        train_ivf_pq(b, sample)
        assert b.is_trained and b.quantizer.ntotal == 24
        np.testing.assert_array_equal(a.quantizer.reconstruct_n(0, 24), b.quantizer.reconstruct_n(0, 24))
