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

import sys
from typing import Optional, Sequence

SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEFAULT_SEED = 1234


def _imports():
    # Importing the modules registers their classes as LightningModule/DataModule
    # subclasses, so configs may also use the short names `RagModule`, `QADataModule`.
    import pytorch_lightning as pl
    from pytorch_lightning.cli import LightningCLI

    import rag.training.causal_reader  # noqa: F401
    import rag.training.data  # noqa: F401
    import rag.training.modules  # noqa: F401
    import rag.training.nli  # noqa: F401
    import rag.training.nli_data  # noqa: F401
    import rag.training.replug_lsr  # noqa: F401
    import rag.training.reranker  # noqa: F401

    return pl, LightningCLI


def make_cli(args: Optional[Sequence[str]] = None, *, run: bool = True):
    """Build (and with `run=True` run) the LightningCLI for `args` (``["fit", "--config", ...]``).

    With ``run=False`` `args` has no subcommand (``["--config", ...]``): the config is
    parsed and the model, data module and trainer are instantiated but nothing runs —
    cheap, because :class:`~rag.training.modules.RagModule` builds its model lazily.
    """
    pl, LightningCLI = _imports()
    return LightningCLI(
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
    make_cli(None if argv == sys.argv[1:] else argv, run=True)
