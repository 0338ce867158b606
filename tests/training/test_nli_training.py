"""`rag fit --config lightning_configs/nli_tiny.yaml`: the NLI cross-encoder trains (its loss falls), reports accuracy
and exports a directory that NLIScorer loads like a hub NLI model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[2] / "lightning_configs" / "nli_tiny.yaml"


@pytest.mark.slow  # a whole CLI run (~11-15 s on 2 cores)
def test_tiny_config_trains_and_exports(tmp_path, monkeypatch):
    from rag.cli import main
    from rag.retrobust.nli import NLIScorer
    from rag.training.nli import EXPORT_INFO

    monkeypatch.chdir(tmp_path)  # runs/nli_tiny/... is relative to the working directory
    assert main(["fit", "--config", str(CONFIG)]) == 0
    rows = list(csv.DictReader(open(next((tmp_path / "runs" / "nli_tiny").rglob("metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 16
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    val = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
    assert len(val) == 1 and 0.0 <= val[0] <= 1.0

    export = tmp_path / "runs" / "nli_tiny" / "model"
    info = json.loads((export / EXPORT_INFO).read_text())
    assert info["global_step"] == 16 and info["labels"] == ["entailment", "neutral", "contradiction"]
    scorer = NLIScorer.from_pretrained(export)
    assert scorer.labels == {"entailment": 0, "neutral": 1, "contradiction": 2}
    p = scorer.entailment_probs(["Iron. Symbol: Fe."], ["The chemical symbol of iron is Fe."])
    assert p.shape == (1,) and 0.0 < float(p[0]) < 1.0


def test_nli_module_rejects_bad_options():
    from rag.training.nli import NLIModule
    from rag.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="warmup_ratio"):
        NLIModule(optimizer={"warmup_ratio": 1.5})
    with pytest.raises(ConfigError, match="export"):
        NLIModule().export("/nonexistent/never-written")


@pytest.mark.slow  # a whole CLI run (~11-15 s on 2 cores)
def test_rag_nli_prepare_trains_tests_and_is_then_a_no_op(tmp_path, monkeypatch, capsys, make_snli_sdist):
    """`rag nli prepare` with a local sdist (the tiny layout of test_snli) and the tiny recipe."""
    from rag.cli import main
    from rag.training import snli
    from rag.training.nli import EXPORT_INFO
    from rag.utils.checksums import sha256_file

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    sdist = make_snli_sdist(tmp_path / "s.tar.gz")
    monkeypatch.setattr(snli, "SNLI_SDIST_SHA256", sha256_file(sdist))
    out = tmp_path / "model"
    args = ["nli", "prepare", "--sdist", str(sdist), "--config", str(CONFIG), "--out", str(out)]
    assert main(args) == 0
    assert (tmp_path / "cache" / "snli" / "train.jsonl").is_file()
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["test"]["data"] == "elements:test" and info["test"]["pairs"] == 48 and 0 <= info["test"]["test/acc"] <= 1
    assert "test accuracy" in capsys.readouterr().out
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0 and "exists" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
