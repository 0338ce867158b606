"""`rag fit | validate | test | predict --config lightning_configs/NAME.yaml` (LightningCLI).

Model and data are chosen in the config by class path, so every LightningModule /
LightningDataModule of :mod:`rag.training` (and any user subclass) can be trained
with the same command::

    model:
      class_path: rag.training.modules.RagModule
      init_args: {generator: tiny:bart, ...}
    data:
      class_path: rag.training.data.QADataModule
      init_args: {train: demo:train, ...}

jsonargparse validates the whole config before anything runs: an unknown key fails
with an error naming it. `rag fit --print_config` shows every option with its default.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import rag.training.causal_reader  # noqa: F401 (registers its classes)
import rag.training.data  # noqa: F401 (registers its classes)
import rag.training.modules  # noqa: F401 (registers its classes)
import rag.training.nli  # noqa: F401 (registers its classes)
import rag.training.nli_data  # noqa: F401 (registers its classes)
import rag.training.replug_lsr  # noqa: F401 (registers its classes)
import rag.training.reranker  # noqa: F401 (registers its classes)
from rag.training.distributed import ddp_strategy
from rag.training.run_dir import expand_run_dir, hold_run_dir, release_run_dirs
from rag.training.settings import check_renamed
from rag.utils.devices import check_trainer_devices
from rag.utils.errors import ConfigError
from rag.utils.yaml_files import check_cli_yaml

SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEFAULT_SEED = 1234


def _imports():
    # The rag.training modules imported at the top registered their classes as LightningModule/DataModule
    # subclasses, so configs may also use the short names `RagModule`, `QADataModule`.
    import pytorch_lightning as pl
    from pytorch_lightning.cli import LightningCLI

    return pl, LightningCLI


DEFAULT_MODEL = "rag.training.modules.RagModule"
DEFAULT_DATA = "rag.training.data.QADataModule"


EVALUATION_OPTIONS = ("decoding", "evaluation")
"""Model argument groups that say how to evaluate, not what was trained (RagModule's ``model.decoding`` and
``model.evaluation``): on ``rag validate|test|predict --ckpt_path`` the command's values (its config and flags, else the
defaults) replace those the checkpoint recorded."""


_SPLITS_READ = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def _check_data_files(data, subcommand: str) -> None:
    """A data file the `subcommand` reads that does not exist is one error before anything is built (the model's
    knowledge base can take minutes): ``data.train|val|test|predict`` given as paths (``DIR#split`` included)."""
    init = data.get("init_args") if data is not None else None
    if init is None or not str(data.get("class_path", "")).endswith("QADataModule"):  # other modules name sources otherwise
        return
    for split in _SPLITS_READ.get(subcommand, ()):
        value = init.get(split)
        if isinstance(value, str) and value and not value.startswith("demo:"):
            path = Path(value.partition("#")[0])
            if not path.exists():
                raise ConfigError(f"data.{split}: {path}: no such file; give a JSONL/TSV file, a saved dataset directory or "
                                  "demo:train|dev|test")


def asks_corpus_only(argv: Sequence[str]) -> bool:
    """Whether the command line names a knowledge base (``--model.knowledge_base``) but no ``--data.train``."""
    names = {a.partition("=")[0] for a in argv}
    return "--model.knowledge_base" in names and not any(n in names for n in ("--data.train", "--data.data_dir"))


def corpus_only(config, asked: bool = False) -> bool:
    """The corpus-only recipe: a QADataModule without training pairs of its own — ``data.train`` unset, or the demo's
    (a recipe's default) when the command line named a knowledge base and no training data (`asked`) — trains on cloze
    pairs made from ``model.knowledge_base`` (``data.self_supervised_kb``; demo validation and test sets are dropped with
    it). Sets those fields in `config` and returns True when so."""
    model, data = config.get("model"), config.get("data")
    minit = model.get("init_args") if model is not None else None
    dinit = data.get("init_args") if data is not None else None
    if minit is None or dinit is None or not str(data.get("class_path", "")).endswith("QADataModule"):
        return False
    kb = minit.get("knowledge_base")
    if not isinstance(kb, str) or not kb or dinit.get("self_supervised_kb") is not None or dinit.get("data_dir") is not None:
        return False
    demo = lambda v: isinstance(v, str) and v.startswith("demo:")  # noqa: E731
    train = dinit.get("train")
    if train is not None and not (demo(train) and asked):
        return False
    for split in ("train", "val", "test"):
        if dinit.get(split) is None or demo(dinit.get(split)):
            dinit[split] = None
    dinit["self_supervised_kb"] = kb
    return True


def _cli_class(model_class: str = DEFAULT_MODEL, data_class: str = DEFAULT_DATA, asked_corpus_only: bool = False):
    """LightningCLI whose model and data default to `model_class` and `data_class` (the classes the command line
    chooses, else RagModule and QADataModule), so that `rag fit --print_config` and `rag fit --help` show their options.
    The default is the chosen class itself: a default of another class would lend the chosen one its defaults for the
    arguments both name (RagModule's ``optimizer`` fields to NLIModule's ``optimizer``)."""
    from pytorch_lightning.cli import LightningCLI

    class RagCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.set_defaults({"model": {"class_path": model_class}, "data": {"class_path": data_class}})

        def _parse_ckpt_path(self) -> None:
            """Lightning replaces the model's arguments with those the checkpoint recorded, including how it evaluated
            (``--model.decoding.num_beams 4`` on ``rag test --ckpt_path ...`` was silently ignored). The model stays the
            checkpoint's; how to evaluate (:data:`EVALUATION_OPTIONS`) is the command's: its config files and flags, else
            the module's defaults."""
            sub = self.config.get("subcommand")
            model = self.config[sub].get("model") if sub else None
            init = model.get("init_args") if model is not None else None
            given = {k: init[k] for k in EVALUATION_OPTIONS if init is not None and k in init}
            super()._parse_ckpt_path()
            model = self.config[sub].get("model") if sub else None
            if model is None or not given:
                return
            for where in ("init_args", "dict_kwargs"):  # where Lightning put the checkpoint's arguments
                target = model.get(where)
                if target is not None:
                    for name, value in given.items():
                        if name in target:
                            target[name] = value

        def before_instantiate_classes(self) -> None:
            """GPUs asked for that this machine lacks: one clear error before anything is built. Output paths follow
            ``trainer.default_root_dir`` (``{default_root_dir}`` in a config), and the run locks that folder
            (:mod:`rag.training.run_dir`)."""
            config = self.config[self.subcommand] if self.subcommand else self.config
            trainer = config.get("trainer")
            if trainer is not None:
                check_trainer_devices(trainer.get("accelerator", "auto"), trainer.get("devices", "auto"))
                root = trainer.get("default_root_dir") or os.getcwd()
                for key in ("trainer", "model", "data"):
                    if config.get(key) is not None:
                        config[key] = expand_run_dir(config[key], str(root))
                if self.subcommand:
                    hold_run_dir(root, self.subcommand)
            if self.subcommand == "fit":
                corpus_only(config, asked_corpus_only)
            if self.subcommand:
                _check_data_files(config.get("data"), self.subcommand)

        def instantiate_trainer(self, **kwargs):
            """Trainer options Lightning rejects (e.g. ``strategy: fsdp`` on a CPU) are the user's to fix: one line."""
            from lightning_fabric.utilities.exceptions import MisconfigurationException

            self._choose_ddp_strategy()
            try:
                return super().instantiate_trainer(**kwargs)
            except (ValueError, MisconfigurationException) as e:
                raise ConfigError(f"trainer options: {e}") from e

        def _choose_ddp_strategy(self) -> None:
            """``--trainer.strategy ddp`` for a model whose training phases train different parameters (its
            ``training_phases``) becomes ``ddp_find_unused_parameters_true`` (:func:`rag.training.distributed.ddp_strategy`);
            otherwise plain DDP, which is faster and catches a parameter that is never used."""
            import logging

            config = self.config_init[self.subcommand] if self.subcommand else self.config_init
            trainer = config.get("trainer")
            if trainer is None:
                return
            chosen = ddp_strategy(trainer.get("strategy"), getattr(self.model, "training_phases", None))
            if chosen != trainer.get("strategy"):
                trainer["strategy"] = chosen
                logging.getLogger(__name__).info("strategy ddp: %s trains some parameters only on some steps; DDP searches "
                                                 "for unused parameters (%s)", type(self.model).__name__, chosen)

    return RagCLI


def make_cli(args: Optional[Sequence[str]] = None, *, run: bool = True):
    """Build (and with `run=True` run) the LightningCLI for `args` (``["fit", "--config", ...]``).

    With ``run=False`` `args` has no subcommand (``["--config", ...]``): the config is
    parsed and the model, data module and trainer are instantiated but nothing runs —
    cheap, because :class:`~rag.training.modules.RagModule` builds its model lazily.
    """
    from jsonargparse import set_parsing_settings

    argv = sys.argv[1:] if args is None else list(args)
    check_cli_yaml(argv)  # bounded YAML (aliases, depth, size) before any config file is parsed
    check_renamed_options(argv)
    pl, _ = _imports()
    # Option help from the dataclass fields' own docstrings (RagModelConfig, ContextMixing, ...), not only from Args:.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    return _cli_class(_class_in(argv, "model"), _class_in(argv, "data"), asks_corpus_only(argv))(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if args is None else list(args),
        run=run,
        seed_everything_default=DEFAULT_SEED,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # RagModule sets per-component learning rates itself
        # `rag fit --help` etc. name the real command (not __main__.py); every subcommand
        # parser has its own --config, so `rag validate --config X.yaml --ckpt_path ...` works too.
        parser_kwargs={"prog": "rag"},
    )


