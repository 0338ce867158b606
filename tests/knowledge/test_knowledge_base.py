"""KnowledgeBase: build / open round trip, integrity checks, atomic builds, versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import EMBEDDINGS, INDEX, MANIFEST
from rag.knowledge.passages import Passage
from rag.knowledge.retriever import DenseRetriever
from rag.utils.errors import CorpusError, IntegrityError, KnowledgeBaseError, RagError

ENC = {"name": "hand-set", "fingerprint": "f" * 64, "dim": 4, "pooling": "cls", "normalize": False}


def _toy(n: int = 6):
    passages = [Passage(f"p{i}", f"title {i}", f"text number {i}") for i in range(n)]
    emb = np.eye(n, 4, dtype=np.float32) * np.arange(1, n + 1, dtype=np.float32)[:, None]
    emb[4:] = [[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]][: n - 4]
    return passages, emb


@pytest.fixture
def toy_kb(tmp_path) -> KnowledgeBase:
    passages, emb = _toy()
    return KnowledgeBase.from_embeddings(passages, emb, ENC, tmp_path / "kb", index="flat", show_progress=False)


@pytest.fixture(scope="module")
def bert_encoder(tiny_bert_dir):
    from rag.knowledge.encoders import TextEncoder

    return TextEncoder(tiny_bert_dir, pooling="cls")


def test_exact_search_on_hand_set_embeddings(toy_kb):
    q = np.array([[0, 0, 1, 0], [1, 1, 0, 0]], dtype=np.float32)
    scores, rows = toy_kb.search(q, 3)
    assert rows[0].tolist()[0] == 2 and scores[0, 0] == pytest.approx(3.0)
    # [1,1,0,0]·p1=2, ·p0=1, ·p4=1 -> p1 first, then the two ties
    assert rows[1, 0] == 1 and scores[1].tolist() == pytest.approx([2.0, 1.0, 1.0])
    emb = toy_kb.get_embeddings(torch.from_numpy(rows))
    assert emb.shape == (2, 3, 4)
    # recomputed doc scores (RAG's q · doc_embeds) equal the index scores
    recomputed = torch.einsum("bd,bkd->bk", torch.from_numpy(q), emb)
    assert torch.allclose(recomputed, torch.from_numpy(scores))
    ps = toy_kb.get_passages(rows)
    assert ps[0][0] == Passage("p2", "title 2", "text number 2")


def test_a_search_pool_answers_search_for_its_own_version_only(toy_kb):
    """use_search_pool: search goes to the pool (validated first, as local search is); a pool over another version is
    refused; None searches locally again."""
    q = np.array([[0, 0, 1, 0]], dtype=np.float32)
    local = toy_kb.search(q, 2)
    asked = []

    class Pool:
        version = toy_kb.version

        def search(self, query, k):
            asked.append((query.shape, k))
            return local

    toy_kb.use_search_pool(Pool())
    assert toy_kb.search(q, 2) is local and asked == [((1, 4), 2)]
    with pytest.raises(KnowledgeBaseError, match="dim=4"):
        toy_kb.search(np.zeros((1, 3), np.float32), 2)
    assert len(asked) == 1
    stale = Pool()
    stale.version = "kb-000000000000"
    with pytest.raises(KnowledgeBaseError, match="serves knowledge base kb-000000000000"):
        toy_kb.use_search_pool(stale)
    toy_kb.use_search_pool(None)
    np.testing.assert_array_equal(toy_kb.search(q, 2)[1], local[1])
    assert len(asked) == 1


def test_manifest_records_what_was_built(toy_kb):
    m = json.loads((toy_kb.path / MANIFEST).read_text())
    assert m["format_version"] == 1 and m["count"] == 6 and m["dim"] == 4 and m["metric"] == "ip"
    assert m["encoder"]["fingerprint"] == ENC["fingerprint"]
    assert m["index"]["kind"] == "flat" and m["version"].startswith("kb-")
    assert {EMBEDDINGS, INDEX} <= set(m["files"]) and any(f.startswith("passages/") for f in m["files"])
    assert all(len(v["sha256"]) == 64 for v in m["files"].values())
    assert m["created"].endswith("+00:00")


def test_version_is_content_addressed(tmp_path):
    passages, emb = _toy()
    a = KnowledgeBase.from_embeddings(passages, emb, ENC, tmp_path / "a", index="flat", show_progress=False)
    b = KnowledgeBase.from_embeddings(passages, emb, ENC, tmp_path / "b", index="flat", show_progress=False)
    emb2 = emb.copy()
    emb2[0, 0] += 1
    c = KnowledgeBase.from_embeddings(passages, emb2, ENC, tmp_path / "c", index="flat", show_progress=False)
    assert a.version == b.version != c.version


def test_open_round_trip_with_real_encoder(tmp_path, bert_encoder, demo_passages):
    kb = KnowledgeBase.build(demo_passages[:40], bert_encoder, tmp_path / "kb", index="hnsw", show_progress=False)
    reopened = KnowledgeBase.open(tmp_path / "kb")
    q = bert_encoder.encode(["what is the atomic number of argon?", "lightest element"], show_progress=False)
    s1, r1 = kb.search(q, 5)
    s2, r2 = reopened.search(q, 5)
    assert np.array_equal(r1, r2) and np.allclose(s1, s2)
    assert reopened.encoder["fingerprint"] == bert_encoder.identity()["fingerprint"]
    assert len(reopened) == 40 and reopened.dim == bert_encoder.dim
    np.testing.assert_allclose(np.asarray(reopened.embeddings()),
                               bert_encoder.encode_passages(demo_passages[:40], show_progress=False), atol=1e-5)


@pytest.mark.parametrize("target", [EMBEDDINGS, INDEX, "passages"])
def test_flipped_byte_is_detected(toy_kb, target):
    path = toy_kb.path / target
    if path.is_dir():
        path = next(p for p in sorted(path.iterdir()) if p.suffix == ".arrow")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=path.name):
        KnowledgeBase.open(toy_kb.path)


def test_truncated_file_is_detected_even_by_size_check(toy_kb):
    path = toy_kb.path / INDEX
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match="truncated"):
        KnowledgeBase.open(toy_kb.path, verify="size")


def test_missing_manifest_and_missing_dir(tmp_path, toy_kb):
    with pytest.raises(KnowledgeBaseError, match="no such knowledge-base directory"):
        KnowledgeBase.open(tmp_path / "nope")
    (toy_kb.path / MANIFEST).unlink()
    with pytest.raises(KnowledgeBaseError, match="manifest.json"):
        KnowledgeBase.open(toy_kb.path)


def test_bad_corpus_inputs(tmp_path):
    with pytest.raises(CorpusError, match="empty"):
        KnowledgeBase.from_embeddings([], np.zeros((0, 4), np.float32), ENC, tmp_path / "kb", index="flat")
    dup = [Passage("x", "", "a"), Passage("x", "", "b")]
    with pytest.raises(CorpusError, match="duplicate passage id 'x'"):
        KnowledgeBase.from_embeddings(dup, np.ones((2, 4), np.float32), ENC, tmp_path / "kb", index="flat")
    with pytest.raises(RagError, match="NaN"):
        KnowledgeBase.from_embeddings([Passage("a", "", "a")], np.full((1, 4), np.nan, np.float32), ENC, tmp_path / "kb",
                                      index="flat")
    assert not (tmp_path / "kb").exists()


def test_query_dimension_and_k_are_checked(toy_kb):
    with pytest.raises(KnowledgeBaseError, match="dim=4"):
        toy_kb.search(np.zeros((1, 5), np.float32), 1)
    for k in (0, 7, -1):
        with pytest.raises(RagError, match="between 1 and"):
            toy_kb.search(np.zeros((1, 4), np.float32), k)


def test_retriever_rejects_encoder_of_other_dimension(toy_kb, bert_encoder):
    with pytest.raises(KnowledgeBaseError, match="dim=4"):
        DenseRetriever(toy_kb, bert_encoder)


def test_dense_retriever_returns_stored_embeddings(tmp_path, bert_encoder, demo_passages):
    kb = KnowledgeBase.build(demo_passages[:30], bert_encoder, tmp_path / "kb", index="flat", show_progress=False)
    r = DenseRetriever(kb, bert_encoder).retrieve(["symbol of gold", "noble gas"], 4)
    assert r.rows.shape == (2, 4) and r.doc_embeds.shape == (2, 4, bert_encoder.dim)
    assert r.kb_version == kb.version
    q = torch.from_numpy(bert_encoder.encode(["symbol of gold", "noble gas"], show_progress=False))
    assert torch.allclose(torch.einsum("bd,bkd->bk", q, r.doc_embeds), r.scores, atol=1e-4)
    assert r.passages[0] == kb.get_passages(r.rows[:1])[0]


def test_dense_retriever_is_a_retriever(tmp_path, bert_encoder, demo_passages):
    from rag.knowledge.types import Retriever

    kb = KnowledgeBase.build(demo_passages[:10], bert_encoder, tmp_path / "kb", index="flat", show_progress=False)
    r = DenseRetriever(kb, bert_encoder)
    assert isinstance(r, Retriever) and r.kb_version == kb.version and r.knowledge_base is kb


def test_add_writes_a_new_version_and_leaves_the_old_one(tmp_path, bert_encoder, demo_passages):
    old = KnowledgeBase.build(demo_passages[:20], bert_encoder, tmp_path / "v1", index="flat", show_progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "v1").rglob("*") if p.is_file()}
    new = old.add(demo_passages[20:25], bert_encoder, tmp_path / "v2", show_progress=False)
    after = {p.name: p.read_bytes() for p in (tmp_path / "v1").rglob("*") if p.is_file()}
    assert before == after
    assert len(new) == 25 and new.manifest.parent == old.version and new.version != old.version
    assert KnowledgeBase.open(tmp_path / "v1").version == old.version
    with pytest.raises(CorpusError, match="already exist"):
        new.add(demo_passages[:1], bert_encoder, tmp_path / "v3")


def test_add_refuses_a_different_encoder(tmp_path, bert_encoder, tiny_dpr_context_dir, demo_passages):
    from rag.knowledge.encoders import TextEncoder

    old = KnowledgeBase.build(demo_passages[:5], bert_encoder, tmp_path / "v1", index="flat", show_progress=False)
    with pytest.raises(KnowledgeBaseError, match="not the one that built"):
        old.add(demo_passages[5:6], TextEncoder(tiny_dpr_context_dir), tmp_path / "v2")


def test_existing_output_needs_overwrite(toy_kb):
    passages, emb = _toy()
    with pytest.raises(FileExistsError, match="overwrite"):
        KnowledgeBase.from_embeddings(passages, emb, ENC, toy_kb.path, index="flat")
    kb = KnowledgeBase.from_embeddings(passages[:5], emb[:5], ENC, toy_kb.path, index="flat", overwrite=True, show_progress=False)
    assert len(KnowledgeBase.open(toy_kb.path)) == 5 and len(kb) == 5


def test_killed_build_leaves_nothing_open_accepts_and_rerun_succeeds(tmp_path):
    """SIGKILL a build after its index is written but before the rename."""
    out = tmp_path / "kb"
    child = textwrap.dedent(
        f"""
        import time, numpy as np
        import rag.knowledge.knowledge_base as kbm
        from rag.knowledge.passages import Passage
        real = kbm.write_index
        def slow(index, path):
            real(index, path)
            print("written", flush=True)
            time.sleep(60)
        kbm.write_index = slow
        ps = [Passage(f"p{{i}}", "", "t") for i in range(50)]
        kbm.KnowledgeBase.from_embeddings(ps, np.random.rand(50, 8).astype("float32"), {{"name": "x"}}, {str(out)!r},
                                          index="flat", show_progress=False)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not out.exists()
    leftovers = list(tmp_path.glob(".kb.tmp-*"))
    assert leftovers, "the partial build should be in a hidden temp dir"
    with pytest.raises(KnowledgeBaseError):
        KnowledgeBase.open(out)
    for d in leftovers:
        with pytest.raises(KnowledgeBaseError):
            KnowledgeBase.open(d)
    ps = [Passage(f"p{i}", "", "t") for i in range(50)]
    KnowledgeBase.from_embeddings(ps, np.random.rand(50, 8).astype("float32"), {"name": "x"}, out, index="flat",
                                  show_progress=False)
    assert len(KnowledgeBase.open(out)) == 50 and not list(tmp_path.glob(".kb.tmp-*"))


