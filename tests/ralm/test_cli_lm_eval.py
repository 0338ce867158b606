"""`rag lm-eval`: JSON output equal to the Python API, BM25 / dense / none, and bad input as exit 2 naming the option."""

from __future__ import annotations

import json
import re

import pytest

from rag.cli import main

ARGS = ["--max-length", "96", "--doc-max-length", "40", "--stride", "4", "--query-length", "8"]


@pytest.fixture(scope="module")
def kbs(tmp_path_factory, demo_passages, minilm_path):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    root = tmp_path_factory.mktemp("lm_eval_kb")
    enc = TextEncoder(minilm_path)
    passages = demo_passages[:24]
    KnowledgeBase.build(passages, enc, root / "bm25", index="flat", bm25=True, show_progress=False)
    KnowledgeBase.build(passages, enc, root / "dense", index="flat", show_progress=False)
    return {"bm25": str(root / "bm25"), "dense": str(root / "dense")}


@pytest.fixture(scope="module")
def data(tmp_path_factory, demo_passages):
    p = tmp_path_factory.mktemp("lm_eval_data") / "eval.jsonl"
    p.write_text("".join(json.dumps({"id": q.id, "title": q.title, "text": q.text}) + "\n" for q in demo_passages[:3]),
                 encoding="utf-8")
    return str(p)


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_equals_the_python_api(capsys, tiny_gpt2_dir, kbs, data, lm):
    from rag.eval.perplexity import evaluate_perplexity, read_eval_texts
    from rag.knowledge.bm25 import BM25Retriever
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.ralm.model import InContextRALM, RalmConfig

    code, out, _ = _run(capsys, ["lm-eval", "--model", tiny_gpt2_dir, "--kb", kbs["bm25"], "--data", data, "--retrieval", "bm25",
                                 "--json", *ARGS])
    assert code == 0
    got = json.loads(out)
    assert {"perplexity", "word_perplexity", "bits_per_byte", "tokens", "words", "bytes", "settings"} <= set(got)
    kb = KnowledgeBase.open(kbs["bm25"])
    ralm = InContextRALM(*lm, BM25Retriever(kb.bm25, kb.get_passages, kb.version, knowledge_base=kb),
                         RalmConfig(stride=4, query_length=8, max_length=96, doc_max_length=40))
    expected = evaluate_perplexity(ralm, read_eval_texts(data))
    assert got["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert got["bits_per_byte"] == pytest.approx(expected.bits_per_byte, rel=1e-9)
    assert got["retrieved_chunks"] > 0 and got["settings"]["stride"] == 4


@pytest.mark.parametrize("retrieval, rerank", [("dense", "none"), ("none", "none"), ("bm25", "zero-shot")])
def test_other_retrievers_and_reranking_run(capsys, tiny_gpt2_dir, kbs, data, retrieval, rerank):
    kb = kbs["dense" if retrieval == "dense" else "bm25"]
    code, out, err = _run(capsys, ["lm-eval", "--model", tiny_gpt2_dir, "--kb", kb, "--data", data, "--retrieval", retrieval,
                                   "--rerank", rerank, "--rerank-k", "4", "--rerank-tokens", "4", "--json", *ARGS])
    assert code == 0, err
    got = json.loads(out)
    assert (got["retrieved_chunks"] == 0) == (retrieval == "none") and got["perplexity"] > 1


@pytest.mark.parametrize("extra, message", [
    (["--retrieval", "bm25", "--kb", "DENSE"], "--kb .*has no BM25 index.*--bm25"),
    (["--stride", "0"], "--stride"),
    (["--query-length", "0"], "--query-length"),
    (["--stride", "60"], "cannot fit.*--max-length"),
    (["--model", "BART"], "seq2seq.*decoder-only.*needed"),
    (["--retrieval", "none", "--rerank", "zero-shot"], "--rerank zero-shot.*--retrieval"),
    (["--data", "SHORT"], "shorter than one stride"),
])
def test_bad_input_exits_2_naming_the_option(capsys, tiny_gpt2_dir, tiny_bart_dir, kbs, data, tmp_path, extra, message):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "Tin"}) + "\n", encoding="utf-8")
    argv = ["lm-eval", "--model", tiny_gpt2_dir, "--kb", kbs["bm25"], "--data", data, *ARGS, *extra]
    argv = [{"DENSE": kbs["dense"], "BART": tiny_bart_dir, "SHORT": str(short)}.get(a, a) for a in argv]
    code, _, err = _run(capsys, argv)
    assert code == 2
    assert re.search(message, err), err


def test_cli_lm_eval_replug_ensemble(capsys, tiny_gpt2_dir, kbs, data):
    base = ["lm-eval", "--model", tiny_gpt2_dir, "--kb", kbs["bm25"], "--data", data, "--retrieval", "bm25", "--json", *ARGS]
    code, out, _ = _run(capsys, base + ["--ensemble", "3", "--retrieval-temperature", "2"])
    assert code == 0
    top = json.loads(out)
    assert top["settings"]["ensemble"] == 3 and top["settings"]["retrieval_temperature"] == 2.0 and top["bits_per_byte"] > 0
    code, out, err = _run(capsys, base + ["--ensemble", "3", "--temperature", "2"])  # the deprecated alias works, and says so
    assert code == 0 and json.loads(out) == top
    assert "FutureWarning: --temperature is deprecated: use --retrieval-temperature" in err
    code, out, _ = _run(capsys, base + ["--ensemble", "3", "--random-docs"])
    rnd = json.loads(out)
    assert code == 0 and rnd["settings"]["random_docs"] is True and rnd["bits_per_byte"] != top["bits_per_byte"]
    code, _, err = _run(capsys, base + ["--ensemble", "2", "--rerank", "zero-shot"])
    assert code == 2 and "--ensemble" in err
    code, _, err = _run(capsys, base + ["--ensemble", "25"])
    assert code == 2 and "--ensemble" in err and "holds 24" in err
