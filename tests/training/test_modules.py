"""RagModule: fast_dev_run smoke, per-component learning rates, schedule, checkpoint resume, setup errors."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from rag.generators.tiny_generator import TinyGenerator, ensure_tiny_generator
from rag.training.modules import RagModule
from rag.training.schedules import warmup_constant, warmup_linear_decay
from rag.utils.errors import ConfigError, KnowledgeBaseError


def _snapshot(params):
    return [p.detach().clone() for p in params]


def _changed(before, params):
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, params))


def test_schedule_values():
    f = lambda s: warmup_linear_decay(s, warmup_steps=10, total_steps=110)  # noqa: E731
    assert [f(s) for s in (0, 5, 10, 60, 110, 200)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert warmup_linear_decay(3, 0, 4) == pytest.approx(0.25)  # no warm-up: decay from step 0
    assert [warmup_constant(s, 4, 100) for s in (0, 2, 4, 50)] == [0.0, 0.5, 1.0, 1.0]


def test_constructor_validates_without_building(make_module):
    m = make_module(generator="facebook/bart-large-that-does-not-exist")  # lazy: nothing loaded yet
    assert m.model is None and m.hparams.rag["n_docs"] == 2
    with pytest.raises(ConfigError, match="n_docs"):
        make_module(rag={"n_docs": 0})
    with pytest.raises(ConfigError, match=r"model.rag: unknown field\(s\) \['ndocs'\]"):
        make_module(rag={"ndocs": 3})
    with pytest.raises(ConfigError, match="warmup_steps or model.optimizer.warmup_ratio"):
        make_module(optimizer={"warmup_steps": 3, "warmup_ratio": 0.1})
    with pytest.raises(ConfigError, match="tiny:bart"):
        make_module(generator="tiny:gpt")


def test_fast_dev_run_trains_both_components_and_reports_metrics(make_module, make_data, trainer_kw):
    module = make_module(rag={"n_docs": 2, "max_context_length": 24, "max_target_length": 8, "max_question_length": 16})
    module.configure_model()
    assert module.model.training  # built in train mode (from_pretrained returns eval mode)
    groups = module.model.parameter_groups()
    q_before, g_before = _snapshot(groups["query_encoder"]), _snapshot(groups["generator"])
    trainer = pl.Trainer(fast_dev_run=True, **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 1
    assert _changed(q_before, groups["query_encoder"]), "no update reached the query encoder"
    assert _changed(g_before, groups["generator"])
    m = trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/em", "val/f1", "val/recall@1", "val/recall@3"):
        assert key in m, f"{key} not logged; got {sorted(m)}"
    assert 0.0 <= float(m["val/recall@1"]) <= float(m["val/recall@3"]) <= 1.0
    # contexts of 24 tokens cannot hold a demo passage: truncations are counted and logged per epoch
    assert float(m["train/truncated_contexts"]) > 0
    assert torch.isfinite(m["train/loss"])


def test_optimizer_groups_and_schedule(make_module, make_data, trainer_kw):
    # 6 batches with gradient accumulation 2 = 3 optimizer steps; warm-up = round(0.5 * 3) = 2 steps
    module = make_module(optimizer={"query_encoder_lr": 1e-4, "lr": 5e-4, "warmup_ratio": 0.5, "weight_decay": 0.01})
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=6, accumulate_grad_batches=2, limit_val_batches=0, **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 3 and trainer.estimated_stepping_batches == 3
    opt = trainer.optimizers[0]
    by_name = {g["name"]: g for g in opt.param_groups}
    assert set(by_name) == {"query_encoder", "query_encoder_no_decay", "generator", "generator_no_decay"}
    assert by_name["query_encoder"]["initial_lr"] == 1e-4 and by_name["generator"]["initial_lr"] == 5e-4
    assert by_name["generator"]["weight_decay"] == 0.01 and by_name["generator_no_decay"]["weight_decay"] == 0.0
    groups = module.model.parameter_groups()
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    query_encoder = ids(by_name["query_encoder"]["params"]) | ids(by_name["query_encoder_no_decay"]["params"])
    assert query_encoder == ids(groups["query_encoder"])
    assert ids(by_name["generator"]["params"]) | ids(by_name["generator_no_decay"]["params"]) == ids(groups["generator"])
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.lr_lambdas[0].keywords == {"warmup_steps": 2, "total_steps": 3}
    assert [sched.lr_lambdas[0](s) for s in range(4)] == [0.0, 0.5, 1.0, 0.0]
    for g in opt.param_groups:  # stepped once per optimizer step: now at step 3 of 3
        assert g["lr"] == pytest.approx(g["initial_lr"] * warmup_linear_decay(3, 2, 3))


def test_frozen_query_encoder_has_no_group(make_module):
    from types import SimpleNamespace

    module = make_module(rag={"n_docs": 2, "freeze_query_encoder": True})
    module.configure_model()
    module._trainer = SimpleNamespace(estimated_stepping_batches=10)  # configure_optimizers only reads this
    opt = module.configure_optimizers()["optimizer"]
    assert [g["name"] for g in opt.param_groups] == ["generator"]
    assert not any(p.requires_grad for p in module.model.question_encoder.parameters())


def test_checkpoint_save_and_resume(make_module, make_data, trainer_kw, tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    ckpt_dir = tmp_path / "ckpt"
    kw = dict(limit_val_batches=0, **trainer_kw)
    first = make_module()
    t1 = pl.Trainer(max_steps=2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], **kw)
    t1.fit(first, datamodule=make_data())
    last = ckpt_dir / "last.ckpt"
    assert last.is_file()
    ckpt = torch.load(last, weights_only=True, map_location="cpu")  # plain types only: safe loading works
    assert ckpt["global_step"] == 2 and ckpt["hyper_parameters"]["rag"]["n_docs"] == 2
    assert ckpt["rag"]["kb_version"].startswith("kb-")
    saved = {k: v.clone() for k, v in first.state_dict().items()}

    # Resume in a fresh module/trainer: weights, optimizer state and step counter continue.
    second = make_module()
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["state"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
            seen["adam_step"] = max(float(s["step"]) for s in trainer.optimizers[0].state.values())

    t2 = pl.Trainer(max_steps=3, callbacks=[Probe()], **kw)
    t2.fit(second, datamodule=make_data(), ckpt_path=str(last))
    assert t2.global_step == 3
    assert seen["adam_step"] == 2.0
    assert set(seen["state"]) == set(saved)
    assert all(torch.equal(seen["state"][k], saved[k]) for k in saved)

    # load_from_checkpoint builds the model (configure_model) and loads its weights
    restored = RagModule.load_from_checkpoint(str(last), map_location="cpu")
    assert all(torch.equal(restored.state_dict()[k], saved[k]) for k in saved)


def test_kb_dimension_mismatch_fails_before_first_step(make_module, make_data, trainer_kw, minilm_path):
    module = make_module(question_encoder=minilm_path)  # 384-d queries against a 32-d knowledge base
    trainer = pl.Trainer(max_steps=1, **trainer_kw)
    with pytest.raises(KnowledgeBaseError, match="dim"):
        trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 0


def test_tiny_generator_is_built_once_and_cached(tiny_kb_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    spec = TinyGenerator(d_model=16, layers=1, heads=2, ffn=32, vocab_size=400)
    path = ensure_tiny_generator("bart", spec, tiny_kb_dir)
    assert path.startswith(str(tmp_path / "cache" / "tiny"))
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model, tok = AutoModelForSeq2SeqLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert model.config.d_model == 16 and model.config.vocab_size == len(tok)
    mtime = (tmp_path / path / "config.json").stat().st_mtime_ns
    assert ensure_tiny_generator("bart", spec, tiny_kb_dir) == path  # cached: same directory, not rebuilt
    assert (tmp_path / path / "config.json").stat().st_mtime_ns == mtime
    assert ensure_tiny_generator("bart", TinyGenerator(d_model=16, layers=1, heads=2, ffn=32, vocab_size=400, seed=1),
                                 tiny_kb_dir) != path


def test_bf16_mixed_precision_and_clipping(make_module, make_data, trainer_kw):
    """Trainer-level mixed precision (CPU autocast bf16) and gradient clipping work with the module."""
    module = make_module()
    trainer = pl.Trainer(fast_dev_run=True, precision="bf16-mixed", gradient_clip_val=0.5, **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    m = trainer.callback_metrics
    assert trainer.global_step == 1 and torch.isfinite(m["train/loss"]) and torch.isfinite(m["val/loss"])
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32


def test_closed_book_trains_only_the_generator_on_bare_questions(make_module, make_data, trainer_kw, monkeypatch):
    """model.closed_book: the loss is RagModel.generator_loss(questions, targets) (no passage), nothing is ever retrieved,
    the query encoder keeps its weights, and validation reports EM/F1 without recall."""
    module = make_module(closed_book=True)
    module.configure_model()
    groups = module.model.parameter_groups()
    q_before, g_before = _snapshot(groups["query_encoder"]), _snapshot(groups["generator"])
    batch = {"questions": ["what is the symbol of gold?", "which element has atomic number 8?"], "targets": ["Au", "Oxygen"]}
    expected = module.model.generator_loss(batch["questions"], batch["targets"])
    assert float(module.training_step(batch, 0).detach()) == pytest.approx(float(expected), rel=1e-6)

    def no_retrieval(*a, **k):
        raise AssertionError("a closed-book run retrieved")

    monkeypatch.setattr(module.model, "retrieve", no_retrieval)
    monkeypatch.setattr(module.model, "prepare_inputs", no_retrieval)
    trainer = pl.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    assert [g["name"] for g in trainer.optimizers[0].param_groups] == ["generator"]
    assert not _changed(q_before, groups["query_encoder"]) and _changed(g_before, groups["generator"])
    m = trainer.callback_metrics
    assert {"val/loss", "val/em", "val/f1"} <= set(m) and not any(k.startswith("val/recall") for k in m)


def test_closed_book_refuses_mixed_contexts(make_module):
    from rag.knowledge.passages import Passage
    from rag.utils.errors import ConfigError

    module = make_module(closed_book=True)
    module.configure_model()
    with pytest.raises(ConfigError, match="model.closed_book.*context_mixing"):
        module.training_step({"questions": ["q?"], "targets": ["a"], "contexts": [Passage(id="p", title="t", text="x")],
                              "context_kinds": ["top1"]}, 0)


def test_generation_metrics_are_logged_in_validation(make_module, make_data, trainer_kw):
    from rag.utils.errors import ConfigError

    module = make_module(evaluation={"generation_metrics": ["bleu1", "rougeL"], "recall_at": [1, 3]})
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, val_check_interval=1, **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    m = trainer.callback_metrics
    assert {"val/bleu1", "val/rougeL", "val/em", "val/f1"} <= set(m)
    assert 0.0 <= float(m["val/bleu1"]) <= 1.0 and 0.0 <= float(m["val/rougeL"]) <= 1.0
    with pytest.raises(ConfigError, match="model.evaluation.generation_metrics.*bleu4"):
        make_module(evaluation={"generation_metrics": ["bleu4"]})


def test_rag_module_actor_options_are_checked():
    from rag.training.modules import RagModule
    from rag.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="model.retrieval_actors.count"):
        RagModule(retrieval_actors={"count": -1})
    with pytest.raises(ConfigError, match="set model.retrieval_actors.count too"):
        RagModule(retrieval_actors={"ray_address": "head:6379"})


@pytest.mark.parametrize("settings, phases, strategy", [
    ({}, [{"generator", "query_encoder"}], "ddp"),
    ({"reading_practice": {"pretrain_steps": 2}}, [{"generator"}, {"generator", "query_encoder"}],
     "ddp_find_unused_parameters_true"),
    ({"reading_practice": {"pretrain_steps": 2}, "closed_book": True}, [{"generator"}, {"generator"}], "ddp"),
    ({"reading_practice": {"pretrain_steps": 2}, "rag": {"freeze_query_encoder": True}}, [{"generator"}, {"generator"}], "ddp"),
    ({"reading_practice": {"pretrain_steps": 2}, "rag": {"freeze_query_encoder": True, "learn_retrieval_temperature": True}},
     [{"generator"}, {"generator", "retrieval_temperature"}], "ddp_find_unused_parameters_true"),
])
def test_training_phases_choose_the_ddp_strategy(settings, phases, strategy):
    """The module says which parameter groups each phase of its run trains; the DDP strategy follows from that outside
    it (rag.training.distributed.ddp_strategy): unused-parameter search only when the phases differ."""
    from rag.training.distributed import ddp_strategy
    from rag.training.modules import RagModule

    module = RagModule(**settings)
    assert module.training_phases == [frozenset(p) for p in phases]
    assert ddp_strategy("ddp", module.training_phases) == strategy
    assert ddp_strategy("fsdp", module.training_phases) == "fsdp" and ddp_strategy(None, module.training_phases) is None


def test_decoding_left_unset_takes_the_generation_options_defaults(make_module):
    """model.decoding fields left null resolve from the one table of generation defaults, not constants of training."""
    from rag.generation.options import FALLBACK_DEFAULTS

    resolved = make_module(decoding={}).decoding.resolved()
    assert resolved == {"num_beams": FALLBACK_DEFAULTS["num_beams"], "max_new_tokens": FALLBACK_DEFAULTS["max_new_tokens"],
                        "length_penalty": FALLBACK_DEFAULTS["length_penalty"], "sequence_decoding": FALLBACK_DEFAULTS["decoding"]}
    assert make_module(decoding={"num_beams": 3}).decoding_defaults() == {
        "num_beams": 3, "max_new_tokens": FALLBACK_DEFAULTS["max_new_tokens"], "length_penalty": 1.0}
