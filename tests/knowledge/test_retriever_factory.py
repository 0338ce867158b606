"""One retriever factory and one knowledge-base resolver: every retriever over a knowledge base reports its served
version (``+unverified`` when opened without hashing), whichever path built it."""

from __future__ import annotations

import pytest

from rag.knowledge.encoders import TextEncoder
from rag.knowledge.knowledge_base import KnowledgeBase

QUESTIONS = ["Who discovered oxygen?", "Which element has symbol Na?"]


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory, demo_passages, tiny_dpr_context_dir):
    out = tmp_path_factory.mktemp("factory_kb") / "kb"
    KnowledgeBase.build(demo_passages[:20], TextEncoder(tiny_dpr_context_dir), out, index="flat", bm25=True,
                        show_progress=False)
    return out


def test_rag_bm25_model_over_a_size_verified_knowledge_base_reports_it_unverified(kb_dir, tiny_dpr_question_dir,
                                                                                   tiny_bart_dir):
    """Answer.kb_version promises "+unverified" for content opened without hashing; RAG-BM25 dropped it."""
    from rag.models.rag.model import RagModel

    kb = KnowledgeBase.open(kb_dir, verify="size")
    assert kb.served_version == f"{kb.version}+unverified"
    model = RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, retrieval="bm25", n_docs=2).eval()
    retrieved, _ = model.retrieve(QUESTIONS)
    assert retrieved.kb_version == model.retriever.kb_version == kb.served_version


@pytest.mark.parametrize("kind", ["bm25", "dense", "hybrid"])
def test_every_kind_reports_the_served_version_before_and_after_a_swap(kb_dir, tiny_dpr_question_dir, kind):
    from rag.knowledge.hotswap import KnowledgeBaseSlot
    from rag.knowledge.retriever_kinds import retriever_for_kind

    size = KnowledgeBase.open(kb_dir, verify="size")
    encoder = TextEncoder(tiny_dpr_question_dir)
    retriever = retriever_for_kind(kind, size, None if kind == "bm25" else encoder)
    assert retriever.retrieve(QUESTIONS, 2).kb_version == retriever.kb_version == f"{size.version}+unverified"
    KnowledgeBaseSlot(retriever).swap(kb_dir)  # a swap always hashes every file
    assert retriever.retrieve(QUESTIONS, 2).kb_version == size.version


def test_a_bm25_retriever_over_a_knowledge_base_cannot_report_another_version(kb_dir):
    from rag.knowledge.bm25 import BM25Retriever
    from rag.utils.errors import ConfigError

    kb = KnowledgeBase.open(kb_dir, verify="none")
    assert BM25Retriever(kb.bm25, kb.get_passages).kb_version == kb.served_version  # the knowledge base is inferred
    with pytest.raises(ConfigError, match="omit kb_version"):
        BM25Retriever(kb.bm25, kb.get_passages, kb.version, knowledge_base=kb)


def test_the_resolver_takes_a_knowledge_base_a_directory_or_a_name(kb_dir, monkeypatch):
    import rag.demo.kb
    from rag.demo.kb import KNOWLEDGE_BASE_NAMES, resolve_knowledge_base
    from rag.knowledge.resolve import open_knowledge_base
    from rag.utils.errors import ConfigError

    kb = KnowledgeBase.open(kb_dir)
    assert resolve_knowledge_base(kb) is kb
    assert resolve_knowledge_base(kb_dir, verify="size").served_version == f"{kb.version}+unverified"
    assert resolve_knowledge_base(str(kb_dir)).served_version == kb.version
    built = []
    monkeypatch.setattr(rag.demo.kb, "ensure_demo_kb", lambda **kw: built.append(kw) or kb)  # the demo's, built on use
    assert list(KNOWLEDGE_BASE_NAMES) == ["demo"] and resolve_knowledge_base("demo") is kb and built == [
        {"show_progress": False}]
    with pytest.raises(ConfigError, match="knowledge_base must be"):
        resolve_knowledge_base(3)
    with pytest.raises(Exception, match="demo"):  # this layer knows no names: "demo" is a directory here
        open_knowledge_base("demo")
