"""Hot-swapping the knowledge base of BM25 retrieval (RAG-BM25): the BM25 index moves with it.

Knowledge bases A and B hold the same passage ids; texts are tagged "[A]" / "[B]" and B's
passage p3 mentions "zirconium", which no passage of A does, so both the ranking and the
passages show which BM25 index and which passages answered.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from rag.knowledge.bm25 import BM25Retriever
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.knowledge.retriever_kinds import retriever_for_kind
from rag.utils.errors import IntegrityError, KnowledgeBaseError

N = 12
ZR = "zirconium"


def _passages(demo_passages, tag: str) -> list[Passage]:
    out = [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in demo_passages[:N]]
    if tag == "B":
        out[3] = Passage(out[3].id, out[3].title, out[3].text + " It is alloyed with zirconium.")
    return out


def _tags(retrieved) -> set[str]:
    return {p.text[1] for ps in retrieved.passages for p in ps}


@pytest.fixture(scope="module")
def kbs(tmp_path_factory, demo_passages, tiny_dpr_context_dir):
    from rag.knowledge.encoders import TextEncoder

    root = tmp_path_factory.mktemp("bm25_swap")
    enc = TextEncoder(tiny_dpr_context_dir)
    out = {}
    for tag, bm25 in (("A", True), ("B", True), ("C", False)):
        kb = KnowledgeBase.build(_passages(demo_passages, tag), enc, root / f"kb_{tag}", index="flat", bm25=bm25,
                                 show_progress=False)
        out[tag], out[kb.version] = str(kb.path), tag
    # D: another embedding dimension and encoder; BM25 does not use embeddings, so it may serve
    rng = np.random.default_rng(0)
    d = KnowledgeBase.from_embeddings(_passages(demo_passages, "D"), rng.standard_normal((N, 8)).astype(np.float32),
                                      {"name": "other", "dim": 8, "fingerprint": "other8"}, root / "kb_D",
                                      index="flat", bm25=True, show_progress=False)
    out["D"], out[d.version] = str(d.path), "D"
    corrupt = root / "kb_B_corrupt"
    shutil.copytree(root / "kb_B", corrupt)
    victim = max((f for f in (corrupt / "bm25").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte in the BM25 index
    victim.write_bytes(bytes(data))
    out["B_corrupt"] = str(corrupt)
    return out


@pytest.fixture()
def retriever(kbs):
    return retriever_for_kind("bm25", KnowledgeBase.open(kbs["A"]))


def test_swap_moves_the_bm25_index_with_the_knowledge_base(retriever, kbs):
    slot = KnowledgeBaseSlot(retriever)
    before = retriever.retrieve([ZR], k=2)
    assert kbs[before.kb_version] == "A" and _tags(before) == {"A"} and float(before.scores[0, 0]) == 0.0

    res = slot.swap(kbs["B"])
    kb_b = retriever.knowledge_base
    assert kbs[res.new_version] == "B" and kb_b.version == res.new_version and retriever.index is kb_b.bm25
    after = retriever.retrieve([ZR, "iron"], k=2)
    assert after.kb_version == res.new_version and _tags(after) == {"B"}
    assert after.passages[0][0].id == kb_b.get_passages(np.array([[3]]))[0][0].id and float(after.scores[0, 0]) > 0

    back = slot.swap_back()  # one call
    assert kbs[back.new_version] == "A" and retriever.kb_version == back.new_version
    assert _tags(retriever.retrieve([ZR], k=2)) == {"A"}


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("C", KnowledgeBaseError, "no BM25 index"),
        ("B_corrupt", IntegrityError, "SHA-256"),
        ("missing", KnowledgeBaseError, "no such knowledge-base directory"),
    ],
)
def test_failed_bm25_swap_keeps_the_old_index_serving(retriever, kbs, name, error, match, tmp_path):
    slot = KnowledgeBaseSlot(retriever)
    index, version = retriever.index, retriever.kb_version
    with pytest.raises(error, match=match) as info:
        slot.swap(kbs.get(name, str(tmp_path / "nope")))
    assert f"still serving {version}" in str(info.value)
    assert retriever.index is index and retriever.kb_version == version and slot.swap_count == 0
    assert _tags(retriever.retrieve(["iron"], k=3)) == {"A"}


def test_embedding_checks_do_not_apply_to_bm25(retriever, kbs):
    """Dimension, metric and encoder identity constrain dense retrieval only."""
    res = KnowledgeBaseSlot(retriever).swap(kbs["D"])
    assert kbs[res.new_version] == "D" and _tags(retriever.retrieve(["iron"], k=2)) == {"D"}


def test_build_missing_indexes_a_knowledge_base_without_bm25(kbs):
    kb_c = KnowledgeBase.open(kbs["C"])
    r = retriever_for_kind("bm25", kb_c, build_missing=True, show_progress=False)  # built in memory
    assert r.build_missing and r.knowledge_base is kb_c
    slot = KnowledgeBaseSlot(r)
    slot.swap(kbs["A"])  # stored index used
    assert r.index is r.knowledge_base.bm25 and _tags(r.retrieve(["iron"], k=2)) == {"A"}
    slot.swap(kbs["C"])  # none stored: built during the swap, before the lock
    assert r.knowledge_base.bm25 is None and _tags(r.retrieve(["iron"], k=2)) == {"C"}


def test_call_started_on_old_bm25_index_finishes_on_it(kbs, monkeypatch):
    parked, leave = threading.Event(), threading.Event()
    get_passages = KnowledgeBase.get_passages

    def gated(self, rows):  # park the first lookup on A, after its BM25 search
        if kbs[self.version] == "A" and not parked.is_set():
            parked.set()
            leave.wait(timeout=60)
        return get_passages(self, rows)

    monkeypatch.setattr(KnowledgeBase, "get_passages", gated)  # before the retriever binds kb.get_passages
    retriever = retriever_for_kind("bm25", KnowledgeBase.open(kbs["A"]))
    slot = KnowledgeBaseSlot(retriever, keep_loaded=0)
    va = retriever.kb_version
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=retriever.retrieve([ZR, "iron"], k=3)))
    t.start()
    try:
        assert parked.wait(timeout=60)
        res = slot.swap(kbs["B"])
        assert retriever.kb_version == res.new_version
        assert not slot.wait_released(timeout=0.2)  # A stays open while the call is on it
    finally:
        leave.set()
        t.join(timeout=60)
    assert out["r"].kb_version == va and _tags(out["r"]) == {"A"} and float(out["r"].scores[0, 0]) == 0.0
    assert slot.wait_released(timeout=60)  # ... and is released once it has finished
    assert _tags(retriever.retrieve([ZR], k=1)) == {"B"}


def test_lookup_of_a_knowledge_base_is_recognised(kbs):
    """RagModel builds BM25Retriever(kb.bm25, kb.get_passages, kb_version=...): the knowledge base is inferred."""
    kb = KnowledgeBase.open(kbs["A"])
    r = BM25Retriever(kb.bm25, kb.get_passages, kb_version=kb.version)
    assert r.knowledge_base is kb
    assert BM25Retriever.from_passages(KnowledgeBase.open(kbs["B"]).all_passages(), show_progress=False).knowledge_base is None


def test_rag_bm25_pipeline_swaps_its_index(kbs, tiny_dpr_question_dir, tiny_bart_dir):
    """A RAG-BM25 model behind a pipeline: answers and retrievals name and use the swapped-in version."""
    from rag.models.rag.model import RagModel
    from rag.pipeline.api import RagPipeline

    pipe = RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kbs["A"], retrieval="bm25", n_docs=2))
    slot = KnowledgeBaseSlot.for_model(pipe)
    assert kbs[slot.version] == "A"
    res = slot.swap(kbs["B"])
    assert pipe.kb_version == res.new_version and pipe.model.knowledge_base.version == res.new_version
    [hits] = pipe.retrieve([ZR], k=2)
    assert hits.kb_version == res.new_version and {p.text[1] for p in hits.passages} == {"B"}
    assert "zirconium" in hits.passages[0].text
    [ans] = pipe.generate([ZR], max_new_tokens=3)
    assert ans.kb_version == res.new_version and {p.text[1] for p in ans.passages} == {"B"}
    slot.swap_back()
    [ans] = pipe.generate([ZR], max_new_tokens=3)
    assert kbs[ans.kb_version] == "A" and {p.text[1] for p in ans.passages} == {"A"}
