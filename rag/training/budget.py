"""A CPU-time budget for training: :class:`CpuBudget` stops ``fit`` once the run's training has used its CPU minutes.

The budget counts the process's CPU time (all its threads: with ``OMP_NUM_THREADS=1``, CPU time = wall time of a
quiet machine) spent between the start of training and now, minus the time validation took, so that a run on a
shared, loaded machine trains exactly as much as on an idle one, only slower. Under DDP each rank counts its own.
"""

from __future__ import annotations

import logging
import os
import time

import pytorch_lightning as pl

from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

logger = logging.getLogger(__name__)

__all__ = ["CpuBudget"]


class CpuBudget(pl.Callback):
    """Stop training when its CPU time (validation excluded) reaches `minutes`.

    Args:
        minutes: the training budget in CPU-minutes (> 0). Set ``trainer.max_steps`` as well (an upper bound the
            learning-rate schedule is laid out over).
    """

    def __init__(self, minutes: float = 20.0) -> None:
        check_number(minutes, "CpuBudget minutes (the CPU budget in minutes)", above=0, error=ConfigError)
        self.minutes = float(minutes)
        self._start = 0.0
        self._excluded = 0.0
        self._resumed = 0.0  # CPU seconds spent before the checkpoint a run resumed from
        self._validation_start = None
        self.used_seconds = 0.0
        self.stopped_at_step = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._excluded = time.process_time(), 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.process_time()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self._excluded += time.process_time() - self._validation_start
            self._validation_start = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.used_seconds = self._resumed + time.process_time() - self._start - self._excluded
        pl_module.log("train/cpu_minutes", self.used_seconds / 60.0)
        if self.used_seconds >= 60.0 * self.minutes and not trainer.should_stop:
            trainer.should_stop = True
            self.stopped_at_step = trainer.global_step
            logger.warning("CPU budget of %.1f minutes spent at step %d: stopping training", self.minutes, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A run the budget stopped keeps its last steps: every ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt``
        now (checkpoints every N steps would otherwise lose up to N - 1 steps, and `rag test` would test the older
        model)."""
        if self.stopped_at_step is None:
            return
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "save_last", False) and cb.dirpath is not None:
                last = os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
                trainer.save_checkpoint(last)  # every rank calls it; Lightning writes from rank 0
                cb.last_model_path = last

    def state_dict(self) -> dict:
        return {"used_seconds": self.used_seconds}

    def load_state_dict(self, state_dict: dict) -> None:
        """A run resumed from a checkpoint (``--ckpt_path``) goes on spending the same budget, not a fresh one."""
        self._resumed = self.used_seconds = float(state_dict.get("used_seconds", 0.0))
