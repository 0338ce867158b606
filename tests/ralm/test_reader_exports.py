"""One export format and one loader for every reader: an In-Context RALM reader, a REPLUG ensemble and a RAG model over
a causal generator are each written by `export_reader` and read back by `rag.load` through the same (probe, loader)
pair, answering exactly as the reader they were exported from."""

from __future__ import annotations

import json

import pytest

import rag
from rag.generators.load import load_generator
from rag.models.rag.model import RagModel, RagModelConfig
from rag.models.ralm.model import RalmConfig
from rag.pipeline import api
from rag.pipeline.api import RagPipeline
from rag.pipeline.exports import READER_MANIFEST, export_reader, is_reader_export, load_reader
from rag.pipeline.readers import RagReader, RalmReader
from rag.utils.errors import ConfigError

PROMPTS = ["The capital of France is", "Oxygen was discovered by"]
SETTINGS = dict(stride=4, query_length=8, max_length=96, doc_max_length=24)


@pytest.fixture(scope="module")
def kb(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    return KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), tmp_path_factory.mktemp("export_kb") / "kb",
                               index="flat", bm25=True, query_encoder=tiny_dpr_question_dir, show_progress=False)


def _readers(tiny_gpt2_dir, kb):
    model, tok, _ = load_generator(tiny_gpt2_dir, kind="causal")
    ralm = RalmReader(model, tok, kb.path, RalmConfig(**SETTINGS), retrieval="bm25")
    replug = RalmReader(model, tok, kb.path, RalmConfig(**SETTINGS, ensemble=3, retrieval_temperature=0.5), retrieval="bm25")
    causal_rag = RagReader(RagModel.from_components(None, tiny_gpt2_dir, kb.path,
                                                    RagModelConfig(n_docs=2, max_context_length=96)))
    return {"ralm": ralm, "replug": replug, "causal_rag": causal_rag}


def test_every_reader_exports_and_loads_through_the_one_loader(tmp_path, tiny_gpt2_dir, kb, monkeypatch):
    loaded_by = []
    probe, loader = next((p, f) for p, f in api.LOADERS if p is is_reader_export)
    monkeypatch.setattr(api, "LOADERS", tuple((p, (lambda *a, _f=f: loaded_by.append(a[0]) or _f(*a)) if p is probe else f)
                                              for p, f in api.LOADERS))
    for name, reader in _readers(tiny_gpt2_dir, kb).items():
        out = export_reader(reader, tmp_path / name)
        manifest = json.loads((out / READER_MANIFEST).read_text())
        assert manifest["method"] == reader.method
        pipe = rag.load(out, knowledge_base=kb.path)
        assert loaded_by[-1] == out, f"{name} did not load through the reader-export loader"
        assert type(pipe.reader) is type(reader) and pipe.reader.description() == reader.description()
        assert (pipe.method, pipe.generator_kind) == (reader.method, "causal")
        want = reader.generate(PROMPTS, max_new_tokens=5, min_new_tokens=5)
        got = pipe.generate(PROMPTS, max_new_tokens=5, min_new_tokens=5)
        assert [a.text for a in got] == [a.text for a in want]
        assert [[p.id for p in a.passages] for a in got] == [[p.id for p in a.passages] for a in want]
    assert load_reader(tmp_path / "replug", kb.path).config.ensemble == 3  # the REPLUG ensemble is part of the export


def test_a_loaded_export_takes_overrides_and_a_damaged_manifest_is_one_line(tmp_path, tiny_gpt2_dir, kb):
    reader = _readers(tiny_gpt2_dir, kb)["ralm"]
    out = export_reader(reader, tmp_path / "ralm")
    pipe = rag.load(out, knowledge_base=kb.path, stride=8)
    assert isinstance(pipe, RagPipeline) and (pipe.reader.config.stride, pipe.reader.config.query_length) == (8, 8)
    (out / READER_MANIFEST).write_text(json.dumps({"format": "rag-reader/1", "method": "ralm", "settings": {"beams": 2}}))
    with pytest.raises(ConfigError, match=r"reader\.json: settings \['beams'\]") as e:
        rag.load(out, knowledge_base=kb.path)
    assert "\n" not in str(e.value)
    (out / READER_MANIFEST).write_text(json.dumps({"format": "rag-reader/1", "method": "bert"}))
    with pytest.raises(ConfigError, match=r"method 'bert'"):
        rag.load(out, knowledge_base=kb.path)
