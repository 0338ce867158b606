"""Multi-process training checks: every rank must retrieve from the same knowledge-base version.

Under ``rag fit --trainer.strategy ddp --trainer.devices N`` each rank is its own process with its own
:class:`~rag.knowledge.knowledge_base.KnowledgeBase` (opened memory-mapped, so the ranks of one node share
the page cache) and retrieves for its own batch; DDP averages the gradients. That is only the gradient of
one model if every rank searched the same index: a rank that opened another directory, or failed to swap in
a refreshed index (:class:`~rag.training.callbacks.IndexRefresh`), would train the query encoder against
other passages. :func:`check_same_knowledge_base` gathers the ranks' version ids before each step and refuses
to step when they differ.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.utils.errors import KnowledgeBaseError

__all__ = ["version_code", "check_same_knowledge_base", "knowledge_base_of", "ddp_strategy"]


def version_code(version: Optional[str]) -> int:
    """A 62-bit integer naming `version` (0 for none), gatherable as one int64 across ranks."""
    if not version:
        return 0
    return int.from_bytes(hashlib.sha256(version.encode("utf-8")).digest()[:8], "big") >> 2


def knowledge_base_of(pl_module: pl.LightningModule):
    """The knowledge base a LightningModule's model retrieves from (``.model.knowledge_base``), or None."""
    model = getattr(pl_module, "model", None)
    return getattr(model, "knowledge_base", None) if model is not None else None


def check_same_knowledge_base(trainer: pl.Trainer, kb, step: Optional[int] = None) -> None:
    """Raise KnowledgeBaseError on every rank unless all ranks serve the same knowledge-base version.

    A collective: every rank must call it at the same point (a no-op when ``trainer.world_size == 1``). Cost:
    one all-gather of one int64 per call.
    """
    if trainer.world_size <= 1:
        return
    version = getattr(kb, "version", None)
    mine = torch.tensor([version_code(version)], dtype=torch.int64, device=trainer.strategy.root_device)
    codes = trainer.strategy.all_gather(mine).reshape(-1).tolist()
    if len(set(codes)) == 1:
        return
    agree = [r for r, c in enumerate(codes) if c == codes[0]]
    where = f" at step {step}" if step is not None else ""
    raise KnowledgeBaseError(
        f"rank {trainer.global_rank} serves knowledge base {version} ({getattr(kb, 'path', None)}), but the ranks "
        f"disagree{where}: ranks {agree} serve the same version as rank 0, the others another one; refusing to step, "
        "because their gradients would come from different indexes. Give every rank the same knowledge_base directory "
        "(a shared filesystem or identical copies); if an IndexRefresh swap failed on some rank, its log names the cause"
    )


def ddp_strategy(strategy: Optional[str], phases: Optional[Sequence[frozenset]]) -> Optional[str]:
    """The DDP strategy for a module whose training runs in `phases` (the parameter groups each phase trains, in order:
    a module's ``training_phases``). ``ddp`` becomes ``ddp_find_unused_parameters_true`` when the phases train different
    groups, so that some steps leave trainable parameters without a gradient (e.g. the reader's pre-training trains the
    generator alone, then the query encoder joins); otherwise plain DDP, which is faster and catches a parameter that is
    never used. Any other `strategy` is returned as given."""
    if strategy != "ddp" or not phases or len(set(phases)) <= 1:
        return strategy
    return "ddp_find_unused_parameters_true"