def run_lightning_cli(argv: Sequence[str]) -> None:
    """Entry point of `rag fit|validate|test|predict ...` (dispatched by :mod:`rag.cli`).

    `argv` starts with the subcommand. When it is the process's own command line it is
    left for LightningCLI to read from ``sys.argv`` (so usage messages name `rag`);
    otherwise it is passed explicitly.
    """
    argv = list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"rag: expected one of {', '.join(SUBCOMMANDS)} followed by --config FILE.yaml")

    check_cli_yaml(argv)  # before any YAML loader (nested_help's, jsonargparse's) expands an alias
    own = argv == sys.argv[1:]
    nested = nested_help(argv)
    if nested is not None:
        argv = nested
        if own:  # it stays the process's command line, as LightningCLI expects
            sys.argv[1:] = nested
    for name in LIGHTNING_NOISE:
        logging.getLogger(name).addFilter(drop_lightning_noise)
    try:
        make_cli(None if own else argv, run=True)
    finally:
        for name in LIGHTNING_NOISE:
            logging.getLogger(name).removeFilter(drop_lightning_noise)
        release_run_dirs()  # the run's folder is free for the next run of this process


LIGHTNING_NOISE = {
    "pytorch_lightning.utilities.rank_zero": "try installing [litlogger]",  # an advertisement, on every run without it
    # on every checkpoint save: it says the *saved* file holds optimizer states too, and reads like an unsafe load
    "pytorch_lightning.trainer.connectors.checkpoint_connector": "`weights_only` was not set, defaulting to `False`",
}
"""Lines Lightning logs on every run that say nothing about this run: {logger: a fragment of the line}."""


