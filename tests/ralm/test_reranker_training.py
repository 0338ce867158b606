"""Predictive reranker (§6.2): the Eq. 9 loss, examples from the LM's own log-likelihoods, training lowers the loss
on a toy task, the exported reranker serves `rag lm-eval --rerank trained`, the bundled config parses."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from rag.models.ralm.model import EvalText, InContextRALM, RalmConfig, window_ids
from rag.training.reranker import (
    PredictiveRerankerModule,
    RerankerDataModule,
    RerankExample,
    collate,
    collect_examples,
    reranker_loss,
)
from rag.utils.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "lightning_configs" / "ralm_reranker_tiny.yaml"
QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False, num_sanity_val_steps=0)


def test_losses_by_hand():
    scores = torch.tensor([[1.0, 0.0, -1.0]])
    ll = torch.tensor([[-2.0, -5.0, -1.0]])
    p = torch.softmax(scores, -1)
    marginal = -math.log(sum(p[0, i].item() * math.exp(ll[0, i].item()) for i in range(3)))
    assert reranker_loss(scores, ll).item() == pytest.approx(marginal, rel=1e-6)
    q = torch.softmax(ll / 2.0, -1)
    soft = -(q * torch.log(p)).sum().item()
    assert reranker_loss(scores, ll, "soft_label", 2.0).item() == pytest.approx(soft, rel=1e-6)


def test_examples_are_the_lms_log_likelihood_of_the_next_stride(lm, bm25, demo_passages, capsys):
    model, tok = lm
    ralm = InContextRALM(model, tok, bm25, RalmConfig(stride=4, query_length=8, k=3, max_length=96, doc_max_length=40))
    texts = [EvalText(p.text, p.id, p.title) for p in demo_passages[:3]]
    examples = collect_examples(ralm, texts, chunks_per_text=2, prefix_tokens=8, seed=1, desc="examples")
    assert len(examples) == 6 and all(len(e.docs) == 3 and len(e.lm_loglik) == 3 for e in examples)
    assert "examples: 100%" in capsys.readouterr().err  # the LM scoring, the long part, shows its progress
    # re-derive the first example by hand: which chunk it is follows from its prefix text
    stream = ralm.scorer.stream(texts[0].text)
    spans, _ = ralm.plan(stream)
    a, b = next((a, b) for a, b in spans[1:] if tok.decode(stream[max(1, a - 8):a]) == examples[0].prefix)
    for doc, ll in zip(examples[0].docs, examples[0].lm_loglik):
        ids = window_ids(stream, a, b, tok(doc, add_special_tokens=False, truncation=True, max_length=40)["input_ids"], 96)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -(b - a) - 1:-1], -1)
        assert ll == pytest.approx(lp.gather(-1, torch.tensor(ids[-(b - a):])[:, None]).sum().item(), rel=1e-4)
    assert all(texts[0].title not in d.split("\n")[0] for d in examples[0].docs)  # leakage guard


def _toy(n: int, seed: int) -> list[RerankExample]:
    """The document that helps the LM always says 'useful'; the others say 'noise'; positions are shuffled."""
    rng = random.Random(seed)
    words = ["hydrogen", "helium", "lithium", "carbon", "oxygen", "neon", "sodium", "iron"]
    out = []
    for _ in range(n):
        name = rng.choice(words)
        docs = [f"{rng.choice(words)} noise"] * 3 + [f"{rng.choice(words)} useful"]
        ll = [-6.0, -6.0, -6.0, -1.0]
        order = list(range(4))
        rng.shuffle(order)
        out.append(RerankExample(f"tell me about {name}", [docs[i] for i in order], [ll[i] for i in order]))
    return out


def _mean_loss(module, examples):
    module.eval()
    with torch.no_grad():
        b = collate(examples)
        return reranker_loss(module.reranker(b["prefixes"], b["docs"]), b["lm_loglik"]).item()


def test_training_lowers_the_loss_on_a_toy_task(tiny_bert_dir, tmp_path):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    pl.seed_everything(0)
    train = _toy(64, 0)
    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=32, optimizer={"lr": 3e-3, "warmup_ratio": 0.0},
                                      export_dir=str(tmp_path / "rr"))
    before = _mean_loss(module, train)
    module.train()
    pl.Trainer(max_epochs=4, default_root_dir=str(tmp_path), **QUIET).fit(
        module, DataLoader(train, batch_size=8, shuffle=True, collate_fn=collate))
    after = _mean_loss(module, train)
    assert after < before - 1.0, (before, after)
    assert after < 2.0  # the floor is 1.0 (all mass on the 'useful' document)
    assert (tmp_path / "rr" / "rag_reranker.json").is_file()  # exported at the end of fit


def test_rank_prior_starts_at_the_retrievers_order_and_round_trips(tiny_bert_dir, tmp_path):
    """rank_prior = k: untrained, every candidate ties, so Eq. 8 picks the retriever's first; the biases are saved with
    the head and checked against the settings on load; another k is refused by name."""
    from rag.models.ralm.rerank import HEAD_FILE, RERANKER_FILE, PredictiveReranker, best_documents
    from rag.utils.errors import IntegrityError

    rr = PredictiveReranker(tiny_bert_dir, max_length=32, rank_prior=4).eval()
    b = collate(_toy(5, 2))
    with torch.no_grad():
        scores = rr(b["prefixes"], b["docs"])
    assert torch.equal(scores, torch.zeros(5, 4)) and best_documents(scores).tolist() == [0] * 5
    with pytest.raises(ConfigError, match=r"rank_prior.*--rerank-k 4"):
        rr(b["prefixes"], [d[:3] for d in b["docs"]])
    with torch.no_grad():  # a trained state: both parts of the score must come back
        rr.rank_bias.copy_(torch.tensor([0.5, -0.25, 1.0, 0.0]))
        rr.head.weight.normal_(0, 0.5)
        want = rr(b["prefixes"], b["docs"])
    rr.save(tmp_path / "rr")
    loaded = PredictiveReranker.load(tmp_path / "rr")
    with torch.no_grad():
        torch.testing.assert_close(loaded(b["prefixes"], b["docs"]), want)
    assert loaded.rank_prior == 4
    settings = json.loads((tmp_path / "rr" / RERANKER_FILE).read_text())
    (tmp_path / "rr" / RERANKER_FILE).write_text(json.dumps({**settings, "rank_prior": 3}))
    with pytest.raises(IntegrityError, match=rf"{HEAD_FILE}.*'rank_prior' = 3"):
        PredictiveReranker.load(tmp_path / "rr")
    (tmp_path / "rr" / RERANKER_FILE).write_text(json.dumps({k: v for k, v in settings.items() if k != "rank_prior"}))
    with pytest.raises(IntegrityError, match="rank_prior"):  # a head with biases, settings without: refused, not dropped
        PredictiveReranker.load(tmp_path / "rr")
    with pytest.raises(ConfigError, match="rank_prior"):
        PredictiveReranker(tiny_bert_dir, rank_prior=-1)


def test_lm_eval_refuses_a_rank_prior_reranker_at_another_k(capsys, tiny_bert_dir, tiny_gpt2_dir, demo_passages, tmp_path):
    """Refused before any text is scored, by the option to change."""
    from rag.cli import main
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.ralm.rerank import PredictiveReranker

    KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_bert_dir), tmp_path / "kb", index="flat", bm25=True,
                        show_progress=False)
    PredictiveReranker(tiny_bert_dir, max_length=48, query_tokens=8, rank_prior=3).save(tmp_path / "rr")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": demo_passages[20].text, "id": demo_passages[20].id}) + "\n", encoding="utf-8")
    argv = ["lm-eval", "--model", tiny_gpt2_dir, "--kb", str(tmp_path / "kb"), "--data", str(data), "--retrieval", "bm25",
            "--rerank", "trained", "--rerank-model", str(tmp_path / "rr"), "--max-length", "96", "--doc-max-length", "40",
            "--stride", "4", "--query-length", "8", "--json"]
    assert main([*argv, "--rerank-k", "4"]) == 2
    assert "top 3 (its rank_prior) but --rerank-k is 4; pass --rerank-k 3" in capsys.readouterr().err
    assert main([*argv, "--rerank-k", "3"]) == 0
    reranked = json.loads(capsys.readouterr().out)
    assert main([a for a in argv if a not in ("--rerank", "trained", "--rerank-model", str(tmp_path / "rr"))]) == 0
    plain = json.loads(capsys.readouterr().out)
    # untrained, every candidate ties: the reranker keeps BM25's first document, so it reads exactly what BM25 alone reads
    assert reranked["retrieved_chunks"] == plain["retrieved_chunks"] > 0
    assert reranked["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-4)  # float32 batches may differ


def test_rank_biases_learn_the_retrievers_prior_at_their_own_rate(tiny_bert_dir, tmp_path):
    """Every document reads the same and the retriever's first helps most: only the per-rank biases can learn that,
    and at the encoder's rate they would not move."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    rng = random.Random(0)
    examples = [RerankExample("the same prefix", ["the same document"] * 3,
                              [-2.0 - rng.random(), -4.0 - rng.random(), -5.0 - rng.random()]) for _ in range(48)]
    moved = {}
    for prior_lr in (1e-2, 1e-6):
        pl.seed_everything(0)
        module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=32, rank_prior=3,
                                          optimizer={"rank_prior_lr": prior_lr, "lr": 1e-6, "warmup_ratio": 0.0})
        pl.Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET).fit(
            module, DataLoader(examples, batch_size=8, shuffle=True, collate_fn=collate))
        moved[prior_lr] = module.reranker.rank_bias.detach().clone()
    fast, slow = moved[1e-2], moved[1e-6]
    assert fast.argmax().item() == 0 and (fast[0] - fast[1:]).min().item() > 0.05, fast
    assert slow.abs().max().item() < 1e-3, slow
    with pytest.raises(ConfigError, match="rank_prior_lr"):
        PredictiveRerankerModule(encoder=tiny_bert_dir, rank_prior=3, optimizer={"rank_prior_lr": 0})


