"""The NLI cross-encoder LightningModule: a 3-way entailment / neutral / contradiction classifier fine-tuned from an
encoder (the bundled MiniLM by default) and exported with ``save_pretrained`` for :class:`rag.retrobust.nli.NLIScorer`.

The model is ``AutoModelForSequenceClassification`` with ``num_labels=3`` and ``id2label`` set to
:data:`rag.training.snli.LABELS`, so the exported directory loads like any hub NLI checkpoint. Metrics: ``train/loss``,
``train/acc``, ``val/acc``, ``test/acc`` (torchmetrics Accuracy, 3 classes), plus ``*/loss`` on val and test.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import pytorch_lightning as pl
import torch
import torchmetrics

from rag.knowledge.encoders import resolve_name_or_path
from rag.retrobust.nli import encode_nli_pairs
from rag.training.settings import Optimizer, settings_dict
from rag.training.snli import LABELS
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.io import atomic_directory

__all__ = ["NLIModule", "EXPORT_INFO"]

EXPORT_INFO = "rag_nli_training.json"
_DEFAULT_OPTIMIZER = Optimizer(lr=8e-5, weight_decay=0.01, warmup_ratio=0.1)


class NLIModule(pl.LightningModule):
    """Fine-tune `encoder` (``"minilm"``, a directory or hub id) as a 3-way NLI cross-encoder.

    `optimizer`: AdamW and its schedule (:class:`~rag.training.settings.Optimizer`; weight decay spares biases and
    LayerNorm weights). `export_dir`: where the model and tokenizer are written (``save_pretrained``) at the end of fit,
    replacing what was there; None writes nothing (call :meth:`export` yourself).
    """

    def __init__(self, encoder: str = "minilm", optimizer: Optimizer = _DEFAULT_OPTIMIZER, max_length: int = 128,
                 export_dir: Optional[str] = None):
        super().__init__()
        optimizer = settings_dict(optimizer, Optimizer, "optimizer")  # a plain dict in the hyperparameters
        self.optimizer_settings = Optimizer(**optimizer)
        if max_length < 8:
            raise ConfigError(f"model.max_length must be >= 8 tokens, got {max_length}")
        self.save_hyperparameters()
        self.model = None
        self.tokenizer = None
        self.accuracy = torch.nn.ModuleDict({f"{s}_acc": torchmetrics.Accuracy(task="multiclass", num_classes=len(LABELS))
                                            for s in ("train", "val", "test")})
        self._fit_started: Optional[float] = None
        self._fit_cpu_seconds: Optional[float] = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_name_or_path(self.hparams.encoder)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps modes as found, so dropout would stay off

    def forward(self, premises, hypotheses) -> torch.Tensor:
        """Logits `(B, 3)` of the pairs, premises cut to `max_length` tokens."""
        enc = encode_nli_pairs(self.tokenizer, premises, hypotheses, self.hparams.max_length)
        return self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        logits = self(batch["premises"], batch["hypotheses"])
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        self.accuracy[f"{stage}_acc"](logits.argmax(-1), batch["labels"])
        size = len(batch["labels"])
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=size, on_step=on_step, on_epoch=not on_step)
        self.log(f"{stage}/acc", self.accuracy[f"{stage}_acc"], prog_bar=stage != "train", batch_size=size, on_step=False,
                 on_epoch=True)
        return loss

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @without_cudnn_attention
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    @without_cudnn_attention
    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> dict:
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
        o = self.optimizer_settings
        return o.build(self, [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}])

    def on_fit_start(self) -> None:
        self._fit_started = time.process_time()

    def on_fit_end(self) -> None:
        if self._fit_started is not None:
            self._fit_cpu_seconds = round(time.process_time() - self._fit_started, 1)
        if self.hparams.export_dir:
            self.export(self.hparams.export_dir)

    def export(self, path: str | os.PathLike, **info) -> None:
        """Write model + tokenizer with ``save_pretrained`` (atomically, replacing `path`) and a JSON training record."""
        if self.model is None:
            raise ConfigError("NLIModule.export: the model is not built yet (nothing was trained)")
        record = {"encoder": self.hparams.encoder, "labels": list(LABELS), "global_step": int(self.global_step),
                  "hparams": {k: v for k, v in self.hparams.items() if k != "export_dir"}, **info}
        if self._fit_cpu_seconds is not None:
            record["fit_cpu_seconds"] = self._fit_cpu_seconds  # this process's CPU time over fit (all threads)
        if self.trainer is not None and self.trainer.datamodule is not None:
            record["train_batch_size"] = getattr(self.trainer.datamodule.hparams, "batch_size", None)
        with atomic_directory(path, overwrite=True, replaces=lambda p: (p / EXPORT_INFO).is_file(),
                              kind="exported NLI model") as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / EXPORT_INFO).write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