@pytest.mark.parametrize("entry", ["../outside.bin", "/etc/hostname", "passages/../../outside.bin", "link.bin"])
def test_manifest_file_entries_never_leave_the_directory(toy_kb, entry):
    """A manifest is input: a file entry that points outside the knowledge base (.., absolute, or a link) is refused."""
    root = Path(toy_kb.path)
    (root.parent / "outside.bin").write_bytes(b"x" * 8)
    (root / "link.bin").symlink_to(root.parent / "outside.bin")
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"][entry] = {"sha256": "0" * 64, "bytes": 8}
    (root / MANIFEST).write_text(json.dumps(manifest))
    for verify in ("full", "size"):
        with pytest.raises(IntegrityError, match="outside"):
            KnowledgeBase.open(root, verify=verify)


def _rewrite_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    edit(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


def _rechecksum(root: Path, rel: str) -> None:
    """Update the manifest's record of `rel` to the file's current content (a consistent tampering)."""
    from rag.utils.checksums import file_checksums

    _rewrite_manifest(root, lambda m: m["files"].update(file_checksums(root, [root / rel])))


@pytest.mark.parametrize("edit, what", [
    (lambda m: m.update(files={}), "records no file checksums"),
    (lambda m: m["files"].pop(EMBEDDINGS), "records no checksum for ['embeddings.npy']"),
    (lambda m: m["files"].pop(INDEX), "records no checksum for ['index.faiss']"),
    (lambda m: m["files"].pop("passages/state.json"), "records no checksum for ['passages/state.json']"),
])
def test_verification_covers_every_file_open_reads(toy_kb, edit, what):
    """Emptying or trimming the manifest's records cannot make verification vacuous: a corrupted file whose
    record was removed is refused, by the full and the size check alike."""
    root = Path(toy_kb.path)
    emb = root / EMBEDDINGS
    data = bytearray(emb.read_bytes())
    data[-1] ^= 0x01
    emb.write_bytes(bytes(data))
    _rewrite_manifest(root, edit)
    for verify in ("full", "size"):
        with pytest.raises(IntegrityError) as e:
            KnowledgeBase.open(root, verify=verify)
        assert what in str(e.value) and str(root / MANIFEST) in str(e.value)


def test_unrecorded_file_in_a_loaded_directory_is_refused(tmp_path, bert_encoder, demo_passages):
    kb = KnowledgeBase.build(demo_passages[:8], bert_encoder, tmp_path / "kb", index="flat", bm25=True, show_progress=False)
    for extra in ("passages/extra.arrow", "bm25/extra.json"):
        (kb.path / extra).write_bytes(b"{}")
        with pytest.raises(IntegrityError, match=f"records no checksum for \\['{extra}'\\]"):
            KnowledgeBase.open(kb.path, verify="size")
        (kb.path / extra).unlink()
    assert len(KnowledgeBase.open(kb.path)) == 8


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_embeddings_are_refused_at_open(toy_kb, value, monkeypatch):
    """A knowledge base whose records agree with NaN/Inf embeddings (written by another tool, or re-checksummed)
    is refused on opening; the check reads the memory map in blocks (forced small here)."""
    import rag.knowledge.manifest as kbm

    root = Path(toy_kb.path)
    emb = np.load(root / EMBEDDINGS)
    emb[5, 2] = value
    np.save(root / EMBEDDINGS, emb)
    _rechecksum(root, EMBEDDINGS)
    monkeypatch.setattr(kbm, "_FINITE_CHUNK", 16)  # one row per block: the bad row is found in a later block
    for verify in ("full", "size"):
        with pytest.raises(IntegrityError, match="row 5 holds NaN or inf"):
            KnowledgeBase.open(root, verify=verify)
    assert KnowledgeBase.open(root, verify="none").verified == "none"  # "none" trusts the directory


def test_passages_data_file_names_stay_inside(toy_kb):
    """passages/state.json names the Arrow files datasets reads: a name leaving the directory is refused, even when
    the manifest's records were updated to match."""
    root = Path(toy_kb.path)
    state = root / "passages" / "state.json"
    data = json.loads(state.read_text())
    data["_data_files"][0]["filename"] = "../../outside.arrow"
    state.write_text(json.dumps(data))
    _rechecksum(root, "passages/state.json")
    with pytest.raises(IntegrityError, match="outside"):
        KnowledgeBase.open(root)


def _forge_passage(root: Path, old: bytes, new: bytes) -> None:
    """Edit one passage's text inside the stored Arrow file and update the manifest's record of that file."""
    [arrow] = (root / "passages").glob("*.arrow")
    data = arrow.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    arrow.write_bytes(data.replace(old, new))
    _rechecksum(root, str(arrow.relative_to(root)))


@pytest.mark.parametrize("forge", [
    lambda root: _forge_passage(root, b"text number 3", b"text number 9"),
    lambda root: _rewrite_manifest(root, lambda m: m["encoder"].update(fingerprint="e" * 64)),
    lambda root: _rewrite_manifest(root, lambda m: m["index"].update(kind="hnsw")),
])
def test_a_forged_knowledge_base_is_refused_under_the_genuine_id(toy_kb, forge):
    """Content changed after the build with every file record made to match (passages edited, the encoder or the
    index spec rewritten) no longer gives the recorded id: a full open recomputes it and refuses, naming both ids."""
    root, genuine = Path(toy_kb.path), toy_kb.version
    forge(root)
    with pytest.raises(IntegrityError) as e:
        KnowledgeBase.open(root)
    message = str(e.value)
    assert f"records version {genuine} but its content gives kb-" in message and str(root / MANIFEST) in message
    assert "\n" not in message
    assert KnowledgeBase.open(root, verify="size").served_version == f"{genuine}+unverified"


def test_a_self_consistent_rewrite_gets_a_new_id(toy_kb):
    """What the id proves: a writer of the folder can make a new knowledge base whose records all agree, but it then
    carries the id of its own content, never the id of the one it replaced; the recorded passages digest is checked too."""
    from rag.knowledge.manifest import content_version, passages_digest

    root, genuine = Path(toy_kb.path), toy_kb.version
    _forge_passage(root, b"text number 3", b"text number 9")
    edited = [Passage(f"p{i}", f"title {i}", f"text number {9 if i == 3 else i}") for i in range(6)]
    m = json.loads((root / MANIFEST).read_text())
    new_id = content_version(passages_digest(edited), m["files"][EMBEDDINGS]["sha256"], m["index"], m["encoder"])
    _rewrite_manifest(root, lambda m: m.update(version=new_id))
    with pytest.raises(IntegrityError, match="records passages digest .* but the passages give"):
        KnowledgeBase.open(root)
    _rewrite_manifest(root, lambda m: m.update(passages_digest=passages_digest(edited)))
    kb = KnowledgeBase.open(root)
    assert kb.served_version == new_id != genuine
    assert kb.get_passages(np.array([[3]]))[0][0].text == "text number 9"


def test_recheck_of_a_size_checked_open_recomputes_the_id(toy_kb):
    """A knowledge base opened with verify='size' and re-checked in full (a swap back) gets its id recomputed too."""
    root = Path(toy_kb.path)
    _forge_passage(root, b"text number 3", b"text number 9")
    kb = KnowledgeBase.open(root, verify="size")
    with pytest.raises(IntegrityError, match=f"records version {toy_kb.version} but its content gives"):
        kb.recheck("full")
    assert kb.verified == "size"


def test_the_stored_passages_digest_is_the_builds(tmp_path, monkeypatch):
    """The digest computed in Arrow at open equals the build's over Passage objects, with non-ASCII text and many
    blocks."""
    import datasets

    import rag.knowledge.manifest as kbm

    passages = [Passage(f"p{i}", f"tïtle {i}", "Zürich — " * (i % 5) + f"text {i} ☃") for i in range(50)]
    ds = datasets.Dataset.from_dict({"id": [p.id for p in passages], "title": [p.title for p in passages],
                                     "text": [p.text for p in passages]})
    ds.save_to_disk(str(tmp_path / "p"))
    table = datasets.load_from_disk(str(tmp_path / "p")).data.table
    for rows in (7, 65536):
        monkeypatch.setattr(kbm, "_DIGEST_ROWS", rows)
        assert kbm.stored_passages_digest(table, tmp_path / "p") == kbm.passages_digest(passages)


def test_a_swap_to_a_forged_copy_is_refused(tmp_path, bert_encoder, demo_passages):
    """`POST /admin/swap` opens through KnowledgeBaseSlot.swap: a copy with one passage edited and its record updated
    is refused, naming both ids, and the genuine version keeps serving."""
    import shutil

    from rag.knowledge.hotswap import KnowledgeBaseSlot

    kb = KnowledgeBase.build(demo_passages[:8], bert_encoder, tmp_path / "genuine", index="flat", show_progress=False)
    forged = tmp_path / "forged"
    shutil.copytree(kb.path, forged)
    text = demo_passages[2].text.encode()
    _forge_passage(forged, text, text[:-1] + (b"X" if text[-1:] != b"X" else b"Y"))
    slot = KnowledgeBaseSlot(DenseRetriever(kb, bert_encoder), verify_nice=None)
    with pytest.raises(IntegrityError, match=f"swap refused, still serving {kb.version}: .*records version {kb.version} "
                                             f"but its content gives kb-"):
        slot.swap(forged)
    assert slot.version == kb.version and slot.swap_count == 0
