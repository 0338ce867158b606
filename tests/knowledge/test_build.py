"""Bounded-memory builds: indexes built from a file in blocks equal one-shot builds, staged encoding resumes from its
finished chunks, and a spec that cannot fit the memory limit is refused before anything is encoded."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import rag.knowledge.index as index_module
import rag.knowledge.ivf_train as ivf_train
from rag.cli import main
from rag.demo import CORPUS_PATH
from rag.knowledge.build import check_memory, estimate_memory, parse_memory, staging_dir
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.index import IndexSpec, build_index, search_index
from rag.knowledge.ivf_train import pq_sample_size, train_sample_size
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage, load_corpus
from rag.knowledge.vectors import ArrayVectors, NpyVectors, create_npy, write_rows
from rag.utils.errors import ConfigError, KnowledgeBaseError

N, D = 20_000, 8


@pytest.fixture(scope="module")
def vectors_file(tmp_path_factory):
    x = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
    path = tmp_path_factory.mktemp("vec") / "x.npy"
    offset = create_npy(path, x.shape)
    import os

    fd = os.open(path, os.O_WRONLY)
    for start in range(0, N, 3_000):  # chunks that do not line up with the index's 16,384-row blocks
        write_rows(fd, offset, start, x[start:start + 3_000])
    os.close(fd)
    return x, path


def test_a_file_written_in_chunks_is_byte_identical_to_np_save(vectors_file, tmp_path):
    x, path = vectors_file
    np.save(tmp_path / "whole.npy", x)
    assert path.read_bytes() == (tmp_path / "whole.npy").read_bytes()  # so a knowledge base's version id is unchanged
    src = NpyVectors(path)
    assert src.shape == (N, D)
    idx = np.array([0, 7, 4_999, 19_999])
    np.testing.assert_array_equal(src.take(idx), x[idx])  # sparse: row by row
    dense = np.arange(0, N, 3)
    np.testing.assert_array_equal(src.take(dense), x[dense])  # dense: one sequential pass


@pytest.mark.parametrize("spec", ["flat", "hnsw:m=8,ef_construction=40", "hnsw_sq8:m=8,ef_construction=40",
                                  "ivf_pq:nlist=64,pq_m=4,nprobe=8"])
def test_an_index_built_from_a_file_in_blocks_equals_the_one_shot_build(vectors_file, spec, monkeypatch):
    x, path = vectors_file
    monkeypatch.setattr(index_module, "_TRAIN_SAMPLE_SQ", 5_000)  # so that the quantiser's sample is a part of N
    monkeypatch.setattr(ivf_train, "COARSE_SAMPLE_FLOOR", 5_000)  # and the coarse k-means' (65,536 > N otherwise)
    spec = IndexSpec.parse(spec)
    q = np.random.default_rng(1).standard_normal((50, D)).astype(np.float32)
    one = ArrayVectors(x)
    whole = search_index(build_index(one, spec, threads=1, show_progress=False), q, 10, spec)
    src = NpyVectors(path)
    chunked = search_index(build_index(src, spec, threads=1, show_progress=False), q, 10, spec)
    np.testing.assert_array_equal(chunked[1], whole[1])
    np.testing.assert_array_equal(chunked[0], whole[0])
    # the most rows the build held at once: one add block (16,384) or the training sample, never all N
    assert src.largest_block <= 16_384 < N
    assert one.largest_block == src.largest_block


def test_non_finite_rows_in_a_file_are_refused_naming_the_row(tmp_path):
    x = np.ones((100, 4), np.float32)
    x[37, 2] = np.nan
    np.save(tmp_path / "bad.npy", x)
    with pytest.raises(Exception, match="row 37 contains NaN"):
        build_index(NpyVectors(tmp_path / "bad.npy"), IndexSpec(kind="flat"), show_progress=False)


class CountingEncoder(TextEncoder):
    """The tiny DPR context encoder, counting its encode_passages calls and failing on call `fail_at` (a killed build)."""

    calls = 0
    fail_at = None

    def encode_passages(self, passages, **kw):
        type(self).calls += 1
        if type(self).calls == type(self).fail_at:
            raise KeyboardInterrupt("killed mid-build")
        return super().encode_passages(passages, **kw)


@pytest.fixture()
def counting(tiny_dpr_context_dir):
    CountingEncoder.calls, CountingEncoder.fail_at = 0, None
    return CountingEncoder(tiny_dpr_context_dir, role="context")


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(str(CORPUS_PATH), show_progress=False)


def test_a_killed_build_leaves_nothing_open_accepts_and_resumes_from_its_chunks(counting, corpus, tmp_path):
    chunks = -(-len(corpus) // 20)
    assert chunks >= 6
    ref = KnowledgeBase.build(corpus, counting, tmp_path / "ref", index="flat", chunk_rows=20, show_progress=False)
    assert CountingEncoder.calls == chunks and not staging_dir(tmp_path / "ref").exists()

    out = tmp_path / "kb"
    CountingEncoder.calls, CountingEncoder.fail_at = 0, 4  # three chunks written, then killed
    with pytest.raises(KeyboardInterrupt):
        KnowledgeBase.build(corpus, counting, out, index="flat", chunk_rows=20, show_progress=False)
    assert not out.exists()
    with pytest.raises(KnowledgeBaseError):
        KnowledgeBase.open(out)
    with pytest.raises(KnowledgeBaseError):
        KnowledgeBase.open(staging_dir(out))  # the staging holds chunks, never a manifest
    progress = json.loads((staging_dir(out) / "progress.json").read_text())
    assert sorted(progress["done"]) == ["0", "1", "2"]

    CountingEncoder.calls, CountingEncoder.fail_at = 0, None
    kb = KnowledgeBase.build(corpus, counting, out, index="flat", chunk_rows=20, show_progress=False)
    assert CountingEncoder.calls == chunks - 3  # the three finished chunks were not encoded again
    assert kb.version == ref.version and not staging_dir(out).exists()
    assert kb.manifest.files["embeddings.npy"] == ref.manifest.files["embeddings.npy"]


def test_resume_rechecks_chunks_and_only_for_the_same_build(counting, corpus, tmp_path):
    out = tmp_path / "kb"
    CountingEncoder.fail_at = 5  # four chunks written
    with pytest.raises(KeyboardInterrupt):
        KnowledgeBase.build(corpus, counting, out, index="flat", chunk_rows=20, show_progress=False)
    # a chunk altered on disk is encoded again; the others are kept
    emb = staging_dir(out) / "embeddings.npy"
    src = NpyVectors(emb)
    with open(emb, "r+b") as f:
        f.seek(src.offset + 25 * src.shape[1] * 4)  # row 25 (chunk 1)
        f.write(b"\xff\xff\xff\x7f")
    CountingEncoder.calls, CountingEncoder.fail_at = 0, 4  # chunk 1 again, then two new ones: killed again
    with pytest.raises(KeyboardInterrupt):
        KnowledgeBase.build(corpus, counting, out, index="flat", chunk_rows=20, show_progress=False)
    assert sorted(json.loads((staging_dir(out) / "progress.json").read_text())["done"], key=int) == ["0", "1", "2", "3", "4", "5"]
    # another index spec (or corpus, or encoder) does not reuse them
    CountingEncoder.calls, CountingEncoder.fail_at = 0, None
    KnowledgeBase.build(corpus, counting, out, index="hnsw:m=8", chunk_rows=20, show_progress=False)
    assert CountingEncoder.calls == -(-len(corpus) // 20)


def test_memory_limit_is_checked_before_encoding(counting, corpus, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"--max-memory 64\.0 KiB: a hnsw build of 150 vectors of dim 32 needs about .*"
                                          r"must fit in RAM to be searched, so raise --max-memory to at least"):
        KnowledgeBase.build(corpus, counting, tmp_path / "kb", max_memory="64K", show_progress=False)
    assert CountingEncoder.calls == 0 and not (tmp_path / "kb").exists() and not staging_dir(tmp_path / "kb").exists()
    code = main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", "minilm", "--out", str(tmp_path / "x"),
                 "--quiet", "--max-memory", "1M"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--max-memory 1.0 MiB" in err[0] and "raise --max-memory" in err[0]
    assert main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", "minilm", "--out", str(tmp_path / "x"),
                 "--quiet", "--max-memory", "lots"]) == 2
    assert "--max-memory 'lots': expected a size such as 16G" in capsys.readouterr().err


def test_memory_estimate_parts():
    assert parse_memory("2G") == 2 << 30 and parse_memory("512MiB") == 512 << 20 and parse_memory(1000) == 1000
    n, d = 1_000_000, 768
    flat, pq = estimate_memory(IndexSpec(kind="flat"), n, d), estimate_memory(IndexSpec(kind="ivf_pq"), n, d)
    assert flat.index == n * d * 4 and pq.index < flat.index / 20
    assert pq.peak - pq.index - pq.parts["runtime"] < flat.index / 4  # the build holds a sample and a chunk, not the vectors
    check_memory(IndexSpec(kind="ivf_pq"), n, d, pq.peak)
    with pytest.raises(ConfigError, match=r"or use --index ivf_pq \(peak "):
        check_memory(IndexSpec(kind="hnsw"), n, d, pq.peak)


def test_ivf_pq_training_estimate_is_constant_in_n_and_covers_the_sample():
    d, spec = 384, IndexSpec(kind="ivf_pq")
    train = {n: estimate_memory(spec, n, d).parts["training sample"] for n in (100_000, 300_000, 1_000_000)}
    assert len(set(train.values())) == 1, train  # the default nlist grows with N; the training memory does not
    for n in (5_000, 100_000, 1_000_000, 21_000_000):
        nlist = index_module._auto_nlist(n)
        held = train_sample_size(n, nlist, 8) * d * 4 + 2 * pq_sample_size(n, 8) * d * 4  # sample, PQ rows + residuals
        assert estimate_memory(spec, n, d).parts["training sample"] >= held


def test_bad_ray_and_worker_options_are_one_line_errors(tmp_path, capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    base = ["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", "minilm", "--out", str(tmp_path / "x"), "--quiet"]
    assert main([*base, "--ray", f"127.0.0.1:{port}", "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--ray: Ray cluster at 127.0.0.1:{port} is not reachable" in err[0]
    assert main([*base, "--workers", "2"]) == 2
    assert "--workers 2: only means something with --ray" in capsys.readouterr().err
    assert main([*base, "--ray", "--workers", "0"]) == 2
    assert "--workers 0: must be a positive integer" in capsys.readouterr().err


def test_staging_file_digest_matches_progress_record(counting, corpus, tmp_path):
    out = tmp_path / "kb"
    CountingEncoder.fail_at = 2
    with pytest.raises(KeyboardInterrupt):
        KnowledgeBase.build(corpus, counting, out, index="flat", chunk_rows=40, show_progress=False)
    done = json.loads((staging_dir(out) / "progress.json").read_text())["done"]
    rows = NpyVectors(staging_dir(out) / "embeddings.npy").take(np.arange(40))
    assert done == {"0": hashlib.sha256(rows.tobytes()).hexdigest()}


def test_from_embeddings_reads_a_file_in_blocks_and_copies_it(vectors_file, tmp_path):
    x, path = vectors_file
    passages = [Passage(f"p{i}", "", f"t{i}") for i in range(N)]
    from_file = KnowledgeBase.from_embeddings(passages, path, {"name": "x"}, tmp_path / "a", index="flat", show_progress=False)
    from_array = KnowledgeBase.from_embeddings(passages, x, {"name": "x"}, tmp_path / "b", index="flat", show_progress=False)
    assert from_file.version == from_array.version  # the same bytes, hence the same id
    assert (tmp_path / "a" / "embeddings.npy").stat().st_ino != path.stat().st_ino  # the caller's file is never shared
