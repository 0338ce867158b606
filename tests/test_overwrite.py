"""`overwrite=True` / `--overwrite` replaces only the writer's own kind of directory: never a file, never other data.

One test per writer (knowledge bases, BM25 indexes, saved TextEncoders) plus the shared `rag.utils.io.atomic_directory`
they all go through. Each checks that the refused target is left byte for byte as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from rag.knowledge.bm25 import BM25Index, is_bm25_index
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import MANIFEST, is_knowledge_base
from rag.knowledge.passages import Passage
from rag.utils.errors import OutputExistsError, RagError
from rag.utils.io import atomic_directory, check_output_dir

ENC = {"name": "hand-set", "fingerprint": "f" * 64, "dim": 4, "pooling": "cls", "normalize": False}
PASSAGES = [Passage(f"p{i}", f"title {i}", f"text number {i} about element {i}") for i in range(6)]
EMB = np.eye(6, 4, dtype=np.float32) + 0.1


def _snapshot(path: Path) -> dict:
    """Every file under `path` (or `path` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def _user_data(tmp_path: Path) -> tuple[Path, Path]:
    """A user's corpus file and a folder of their documents."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"title": "a", "text": "precious data"}\n')
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "n1.txt").write_text("my notes")
    (folder / "sub").mkdir()
    (folder / "sub" / "n2.txt").write_text("more notes")
    return corpus, folder


def _is_mine(path: Path) -> bool:
    return (path / "MINE").is_file()


# ------------------------------------------------------------------------------------- rag.utils.io


def test_atomic_directory_replaces_only_what_the_predicate_recognises(tmp_path):
    corpus, folder = _user_data(tmp_path)
    before = {p: _snapshot(p) for p in (corpus, folder)}
    for target in (corpus, folder):
        with pytest.raises(OutputExistsError, match="never|not a widget"):
            with atomic_directory(target, overwrite=True, replaces=_is_mine, kind="widget") as tmp:
                (tmp / "MINE").write_text("new")
        assert _snapshot(target) == before[target]
    assert not list(tmp_path.glob(".*tmp-*")), "the refused write left its temporary directory behind"

    own = tmp_path / "own"
    with atomic_directory(own, replaces=_is_mine, kind="widget") as tmp:
        (tmp / "MINE").write_text("v1")
    with pytest.raises(OutputExistsError, match="already exists.*--overwrite"):  # no overwrite asked
        with atomic_directory(own, replaces=_is_mine, kind="widget"):
            pass
    with atomic_directory(own, overwrite=True, replaces=_is_mine, kind="widget") as tmp:
        (tmp / "MINE").write_text("v2")
    assert (own / "MINE").read_text() == "v2"

    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_directory(empty, replaces=_is_mine, kind="widget") as tmp:  # an empty directory holds nothing to lose
        (tmp / "MINE").write_text("x")
    assert _is_mine(empty)


def test_a_second_writer_of_the_same_target_leaves_the_first_ones_partial_directory_alone(tmp_path):
    """Two builds of one target at once (two first runs rebuilding the demo knowledge base): the second's clean-up of
    killed builds' leftovers once deleted the first's directory while it was being written. A leftover that no live
    writer holds is still removed."""
    target = tmp_path / "kb"
    leftover = tmp_path / ".kb.tmp-killed"  # a killed writer's partial directory: nobody holds it
    leftover.mkdir()
    with atomic_directory(target, overwrite=True, replaces=_is_mine, kind="widget") as first:
        (first / "MINE").write_text("first")
        with atomic_directory(target, overwrite=True, replaces=_is_mine, kind="widget") as second:
            assert (first / "MINE").read_text() == "first"
            assert not leftover.exists()
            (second / "MINE").write_text("second")
        assert (target / "MINE").read_text() == "second"
    assert (target / "MINE").read_text() == "first"  # the last to finish replaced the other, whole
    assert not list(tmp_path.glob(".kb.tmp-*")) and not list(tmp_path.glob(".kb.old-*"))


def test_a_file_is_never_replaced_even_without_a_predicate(tmp_path):
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(OutputExistsError, match="is a file"):
        check_output_dir(f, overwrite=True)
    assert f.read_text() == "data"


def test_a_symlink_to_an_own_directory_is_replaced_without_touching_its_target(tmp_path):
    real = tmp_path / "real"
    with atomic_directory(real, replaces=_is_mine) as tmp:
        (tmp / "MINE").write_text("v1")
    link = tmp_path / "link"
    link.symlink_to(real)
    with atomic_directory(link, overwrite=True, replaces=_is_mine) as tmp:
        (tmp / "MINE").write_text("v2")
    assert (real / "MINE").read_text() == "v1" and not link.is_symlink() and (link / "MINE").read_text() == "v2"


def test_an_output_that_cannot_be_created_is_refused_up_front(tmp_path):
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(RagError, match="is a file, so no directory can be created"):
        check_output_dir(f / "out")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(RagError, match="cannot create a directory in"):
                check_output_dir(ro / "out")
        finally:
            ro.chmod(0o700)


# ------------------------------------------------------------------------------------- knowledge bases


def test_knowledge_base_overwrite_replaces_a_knowledge_base_only(tmp_path):
    corpus, folder = _user_data(tmp_path)
    foreign = tmp_path / "webapp"  # has a manifest.json, but not a knowledge base's
    foreign.mkdir()
    (foreign / MANIFEST).write_text(json.dumps({"name": "my web app", "icons": []}))
    for target in (corpus, folder, foreign):
        before = _snapshot(target)
        with pytest.raises(OutputExistsError, match="knowledge base"):
            KnowledgeBase.from_embeddings(PASSAGES, EMB, ENC, target, index="flat", overwrite=True, show_progress=False)
        assert _snapshot(target) == before and not is_knowledge_base(target)

    kb_dir = tmp_path / "kb"
    KnowledgeBase.from_embeddings(PASSAGES, EMB, ENC, kb_dir, index="flat", show_progress=False)
    assert is_knowledge_base(kb_dir)
    kb = KnowledgeBase.from_embeddings(PASSAGES[:3], EMB[:3], ENC, kb_dir, index="flat", overwrite=True, show_progress=False)
    assert len(KnowledgeBase.open(kb_dir)) == 3 == len(kb)


def test_knowledge_base_build_checks_its_output_before_encoding(tmp_path, tiny_bert_dir):
    from rag.knowledge.encoders import TextEncoder

    class CountingEncoder(TextEncoder):
        calls = 0

        def encode_passages(self, *a, **kw):
            CountingEncoder.calls += 1
            return super().encode_passages(*a, **kw)

    enc = CountingEncoder(tiny_bert_dir, pooling="cls")
    _, folder = _user_data(tmp_path)
    with pytest.raises(OutputExistsError, match="not a knowledge base"):
        KnowledgeBase.build(PASSAGES, enc, folder, index="flat", overwrite=True, show_progress=False)
    with pytest.raises(RagError, match="unknown kind"):
        KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="bogus", show_progress=False)
    with pytest.raises(RagError, match="pq_m=7 does not divide the dimension 32"):  # needs the encoder's dim
        KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="ivf_pq:pq_m=7", show_progress=False)
    with pytest.raises(RagError, match="cannot train on 6 vectors"):  # needs the passage count
        KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="ivf_pq:nlist=64", show_progress=False)
    with pytest.raises(RagError, match="batch_size"):
        KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="flat", batch_size=0, show_progress=False)
    with pytest.raises(RagError, match="cuda:7"):
        KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="flat", device="cuda:7", show_progress=False)
    assert CountingEncoder.calls == 0
    KnowledgeBase.build(PASSAGES, enc, tmp_path / "kb", index="flat", show_progress=False)
    assert CountingEncoder.calls == 1


# ------------------------------------------------------------------------------------- BM25 indexes and encoders


def test_bm25_overwrite_replaces_a_bm25_index_only(tmp_path):
    index = BM25Index.build(PASSAGES, show_progress=False)
    _, folder = _user_data(tmp_path)
    before = _snapshot(folder)
    with pytest.raises(OutputExistsError, match="not a BM25 index"):
        index.save(folder, overwrite=True)
    assert _snapshot(folder) == before

    out = tmp_path / "bm25"
    BM25Index.build(PASSAGES[:2], show_progress=False).save(out)
    assert is_bm25_index(out) and not is_bm25_index(folder)
    index.save(out, overwrite=True)
    assert BM25Index.load(out).search(["element"], 6)[1].shape == (1, 6)


def test_text_encoder_save_never_replaces_a_file(tmp_path, tiny_bert_dir):
    from rag.knowledge.encoders import TextEncoder

    enc = TextEncoder(tiny_bert_dir, pooling="cls")
    corpus, folder = _user_data(tmp_path)
    with pytest.raises(OutputExistsError, match="is a file"):
        enc.save_pretrained(corpus, overwrite=True)
    before = _snapshot(folder)
    with pytest.raises(RagError, match="not a saved TextEncoder"):  # without overwrite=True: another tool's directory
        enc.save_pretrained(folder)
    assert _snapshot(folder) == before and _snapshot(corpus) == {".": b'{"title": "a", "text": "precious data"}\n'}
    enc.save_pretrained(tmp_path / "enc")
    enc.save_pretrained(tmp_path / "enc")  # an earlier save is replaced without asking
    assert TextEncoder(tmp_path / "enc").identity()["fingerprint"] == enc.identity()["fingerprint"]


def test_atomic_outputs_get_the_permissions_a_plain_write_would(tmp_path):
    """tempfile makes 0600 files and 0700 directories: knowledge bases and models written through them were unreadable
    by the other users of a machine (a serving account, Ray actors under another user)."""
    import stat

    from rag.utils.io import atomic_write_text, process_umask

    old = os.umask(0o022)
    try:
        assert process_umask() == 0o022
        atomic_write_text(tmp_path / "a.json", "{}")
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
        with atomic_directory(tmp_path / "kb") as tmp:
            atomic_write_text(tmp / "manifest.json", "{}")
        assert stat.S_IMODE((tmp_path / "kb").stat().st_mode) == 0o755
        assert stat.S_IMODE((tmp_path / "kb" / "manifest.json").stat().st_mode) == 0o644
        os.chmod(tmp_path / "a.json", 0o600)  # a file the user restricted keeps its mode when rewritten
        atomic_write_text(tmp_path / "a.json", "[]")
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o600
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.json", "{}")
        assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600
    finally:
        os.umask(old)
