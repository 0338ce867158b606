"""The CPU reader recipe's parts: reading practice from any corpus, the CPU budget, the warm-started generator named in
YAML with its frozen encoder cached inside the LightningModule, and checkpoints / exports that stay loadable."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from rag.knowledge.passages import Passage
from rag.training.budget import CpuBudget
from rag.training.reading_practice import ReadingPracticeSettings, corpus_practice
from rag.utils.errors import ConfigError

PASSAGES = [
    Passage("a", "Quicksort", "Quicksort is a sorting algorithm that picks a pivot. It partitions the array around the pivot "
            "and recurses on both sides of it. Quicksort runs in n log n time on average."),
    Passage("b", "TCP", "A connection-oriented transport protocol of the Internet suite. It guarantees ordered delivery of "
            "bytes between two hosts over an unreliable network."),
    Passage("c", "", "A passage without a title cannot be asked about."),
]


def test_corpus_practice_can_only_be_answered_by_reading():
    examples = corpus_practice(PASSAGES, 200, seed=3)
    assert examples == corpus_practice(PASSAGES, 200, seed=3)  # seeded
    kinds = {"definition": 0, "term": 0}
    for e in examples:
        title = e.passage.title
        assert title not in ("Quicksort", "TCP") and "quicksort" not in e.passage.text.lower()  # the real name is gone
        assert "tcp" not in e.passage.text.lower().split()
        if e.question.startswith("what is "):
            kinds["definition"] += 1
            assert e.question == f"what is {title}?" and e.passage.text.startswith(e.answer.rstrip("."))
        else:
            kinds["term"] += 1
            quote = e.question.split('"')[1]
            assert e.answer == title and quote in e.passage.text
    assert kinds["definition"] > 100 and kinds["term"] > 20, kinds
    with pytest.raises(ConfigError, match="titles"):
        corpus_practice([PASSAGES[2]], 3)


@pytest.mark.parametrize("kw, field", [({"per_step": 0}, "per_step"), ({"pool": -1}, "pool"), ({"source": "web"}, "source"),
                                       ({"pretrain_steps": -1}, "pretrain_steps"), ({"pretrain_lr": 0}, "pretrain_lr")])
def test_bad_practice_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"model.reading_practice.{field}"):
        ReadingPracticeSettings(**kw)


@pytest.mark.parametrize("minutes", [0, -1, True, "5"])
def test_a_budget_must_be_positive(minutes):
    with pytest.raises(ConfigError, match="CpuBudget"):
        CpuBudget(minutes)


def test_budget_stops_training(make_module, make_data, trainer_kw):
    budget = CpuBudget(minutes=1e-7)  # spent by the first step
    trainer = pl.Trainer(max_steps=50, limit_val_batches=0, callbacks=[budget], **trainer_kw)
    trainer.fit(make_module(), datamodule=make_data())
    assert trainer.global_step == 1 and budget.stopped_at_step == 1 and budget.used_seconds > 0


def test_pretraining_steps_train_the_generator_alone_then_rag_takes_over(make_module, make_data, trainer_kw):
    """reading_practice.pretrain_steps: the first steps read practice alone at pretrain_lr (nothing retrieved: the query
    encoder stays put, its learning rate 0); then the RAG loss and the configured learning rates take over."""
    module = make_module(reading_practice={"per_step": 2, "pool": 20, "pretrain_steps": 2, "pretrain_batch": 3,
                                           "pretrain_lr": 5e-3},
                         optimizer={"query_encoder_lr": 1e-3, "lr": 2e-3, "schedule": "constant"})
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            qenc = torch.cat([p.detach().flatten() for p in pl_module.model.question_encoder.parameters()])
            gen = torch.cat([p.detach().flatten() for p in pl_module.model.generator.parameters() if p.requires_grad])
            lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
            seen.append((qenc.clone(), gen.clone(), lrs, float(outputs["loss"])))

    trainer = pl.Trainer(max_steps=4, limit_val_batches=0, callbacks=[Watch()], **trainer_kw)
    module.configure_model()
    q0 = torch.cat([p.detach().flatten() for p in module.model.question_encoder.parameters()]).clone()
    trainer.fit(module, datamodule=make_data())
    assert len(seen) == 4
    assert torch.equal(seen[0][0], q0) and torch.equal(seen[0][0], seen[1][0])  # pre-training: the query encoder never moves ...
    assert not torch.equal(seen[0][1], seen[1][1])  # ... while the generator learns
    assert not torch.equal(seen[2][0], seen[3][0])  # after it, retrieval's gradient reaches the query encoder
    # LambdaLR has already moved to the next step's rate when a batch ends: seen[0] holds step 1's, seen[1] step 2's
    assert seen[0][2]["generator"] == pytest.approx(5e-3) and seen[0][2]["query_encoder"] == 0.0
    assert seen[1][2]["generator"] == pytest.approx(2e-3) and seen[1][2]["query_encoder"] == pytest.approx(1e-3)


def test_warm_generator_from_yaml_trains_with_cached_encoder_and_practice(tiny_kb_dir, tiny_dpr_question_dir, make_data,
                                                                         trainer_kw, tmp_path):
    """generator: warm:minilm builds (once) a copy-head generator over the bundled MiniLM; training caches its frozen
    encoder inside the module, mixes reading practice into each step, and the checkpoint and export load back."""
    from rag.generators.warm_start import is_warm_start
    from rag.training.export import export_checkpoint
    from rag.training.modules import RagModule

    def make():
        return RagModule(generator="warm:minilm", question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
                         warm_start={"decoder_layers": 1, "pointer": True},
                         rag={"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "max_question_length": 16},
                         reading_practice={"per_step": 2, "pool": 20},
                         decoding={"max_new_tokens": 3, "num_beams": 2, "length_penalty": 1.5, "sequence_decoding": "fast"},
                         evaluation={"recall_at": [1]},
                         export_dir=str(tmp_path / "model"))

    module = make()
    calls = []
    trainer = pl.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], **trainer_kw)
    module.configure_model()
    gen = module.model.generator
    assert is_warm_start(gen) and not any(p.requires_grad for p in gen.encoder.parameters())
    assert gen.copy_continue_bigram is not None and gen.config.rag_warm_start["continuation"] == "bigram"  # the default
    inner_forward = gen.encoder.forward
    gen.encoder.forward = lambda *a, **k: (calls.append(1), inner_forward(*a, **k))[1]
    trainer.fit(module, datamodule=make_data())
    assert 0 < len(module._practice) <= 20 and calls  # practice built from the knowledge base; the encoder ran (cached)
    # fitted to the window: every practice prompt is read whole, its answer in its passage (rag.training.reading_practice)
    lengths = [len(module.model.lm.prompt_ids(e.question, [e.passage], module.model.config)[0]) for e in module._practice]
    assert max(lengths) <= 48 and all(e.answer in e.passage.text for e in module._practice)
    assert type(module.model.generator.encoder).__name__ != "_CachedEncoder"  # released at the end of fit
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    assert not any(".encoder.inner." in k for k in state) and any(k.startswith("model.generator.encoder.") for k in state)
    again = make()
    again.configure_model()
    again.load_state_dict(state)  # strict: every key in place
    assert (tmp_path / "model" / "rag_config.json").is_file()
    out = export_checkpoint(tmp_path / "ckpt" / "last.ckpt", tmp_path / "exported", knowledge_base=tiny_kb_dir)
    assert (out / "generator" / "config.json").is_file()
    from rag.generators.warm_start import load_warm_start
    from rag.pipeline.api import load

    for exported in (tmp_path / "model", out):  # the end of fit and rag export store the run's decoding settings
        stored = load(exported, knowledge_base=tiny_kb_dir).model.config.generation
        assert stored["num_beams"] == 2 and stored["max_new_tokens"] == 3 and stored["length_penalty"] == 1.5
    assert module.model.config.generation is None  # the module's own model is left as it was
    loaded, _ = load_warm_start(out / "generator")  # the trained continuation head is exported with the rest
    trained = module.model.generator.copy_continue
    assert torch.equal(loaded.copy_continue.weight, trained.weight) and torch.equal(loaded.copy_continue.bias, trained.bias)


def test_gold_passages_by_unique_answer_and_by_named_id():
    from rag.training.gold_passages import GoldPassages

    passages = PASSAGES + [Passage("d", "UDP", "A connectionless transport protocol of the Internet suite.")]
    gold = GoldPassages(passages, ["a sorting algorithm that picks a pivot", "transport protocol of the Internet suite", "it"],
                        mode="auto")
    found = gold.lookup(["A sorting algorithm that picks a pivot.", "transport protocol of the Internet suite", "it", "unseen"])
    assert [p.id if p else None for p in found] == ["a", None, None, None]  # two passages hold the second; "it" too short
    assert [p.id for p in gold.lookup(["x", "y"], ["b", "d"])] == ["b", "d"]  # named ids win when the batch has them
    with pytest.raises(ConfigError, match="passage id 'zz' is not in the knowledge base"):
        gold.lookup(["x"], ["zz"])
    with pytest.raises(ConfigError, match="model.gold_passage"):
        GoldPassages(passages, [], mode="sometimes")


def test_data_names_passages_and_gold_loss_joins_the_step(tmp_path, make_module, make_data, tiny_kb_dir):
    """data.passage_field carries each pair's passage id into the batch; model.gold_passage adds the generator's loss on
    that passage alone; an id that is not in the knowledge base stops fit before the first step, naming it."""
    import json

    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.open(tiny_kb_dir)
    argon = next(p for p in kb.all_passages() if p.title == "Argon")
    rows = [{"question": "what is the chemical symbol of argon?", "answers": ["Ar"], "pid": argon.id}] * 4
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = make_data(train=str(good), passage_field="pid", batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["passage_ids"] == [argon.id] * 4
    module = make_module(gold_passage="named")
    module.configure_model()
    from rag.training.gold_passages import GoldPassages

    module._gold = GoldPassages(kb.all_passages(), [], mode="named")
    model = module.model
    plain = model(batch["questions"], batch["targets"]).loss
    reading = model.generator_loss(batch["questions"], batch["targets"], [argon] * 4)
    mixed = module._with_auxiliary_losses(plain, batch)
    assert float(mixed) == pytest.approx((4 * float(plain) + 4 * float(reading)) / 8, rel=1e-5)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q?", "answers": ["a"], "pid": "nowhere"}) + "\n")
    trainer = pl.Trainer(max_steps=1, limit_val_batches=0, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="'nowhere' is not in the knowledge base"):
        trainer.fit(make_module(gold_passage="auto"), datamodule=make_data(train=str(bad), passage_field="pid"))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"question": "q?", "answers": ["a"]}) + "\n")
    with pytest.raises(Exception, match="data.passage_field"):
        make_data(train=str(missing), passage_field="pid").setup("fit")
