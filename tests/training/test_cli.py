"""`rag fit|validate|test` through LightningCLI: every bundled config parses, unknown keys are
named, and a tiny end-to-end run writes CSV + TensorBoard logs and a resumable checkpoint."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import yaml

from rag.cli.train import make_cli

CONFIG_DIR = Path(__file__).resolve().parents[2] / "lightning_configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
NLI_CONFIGS = [p for p in CONFIGS if p.name.startswith("nli_")]
# ralm_*, replug_*: tested in tests/ralm; retrobust_*: tests/training/test_causal_reader.py; nli_*, reranker_*: below
RAG_CONFIGS = [p for p in CONFIGS if not p.name.startswith(("ralm_", "replug_", "nli_", "retrobust_", "reranker_"))]


def test_expected_configs_exist():
    assert {p.name for p in CONFIGS} >= {"rag_sequence_bart.yaml", "rag_token_bart.yaml", "rag_t5.yaml", "tiny_cpu.yaml",
                                        "nli_minilm.yaml", "nli_tiny.yaml"}
    for p in CONFIGS:
        first = p.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# Launch:") and f"--config lightning_configs/{p.name}" in first, p.name


def test_the_reranker_distillation_config_parses_and_instantiates(tmp_path, monkeypatch):
    from rag.training.rerank_distill import PosteriorDataModule, RerankDistillModule

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(CONFIG_DIR / "reranker_demo.yaml")], run=False)
    assert isinstance(cli.model, RerankDistillModule) and isinstance(cli.datamodule, PosteriorDataModule)


@pytest.mark.parametrize("path", RAG_CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_instantiates(path, tmp_path, monkeypatch):
    from rag.training.data import QADataModule
    from rag.training.modules import RagModule

    monkeypatch.chdir(tmp_path)  # loggers/checkpoint dirs are relative: keep them out of the repo
    cli = make_cli(["--config", str(path)], run=False)
    assert isinstance(cli.model, RagModule) and isinstance(cli.datamodule, QADataModule)
    assert cli.model.model is None  # lazy: parsing never loads models or knowledge bases
    cfg = yaml.safe_load(path.read_text())
    init = cfg["model"]["init_args"]
    assert cli.model.hparams.generator == init["generator"]
    assert cli.model.hparams.rag["n_docs"] == init["rag"]["n_docs"]
    assert cli.model.rag_config.marginalization == init["rag"].get("marginalization", "sequence")
    if path.name.startswith("tiny_cpu"):  # needs no hub: random tiny generator, bundled MiniLM, demo data
        assert init["generator"].startswith("tiny:") and init["question_encoder"] == "minilm"
        assert init["build_knowledge_base"]["corpus"] == "demo"
        assert cfg["data"]["init_args"]["train"].startswith("demo:")
    elif path.name == "cpu_reader.yaml":  # needs no hub: warm-started MiniLM generator, reading practice, a CPU budget
        assert init["generator"] == "warm:minilm" and cli.model.components.warm_start.pointer
        assert cli.model.practice_settings.source == "corpus" and cli.model.hparams.cache_encoder
        budget = [c for c in cli.trainer.callbacks if type(c).__name__ == "CpuBudget"]
        assert len(budget) == 1 and 0 < budget[0].minutes <= 20
    elif path.name == "cpu_causal_reader.yaml":  # needs no hub: the demo LM (SmolLM2) with LoRA, a CPU budget
        assert init["generator"] == "smollm2"
        budget = [c for c in cli.trainer.callbacks if type(c).__name__ == "CpuBudget"]
        assert len(budget) == 1 and 0 < budget[0].minutes <= 30
    else:
        assert init["generator"] in ("facebook/bart-large", "t5-base")
        assert init["question_encoder"] == "facebook/dpr-question_encoder-single-nq-base"


@pytest.mark.parametrize("path", NLI_CONFIGS, ids=lambda p: p.name)
def test_nli_config_parses_and_instantiates(path, tmp_path, monkeypatch):
    from rag.training.nli import NLIModule
    from rag.training.nli_data import NLIDataModule

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(path)], run=False)
    assert isinstance(cli.model, NLIModule) and isinstance(cli.datamodule, NLIDataModule)
    assert cli.model.model is None and not cli.datamodule.splits  # lazy: nothing loaded or downloaded on parse
    cfg = yaml.safe_load(path.read_text())
    assert cli.model.hparams.encoder == cfg["model"]["init_args"]["encoder"] == "minilm"
    # output paths follow trainer.default_root_dir ({default_root_dir} in the config, expanded by rag's CLI)
    root = cfg["trainer"]["default_root_dir"]
    assert cli.model.hparams.export_dir == cfg["model"]["init_args"]["export_dir"].replace("{default_root_dir}", root)
    if path.name != "nli_tiny.yaml":  # the recipes: SNLI, with a stated step budget and a wall-clock cap
        assert cfg["data"]["init_args"]["train"] == "snli:train" and cfg["data"]["init_args"]["test"] == "snli:test"
        assert cfg["trainer"]["max_steps"] > 0 and cfg["trainer"]["max_time"]


def _write(tmp_path, cfg: dict, name="cfg.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize(
    "where, key",
    [
        (("model", "init_args"), "generator_learning_rate"),
        (("model", "init_args", "rag"), "n_doc"),
        (("data", "init_args"), "batchsize"),
        (("trainer",), "max_epoch"),
    ],
)
def test_unknown_key_is_named(tmp_path, capsys, where, key):
    cfg = yaml.safe_load((CONFIG_DIR / "tiny_cpu.yaml").read_text())
    node = cfg
    for part in where:
        node = node[part]
    node[key] = 1
    with pytest.raises(SystemExit) as e:
        make_cli(["--config", _write(tmp_path, cfg)], run=False)
    assert e.value.code != 0
    err = capsys.readouterr().err
    message = err.rsplit("error:", 1)[-1]  # the error itself, after the usage text
    assert key in message and ("not accepted" in message or "does not accept" in message), message


@pytest.mark.parametrize("config, old, value, new", [
    ("tiny_cpu.yaml", "generator_lr", 1e-3, "model.optimizer.lr"),
    ("tiny_cpu.yaml", "num_beams", 2, "model.decoding.num_beams"),
    ("tiny_cpu.yaml", "recall_at", [1], "model.evaluation.recall_at"),
    ("tiny_cpu.yaml", "build_knowledge_base_from", "demo", "model.build_knowledge_base.corpus"),
    ("tiny_cpu.yaml", "retrieval_actors", 2, "model.retrieval_actors.count"),
    ("replug_lsr_tiny.yaml", "query_encoder_lr", 1e-4, "model.optimizer.lr"),
    ("retrobust_reader_tiny.yaml", "learning_rate", 1e-4, "model.optimizer.lr"),
    ("nli_tiny.yaml", "warmup_ratio", 0.1, "model.optimizer.warmup_ratio"),
    ("ralm_reranker_tiny.yaml", "rank_prior_lr", 0.1, "model.optimizer.rank_prior_lr"),
])
def test_an_old_key_is_refused_naming_the_new_one(tmp_path, capsys, config, old, value, new):
    """An option of an earlier release (flat, now in an argument group), in a config file or as a flag: `rag fit` exits 2
    with one line naming the new key."""
    from rag.cli import main

    cfg = yaml.safe_load((CONFIG_DIR / config).read_text())
    cfg["model"]["init_args"][old] = value
    assert main(["fit", "--config", _write(tmp_path, cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.{old} is now {new}" in err[0], err
    flag = ["--model.init_args." + old if config != "tiny_cpu.yaml" else "--model." + old, str(value)]
    assert main(["fit", "--config", str(CONFIG_DIR / config), *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.{old} is now {new}" in err[0] and "the command line" in err[0], err


def test_print_config_without_a_config_shows_the_default_modules(tmp_path, monkeypatch, capsys):
    """`rag fit --print_config` shows RagModule's and QADataModule's options, nested RAG options expanded."""
    from rag.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--print_config"])
    assert e.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["class_path"] == "rag.training.modules.RagModule"
    assert cfg["model"]["init_args"]["rag"]["n_docs"] == 5 and "retrieval_temperature" in cfg["model"]["init_args"]["rag"]
    assert cfg["model"]["init_args"]["tiny"]["d_model"] > 0
    assert cfg["data"]["class_path"] == "rag.training.data.QADataModule" and "batch_size" in cfg["data"]["init_args"]


def test_print_config_keeps_the_config_class(tmp_path, monkeypatch, capsys):
    from rag.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIG_DIR / "replug_lsr_tiny.yaml"), "--print_config"])
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["class_path"] == "rag.training.replug_lsr.ReplugLSRModule" and "rag" not in cfg["model"]["init_args"]


@pytest.mark.parametrize("argv, shows", [
    (["fit", "--model.rag.help"], "--model.rag.n_docs"),
    (["fit", "--model", "RagModule", "--model.tiny.help"], "--model.tiny.d_model"),
    (["fit", "--config", str(CONFIG_DIR / "replug_lsr_tiny.yaml"), "--model.lm.help"], "--model.retrieval_temperature"),
])
def test_nested_option_help_shows_the_fields_with_their_docs(argv, shows, tmp_path, monkeypatch, capsys):
    from rag.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert shows in out
    if "rag.help" in argv[-1]:  # the field's own docstring, not only its type
        assert "marginalised" in out.split("--model.rag.n_docs N_DOCS", 2)[-1][:200]


@pytest.mark.slow
def test_cli_fit_validate_and_resume(tmp_path, monkeypatch, capsys, caplog, tiny_bart_dir, tiny_dpr_question_dir,
                                    tiny_kb_dir):
    """`rag fit` then `rag validate` and a resumed `rag fit`, all via rag.cli.main."""
    from rag.cli import main

    caplog.set_level(logging.INFO, logger="pytorch_lightning")

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    cfg = {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2,
            "num_sanity_val_steps": 0, "default_root_dir": str(run), "enable_progress_bar": True,
            "gradient_clip_val": 1.0, "accumulate_grad_batches": 1, "log_every_n_steps": 1,
            "logger": [
                {"class_path": "pytorch_lightning.loggers.CSVLogger", "init_args": {"save_dir": str(run), "name": "csv"}},
                {"class_path": "pytorch_lightning.loggers.TensorBoardLogger", "init_args": {"save_dir": str(run), "name": "tb"}},
            ],
            "callbacks": [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(run / "ckpt"), "save_last": True}}],
        },
        "model": {"class_path": "RagModule", "init_args": {  # short class names resolve too
            "generator": tiny_bart_dir, "question_encoder": tiny_dpr_question_dir, "knowledge_base": tiny_kb_dir,
            "rag": {"n_docs": 2, "max_context_length": 48, "max_target_length": 8},
            "decoding": {"max_new_tokens": 3}, "evaluation": {"recall_at": [1, 2]}}},
        "data": {"class_path": "QADataModule", "init_args": {
            "train": "demo:train", "val": "demo:dev", "test": "demo:test", "batch_size": 4, "max_eval_examples": 4}},
    }
    path = _write(tmp_path, cfg)
    assert main(["fit", "--config", path]) == 0
    shown = [r.getMessage() for r in caplog.records]
    assert any("GPU available" in m for m in shown)  # Lightning's own lines are shown ...
    assert not any("litlogger" in m for m in shown)  # ... but not its advertisement of a cloud logging service
    assert not any("weights_only" in m for m in shown)  # nor its line on every checkpoint save
    last = run / "ckpt" / "last.ckpt"
    assert last.is_file()
    metrics_files = list((run / "csv").rglob("metrics.csv"))
    assert len(metrics_files) == 1
    header = next(csv.reader(open(metrics_files[0])))
    assert {"train/loss", "val/em", "val/f1", "val/recall@1", "val/recall@2"} <= set(header)
    assert list((run / "tb").rglob("events.out.tfevents.*")), "TensorBoard wrote no event file"
    assert list(run.rglob("config.yaml")), "the resolved config was not saved next to the logs"

    # validate from the checkpoint, and resume training to step 3 (config.yaml is overwritten, not an error)
    assert main(["validate", "--config", path, "--ckpt_path", str(last)]) == 0
    assert main(["fit", "--config", path, "--trainer.max_steps", "3", "--ckpt_path", str(last)]) == 0
    import torch

    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 3

    # a data file that is not there: one line before anything is built
    capsys.readouterr()
    assert main(["fit", "--config", path, "--data.train", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "data.train" in err and "missing.jsonl: no such file" in err and "Traceback" not in err

    # rag test from the checkpoint: the model is the checkpoint's, but how to evaluate is the command's
    from rag.training.modules import RagModule

    seen = []
    inner = RagModule._answer
    monkeypatch.setattr(RagModule, "_answer", lambda self, q: (seen.append(self.decoding.resolved()), inner(self, q))[1])
    assert main(["test", "--config", path, "--ckpt_path", str(last), "--model.decoding.num_beams", "2",
                 "--model.init_args.decoding.length_penalty", "1.5"]) == 0
    assert seen and all(h["num_beams"] == 2 and h["length_penalty"] == 1.5 and h["max_new_tokens"] == 3 for h in seen)


def test_a_config_of_another_module_keeps_that_modules_defaults(tmp_path):
    """The CLI's default model (RagModule) lends nothing to the module a config chooses: NLIModule's optimizer defaults
    (weight decay 0.01) stay its own where the config sets no optimizer."""
    cfg = yaml.safe_load((CONFIG_DIR / "nli_tiny.yaml").read_text())
    del cfg["model"]["init_args"]["optimizer"]
    cli = make_cli(["--config", _write(tmp_path, cfg)], run=False)
    assert cli.model.optimizer_settings.weight_decay == 0.01 and cli.model.optimizer_settings.lr == 8e-5
