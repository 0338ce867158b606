"""examples/replug_demo.py end to end on a tiny random GPT-2 over a tiny .rst corpus written from the bundled Elements
passages (no Debian package needed): every measurement runs (no retrieval, REPLUG dense / BM25, the random-documents
control, REPLUG LSR trained with `rag fit` and re-evaluated, Elements QA), the held-out and LSR-training documents are
absent from the knowledge base, the results JSON and the plot are written. A random LM's numbers are meaningless; the
test checks the plumbing and the invariants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag.demo import load_demo_corpus

EXAMPLE = "replug_demo"

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("rst")
    for p in load_demo_corpus()[:24]:
        head = f"{p.title} --- element"
        (root / f"{p.title.lower()}.rst.txt").write_text(f"{head}\n{'=' * len(head)}\n\n{p.text}\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from rag.generators import tiny
    from rag.generators.tiny import sample_texts

    tok = tiny.train_bpe_tokenizer(sample_texts(), vocab_size=500)
    model = tiny.tiny_gpt2(tok, d_model=32, layers=2, max_positions=256, seed=0)
    return tiny.save(model, tok, tmp_path_factory.mktemp("lm"))


def test_replug_settings_name_the_config_fields(demo):
    from rag.models.ralm.model import RalmConfig

    cfg = RalmConfig(**demo.replug_settings(3, 0.5, True))
    assert (cfg.ensemble, cfg.retrieval_temperature, cfg.random_docs) == (3, 0.5, True)
    assert demo.replug_settings(None, 0.5) == {}


@pytest.mark.slow
def test_demo_end_to_end(demo, corpus, tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    out, res, png = tmp_path / "out", tmp_path / "r.json", tmp_path / "r.png"
    ks = [1, 2, 3]
    results = demo.main(["--corpus", str(corpus), "--model", tiny_lm, "--out", str(out), "--results", str(res), "--plot",
                         str(png),
                         "--n-eval", "2", "--text-tokens", "40", "--n-train", "3", "--lsr-pairs-per-doc", "2",
                         "--lsr-query-tokens", "8", "--lsr-target-tokens", "8", "--lsr-k", "2", "--lsr-epochs", "1",
                         "--lsr-lr", "1e-3", "--ks", ",".join(map(str, ks)), "--stride", "8", "--max-length", "64",
                         "--doc-max-length", "24", "--words-per-passage", "30", "--qa-n", "6", "--qa-k", "2", "--qa-new-tokens",
                         "3"])
    assert json.loads(res.read_text()) == json.loads(json.dumps(results))
    assert png.stat().st_size > 1000
    from rag.knowledge.knowledge_base import KnowledgeBase

    held = {h["id"] for h in results["corpus"]["held_out"]}
    lsr_docs = set(results["corpus"]["lsr_documents"])
    assert len(held) == 2 and len(lsr_docs) == 3 + 4 and not held & lsr_docs
    kb = KnowledgeBase.open(out / "kb")
    kb_docs = {p.id.rsplit("-", 1)[0] for p in kb.get_passages([list(range(len(kb)))])[0]}
    assert kb_docs and not (held | lsr_docs) & kb_docs
    train = [json.loads(line) for line in (out / "lsr_train.jsonl").read_text().splitlines()]
    assert train and {t["doc"] for t in train} <= lsr_docs
    by = {r["name"]: r for r in results["runs"]}
    tokens = by["none"]["tokens"]
    assert by["none"]["retrieved_chunks"] == 0
    for method in ("REPLUG dense", "random docs", "REPLUG BM25", "REPLUG LSR"):
        for k in ks:
            r = by[f"{method} k={k}"]
            assert r["tokens"] == tokens and 0 < r["retrieved_chunks"] and r["bits_per_byte"] > 0
    # the trained query encoder was exported and used
    assert results["lsr_training"]["steps"] >= 1
    assert Path(results["lsr_training"]["export_dir"]).is_dir()
    qa = results["elements_qa"]
    assert [r["k"] for r in qa["runs"]] == [1, 2] and all(0.0 <= r["em"] <= r["f1"] + 1e-9 <= 1.0 + 1e-9 for r in qa["runs"])
    assert "REPLUG LSR" in results["markdown"] and "Elements QA" in results["markdown"]
    assert "Against no retrieval" in results["markdown"] and all(len(r["per_text"]) == 2 for r in results["runs"])
    png.unlink()
    again = demo.main(["--report", "--results", str(res), "--plot", str(png)])
    assert again["markdown"] == results["markdown"] and png.is_file()


@pytest.mark.slow
def test_lsr_with_the_document_encoder_refreshes_the_index_and_measures_before_and_after(demo, corpus, tiny_lm, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    out, res = tmp_path / "out", tmp_path / "r.json"
    results = demo.main(["--corpus", str(corpus), "--model", tiny_lm, "--out", str(out), "--results", str(res), "--plot",
                         str(tmp_path / "r.png"), "--n-eval", "2", "--text-tokens", "40", "--n-train", "3", "--n-val", "2",
                         "--lsr-pairs-per-doc", "2", "--lsr-query-tokens", "8", "--lsr-target-tokens", "8", "--lsr-k", "2",
                         "--lsr-epochs", "2", "--lsr-lr", "1e-3", "--ks", "2", "--stride", "8", "--max-length", "64",
                         "--doc-max-length", "24", "--words-per-passage", "30", "--skip", "bm25,random,qa",
                         "--lsr-doc-encoder", "--lsr-refresh-every", "1"])
    tr = results["lsr_training"]
    assert len(results["corpus"]["lsr_documents"]) == 3 + 2 and tr["val_pairs"] == 2 * 2
    assert set(tr["val_before"]) == set(tr["val_last"]) >= {"val/loss", "val/top1_agreement", "val/replug_loglik"}
    assert len(tr["val_by_epoch"]) == 2
    refreshed = Path(tr["knowledge_base"])
    assert refreshed.is_dir() and refreshed.parent.parent == out / "lsr_run" / "index_refresh"
    by = {r["name"]: r for r in results["runs"]}
    assert by["REPLUG LSR k=2"]["retrieved_chunks"] > 0 and "before training" in results["markdown"]


@pytest.mark.slow
def test_prepare_only_then_measure_reuses_the_knowledge_base_and_passes_the_lsr_options(demo, corpus, tiny_lm, tmp_path,
                                                                                         monkeypatch):
    import yaml

    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    out, res = tmp_path / "out", tmp_path / "r.json"
    common = ["--corpus", str(corpus), "--model", tiny_lm, "--out", str(out), "--results", str(res), "--plot",
              str(tmp_path / "r.png"),
              "--n-eval", "2", "--text-tokens", "40", "--n-train", "3", "--n-val", "2", "--lsr-pairs-per-doc", "2",
              "--lsr-query-tokens", "8", "--lsr-target-tokens", "8", "--words-per-passage", "30"]
    assert demo.main([*common, "--prepare-only"]) == {}
    assert (out / "kb").is_dir() and (out / "lsr_train.jsonl").is_file() and not res.exists()  # nothing measured
    results = demo.main([*common, "--lsr-k", "2", "--lsr-epochs", "1", "--lsr-beta", "0.5", "--lsr-seed", "7",
                         "--lsr-lm-batch-size", "3", "--ks", "2", "--stride", "8", "--max-length", "64", "--doc-max-length", "24",
                         "--skip", "bm25,random,qa"])
    assert results["corpus"]["kb_build_cpu_s"] == 0.0  # the prepared knowledge base was reused, not rebuilt
    assert results["settings"]["device_name"] == "cpu"
    hparams = [yaml.safe_load(p.read_text()) for p in (out / "lsr_run").rglob("hparams.yaml")]
    assert hparams and all(h["beta"] == 0.5 and h["lm_batch_size"] == 3 for h in hparams)
    overrides = results["lsr_training"]["overrides"]
    assert overrides[overrides.index("--seed_everything") + 1] == "7"


def test_device_cuda_without_cuda_is_one_clear_error(demo, tmp_path):
    import torch

    from rag.utils.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match="--device cuda.*--prepare-only"):
        demo.main(["--device", "cuda", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "r.json")])
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda:1"])
