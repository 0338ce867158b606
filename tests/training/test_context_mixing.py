"""RetRobust context mixing (§2.2): proportions, random contexts never from the question's own top-K, bad
probabilities named, and the mixed contexts reaching the batch and the training step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import yaml

from rag.training.context_mixing import ContextMixing, sample_context_choices
from rag.utils.errors import ConfigError, RagError


def _rows(n_questions: int, k: int, n_passages: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(n_passages), k) for _ in range(n_questions)]


@pytest.mark.parametrize("probs", [(1 / 3, 1 / 3, 1 / 3), (0.5, 0.2, 0.3), (0.0, 0.0, 1.0)])
def test_proportions_over_many_draws(probs):
    rows = _rows(6000, 10, 500)
    choices = sample_context_choices(rows, ContextMixing(p_top1=probs[0], p_low=probs[1], p_random=probs[2], seed=3))
    counts = Counter(c.kind for c in choices)
    for kind, p in zip(("top1", "low", "random"), probs):
        assert abs(counts[kind] / len(rows) - p) < 0.025, (kind, counts)


def test_each_kind_comes_from_its_pool_and_random_never_from_own_top_k():
    rows = _rows(400, 8, 60, seed=1)  # few passages: other questions' top-1 often lies in this question's top-8
    mixing = ContextMixing(top_k=8, low_rank_start=5, seed=7)
    choices = sample_context_choices(rows, mixing)
    tops = {r[0] for r in rows}
    n_random = 0
    for r, c in zip(rows, choices):
        if c.kind == "top1":
            assert c.row == r[0]
        elif c.kind == "low":
            assert c.row in r[5:8]
        else:
            n_random += 1
            assert c.row not in r and c.row in tops
    assert n_random > 100
    assert sample_context_choices(rows, mixing) == choices  # seeded
    assert sample_context_choices(rows, ContextMixing(top_k=8, low_rank_start=5, seed=8)) != choices


def test_default_low_pool_is_lower_half():
    rows = _rows(300, 10, 1000)
    choices = sample_context_choices(rows, ContextMixing(p_top1=0, p_low=1, p_random=0))
    ranks = Counter(r.index(c.row) for r, c in zip(rows, choices))
    assert set(ranks) == set(range(5, 10))


def test_no_random_context_possible_is_a_clear_error():
    rows = [[0, 1, 2], [1, 0, 2], [2, 1, 0]]  # every other top-1 is in each question's own top-3
    with pytest.raises(RagError, match="no random context"):
        sample_context_choices(rows, ContextMixing(top_k=3, p_top1=0, p_low=0, p_random=1))


@pytest.mark.parametrize("kw, option", [
    (dict(p_top1=0.5, p_low=0.5, p_random=0.5), "p_top1 \\+ p_low \\+ p_random = 1.5"),
    (dict(p_top1=1.2, p_low=-0.2, p_random=0.0), "p_low=-0.2"),
    (dict(p_top1=float("nan")), "p_top1=nan"),
    (dict(top_k=1), r"top_k .*must be an integer >= 2, got 1"),
    (dict(top_k=10, low_rank_start=10), "low_rank_start=10"),
])
def test_bad_options_name_the_option(kw, option):
    with pytest.raises(ConfigError, match="data.context_mixing." + option):
        ContextMixing(**kw)


def test_datamodule_batches_hold_mixed_contexts_and_train_step_reads_them(tiny_kb_dir, make_module, make_data):
    """Real retrieval (the demo KB, MiniLM) over the demo training questions; the tiny random DPR retrieves the same
    passages for every question, which leaves no random context (the error above)."""
    from rag.demo.kb import ensure_demo_kb

    kb = ensure_demo_kb(show_progress=False)
    data = make_data(context_mixing=ContextMixing(knowledge_base="demo", top_k=6, seed=0), batch_size=8)
    data.setup("fit")
    ds = data.train_pairs
    kinds = Counter(ds.context_kinds)
    assert set(kinds) == {"top1", "low", "random"} and all(v > len(ds) / 5 for v in kinds.values()), kinds
    titles = {p.title for p in kb.all_passages()}
    assert all(c.title in titles for c in ds.contexts)
    batch = next(iter(data.train_dataloader()))
    assert len(batch["contexts"]) == len(batch["questions"]) == len(batch["context_kinds"]) == 8
    module = make_module()
    module.configure_model()
    loss = module.training_step(batch, 0)
    assert loss.ndim == 0 and loss.requires_grad and float(loss) > 0
    expected = module.model.generator_loss(batch["questions"], batch["targets"], batch["contexts"])
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_trainer_fits_on_mixed_context_batches(make_module, make_data, trainer_kw):
    """Lightning moves every batch to the device before training_step; batches of strings and (frozen dataclass)
    passages must pass through unchanged instead of failing in Lightning's generic mover."""
    import pytorch_lightning as pl

    data = make_data(context_mixing=ContextMixing(knowledge_base="demo", top_k=6, seed=0), batch_size=4)
    trainer = pl.Trainer(max_steps=2, limit_val_batches=0, **trainer_kw)
    trainer.fit(make_module(), datamodule=data)
    assert trainer.global_step == 2


