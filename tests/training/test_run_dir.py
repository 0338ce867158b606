"""A run's folder (issue #28.16): every output path of every shipped config follows --trainer.default_root_dir, and
two runs never share one. Also which runs DDP searches for unused parameters in (issue #31.1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rag.cli import main
from rag.cli.train import make_cli
from rag.training.run_dir import LOCK_FILE, RUN_DIR, hold_run_dir, release_run_dirs

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "lightning_configs").glob("*.yaml"))
INPUTS = {("model", "knowledge_base"), ("data", "knowledge_base"), ("data", "texts"), ("data", "train"), ("data", "val"),
          ("data", "test"), ("data", "predict"), ("data", "data_dir")}
"""Keys whose paths are read, not written (a knowledge base the config builds once, if missing, is a shared cache)."""


def _strings(value, key=()):
    """(key path, string) of every string in a parsed YAML config."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, (*key, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, (*key, i))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_shipped_config_fixes_an_output_path(path):
    cfg = yaml.safe_load(path.read_text())
    trainer = cfg["trainer"]
    assert trainer["default_root_dir"].startswith("runs/")  # the one path a config sets; the CLI may move it
    outputs = []
    logger = trainer.get("logger")
    if isinstance(logger, dict):
        outputs.append(("trainer.logger.save_dir", logger["init_args"].get("save_dir")))
    for cb in trainer.get("callbacks") or []:
        for key in ("dirpath", "output_dir"):
            outputs.append((f"{cb['class_path']}.{key}", cb.get("init_args", {}).get(key)))
    init = cfg["model"]["init_args"]
    for key, value in (("export_dir", init.get("export_dir")),
                       ("evaluation.predictions_file", (init.get("evaluation") or {}).get("predictions_file"))):
        outputs.append((f"model.{key}", value))
    for what, value in outputs:
        assert value is None or value.startswith(RUN_DIR), f"{path.name}: {what} = {value!r} is fixed"
    for key, value in _strings(cfg):
        top = (key[0], key[2]) if len(key) > 2 and key[1] == "init_args" else None
        if value.startswith(("runs/", "./runs", "/")) and key != ("trainer", "default_root_dir"):
            assert top in INPUTS, f"{path.name}: {'.'.join(map(str, key))} = {value!r} is a fixed path"


@pytest.mark.parametrize("name", ["cpu_reader.yaml", "tiny_cpu.yaml", "tiny_cpu_refresh.yaml", "replug_lsr_tiny.yaml",
                                  "ralm_reranker_tiny.yaml", "retrobust_reader_tiny.yaml", "nli_tiny.yaml"])
def test_default_root_dir_moves_every_output(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "elsewhere" / "exp2"
    cli = make_cli(["--config", str(REPO / "lightning_configs" / name), "--trainer.default_root_dir", str(root)], run=False)
    trainer = cli.trainer
    assert Path(trainer.logger.save_dir) == root
    for cb in trainer.callbacks:
        for attr in ("dirpath", "output_dir"):
            value = getattr(cb, attr, None)
            if value is not None:
                assert Path(value).resolve().is_relative_to(root.resolve()), (type(cb).__name__, attr, value)
    export = cli.model.hparams.get("export_dir")
    assert export is None or Path(export).is_relative_to(root)
    assert not (tmp_path / "runs").exists()  # nothing under the config's own runs/<name>


def test_a_second_run_in_the_same_folder_is_refused(tmp_path, capsys):
    root = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rag.training.run_dir import hold_run_dir; "
                               f"hold_run_dir({str(root)!r}, 'fit'); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["fit", "--config", str(REPO / "lightning_configs" / "tiny_cpu.yaml"), "--trainer.default_root_dir",
                     str(root)])
        err = capsys.readouterr().err
        assert code == 2
        assert f"--trainer.default_root_dir {root}: another run is using this folder (rag fit, pid {holder.pid})" in err
        assert "Traceback" not in err and not (root / "logs").exists()
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel dropped the dead holder's lock: the folder is free again
        try:
            hold_run_dir(root, "fit")
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    release_run_dirs()
    assert (root / LOCK_FILE).is_file()


def test_a_run_releases_its_folder_and_ddp_ranks_take_none(tmp_path, monkeypatch):
    hold_run_dir(tmp_path / "a", "fit")
    hold_run_dir(tmp_path / "a", "fit")  # the same process may ask again
    release_run_dirs()
    hold_run_dir(tmp_path / "a", "test")  # released: free for the next run of this process
    release_run_dirs()
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning's DDP launcher started: its parent holds the lock
    hold_run_dir(tmp_path / "b", "fit")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("extra, unused", [([], False), (["--model.reading_practice.pretrain_steps", "5"], True),
                                           (["--model.reading_practice.pretrain_steps", "5", "--model.closed_book", "true"],
                                            False)])
def test_ddp_searches_for_unused_parameters_only_when_some_steps_leave_some_unused(tmp_path, monkeypatch, extra, unused):
    """cpu_reader.yaml with the reader's pre-training: its first steps train the generator alone, the query encoder
    after that; every other run uses plain DDP (faster, and a parameter that is never used is an error there)."""
    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(REPO / "lightning_configs" / "cpu_reader.yaml"), "--trainer.strategy", "ddp",
                    "--trainer.devices", "2", "--trainer.accelerator", "cpu", *extra], run=False)
    assert cli.trainer.strategy._ddp_kwargs.get("find_unused_parameters", False) is unused
