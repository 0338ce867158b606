"""Sharded builds: `rag index build --shard i/N` + `rag index merge` give the knowledge base of a one-shot build."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from rag.cli import main
from rag.demo import CORPUS_PATH
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.shards import ShardSpec, merge_shards, parse_shard
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError

N = 3


def _build(out, encoder, *extra):
    argv = ["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", encoder, "--out", str(out), "--quiet",
            "--index", "hnsw:m=8", "--device", "cpu", *extra]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_dpr_context_dir):
    root = tmp_path_factory.mktemp("shards")
    _build(root / "one", tiny_dpr_context_dir)
    for i in (2, 0, 1):  # any order, as independent processes would finish
        _build(root / f"shard{i}", tiny_dpr_context_dir, "--shard", f"{i}/{N}")
    return root


def test_parse_shard_and_bounds():
    assert parse_shard("2/4") == ShardSpec(2, 4) and str(ShardSpec(2, 4)) == "2/4"
    for bad in ("4/4", "-1/4", "1", "a/b", "0/0"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)
    bounds = [ShardSpec(i, 3).bounds(10) for i in range(3)]
    assert bounds == [(0, 3), (3, 6), (6, 10)]


def test_merged_shards_equal_a_one_shot_build(built, tmp_path, capsys):
    shards = [built / f"shard{i}" for i in (1, 2, 0)]
    assert [len(KnowledgeBase.open(s)) for s in sorted(shards)] == [50, 50, 50]  # the 150 passages of the demo corpus (100 words,
    # a last piece under 20 words joining the passage before it)
    assert main(["index", "merge", str(tmp_path / "merged"), *map(str, shards), "--quiet"]) == 0
    assert "merged 3 shards" in capsys.readouterr().out
    one, merged = KnowledgeBase.open(built / "one"), KnowledgeBase.open(tmp_path / "merged")
    assert merged.index_spec == one.index_spec and merged.index_spec.kind == "hnsw" and len(merged) == len(one)
    assert merged.all_passages() == one.all_passages()  # same rows in the same order
    # The encoder batches passages by length, so a shard's batches differ from a one-shot build's: float rounding only
    np.testing.assert_allclose(merged.embeddings(), one.embeddings(), rtol=1e-5, atol=1e-6)
    q = np.random.default_rng(0).standard_normal((16, merged.dim)).astype(np.float32)
    s1, r1 = one.search(q, 5)
    s2, r2 = merged.search(q, 5)
    # HNSW is approximate and its graph depends on float rounding and faiss's thread schedule, so the two builds may
    # differ on a near-tie; both must find the exact top-5 of the (shared) rows, which scrambled rows would not.
    exact = np.argsort(-(q @ one.embeddings().T), axis=1, kind="stable")[:, :5]
    for rows in (r1, r2):
        assert np.mean([len(set(a) & set(b)) / 5 for a, b in zip(rows, exact)]) >= 0.9
    assert np.mean(r1[:, 0] == r2[:, 0]) >= 0.9
    same = r1 == r2
    np.testing.assert_allclose(s2[same], s1[same], rtol=1e-5, atol=1e-5)
    # the manifest guarantees of any build: every file checksummed, a content-addressed version (a re-merge reproduces it)
    assert set(merged.manifest.files) == set(one.manifest.files) and merged.verified == "full"
    again = merge_shards(tmp_path / "again", shards[::-1], show_progress=False)
    assert again.version == merged.version and again.manifest.files["embeddings.npy"] == merged.manifest.files["embeddings.npy"]
    assert [m["version"] for m in merged.manifest.build["merged_shards"]] == [KnowledgeBase.open(built / f"shard{i}").version
                                                                              for i in range(N)]
    assert not list(tmp_path.glob(".merged.*"))  # the scratch embeddings are gone


def test_missing_shard_or_shard_file_is_a_clear_error_and_writes_nothing(built, tmp_path):
    with pytest.raises(KnowledgeBaseError, match=r"shard\(s\) 1/3 missing: got 2 of 3"):
        merge_shards(tmp_path / "m", [built / "shard0", built / "shard2"], show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="given twice"):
        merge_shards(tmp_path / "m", [built / "shard0", built / "shard0", built / "shard2"], show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="not a shard"):
        merge_shards(tmp_path / "m", [built / "one", built / "shard0"], show_progress=False)
    damaged = tmp_path / "shard1"
    shutil.copytree(built / "shard1", damaged)
    (damaged / "embeddings.npy").unlink()
    with pytest.raises(IntegrityError, match="embeddings.npy"):
        merge_shards(tmp_path / "m", [built / "shard0", damaged, built / "shard2"], show_progress=False)
    assert main(["index", "merge", str(tmp_path / "m"), str(built / "shard0"), str(built / "shard2"), "--quiet"]) == 2
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.*"))


def test_killed_shard_is_refused_then_rebuilt_by_rerunning_it(built, tmp_path, tiny_dpr_context_dir):
    partial = tmp_path / "shard1"  # what a build killed before its final rename leaves: no manifest
    shutil.copytree(built / "shard1", partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(KnowledgeBaseError, match="manifest.json: missing"):
        merge_shards(tmp_path / "m", [built / "shard0", partial, built / "shard2"], show_progress=False)
    shutil.rmtree(partial)
    _build(partial, tiny_dpr_context_dir, "--shard", f"1/{N}")  # re-run the killed shard's command
    merged = merge_shards(tmp_path / "m", [built / "shard0", partial, built / "shard2"], show_progress=False)
    original = merge_shards(tmp_path / "original", [built / f"shard{i}" for i in range(N)], show_progress=False)
    assert merged.version == original.version  # the rebuilt shard holds exactly what the killed one would have


def test_shards_of_another_split_or_corpus_are_refused(built, tmp_path, tiny_dpr_context_dir):
    _build(tmp_path / "half0", tiny_dpr_context_dir, "--shard", "0/2")
    with pytest.raises(KnowledgeBaseError, match="number of shards"):
        merge_shards(tmp_path / "m", [tmp_path / "half0", built / "shard1", built / "shard2"], show_progress=False)
    assert main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", tiny_dpr_context_dir, "--out",
                 str(tmp_path / "x"), "--shard", "3/3", "--quiet"]) == 2


def _tampered(built, tmp_path, i: int, edit):
    """A copy of shard `i` whose manifest's build.shard record `edit` changed (the manifest is not among its own checksums)."""
    import json

    copy = tmp_path / f"shard{i}"
    shutil.copytree(built / f"shard{i}", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest["build"]["shard"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.update(count=10**9), r"build\.shard\.count is 1000000000, not an integer between 1 and corpus_passages"),
    (lambda s: s.update(count="3"), r"build\.shard\.count is '3'"),
    (lambda s: s.pop("count"), r"build\.shard\.count is missing"),
    (lambda s: s.update(start=7), r"build\.shard\.start/stop are 7/"),
    (lambda s: s.update(index=5), r"build\.shard\.index is 5, not below count"),
    (lambda s: s.update(corpus_digest=None), r"build\.shard\.corpus_digest is 'None', not a SHA-256"),
    (lambda s: s.update(index_spec={"kind": "flat"}), r"build\.shard\.index_spec is \{'kind': 'flat'\}"),
])
def test_a_tampered_shard_record_is_refused_naming_the_field(built, tmp_path, capsys, edit, field):
    """Issue #28.7: a shard record is checked (types, ranges, rows) before use: no MemoryError, KeyError or TypeError."""
    bad = _tampered(built, tmp_path, 1, edit)
    with pytest.raises(IntegrityError, match=field):
        merge_shards(tmp_path / "m", [built / "shard0", bad, built / "shard2"], show_progress=False)
    code = main(["index", "merge", str(tmp_path / "m2"), str(built / "shard0"), str(bad), str(built / "shard2"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "unexpected" not in err and str(bad / "manifest.json") in err and "rebuild the shard" in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m2").exists()


def test_every_shard_claiming_a_huge_count_names_a_few_missing_ones(built, tmp_path):
    n = 10**9  # consistent records (start/stop of slice i of 10^9 passages) still leave 10^9 - 3 shards missing
    bad = [_tampered(built, tmp_path, i, lambda s, i=i: s.update(count=n, corpus_passages=n, start=i * n // n, stop=(i + 1)))
           for i in range(N)]
    with pytest.raises(KnowledgeBaseError,
                       match=r"shard\(s\) 3/1000000000, 4/1000000000, .*, \.\.\. missing: got 3 of 1000000000"):
        merge_shards(tmp_path / "m", bad, show_progress=False)


def test_merge_without_verification_marks_its_result_unverified(built, tmp_path, capsys):
    """Issue #28.2: `merge --verify none` of a shard altered in place cannot come out as a verified knowledge base."""
    altered = tmp_path / "shard1"
    shutil.copytree(built / "shard1", altered)
    emb = altered / "embeddings.npy"
    data = bytearray(emb.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the vectors; the size is unchanged
    emb.write_bytes(bytes(data))
    shards = [str(built / "shard0"), str(altered), str(built / "shard2")]
    assert main(["index", "merge", str(tmp_path / "strict"), *shards, "--quiet"]) == 2  # --verify full refuses it
    assert "embeddings.npy" in capsys.readouterr().err
    for verify in ("none", "size"):
        out = tmp_path / f"merged-{verify}"
        assert main(["index", "merge", str(out), *shards, "--verify", verify, "--quiet"]) == 0
        said = capsys.readouterr().out
        kb = KnowledgeBase.open(out)  # its own files verify: they are what its manifest records ...
        assert kb.verified == "full" and kb.unverified_inputs
        assert kb.served_version == f"{kb.version}+unverified" and f"({kb.served_version})" in said  # ... but it is marked
        assert main(["index", "info", str(out)]) == 0
        info = capsys.readouterr().out
        assert f"version         {kb.version}+unverified" in info and "made from unverified inputs" in info
        assert kb.manifest.build["unverified_inputs"]["verify"] == verify
    clean = merge_shards(tmp_path / "clean", [built / f"shard{i}" for i in range(N)], verify="full", show_progress=False)
    assert not clean.unverified_inputs and clean.served_version == clean.version


def test_merge_refuses_a_spec_over_the_memory_limit_before_reading_the_shards(built, tmp_path, capsys):
    shards = [str(built / f"shard{i}") for i in range(N)]
    code = main(["index", "merge", str(tmp_path / "m"), *shards, "--index", "hnsw", "--max-memory", "4K", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--max-memory 4.0 KiB: a hnsw build of 150 vectors" in err[0]
    assert "must fit in RAM to be searched" in err[0] and not (tmp_path / "m").exists()
