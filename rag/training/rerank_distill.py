"""Training a cross-encoder reranker from a RAG model's own document posteriors (distillation, as in Atlas, Izacard et
al. 2022, and Izacard & Grave 2021), with ``rag fit --config lightning_configs/reranker_demo.yaml``.

:class:`PosteriorDataModule` makes the examples with the frozen teacher: for each training question x with gold answer
y it retrieves K candidates z_1..z_K and computes the reader's posterior over them,
``log p(z|x,y) = log_softmax_z(log p(z|x) + log p(y|x,z))`` (the teacher's own prior and teacher-forced likelihood).
:class:`RerankDistillModule` trains a :class:`~rag.knowledge.rerank.CrossEncoder` (a sequence-classification head on
a base encoder, with LoRA adapters) so that its softmax over the K candidates matches the posterior:
``KL(p(·|x,y) || softmax(f(x, ·)))``, minimised as the soft-label cross-entropy of
:func:`rag.training.reranker.reranker_loss` (the same objective the In-Context RALM reranker trains with; they differ
by the posterior's entropy, a constant). ``export_dir`` receives the adapter, the head and a manifest for
``--rerank K --reranker DIR``.

The examples reuse :class:`~rag.training.reranker.RerankExample` (``prefix`` the question, ``docs`` the candidates'
texts, ``lm_loglik`` the teacher's log posterior) and its examples file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.eval.benchmarks import read_eval_set
from rag.generation.marginalize import sequence_log_likelihoods, target_logprobs_from_logits
from rag.knowledge.encoders import resolve_name_or_path, weights_fingerprint
from rag.knowledge.rerank import MANIFEST, CrossEncoder, base_identity, passage_text
from rag.pipeline.api import load
from rag.training.reranker import ExamplesDataModule, RerankExample, read_examples, reranker_loss, write_examples
from rag.training.settings import RerankerOptimizer, decay_split, settings_dict
from rag.utils.checksums import file_checksums
from rag.utils.errors import ConfigError
from rag.utils.io import atomic_directory, atomic_write_json
from rag.utils.validate import check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["teacher_posteriors", "PosteriorDataModule", "RerankDistillModule", "is_distilled_reranker"]


@torch.no_grad()
def teacher_posteriors(model, questions: Sequence[str], answers: Sequence[str], k: int, *, batch_size: int = 2,
                       desc: Optional[str] = None) -> list[RerankExample]:
    """Per question its K retrieved candidates (the RAG model `model`'s own retrieval) and ``log p(z|x,y)`` ``(K,)``,
    the posterior of the model's prior and teacher-forced answer likelihood; `batch_size` questions per pass."""
    from tqdm.auto import tqdm

    out = []
    for i in tqdm(range(0, len(questions), batch_size), desc=desc, disable=desc is None, unit="batch", dynamic_ncols=True):
        qs, ys = list(questions[i:i + batch_size]), list(answers[i:i + batch_size])
        inputs = model.prepare_inputs(qs, n_docs=k)
        decoder_inputs, labels, label_mask = model.training_targets(ys)
        logits = model.generator_logits(inputs, labels, decoder_input_ids=decoder_inputs)  # (B, K, T, V)
        loglik = sequence_log_likelihoods(target_logprobs_from_logits(logits, labels), label_mask)  # (B, K) log p(y|x,z)
        prior = torch.log_softmax(model.retrieval_logits(inputs.doc_scores).float(), dim=-1)
        posterior = torch.log_softmax(prior + loglik.float().to(prior.device), dim=-1).cpu()
        for q, ps, lp in zip(qs, inputs.retrieved.passages, posterior):
            out.append(RerankExample(q, [passage_text(p) for p in ps], [float(x) for x in lp]))
    return out


class PosteriorDataModule(ExamplesDataModule):
    """(question, K candidates, teacher posterior) examples from a frozen RAG model.

    Args:
        teacher: the RAG model (anything :func:`rag.load` takes whose method is ``rag``; ``demo``: the demo default).
        knowledge_base: its knowledge base (None: the model's).
        data: the training questions, any evaluation-set format with gold answers (``demo:train``).
        k: candidates per question (the reranker's K).
        limit: N questions only, drawn at random (`seed`) from the whole set (None: all).
        val_fraction: share held out for validation.
        batch_size: questions per training batch.
        teacher_batch_size: questions per teacher pass.
        seed: the train / validation split.
        examples_file: a JSON file keeping the examples (the teacher's passes are most of a run's cost), reused while
            the teacher's weights, knowledge base, questions and these settings are the same; None: not kept.
    """

    def __init__(self, teacher: str = "demo", knowledge_base: Optional[str] = None, data: str = "demo:train", k: int = 4,
                 limit: Optional[int] = None, val_fraction: float = 0.2, batch_size: int = 4, teacher_batch_size: int = 2,
                 seed: int = 0, examples_file: Optional[str] = None):
        super().__init__()
        check_positive_int(k, "data.k", error=ConfigError)
        check_positive_int(limit, "data.limit", allow_none=True, error=ConfigError)
        check_positive_int(teacher_batch_size, "data.teacher_batch_size", error=ConfigError)
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.train_examples: list[RerankExample] = []
        self.val_examples: list[RerankExample] = []

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_examples:
            return
        h = self.hparams
        examples = [e for e in read_eval_set(h.data) if e.answers]
        if not examples:
            raise ConfigError(f"data.data {h.data}: no question with a gold answer; the posterior needs the answer y")
        order = list(range(len(examples)))  # shuffled before the limit: a file sorted by topic must not give one topic
        random.Random(h.seed).shuffle(order)
        examples = [examples[i] for i in order][:h.limit] if h.limit else [examples[i] for i in order]
        pipe = load(h.teacher, knowledge_base=h.knowledge_base)
        if pipe.method != "rag":
            raise ConfigError(f"data.teacher {h.teacher}: reads with {pipe.method}; the posterior p(z|x,y) is a RAG model's "
                              "(a RAG checkpoint, or 'demo')")
        model = pipe.model
        qs, ys = [e.question for e in examples], [e.answers[0] for e in examples]
        key = None
        if h.examples_file:
            digest = hashlib.sha256(json.dumps([qs, ys]).encode("utf-8")).hexdigest()
            key = {"format": 2, "kind": "posterior", "questions": digest, "teacher": weights_fingerprint(model),
                   "knowledge_base": pipe.kb_version, "settings": {"k": h.k, "limit": h.limit, "val_fraction": h.val_fraction,
                                                                   "seed": h.seed}}
            kept = read_examples(h.examples_file, key, h.k)
            if kept is not None:
                self.train_examples, self.val_examples = kept
                return
        n_val = int(round(h.val_fraction * len(qs)))
        found = teacher_posteriors(model, qs, ys, h.k, batch_size=h.teacher_batch_size,
                                   desc=f"teacher posteriors ({len(qs)} questions)")
        self.val_examples, self.train_examples = found[:n_val], found[n_val:]
        logger.info("posterior examples: %d train, %d val (k=%d)", len(self.train_examples), len(self.val_examples), h.k)
        if h.examples_file:
            write_examples(h.examples_file, key, self.train_examples, self.val_examples)



def is_distilled_reranker(path: Path) -> bool:
    """True for a directory :meth:`RerankDistillModule.export` wrote (the only kind its export replaces)."""
    return (Path(path) / MANIFEST).is_file()


_DEFAULT_OPTIMIZER = RerankerOptimizer(lr=1e-3)


class RerankDistillModule(pl.LightningModule):
    """A cross-encoder distilled from the teacher's posterior (the module docstring's KL).

    Args:
        base: the base encoder (``minilm``: the bundled all-MiniLM-L6-v2), given a one-logit classification head.
        lora_r, lora_alpha, lora_dropout: the LoRA adapters on `target_modules` (0: the whole base is trained and the
            export is a full model directory).
        target_modules: module names that get adapters.
        max_length: word pieces per (question, passage) pair.
        temperature: ``τ`` of the teacher's soft labels (``softmax(log p(z|x,y) / τ)``; 1: the posterior itself).
        optimizer: AdamW and its schedule (``lr`` the adapters' and the head's).
        export_dir: where the reranker is written at the end of ``fit`` (None: only checkpoints).
    """

    def __init__(self, base: str = "minilm", lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.1,
                 target_modules: Sequence[str] = ("query", "key", "value", "dense"), max_length: int = 256,
                 temperature: float = 1.0, optimizer: RerankerOptimizer = _DEFAULT_OPTIMIZER, export_dir: Optional[str] = None):
        super().__init__()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        optimizer = settings_dict(optimizer, RerankerOptimizer, "optimizer")
        self.optimizer_settings = RerankerOptimizer(**optimizer)
        if not isinstance(lora_r, int) or lora_r < 0:
            raise ConfigError(f"model.lora_r must be an integer >= 0 (0: no adapters), got {lora_r!r}")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ConfigError(f"model.temperature must be > 0, got {temperature!r}")
        self.save_hyperparameters()
        path = resolve_name_or_path(base)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if lora_r:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                     target_modules=list(target_modules), modules_to_save=["classifier"]))
        self.net = model
        self.cross_encoder = CrossEncoder(model, tokenizer, max_length=max_length, name=str(base))

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        scores = self.cross_encoder.pair_texts_logits(batch["prefixes"], batch["docs"])  # (B, K)
        teacher = batch["lm_loglik"].to(scores.device)  # log p(z|x,y)
        loss = reranker_loss(scores, teacher, "soft_label", self.hparams.temperature)
        b = teacher.shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=b)
        if stage != "train":
            target = torch.softmax(teacher / self.hparams.temperature, -1)
            kl = loss + (target * torch.log(target.clamp_min(1e-30))).sum(-1).mean()
            self.log(f"{stage}/kl", kl, batch_size=b)
            self.log(f"{stage}/top1", (scores.argmax(-1) == teacher.argmax(-1)).float().mean(), batch_size=b)
            self.log(f"{stage}/retriever_top1", (teacher.argmax(-1) == 0).float().mean(), batch_size=b)
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> dict:
        o = self.optimizer_settings
        return o.build(self, decay_split([p for p in self.parameters() if p.requires_grad], o.weight_decay))

    def on_train_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.export(self.hparams.export_dir)
            logger.info("distilled reranker written to %s", self.hparams.export_dir)

    def export(self, directory: str | os.PathLike) -> Path:
        """Write the reranker for ``--reranker DIR``: with LoRA the adapter and head (peft's files), the classification
        config and the tokenizer, and :data:`~rag.knowledge.rerank.MANIFEST` naming the base and every file's SHA-256."""
        h = self.hparams
        with atomic_directory(directory, overwrite=True, replaces=is_distilled_reranker, kind="distilled reranker") as tmp:
            net = self.net
            if h.lora_r:  # the base by the name the manifest records, not this machine's path
                net.peft_config["default"].base_model_name_or_path = h.base
            net.save_pretrained(tmp)
            if h.lora_r:  # the classification model's config (peft writes only the adapter's)
                inner = net.base_model.model
                inner.config.architectures = [type(inner).__name__]
                inner.config.save_pretrained(tmp)
            self.cross_encoder.tokenizer.save_pretrained(tmp)
            files = file_checksums(tmp, sorted(f for f in tmp.rglob("*") if f.is_file()))
            manifest = {"format": 1, "kind": "rag cross-encoder", "max_length": h.max_length,
                        "trained": {"objective": "KL(teacher posterior || softmax reranker)", "temperature": h.temperature},
                        "files": files}
            if h.lora_r:
                manifest["base"] = base_identity(h.base)
            atomic_write_json(tmp / MANIFEST, manifest)
        return Path(directory)
