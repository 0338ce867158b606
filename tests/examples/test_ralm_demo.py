"""examples/ralm_demo.py: the reStructuredText cleaning, the held-out split, and the demo end to end.

End to end on a tiny random GPT-2 (tokenizer trained on the corpus) over a tiny corpus of .rst files written from the
bundled Elements passages (no Debian package needed): every measurement runs, the held-out documents are absent from
the knowledge base, the predictive reranker is trained with `rag fit` and evaluated, the results JSON and the plot are
written. Perplexities of a random LM are meaningless; the test checks the plumbing and the invariants.
"""

from __future__ import annotations

import json

import pytest

from rag.demo import load_demo_corpus

EXAMPLE = "ralm_demo"

RST = """.. _shutil-mod:

:mod:`shutil` --- High-level file operations
============================================

.. module:: shutil
   :synopsis: High-level file operations, including copying.

.. index::
   single: file; copying

**Source code:** :source:`Lib/shutil.py`

--------------

The :mod:`shutil` module offers operations on files, see :func:`~os.path.join` and `the docs <https://x.y>`_.

.. function:: copyfileobj(fsrc, fdst[, length])

   Copy the contents of ``fsrc`` to *fdst*.

.. note::

   Metadata is lost.
"""


def test_train_variant_labels(demo):
    assert demo.parse_variant("soft2=--model.init_args.loss soft_label") == ("soft2", ["--model.init_args.loss", "soft_label"])
    assert demo.parse_variant("plain") == ("plain", [])
    assert demo.parse_variant("q=--x 'a b' --y=1") == ("q", ["--x", "a b", "--y=1"])  # shell quoting
    for bad in ("=--x", "a b=--x", "../up=--x"):
        with pytest.raises(demo.ConfigError, match="label"):
            demo.parse_variant(bad)
    with pytest.raises(demo.ConfigError, match="share a label"):
        demo.main(["--train-variant", "a", "--train-variant", "a=--x 1", "--out", "/nonexistent/never"])