@pytest.mark.parametrize("export_weights", ["best", "last"])
def test_export_takes_the_epoch_with_the_lowest_validation_loss(tiny_bert_dir, tmp_path, export_weights):
    """Validation examples reward the opposite document of training ones, so learning raises the validation loss:
    `best` exports the epoch whose validation loss was lowest, `last` the final weights."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from rag.models.ralm.rerank import PredictiveReranker

    class Snapshots(pl.Callback):
        def __init__(self):
            self.states, self.losses = [], []

        def on_validation_epoch_end(self, trainer, module):
            self.states.append({k: v.detach().clone() for k, v in module.reranker.state_dict().items()})
            self.losses.append(module.val_loss.compute().item())

    pl.seed_everything(0)
    val = [RerankExample(e.prefix, e.docs, [-7.0 if x == -1.0 else -1.0 for x in e.lm_loglik]) for e in _toy(16, 3)]
    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=32, optimizer={"lr": 3e-3, "warmup_ratio": 0.0},
                                      export_dir=str(tmp_path / "rr"), export_weights=export_weights)
    snaps = Snapshots()
    pl.Trainer(max_epochs=3, default_root_dir=str(tmp_path), callbacks=[snaps], **QUIET).fit(
        module, DataLoader(_toy(64, 0), batch_size=8, shuffle=True, collate_fn=collate),
        DataLoader(val, batch_size=8, collate_fn=collate))
    assert len(snaps.losses) == 3 and snaps.losses[-1] > min(snaps.losses)  # the setting this test needs: best != last
    epoch = snaps.losses.index(min(snaps.losses)) if export_weights == "best" else 2
    exported = PredictiveReranker.load(tmp_path / "rr").state_dict()
    for name, want in snaps.states[epoch].items():
        torch.testing.assert_close(exported[name], want, rtol=0, atol=0, msg=name)
    other = snaps.states[2 if export_weights == "best" else snaps.losses.index(min(snaps.losses))]
    assert not torch.equal(exported["head.weight"], other["head.weight"])


def test_rank_prior_must_match_the_datas_k(tiny_bert_dir, tiny_gpt2_dir, demo_passages, tmp_path):
    import pytorch_lightning as pl

    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in demo_passages[:4]),
                     encoding="utf-8")
    data = RerankerDataModule(texts=str(texts), lm=tiny_gpt2_dir, knowledge_base="demo", k=3, stride=4, query_length=8,
                              prefix_tokens=8,
                              max_length=96, doc_max_length=40, chunks_per_text=1, val_fraction=0.0, batch_size=4)
    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=48, query_tokens=8, rank_prior=4)
    with pytest.raises(ConfigError, match=r"model.rank_prior=4 but data.k=3.*set model.rank_prior to 3"):
        pl.Trainer(fast_dev_run=True, default_root_dir=str(tmp_path), **QUIET).fit(module, data)


def test_exported_reranker_serves_lm_eval(tiny_bert_dir, tiny_gpt2_dir, bm25, lm, demo_passages, tmp_path, capsys):
    from rag.models.ralm.rerank import PredictiveReranker

    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=48, query_tokens=8)
    module.export(tmp_path / "rr")
    loaded = PredictiveReranker.load(tmp_path / "rr")
    b = collate(_toy(3, 1))
    module.reranker.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(b["prefixes"], b["docs"]), module.reranker(b["prefixes"], b["docs"]))
    ralm = InContextRALM(*lm, bm25, RalmConfig(stride=4, query_length=8, k=3, max_length=96, doc_max_length=40), loaded)
    (score,) = ralm.score_texts([EvalText(demo_passages[5].text, demo_passages[5].id, demo_passages[5].title)])
    assert all(score.doc_ids[1:])
    from rag.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": demo_passages[5].text, "id": demo_passages[5].id}) + "\n", encoding="utf-8")
    kb_free = ["--retrieval", "none"]  # the CLI refuses --rerank without retrieval, and without --rerank-model for trained
    assert main(["lm-eval", "--model", tiny_gpt2_dir, "--data", str(data), "--rerank", "trained", *kb_free, "--max-length",
                 "96"]) == 2
    assert "--retrieval" in capsys.readouterr().err


def test_datamodule_fast_dev_run(tiny_bert_dir, tiny_gpt2_dir, demo_passages, tmp_path):
    import pytorch_lightning as pl

    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in demo_passages[:10]),
                     encoding="utf-8")
    data = RerankerDataModule(texts=str(texts), lm=tiny_gpt2_dir, knowledge_base="demo", k=3, stride=4, query_length=8,
                              prefix_tokens=8,
                              max_length=96, doc_max_length=40, chunks_per_text=1, val_fraction=0.3, batch_size=4)
    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=48, query_tokens=8)
    pl.Trainer(fast_dev_run=True, default_root_dir=str(tmp_path), **QUIET).fit(module, data)
    assert len(data.train_examples) == 7 and len(data.val_examples) == 3
    with pytest.raises(ConfigError, match="data.lm_batch_size"):
        RerankerDataModule(texts=str(texts), lm=tiny_gpt2_dir, lm_batch_size=0)


def test_bundled_config_parses(tmp_path, monkeypatch):
    import yaml

    from rag.cli.train import make_cli

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(CONFIG)], run=False)
    assert isinstance(cli.model, PredictiveRerankerModule) and isinstance(cli.datamodule, RerankerDataModule)
    cfg = yaml.safe_load(CONFIG.read_text())
    assert cli.datamodule.hparams.lm == "tiny:gpt2" and cli.datamodule.hparams.knowledge_base == "demo"
    assert cli.model.hparams.query_tokens == cfg["data"]["init_args"]["prefix_tokens"]
    # output paths follow trainer.default_root_dir ({default_root_dir} in the config, expanded by rag's CLI)
    root = cfg["trainer"]["default_root_dir"]
    assert cli.model.hparams.export_dir == cfg["model"]["init_args"]["export_dir"].replace("{default_root_dir}", root)


def test_collected_examples_are_kept_and_read_back_only_for_the_same_collection(tiny_gpt2_dir, demo_passages, tmp_path,
                                                                                 monkeypatch, caplog):
    """The LM's scoring is most of a run: `data.examples_file` keeps it; another setting, text or LM collects again."""
    import rag.training.reranker as reranker

    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in demo_passages[:6]),
                     encoding="utf-8")
    kept = tmp_path / "cache" / "examples.json"
    kw = dict(texts=str(texts), lm=tiny_gpt2_dir, knowledge_base="demo", k=3, stride=4, query_length=8, prefix_tokens=8,
              max_length=96, doc_max_length=40, chunks_per_text=1, val_fraction=0.3, examples_file=str(kept))
    first = RerankerDataModule(**kw)
    first.setup()
    assert kept.is_file() and len(first.train_examples) == 4 and len(first.val_examples) == 2
    calls = []
    real = reranker.collect_examples
    monkeypatch.setattr(reranker, "collect_examples", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = RerankerDataModule(**{**kw, "batch_size": 2})  # batch_size does not change the examples
    again.setup()
    assert calls == [] and again.train_examples == first.train_examples and again.val_examples == first.val_examples
    with caplog.at_level("WARNING", logger="rag.training.reranker"):
        other = RerankerDataModule(**{**kw, "k": 2})
        other.setup()
    assert calls == [1, 1] and "settings" in caplog.text and all(len(e.docs) == 2 for e in other.train_examples)
    assert json.loads(kept.read_text())["key"]["settings"]["k"] == 2  # rewritten for the new collection
    texts.write_text(texts.read_text().replace("Symbol", "Sign"), encoding="utf-8")
    RerankerDataModule(**{**kw, "k": 2}).setup()
    assert len(calls) == 4  # other texts: collected again
    data = json.loads(kept.read_text())
    data["train"][0]["lm_loglik"] = data["train"][0]["lm_loglik"][:1]
    kept.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"examples.json: train\[0\].*data.examples_file"):
        RerankerDataModule(**{**kw, "k": 2}).setup()
    foreign = tmp_path / "mine.json"
    foreign.write_text('{"my": "notes"}')
    with pytest.raises(ConfigError, match="left alone"):
        RerankerDataModule(**{**kw, "examples_file": str(foreign)}).setup()
    assert foreign.read_text() == '{"my": "notes"}'
