"""RagModule over a causal generator with LoRA from a YAML config: trains the adapters (and the query encoder), exports the
adapter with its base named, and a run resumed from a checkpoint spends the CPU budget it had left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from rag.training.budget import CpuBudget

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("causal_module") / "gpt2")


@pytest.fixture(scope="module")
def hybrid_kb(build_hybrid_kb):
    return build_hybrid_kb(40, "causal_module_kb")


def causal_config(gpt2_dir: str, kb: str, root: Path, **model_overrides) -> dict:
    """lightning_configs/cpu_causal_reader.yaml sized for a tiny random GPT-2 (its LoRA targets and layers)."""
    cfg = yaml.safe_load((REPO / "lightning_configs" / "cpu_causal_reader.yaml").read_text())
    init = cfg["model"]["init_args"]
    init.update(generator=gpt2_dir, knowledge_base=kb, question_encoder=None, export_dir=str(root / "model"))
    init["decoding"].update(max_new_tokens=3)
    init["generator_lora"].update(target_modules=["c_attn"], layers=[1])
    init["rag"].update(max_context_length=64)
    init.update(model_overrides)
    cfg["data"]["init_args"].update(max_eval_examples=4, eval_batch_size=4)
    cfg["trainer"].update(max_steps=2, val_check_interval=2, limit_val_batches=1, default_root_dir=str(root),
                          enable_progress_bar=False, logger=False)
    return cfg


def test_the_causal_recipe_trains_lora_and_the_query_encoder_and_exports_the_adapter(gpt2_dir, hybrid_kb, tmp_path):
    from rag.cli.train import make_cli

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(causal_config(gpt2_dir, hybrid_kb, tmp_path)))
    cli = make_cli(["fit", "--config", str(path)])
    model = cli.model.model
    assert cli.trainer.global_step == 2 and model.is_causal and model.config.retrieval == "hybrid"
    trainable = {n for n, p in model.generator.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".h.1." in n for n in trainable)  # only layer 1's adapters
    qenc = cli.model.model.question_encoder
    assert any(p.requires_grad for p in qenc.parameters())  # RAG: the query encoder trains too
    out = tmp_path / "model"
    meta = json.loads((out / "rag_config.json").read_text())
    assert meta["generator"]["adapter"]["base"]["name"] == str(Path(gpt2_dir).resolve())
    assert sorted(p.name for p in (out / "generator").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    from rag.pipeline.api import load

    [a] = load(out).generate(["which element has the symbol Li?"], max_new_tokens=3)
    assert len(a.passages) == 3


def test_a_resumed_run_spends_the_budget_it_had_left(make_module, make_data, trainer_kw, tmp_path):
    first = CpuBudget(minutes=60)
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1)
    pl.Trainer(max_steps=2, limit_val_batches=0, callbacks=[first, ckpt_cb], **trainer_kw).fit(make_module(),
                                                                                               datamodule=make_data())
    spent = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu",
                       weights_only=True)["callbacks"]["CpuBudget"]["used_seconds"]
    assert spent > 0
    again = CpuBudget(minutes=spent / 60)  # a budget the first run had already spent
    trainer = pl.Trainer(max_steps=50, limit_val_batches=0, callbacks=[again], **trainer_kw)
    trainer.fit(make_module(), datamodule=make_data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 3 and again.stopped_at_step == 3 and again.used_seconds > spent  # one step, then stop


def test_a_run_the_budget_stops_saves_its_last_step(make_module, make_data, trainer_kw, tmp_path, monkeypatch):
    """Checkpoints every 2 steps, validation every 20 (as the CPU configs do, so nothing saves at the epoch's end), and
    a budget spent at step 3 (a fake CPU clock, 10 s per reading): last.ckpt holds step 3, not the periodic step 2."""
    import types

    import rag.training.budget as budget_module

    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(budget_module, "time", types.SimpleNamespace(process_time=lambda: float(next(clock))))
    budget = CpuBudget(minutes=0.5)
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=2)
    trainer = pl.Trainer(max_steps=50, limit_val_batches=1, val_check_interval=20, check_val_every_n_epoch=None,
                         callbacks=[budget, ckpt_cb], **trainer_kw)
    trainer.fit(make_module(), datamodule=make_data())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    assert budget.stopped_at_step == trainer.global_step == saved["global_step"] == 3
