"""REPLUG LSR (§4): the loss by hand, the gradient reaches the query encoder only (never the LM), a toy run moves the
retriever toward the document that makes the LM's target likely, endpoint failures stop training, the bundled config runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from rag.models.replug.lm_scorer import LMEndpointError
from rag.models.replug.lsr import lsr_loss
from rag.training.replug_lsr import ReplugLSRModule, lm_scores
from rag.utils.errors import ConfigError, RagError

CONFIG = Path(__file__).resolve().parents[2] / "lightning_configs" / "replug_lsr_tiny.yaml"
QUESTION, ANSWER = "Which element is the lightest?", "hydrogen"


def test_lsr_loss_by_hand():
    s = torch.tensor([[0.9, 0.5, 0.1], [0.2, 0.3, 0.25]], requires_grad=True)
    ll = torch.tensor([[-3.0, -1.0, -6.0], [-2.0, -2.5, -2.0]], requires_grad=True)
    for gamma, beta in ((0.1, 0.1), (1.0, 2.0)):
        want = 0.0
        for b in range(2):
            p = [math.exp(v / gamma) for v in s[b].tolist()]
            q = [math.exp(v / beta) for v in ll[b].tolist()]
            p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
            want += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) / 2
        assert lsr_loss(s, ll, retrieval_temperature=gamma, beta=beta).item() == pytest.approx(want, rel=1e-5)
    lsr_loss(s, ll).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and ll.grad is None  # Q_LM is a fixed target
    assert lsr_loss(ll.detach(), ll.detach(), retrieval_temperature=0.5, beta=0.5).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="retrieval_temperature"):
        lsr_loss(s, ll, retrieval_temperature=0.0)
    with pytest.raises(ConfigError, match="beta"):
        lsr_loss(s, ll, beta=-1.0)
    with pytest.raises(RagError, match="non-finite"):
        lsr_loss(s, torch.tensor([[float("nan"), 0.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, demo_passages, minilm_path):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("lsr_kb") / "kb"
    KnowledgeBase.build(demo_passages[:6], TextEncoder(minilm_path), out, index="flat", show_progress=False)
    return str(out)


def _module(small_kb, minilm_path, lm, **kw):
    m = ReplugLSRModule(lm=lm, question_encoder=minilm_path, knowledge_base=small_kb, **{"k": 6, **kw})
    m.configure_model()
    return m


def test_gradient_reaches_the_query_encoder_only(small_kb, minilm_path, tiny_gpt2_dir):
    m = _module(small_kb, minilm_path, tiny_gpt2_dir)
    loss, _, _ = m._loss({"questions": [QUESTION, "What is helium?"], "targets": [ANSWER, "a noble gas"]})
    loss.backward()
    qgrads = [p.grad for p in m.model.question_encoder.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in qgrads)
    lm_params = list(m.lm.model.parameters())
    assert all(p.grad is None and not p.requires_grad for p in lm_params)
    assert all(not n.startswith("lm") for n, _ in m.named_parameters())  # the LM is not part of the trained module


def test_toy_run_moves_the_retriever_toward_the_helpful_document(small_kb, minilm_path, tiny_gpt2_dir):
    torch.manual_seed(0)
    m = _module(small_kb, minilm_path, tiny_gpt2_dir, retrieval_temperature=0.1, beta=0.02)  # Q_LM ≈ one-hot on the best document
    m.model.eval()  # no dropout: the comparison before / after is deterministic
    batch = {"questions": [QUESTION], "targets": [ANSWER]}
    with torch.no_grad():
        retrieved, scores = m.model([QUESTION], 6)
    ll = lm_scores(m.lm, retrieved.passages, [QUESTION], [ANSWER])[0]
    best = retrieved.passages[0][int(ll.argmax())].id  # the document under which the LM finds the answer most likely

    def p_best():
        with torch.no_grad():
            r, s = m.model([QUESTION], 6)
        ids = [p.id for p in r.passages[0]]
        return torch.softmax(s[0] / 0.1, 0)[ids.index(best)].item()

    before, loss0 = p_best(), m._loss(batch)[0].item()
    opt = torch.optim.Adam(m.model.question_encoder.parameters(), lr=2e-4)
    for _ in range(8):
        opt.zero_grad()
        m._loss(batch)[0].backward()
        opt.step()
    assert p_best() > before + 0.05 and m._loss(batch)[0].item() < loss0
    assert m.cache.hits >= 8 * 6  # the same (document, input, answer) is never scored twice


def test_endpoint_failure_stops_training(small_kb, minilm_path, server):
    url, _ = server
    m = ReplugLSRModule(lm_endpoint=url, lm_endpoint_model="nologprobs", question_encoder=minilm_path, knowledge_base=small_kb,
                        k=2)
    m.configure_model()
    with pytest.raises(LMEndpointError, match="no prompt log-probs"):
        m._loss({"questions": [QUESTION], "targets": [ANSWER]})
    ok = ReplugLSRModule(lm_endpoint=url, lm_endpoint_model="tiny", question_encoder=minilm_path, knowledge_base=small_kb, k=2)
    ok.configure_model()
    assert torch.isfinite(ok._loss({"questions": [QUESTION], "targets": [ANSWER]})[0])


def test_bad_settings_are_named(small_kb, minilm_path, tiny_gpt2_dir):
    for kw, match in (({"k": 0}, "model.k"), ({"retrieval_temperature": 0.0}, "model.retrieval_temperature"),
                      ({"beta": -0.1}, "model.beta"),
                      ({"lm_endpoint": "http://x/v1"}, "lm_endpoint_model")):
        with pytest.raises(ConfigError, match=match):
            ReplugLSRModule(**kw)
    with pytest.raises(ConfigError, match="holds 6"):
        _module(small_kb, minilm_path, tiny_gpt2_dir, k=7)
    m = _module(small_kb, minilm_path, tiny_gpt2_dir, k=2)
    with pytest.raises(ConfigError, match="empty or whitespace"):
        m._loss({"questions": ["  "], "targets": [ANSWER]})


def test_config_parses_lazily(tmp_path, monkeypatch):
    from rag.cli.train import make_cli
    from rag.training.data import QADataModule

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(CONFIG)], run=False)
    assert isinstance(cli.model, ReplugLSRModule) and isinstance(cli.datamodule, QADataModule)
    assert cli.model.model is None and cli.model.hparams.k == 4 and cli.model.hparams.retrieval_temperature == 0.1


def test_gamma_is_a_deprecated_alias_of_retrieval_temperature():
    with pytest.warns(FutureWarning, match="retrieval_temperature"):
        m = ReplugLSRModule(gamma=0.3)
    assert m.hparams.retrieval_temperature == 0.3 and m.hparams.gamma is None
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="model.retrieval_temperature"):
        ReplugLSRModule(gamma=0.0)


@pytest.mark.slow
def test_bundled_config_runs_with_index_refresh(tmp_path, monkeypatch, demo_passages):
    """`rag fit --config lightning_configs/replug_lsr_tiny.yaml`, shortened: LSR steps, an index refresh swapped in, the
    query encoder exported."""
    from rag.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["trainer"].update(max_steps=4, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1)
    cfg["trainer"]["callbacks"][0]["init_args"]["every"] = 2
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(p)]) == 0
    run = tmp_path / "runs" / "replug_lsr_tiny"
    assert (run / "query_encoder").is_dir() and (run / "checkpoints" / "last.ckpt").is_file()
    assert list((run / "index_refresh").glob("step-*/kb/manifest.json")), "no refreshed index was built"
    metrics = next((run / "logs").rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics and "val/top1_agreement" in metrics and "refresh/swaps" in metrics