def test_rst_to_text(demo):
    title, body = demo.rst_to_text(RST)
    assert title == "shutil --- High-level file operations"
    assert body == ("Source code: Lib/shutil.py The shutil module offers operations on files, see os.path.join and the docs. "
                    "copyfileobj(fsrc, fdst[, length]) Copy the contents of fsrc to *fdst*. Note: Metadata is lost.")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("rst")
    for p in load_demo_corpus()[:16]:
        head = f"{p.title} --- element"
        (root / f"{p.title.lower()}.rst.txt").write_text(f".. index:: {p.title}\n\n{head}\n{'=' * len(head)}\n\n{p.text}\n",
                                                         encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from rag.generators import tiny
    from rag.generators.tiny import sample_texts

    tok = tiny.train_bpe_tokenizer(sample_texts(), vocab_size=500)
    model = tiny.tiny_gpt2(tok, d_model=32, layers=2, max_positions=256, seed=0)
    return tiny.save(model, tok, tmp_path_factory.mktemp("lm"))


def test_prepare_only_writes_the_split_and_the_knowledge_base(demo, corpus, tiny_lm, tmp_path, monkeypatch):
    """--prepare-only: the split and the knowledge base, no measurement (for a GPU machine without the corpus package);
    --device cuda where torch sees no GPU is refused before anything is written."""
    import torch

    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    out, res = tmp_path / "out", tmp_path / "r.json"
    argv = ["--corpus", str(corpus), "--model", tiny_lm, "--out", str(out), "--results", str(res), "--n-eval", "2",
            "--text-tokens", "40", "--n-train", "5", "--words-per-passage", "30"]
    if not torch.cuda.is_available():
        with pytest.raises(demo.ConfigError, match="--device cuda.*sees no CUDA device.*--prepare-only"):
            demo.main([*argv, "--device", "cuda"])
        assert not out.exists()
    assert demo.main([*argv, "--prepare-only", "--device", "cuda"]) == {}
    assert len((out / "eval.jsonl").read_text().splitlines()) == 2 and len((out / "train.jsonl").read_text().splitlines()) == 5
    assert (out / "kb").is_dir() and not res.exists()


@pytest.mark.slow
def test_demo_end_to_end(demo, corpus, tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    out, res, png = tmp_path / "out", tmp_path / "r.json", tmp_path / "r.png"
    results = demo.main(["--corpus", str(corpus), "--model", tiny_lm, "--small-lm", tiny_lm, "--out", str(out), "--results",
                         str(res),
                         "--plot", str(png), "--n-eval", "2", "--text-tokens", "40", "--n-train", "5", "--chunks-per-text", "1",
                         "--train-epochs", "1", "--max-length", "128", "--doc-max-length", "48", "--strides", "16,4",
                         "--query-lengths", "8,32", "--rerank-k", "2", "--rerank-tokens", "4", "--words-per-passage", "30",
                         "--train-variant", "plain", "--train-variant",
                         "soft=--model.init_args.loss soft_label --model.init_args.temperature 2",
                         "--train-variant", "rp=--model.init_args.rank_prior 2"])
    assert json.loads(res.read_text()) == json.loads(json.dumps(results))
    assert png.stat().st_size > 1000
    # the held-out documents are not in the knowledge base, and no training text is a held-out document
    from rag.knowledge.knowledge_base import KnowledgeBase

    held = {h["id"] for h in results["corpus"]["held_out"]}
    assert len(held) == 2
    kb = KnowledgeBase.open(out / "kb")
    kb_docs = {p.id.rsplit("-", 1)[0] for p in kb.get_passages([list(range(len(kb)))])[0]}
    assert kb_docs and not held & kb_docs
    assert not held & {json.loads(line)["id"] for line in (out / "train.jsonl").read_text().splitlines()}
    names = [r["name"] for r in results["runs"]]
    assert len(names) == len(set(names))
    by = {r["name"]: r for r in results["runs"]}
    tokens = by["none"]["tokens"]
    assert abs(tokens - 2 * 40) <= 4 and all(r["tokens"] == tokens for r in results["runs"])
    assert by["none"]["retrieved_chunks"] == 0 and "overlap" not in by["none"]
    assert {g for r in results["runs"] for g in r["groups"]} == {"table", "stride", "qlen", "rerank"}
    assert by["BM25 s=4 ℓ=32"]["groups"] == ["table", "stride"]  # one run serves both
    for r in results["runs"][1:]:
        assert 0 < r["retrieved_chunks"] <= tokens // r["stride"]
        assert 0.0 <= r["overlap"]["8gram"] <= r["overlap"]["4gram"] <= 1.0
    assert {r["rerank"] for r in results["runs"]} == {"none", "zero-shot", "zero-shot-small", "trained, plain", "trained, soft",
                                                      "trained, rp"}
    # each variant trains its own reranker from the one examples file, with its own options
    trainings = {t["label"]: t for t in results["reranker_trainings"]}
    assert set(trainings) == {"plain", "soft", "rp"} and "reranker_training" not in results
    assert json.loads((out / "reranker_rp" / "rag_reranker.json").read_text())["rank_prior"] == 2
    assert trainings["rp"]["val_best"]["epoch"] == 1 and "lowest val/loss after epoch 1" in results["markdown"]
    assert trainings["soft"]["extra"] == ["--model.init_args.loss", "soft_label", "--model.init_args.temperature", "2"]
    for label in ("plain", "soft"):
        assert (out / f"reranker_{label}" / "rag_reranker.json").is_file()
        hparams = next((out / f"reranker_run_{label}").rglob("hparams.yaml")).read_text()
        assert ("soft_label" in hparams) == (label == "soft")
    assert "Predictive reranker training 'soft'" in results["markdown"]
    kept = json.loads((out / "reranker_examples.json").read_text())  # a rerun reads the LM's scoring back
    assert kept["kind"] == "rag reranker examples" and kept["train"] and kept["key"]["settings"]["k"] == 2
    assert "(b) Stride" in results["markdown"] and "(d) Reranking" in results["markdown"]
    # every run keeps its per-text log-likelihoods, so settings are compared paired by text, with intervals
    assert all([t["id"] for t in r["per_text"]] == [h["id"] for h in results["corpus"]["held_out"]] for r in results["runs"])
    compared = dict(demo.paired_rows(results))
    rerankers = [r["name"] for r in results["runs"] if r["rerank"] != "none"]
    assert {("BM25 s=16 ℓ=32", n) for n in rerankers} <= set(compared) and ("BM25 s=16 ℓ=32", "BM25 s=16 ℓ=8") in compared
    assert len(compared) == 5 + 10 + 1 and all(d["low"] <= d["delta_bpb"] <= d["high"] for d in compared.values())
    assert "**Paired differences**" in results["markdown"]
    # --report rewrites the table and the plot from the results file alone
    png.unlink()
    again = demo.main(["--report", "--results", str(res), "--plot", str(png)])
    assert again["markdown"] == results["markdown"] and png.is_file()