def test_cli_reads_context_mixing(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from rag.cli.train import make_cli

    monkeypatch.chdir(tmp_path)
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "lightning_configs" / "tiny_cpu.yaml").read_text())
    cfg["data"]["init_args"]["context_mixing"] = {"knowledge_base": "demo", "top_k": 8, "p_top1": 0.5, "p_low": 0.25,
                                                  "p_random": 0.25, "seed": 4}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cli = make_cli(["--config", str(tmp_path / "c.yaml")], run=False)
    m = cli.datamodule.context_mixing
    assert isinstance(m, ContextMixing) and (m.top_k, m.low_start, m.probabilities, m.seed) == (8, 4, (0.5, 0.25, 0.25), 4)
    cfg["data"]["init_args"]["context_mixing"]["p_random"] = 0.5
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises((SystemExit, ValueError)) as e:  # jsonargparse reports the ConfigError's message
        make_cli(["--config", str(tmp_path / "d.yaml")], run=False)
    assert "data.context_mixing.p_top1 + p_low + p_random = 1.25" in str(e.value) + capsys.readouterr().err


@pytest.mark.slow
def test_reader_trained_on_mixed_contexts_is_less_hurt_by_random_ones(tmp_path):
    """The toy version of RetRobust's claim (§2.2, Fig. 4): 12 entities with a code each, one passage per entity.
    A tiny BART trained on its question's own passage only learns to copy from whatever it reads, so a random
    passage makes it answer that passage's code; trained on contexts drawn by the RetRobust sampler (1/3 top-1,
    1/3 low-ranked, 1/3 random) it must also know the codes, and a random passage hurts it far less."""
    import torch

    from rag.generators.tiny import save, tiny_bart, tiny_dpr, train_bpe_tokenizer
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.passages import Passage
    from rag.models.rag.model import RagModel

    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]
    codes = ["red", "blue", "green", "black", "white", "pink", "gray", "brown", "gold", "cyan", "lime", "navy"]
    passages = [Passage(id=n, title=n, text=f"{n} code is {c}") for n, c in zip(names, codes)]
    questions = [f"code of {n} ?" for n in names]
    tok = train_bpe_tokenizer([f"{q} {p.title} {p.text}" for q, p in zip(questions, passages)] * 20, vocab_size=300)
    gen_dir = save(tiny_bart(tok), tok, tmp_path / "generator")
    q_dir = save(tiny_dpr(tok, "question"), tok, tmp_path / "question")
    kb = KnowledgeBase.build(passages, TextEncoder(save(tiny_dpr(tok, "context"), tok, tmp_path / "context")),
                             tmp_path / "kb", index="flat", show_progress=False)
    top_rows = [[i, (i + 1) % 12] for i in range(12)]  # an oracle retriever: own passage first, a neighbour second

    def train(mixing: ContextMixing, steps: int = 150):
        torch.manual_seed(0)
        model = RagModel.from_components(q_dir, gen_dir, kb, n_docs=1, freeze_query_encoder=True)
        opt = torch.optim.AdamW(model.generator.parameters(), lr=3e-3)
        for step in range(steps):  # a fresh draw of contexts per step, as epochs of a mixed DataModule would give
            mixing.seed = step
            rows = [c.row for c in sample_context_choices(top_rows, mixing)]
            loss = model.generator_loss(questions, codes, [passages[r] for r in rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.eval()

    def answer_nll(model, shift: int) -> float:  # mean NLL of the right code with passage (i + shift) % 12
        model.config.reduce_loss = False
        with torch.no_grad():
            nll = model.generator_loss(questions, codes, [passages[(i + shift) % 12] for i in range(12)])
        return float(nll.mean())

    top1_only = train(ContextMixing(top_k=2, p_top1=1.0, p_low=0.0, p_random=0.0))
    mixed = train(ContextMixing(top_k=2, low_rank_start=1))
    own = answer_nll(top1_only, 0), answer_nll(mixed, 0)
    random_ctx = answer_nll(top1_only, 5), answer_nll(mixed, 5)
    assert own[0] < 1.0 and own[1] < 1.0, own  # both read their own passage well
    assert random_ctx[0] > 3.0, random_ctx  # the top-1 reader copies the wrong code
    assert random_ctx[1] < random_ctx[0] / 3, random_ctx  # the RetRobust reader is far less hurt