def drop_lightning_noise(record: logging.LogRecord) -> bool:
    """False for a line of :data:`LIGHTNING_NOISE`, so that `rag fit` shows the training's own lines; every other
    record passes."""
    fragment = LIGHTNING_NOISE.get(record.name)
    return fragment is None or fragment not in record.getMessage()


def _read_config(path: str) -> Optional[dict]:
    """The mapping a ``--config`` file holds, or None when it cannot be read as one (LightningCLI reports that itself)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _config_paths(argv: Sequence[str]) -> list[str]:
    """The ``--config FILE`` / ``--config=FILE`` files of a command line, in order."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    return paths + [a.partition("=")[2] for a in argv if a.startswith("--config=")]


def check_renamed_options(argv: Sequence[str]) -> None:
    """Refuse an option an earlier release had and a group now holds (``model.generator_lr`` is ``model.optimizer.lr``):
    one :class:`~rag.utils.errors.ConfigError` naming the new key, for a ``--config`` file's ``model`` section or a
    ``--model.KEY`` flag (:data:`rag.training.settings.RENAMED`)."""
    model_class = _class_in(argv, "model")
    for path in _config_paths(argv):
        section = (_read_config(path) or {}).get("model")
        if isinstance(section, dict):
            init = section.get("init_args") if "class_path" in section else section
            if isinstance(init, dict):
                check_renamed(str(section.get("class_path", model_class)), init, path)
    for i, a in enumerate(argv):
        if a.startswith("--model.") and not a.startswith("--model.help"):
            key, eq, value = a[len("--model."):].partition("=")
            key = key.removeprefix("init_args.")
            if "." not in key:  # a field inside a group (--model.optimizer.lr) is no old option
                check_renamed(model_class, {key: value if eq else (argv[i + 1] if i + 1 < len(argv) else None)},
                              "the command line")


def _class_in(argv: Sequence[str], key: str) -> str:
    """The class the command line chooses for `key` (``model`` / ``data``): ``--key X``, else the last ``--config``'s
    ``class_path``, else the default."""
    chosen = DEFAULT_MODEL if key == "model" else DEFAULT_DATA
    for i, a in enumerate(argv[:-1]):
        if a == "--config":
            section = (_read_config(argv[i + 1]) or {}).get(key)
            if isinstance(section, dict) and isinstance(section.get("class_path"), str):
                chosen = section["class_path"]
        elif a == f"--{key}" and not argv[i + 1].startswith("-"):
            chosen = argv[i + 1]
    return chosen


def nested_help(argv: Sequence[str]) -> Optional[list[str]]:
    """``rag fit --model.rag.help`` (help on a nested option group, which jsonargparse has no flag for in subclass mode)
    becomes ``rag fit --model.help CLASS``: the chosen class's options, the group's fields with their docs among them.
    None when `argv` asks no such help."""
    for a in argv[1:]:
        parts = a.lstrip("-").split(".")
        if a.startswith("--") and len(parts) >= 3 and parts[0] in ("model", "data") and parts[-1] == "help":
            return [argv[0], f"--{parts[0]}.help", _class_in(argv, parts[0])]
    return None
