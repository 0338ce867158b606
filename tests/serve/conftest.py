"""Fixtures of the serving tests: the tiny RAG model (tiny DPR + tiny BART) over small knowledge bases, the tiny random
GPT-2 over a BM25 knowledge base (a causal reader), and servers of either on a free loopback port.

Knowledge bases hold the same passage ids with texts tagged "[A]" / "[B]", so a response shows which version answered;
``kb_xss`` holds passages whose title and text carry markup that must never run in the page.
"""

from __future__ import annotations

import contextlib

import pytest
from serve_support import TOKEN, XSS_TEXT, XSS_TITLE, serving, tagged

import rag
from rag.knowledge.passages import Passage
from rag.serve.limits import ServeLimits


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, bpe_tokenizer) -> str:
    """The tests' tiny random GPT-2 (as tests/ralm's), saved and loaded back through from_pretrained."""
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=256), bpe_tokenizer, tmp_path_factory.mktemp("serve_gpt2"))


@pytest.fixture(scope="session")
def serve_layout(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir, tiny_bart_dir):
    """root/{kb_a, kb_b, kb_xss}: 12 demo passages each (BM25 and dense), a RAG model on kb_a (n_docs 3)."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.rag.model import RagModel

    base = tmp_path_factory.mktemp("serve_layout")
    root = base / "root"
    enc = TextEncoder(tiny_dpr_context_dir)
    ps = demo_passages[:12]
    kbs = {}
    for name, passages in (("kb_a", tagged(ps, "A")), ("kb_b", tagged(ps, "B")),
                           ("kb_xss", [Passage(p.id, XSS_TITLE if i == 0 else p.title, XSS_TEXT if i == 0 else p.text)
                                       for i, p in enumerate(tagged(ps, "X"))])):
        kbs[name] = KnowledgeBase.build(passages, enc, root / name, index="flat", bm25=True, query_encoder=tiny_dpr_question_dir,
                                        show_progress=False)
    model_dir = base / "model"
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, root / "kb_a", n_docs=3).save_pretrained(model_dir)
    return {"root": root, "model": str(model_dir), "kbs": kbs,
            "versions": {kbs["kb_a"].version: "A", kbs["kb_b"].version: "B", kbs["kb_xss"].version: "X"}}


@pytest.fixture(scope="module")
def rag_server(serve_layout):
    """``(base_url, app)`` of a server over the serve layout's RAG model, on a free loopback port, for the module."""
    with serving(rag.load(serve_layout["model"]), limits=ServeLimits(request_timeout=None)) as served:
        yield served


@pytest.fixture()
def start_server(serve_layout, tiny_gpt2_dir):
    """``start(kind="rag"|"causal", **create_app_kw) -> (base_url, app)``: a server of its own on a free loopback port,
    over a fresh pipeline, stopped after the test."""
    import rag
    from rag.serve.app import background_server, create_app

    with contextlib.ExitStack() as stack:
        def start(kind: str = "rag", **kw):
            if kind == "rag":
                pipe = rag.load(serve_layout["model"])
            else:
                pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=4, query_length=8,
                                max_length=96, doc_max_length=24)
            kw.setdefault("kb_roots", [serve_layout["root"]])
            kw.setdefault("admin_token", TOKEN)
            kw.setdefault("model_name", "tiny-" + kind)
            app = create_app(pipe, **kw)
            url = stack.enter_context(background_server(app))
            return url, app

        yield start
