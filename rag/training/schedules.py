"""Learning-rate schedules of the training modules: warm-up then linear decay or constant, stepped per optimizer step."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from rag.utils.errors import ConfigError

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["SCHEDULES", "step_schedule", "warmup_constant", "warmup_linear_decay"]


def warmup_linear_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based): linear warm-up from 0
    to 1 over `warmup_steps`, then linear decay to 0 at `total_steps` (the schedule of
    BERT/BART fine-tuning and the transformers RAG example)."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def warmup_constant(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1, then constant."""
    return min(1.0, step / max(1, warmup_steps)) if warmup_steps else 1.0


SCHEDULES = {"linear": warmup_linear_decay, "constant": warmup_constant}


def step_schedule(optimizer: torch.optim.Optimizer, trainer: "pl.Trainer", *, warmup_ratio: Optional[float] = None,
                  warmup_steps: int = 0, schedule: str = "linear", first_steps: int = 0,
                  first_factors: Optional[Sequence[float]] = None) -> dict:
    """Lightning's ``lr_scheduler`` entry for `optimizer`: warmup then `schedule` (:data:`SCHEDULES`) over the run's
    optimizer steps, stepped every step. `warmup_ratio` (of the run) wins over `warmup_steps`.

    With `first_steps`, each param group's learning rate is its own times ``first_factors[group]`` for the run's first
    `first_steps` steps (0 idles a group); the warmup and `schedule` then start over the remaining steps.

    Raises:
        ConfigError: the run has no finite length (neither trainer.max_steps nor trainer.max_epochs).
    """
    total = trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ConfigError("the learning-rate schedule needs a finite run length; set trainer.max_steps or trainer.max_epochs")
    total = max(1, int(total) - first_steps)
    warmup = int(round(warmup_ratio * total)) if warmup_ratio is not None else warmup_steps
    fn = functools.partial(SCHEDULES[schedule], warmup_steps=warmup, total_steps=total)
    if first_steps:
        if first_factors is None or len(first_factors) != len(optimizer.param_groups):
            raise ValueError("first_factors needs one factor per param group")
        fn = [functools.partial(_after_first, fn=fn, first_steps=first_steps, factor=f) for f in first_factors]
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, fn), "interval": "step", "frequency": 1}


def _after_first(step: int, *, fn, first_steps: int, factor: float) -> float:
    return factor if step < first_steps else fn(step - first_steps)
