"""LightningModules for training retrieval-augmented models.

:class:`RagModule` fine-tunes a :class:`~rag.models.rag.model.RagModel` end to end (Lewis et al. 2020, §2.4): the
query encoder and the generator are trained jointly on the marginal negative log-likelihood; the document encoder and
the index stay fixed unless ``rag.train_doc_encoder`` trains the document encoder too (then pair it with the
:class:`~rag.training.callbacks.IndexRefresh` callback). Validation/test generate answers and report exact match,
token F1 (SQuAD normalisation) and retrieval recall@k.

Construction is lazy: ``__init__`` only records the typed argument groups (:mod:`rag.training.settings`), so a
config parses without touching a model hub or the disk. What the module trains over is built outside it
(:class:`~rag.training.artifacts.RagComponents`: knowledge base, generator, tokenizers; the Ray actors): Lightning's
``prepare_data`` builds what is missing, ``configure_model`` opens the RagModel before the first step and before a
checkpoint is restored, so a knowledge base / query-encoder mismatch surfaces at setup, never mid-epoch. Whether
steps retrieve is a mode chosen once (:mod:`rag.training.reader_modes`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.eval.metrics import GENERATION_METRICS, ExactMatch, RetrievalRecall, TokenF1
from rag.generators.lora import LoraSettings
from rag.generators.tiny_generator import TinyGenerator, WarmStartGenerator, check_tiny_name
from rag.generators.warm_start import cache_encoder_outputs, is_warm_start
from rag.models.rag.config import RagModelConfig
from rag.pipeline.exports import write_rag_export
from rag.training.artifacts import RagComponents, SearchActors
from rag.training.data import batch_contexts
from rag.training.distributed import check_same_knowledge_base, knowledge_base_of
from rag.training.gold_passages import GoldPassages
from rag.training.reader_modes import ClosedBook, Retrieving, generate_answers
from rag.training.reading_practice import ReadingPracticeSettings, fit_to_window, practice_pool
from rag.training.settings import (
    Decoding,
    Evaluation,
    KnowledgeBaseBuild,
    RagOptimizer,
    RetrievalActors,
    as_settings,
    decay_split,
    settings_dict,
)
from rag.training.windows import DataWindows, TrainingPrompts, answer_window, measure_training_prompts, model_positions
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.io import atomic_write_text, check_output_dir, to_json
from rag.utils.truncation import CutPrompts

logger = logging.getLogger(__name__)

__all__ = ["RagModule", "generate_answers"]

# Defaults of RagModule's argument groups: typed dataclasses (not Optional), so that `rag fit --print_config` and
# `--model.help` list their fields; never mutated (RagModule stores plain dicts).
_DEFAULT_RAG, _DEFAULT_TINY, _DEFAULT_WARM = RagModelConfig(), TinyGenerator(), WarmStartGenerator()
_DEFAULT_OPTIMIZER, _DEFAULT_DECODING, _DEFAULT_EVALUATION = RagOptimizer(), Decoding(), Evaluation()
_DEFAULT_ACTORS, _DEFAULT_WINDOWS = RetrievalActors(), DataWindows()


class RagModule(pl.LightningModule):
    """End-to-end RAG fine-tuning (query encoder + generator) with QA evaluation.

    Args:
        generator: seq2seq or causal generator: a local ``save_pretrained`` directory, a hub id (``facebook/bart-large``,
            ``t5-base``), ``smollm2`` (the demo causal LM), ``tiny:bart`` / ``tiny:t5`` (random, sizes in `tiny`, tokenizer
            trained on the knowledge base's passages), or ``warm:<encoder>`` (frozen pretrained encoder, fresh decoder
            and copy head, sizes in `warm_start`).
        question_encoder: query encoder (DPR question encoder dir/hub id, ``minilm``), or None: the knowledge base's.
        document_encoder: document encoder trained by ``rag.train_doc_encoder`` / used by ``rag.rerank_candidates``
            (default: the one that built the knowledge base).
        knowledge_base: knowledge-base directory (``rag index build``), or ``demo`` (the bundled Elements knowledge base).
        build_knowledge_base: build `knowledge_base` first when it does not exist
            (:class:`~rag.training.settings.KnowledgeBaseBuild`: ``corpus``, ``encoder``, ``index``); null: never build.
        rag: RAG options (n_docs, marginalization, label smoothing, truncation lengths, ...).
        tiny: sizes of the ``tiny:*`` generator.
        warm_start: the ``warm:<encoder>`` generator.
        generator_lora: LoRA adapters on a causal generator (``r``, ``alpha``, ``dropout``, ``target_modules``,
            ``layers``): only they train, and the export holds them alone; null trains every generator weight.
        optimizer: AdamW and its schedule (:class:`~rag.training.settings.RagOptimizer`: ``lr`` is the generator's,
            ``query_encoder_lr``, ``doc_encoder_lr``; weight decay spares biases and norm weights).
        decoding: validation/test/predict decoding and the exported model's decoding defaults
            (:class:`~rag.training.settings.Decoding`; null fields: the generation options' defaults).
        evaluation: what validation and test measure (:class:`~rag.training.settings.Evaluation`: ``recall_at``,
            ``generate_on_validation``, ``generation_metrics``, ``predictions_file``).
        reading_practice: an auxiliary generator loss on examples only reading their passage answers, mixed into every
            step, and with ``pretrain_steps`` the run's first steps on practice alone (the reader's pre-training).
        gold_passage: also train the generator on each training pair's gold passage alone (:mod:`rag.training.gold_passages`):
            ``named`` by the data's ``passage_ids``, ``unique_answer`` where the answer occurs in exactly one passage,
            ``auto`` the first when the data names passages, else the second; ``off``.
        cache_encoder: memoise a frozen generator encoder's outputs per distinct context while training.
        retrieval_actors: serve the knowledge base's search from Ray actors
            (:class:`~rag.training.settings.RetrievalActors`: ``count``, ``ray_address``).
        closed_book: the closed-book baseline (Table 1; :class:`~rag.training.reader_modes.ClosedBook`).
        export_dir: write the trained model there at the end of ``fit`` (``rag generate --model DIR`` reads it); an
            earlier export there is replaced, any other content refused.
        windows: ``max_context_length: auto`` / ``max_new_tokens: auto`` choose ``rag.max_context_length`` and
            ``decoding.max_new_tokens`` from the training data before the first step (:mod:`rag.training.windows`).
    """

    def __init__(
        self,
        generator: str = "facebook/bart-large",
        question_encoder: Optional[str] = "facebook/dpr-question_encoder-single-nq-base",
        document_encoder: Optional[str] = None,
        knowledge_base: str = "kb",
        build_knowledge_base: Optional[KnowledgeBaseBuild] = None,
        rag: RagModelConfig = _DEFAULT_RAG,
        tiny: TinyGenerator = _DEFAULT_TINY,
        warm_start: WarmStartGenerator = _DEFAULT_WARM,
        generator_lora: Optional[LoraSettings] = None,
        optimizer: RagOptimizer = _DEFAULT_OPTIMIZER,
        decoding: Decoding = _DEFAULT_DECODING,
        evaluation: Evaluation = _DEFAULT_EVALUATION,
        reading_practice: Optional[ReadingPracticeSettings] = None,
        gold_passage: Literal["off", "auto", "named", "unique_answer"] = "off",
        cache_encoder: bool = True,
        retrieval_actors: RetrievalActors = _DEFAULT_ACTORS,
        closed_book: bool = False,
        export_dir: Optional[str] = None,
        windows: DataWindows = _DEFAULT_WINDOWS,
    ) -> None:
        super().__init__()
        # Hyperparameters are stored as plain dicts/lists so that checkpoints load with
        # torch.load(weights_only=True) (Lightning's default when resuming); save_hyperparameters reads these locals.
        rag = settings_dict(rag, RagModelConfig, "rag") or {}
        tiny = settings_dict(tiny, TinyGenerator, "tiny") or {}
        warm_start = settings_dict(warm_start, WarmStartGenerator, "warm_start") or {}
        generator_lora = settings_dict(generator_lora, LoraSettings, "generator_lora")
        build_knowledge_base = settings_dict(build_knowledge_base, KnowledgeBaseBuild, "build_knowledge_base")
        optimizer = settings_dict(optimizer, RagOptimizer, "optimizer") or {}
        decoding = settings_dict(decoding, Decoding, "decoding") or {}
        evaluation = settings_dict(evaluation, Evaluation, "evaluation") or {}
        reading_practice = settings_dict(reading_practice, ReadingPracticeSettings, "reading_practice")
        retrieval_actors = settings_dict(retrieval_actors, RetrievalActors, "retrieval_actors") or {}
        windows = settings_dict(windows, DataWindows, "windows") or {}
        check_tiny_name(generator, "model.generator")
        self.optimizer_settings = RagOptimizer(**optimizer)
        self.decoding = Decoding(**decoding)
        self.evaluation = Evaluation(**evaluation)
        unknown = [m for m in self.evaluation.generation_metrics if m not in GENERATION_METRICS]
        if unknown:
            raise ConfigError(f"model.evaluation.generation_metrics: unknown {unknown}; choose from {sorted(GENERATION_METRICS)}")
        self.rag_config = RagModelConfig(**rag)  # validates the RAG options now, at parse time
        self.windows = DataWindows(**windows)
        self._chosen_windows: dict = {}  # what model.windows chose (on_fit_start), kept in the checkpoint
        self.practice_settings = as_settings(reading_practice, ReadingPracticeSettings, "reading_practice")
        self.components = RagComponents(
            generator=generator, question_encoder=question_encoder, knowledge_base=knowledge_base, rag=self.rag_config,
            document_encoder=document_encoder,
            build=as_settings(build_knowledge_base, KnowledgeBaseBuild, "build_knowledge_base"),
            tiny=TinyGenerator(**tiny), warm_start=WarmStartGenerator(**warm_start),
            lora=as_settings(generator_lora, LoraSettings, "generator_lora"))
        self.search_actors = SearchActors(RetrievalActors(**retrieval_actors))
        self.mode = ClosedBook() if closed_book else Retrieving()
        self._practice: list = []  # built in on_fit_start
        self._practice_rng = random.Random(0 if self.practice_settings is None else self.practice_settings.seed)
        self._encoder_cache = None
        self._gold = None  # GoldPassages, built in on_fit_start
        self.save_hyperparameters()
        self.model = None  # built in configure_model()
        recall_at = self.evaluation.recall_at
        self.val_em, self.val_f1, self.val_recall = ExactMatch(), TokenF1(), RetrievalRecall(recall_at)
        self.test_em, self.test_f1, self.test_recall = ExactMatch(), TokenF1(), RetrievalRecall(recall_at)
        self.generation_metrics = torch.nn.ModuleDict({f"{stage}_{name}": GENERATION_METRICS[name]()
                                                       for stage in ("val", "test")
                                                       for name in self.evaluation.generation_metrics})
        self._truncated = {"train": 0, "val": 0, "test": 0}  # contexts truncated this epoch
        self._contexts = {"train": 0, "val": 0, "test": 0}  # contexts built this epoch
        self._samples: list[tuple[str, str, list[str]]] = []
        self._predictions: list[dict] = []

    # ------------------------------------------------------------------ model construction
    def prepare_data(self) -> None:
        """Build the knowledge base / tiny generator once (rank 0) before setup on every rank."""
        self.components.prepare()

    def configure_model(self) -> None:
        """Open the :class:`RagModel` (called by Lightning before training/eval and before a checkpoint is restored)."""
        if self.model is not None:
            return
        model = self.components.build_model(train_retrieval=self.mode.retrieves and not self._data_gives_contexts())
        self.search_actors.serve(model.knowledge_base)
        self.model = model.train(self.training)

    def _data_gives_contexts(self) -> bool:
        """True under RetRobust context mixing: the data gives each pair its passage, so no training step retrieves."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(datamodule, "context_mixing", None) is not None

    @property
    def training_phases(self) -> list[frozenset]:
        """The parameter groups trained by each phase of the run, in order: the reader's pre-training
        (``reading_practice.pretrain_steps``: the generator alone), then the mode's steps. The CLI picks the DDP
        strategy from them (:func:`rag.training.distributed.ddp_strategy`)."""
        main = self.mode.trained_groups(self.rag_config)
        return ([frozenset({"generator"})] if self._pretrain_steps() else []) + [main]

    def on_knowledge_base_swapped(self, kb) -> None:
        """Called by :class:`~rag.training.callbacks.IndexRefresh` after a swap: the actors move to the new version."""
        if self.search_actors.pool is not None:
            self.search_actors.serve(kb)

    def teardown(self, stage: str) -> None:
        """Stop the retrieval actors this module started (the Ray cluster itself keeps running)."""
        self.search_actors.stop(self.model.knowledge_base if self.model is not None else None)

    def _require_model(self):
        if self.model is None:
            self.configure_model()
        return self.model

    # ------------------------------------------------------------------ steps
    def forward(self, questions: Sequence[str], targets: Sequence[str]):
        return self._require_model()(list(questions), list(targets))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under DDP, refuse to step unless every rank retrieves from the same knowledge-base version."""
        check_same_knowledge_base(self.trainer, knowledge_base_of(self), self.trainer.global_step)

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        questions, targets = batch["questions"], batch["targets"]
        if self.global_step < self._pretrain_steps():  # the reader's pre-training: practice alone, nothing retrieved
            loss, n = self._practice_loss(self.practice_settings.pretrain_batch)
            self.log("train/practice_loss", loss, prog_bar=True, batch_size=n)
            return loss
        loss, out = self.mode.loss(self._require_model(), questions, targets, batch_contexts(batch))
        if out is not None:
            self._count_contexts("train", out)
        loss = self._with_auxiliary_losses(loss, batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(questions))
        return loss

    def _with_auxiliary_losses(self, loss: torch.Tensor, batch: dict) -> torch.Tensor:
        """`loss` of the batch's pairs mixed with the reading losses, each example weighing as one pair: the generator on
        each pair's gold passage alone (``gold_passage``), and ``reading_practice.per_step`` practice examples."""
        n_real = len(batch["questions"])
        total, weight = loss * n_real, n_real
        model = self._require_model()
        if self._gold is not None:
            golds = self._gold.lookup(batch["targets"], batch.get("passage_ids"))
            found = [i for i, g in enumerate(golds) if g is not None]
            if found:
                gold = model.generator_loss([batch["questions"][i] for i in found], [batch["targets"][i] for i in found],
                                            [golds[i] for i in found])
                total, weight = total + gold * len(found), weight + len(found)
        if self._practice:
            practice, n = self._practice_loss(self.practice_settings.examples_per_step(n_real))
            total, weight = total + practice * n, weight + n
        return total / weight

    def _practice_loss(self, n: int) -> tuple[torch.Tensor, int]:
        """The generator's loss on `n` reading-practice examples drawn from the pool (each read with its passage)."""
        picked = self._practice_rng.sample(self._practice, min(n, len(self._practice)))
        loss = self._require_model().generator_loss([e.question for e in picked], [e.answer for e in picked],
                                                    [e.passage for e in picked])
        return loss, len(picked)

    def _eval_step(self, batch: dict, stage: str) -> None:
        questions, answers = batch["questions"], batch["answers"]
        loss, out = self.mode.loss(self._require_model(), questions, batch["targets"])
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", batch_size=len(questions), sync_dist=True)
        if out is not None:
            self._count_contexts(stage, out)
        em, f1, recall = (self.val_em, self.val_f1, self.val_recall) if stage == "val" else (self.test_em, self.test_f1,
                                                                                             self.test_recall)
        retrieved = out.retrieved if out is not None else None
        if stage == "test" or self.evaluation.generate_on_validation:
            preds, retrieved = self._answer(questions)
            em.update(preds, answers)
            f1.update(preds, answers)
            for name, metric in self.generation_metrics.items():
                if name.startswith(stage + "_"):
                    metric.update(preds, answers)
            if len(self._samples) < 3:
                self._samples.extend(zip(questions, preds, answers))
        if self.mode.retrieves:
            recall.update(self._recall_passages(questions, retrieved), answers)

    def _recall_passages(self, questions, retrieved) -> list[list]:
        """Ranked passages for recall@k: those already retrieved, or a deeper search if max k > n_docs."""
        want = max(self.evaluation.recall_at)
        if retrieved.k >= want:
            return retrieved.passages
        kb = self.model.knowledge_base
        k = min(want, len(kb)) if kb is not None else want
        with torch.no_grad():
            deeper, _ = self.model.retrieve(list(questions), n_docs=k)
        return deeper.passages

    def _answer(self, questions: Sequence[str]):
        """``(answers, Retrieved or None)`` of the mode under this run's decoding."""
        with torch.no_grad():
            return self.mode.answer(self._require_model(), questions, self.decoding.resolved())

    @without_cudnn_attention
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    @without_cudnn_attention
    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    @without_cudnn_attention
    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        """One record per question: ``question``, ``answer``, ``passages`` (``id``, ``title``, ``score``; empty closed-book),
        ``kb_version`` (None closed-book) and, when the data has them, the gold ``answers``."""
        questions = batch["questions"]
        preds, retrieved = self._answer(questions)
        if retrieved is None:  # nothing retrieved (closed-book)
            passages, scores, version = [[] for _ in questions], None, None
        else:
            passages, scores, version = retrieved.passages, retrieved.scores.tolist(), retrieved.kb_version
        records = []
        for i, (q, a, ps) in enumerate(zip(questions, preds, passages)):
            r = {"question": q, "answer": a, "kb_version": version,
                 "passages": [{"id": p.id, "title": p.title, "score": round(float(scores[i][j]), 6)} for j, p in enumerate(ps)]}
            if "answers" in batch:
                r["answers"] = list(batch["answers"][i])
            records.append(r)
        self._predictions.extend(records)
        return records

    def on_predict_epoch_start(self) -> None:
        self._predictions = []

    def on_predict_end(self) -> None:
        path = self.evaluation.predictions_file or os.path.join(self.trainer.default_root_dir, "predictions.jsonl")
        if self.trainer.world_size > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{self.trainer.global_rank}{ext}"
        atomic_write_text(path, "".join(to_json(r) + "\n" for r in self._predictions))
        print(f"rag predict: wrote {len(self._predictions)} predictions to {path}")

    # ------------------------------------------------------------------ epoch ends
    def _log_eval(self, stage: str) -> None:
        em, f1, recall = (self.val_em, self.val_f1, self.val_recall) if stage == "val" else (self.test_em, self.test_f1,
                                                                                             self.test_recall)
        if int(em.count) > 0 or stage == "test":
            self.log(f"{stage}/em", em.compute(), prog_bar=True)
            self.log(f"{stage}/f1", f1.compute())
        if self.mode.retrieves:  # closed-book runs retrieve nothing
            for name, value in recall.compute().items():
                self.log(f"{stage}/{name}", value)
        for name, metric in self.generation_metrics.items():
            if name.startswith(stage + "_") and (int(em.count) > 0 or stage == "test"):
                self.log(f"{stage}/{name[len(stage) + 1:]}", metric.compute())
            if name.startswith(stage + "_"):
                metric.reset()
        for m in (em, f1, recall):
            m.reset()
        if stage == "test" and self._samples and self.trainer.is_global_zero:  # shown with the metrics, not only in logs
            print("test samples:\n"
                  + "\n".join(f"  Q: {q}\n     predicted: {p!r}   gold: {' | '.join(a)}" for q, p, a in self._samples[:5]))
        for q, p, a in self._samples:
            logger.info("%s sample: Q: %s | predicted: %r | gold: %s", stage, q, p, a)
        self._samples.clear()
        self._report_truncation(stage)

    def _count_contexts(self, stage: str, out) -> None:
        self._truncated[stage] += int(out.n_truncated)
        self._contexts[stage] += int(out.retrieved.batch_size * out.retrieved.k)

    def _report_truncation(self, stage: str) -> None:
        """Once per epoch: how many (question, passage) contexts RagModel had to truncate."""
        n, total = self._truncated[stage], self._contexts[stage]
        if n and not self.trainer.sanity_checking:
            logger.warning(
                "%s: %d of %d generator contexts this epoch were longer than rag.max_context_length=%d tokens and "
                "were truncated (the question is kept); raise model.rag.max_context_length if passages are cut too much",
                stage, n, total, self.rag_config.max_context_length,
            )
        if not self.trainer.sanity_checking:
            self.log(f"{stage}/truncated_contexts", float(n), reduce_fx="sum", sync_dist=True)  # summed over DDP ranks
        self._truncated[stage] = self._contexts[stage] = 0

    def on_train_epoch_end(self) -> None:
        self._report_truncation("train")

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict:
        """AdamW with one learning rate per component (``RagModel.parameter_groups()``; the mode's) and a
        warm-up + linear-decay (or constant) schedule stepped every optimizer step."""
        o = self.optimizer_settings
        groups = self._require_model().parameter_groups()
        lrs = {"query_encoder": o.query_encoder_lr, "generator": o.lr, "doc_encoder": o.doc_encoder_lr}
        unknown = sorted(set(groups) - set(lrs))
        if unknown:
            raise ConfigError(f"RagModel.parameter_groups() returned unknown group(s) {unknown}; expected {sorted(lrs)}")
        param_groups = []
        for name, lr in self.mode.learning_rates(lrs).items():
            params = [p for p in groups.get(name, []) if p.requires_grad]
            if not params:
                continue
            if o.weight_decay > 0:
                decay, plain = decay_split(params, o.weight_decay, lr=lr, name=name)
                param_groups.append(decay)
                if plain["params"]:
                    param_groups.append({**plain, "name": f"{name}_no_decay"})
            else:
                param_groups.append({"params": params, "lr": lr, "weight_decay": 0.0, "name": name})
        if not param_groups:
            raise ConfigError("nothing to train: the query encoder is frozen and the generator has no trainable parameters")
        first = self._pretrain_steps()
        factors = [self.practice_settings.pretrain_lr / g["lr"] if g["name"].startswith("generator") else 0.0
                   for g in param_groups] if first else None
        return o.build(self, param_groups, first_steps=first, first_factors=factors)

    def _pretrain_steps(self) -> int:
        return 0 if self.practice_settings is None else self.practice_settings.pretrain_steps

    # ------------------------------------------------------------------ checkpoints
    def on_train_start(self) -> None:
        """A warm-started generator's frozen encoder runs once per distinct context (``model.cache_encoder``)."""
        gen = self._require_model().generator
        if self.hparams.cache_encoder and self._encoder_cache is None and is_warm_start(gen) \
                and not any(p.requires_grad for p in gen.encoder.parameters()):
            self._encoder_cache = cache_encoder_outputs(gen)
            self._encoder_cache.__enter__()

    def _release_encoder_cache(self) -> None:
        if self._encoder_cache is not None:
            self._encoder_cache.__exit__(None, None, None)
            self._encoder_cache = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Under the encoder-output cache the frozen encoder sits inside a wrapper: save it under its own names.
        checkpoint["state_dict"] = {k.replace(".generator.encoder.inner.", ".generator.encoder."): v
                                    for k, v in checkpoint["state_dict"].items()}
        kb = self.model.knowledge_base if self.model is not None else None
        checkpoint["rag"] = {"kb_version": getattr(kb, "version", None), "kb_path": str(getattr(kb, "path", "")),
                             "windows": dict(self._chosen_windows)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._use_windows(checkpoint.get("rag", {}).get("windows") or {})  # as the run that saved it chose them
        saved = checkpoint.get("rag", {}).get("kb_version")
        kb = self.model.knowledge_base if self.model is not None else None
        if saved and kb is not None and kb.version != saved:
            logger.warning("checkpoint was trained against knowledge base %s, now using %s (%s)", saved, kb.version, kb.path)

    def on_fit_start(self) -> None:
        train = getattr(getattr(self.trainer, "datamodule", None), "train_pairs", None)
        pairs = getattr(train, "pairs", [])  # the training (question, answer) pairs: gold passages, reading practice
        if self.hparams.gold_passage != "off" and self._gold is None:
            self._gold = GoldPassages(self._require_model().knowledge_base.all_passages(), [a for _, a in pairs],
                                      self.hparams.gold_passage)
            if getattr(train, "passage_ids", None) is not None:
                self._gold.check_ids(train.passage_ids)  # every named passage, before the first step
            elif self.hparams.gold_passage == "named":
                raise ConfigError("model.gold_passage=named, but the training data names no passages; set data.passage_field "
                                  "(the record field holding each answer's passage id), or use gold_passage: auto")
        if self.practice_settings is not None and not self._practice:
            model = self._require_model()
            self._practice = practice_pool(self.practice_settings, model.knowledge_base, model.generator_tokenizer,
                                           pairs=pairs)
            logger.info("reading practice: %d examples (%s), %d per step", len(self._practice), self.practice_settings.source,
                        self.practice_settings.per_step)
        self._fit_windows(pairs)
        if self._practice:
            self._fit_practice()
        export_dir = self.hparams.export_dir
        if export_dir and self.trainer.is_global_zero:  # refuse a bad target now, not after the whole run
            check_output_dir(export_dir, True, replaces=lambda p: (p / "rag_config.json").is_file(), kind="RAG model directory",
                             option="model.export_dir")

    def _fit_windows(self, pairs: list) -> None:
        """Before the first step: the windows ``model.windows`` chooses from the training `pairs` (every rank alike;
        a checkpoint's choice is kept), then the report of the training prompts the window cuts (rank zero)."""
        w, zero, retrieves = self.windows, self.trainer.is_global_zero, bool(pairs) and self.mode.retrieves
        found = None
        if not self._chosen_windows and pairs and "auto" in (w.max_new_tokens, w.max_context_length):
            model, chosen = self._require_model(), {}
            if w.max_new_tokens == "auto":
                chosen["max_new_tokens"], longest = answer_window(model.generator_tokenizer, [a for _, a in pairs],
                                                                  self.rag_config.max_target_length)
                if zero:
                    logger.warning("model.windows.max_new_tokens=auto: decoding.max_new_tokens=%d (the longest of the %d "
                                   "training answers is %d tokens, and one for the end token; at most "
                                   "rag.max_target_length=%d)", chosen["max_new_tokens"], len(pairs), longest,
                                   self.rag_config.max_target_length)
            if w.max_context_length == "auto" and retrieves:
                found = self._measure_prompts([q for q, _ in pairs], w.questions)
                positions = model_positions(model.lm)
                cap = positions - self.rag_config.max_target_length if positions else None
                chosen["max_context_length"] = min(found.covering(w.share), cap or 1 << 30)
                if zero:
                    logger.warning("model.windows.max_context_length=auto: rag.max_context_length=%d (holds %g%% of %d "
                                   "reader prompts of %d training questions whole; the longest %d%s)",
                                   chosen["max_context_length"], 100 * w.share, len(found.lengths), found.questions,
                                   max(found.lengths, default=0), f"; the generator's positions allow {cap}" if cap else "")
            self._use_windows(chosen)
        if retrieves and zero:
            self._report_cut_prompts_up_front([q for q, _ in pairs], found)

    def _fit_practice(self) -> None:
        """The reading-practice pool within the run's window (:func:`fit_to_window`): no practice answer is cut from
        the passage it is read in; one line says how many passages were shortened or examples dropped."""
        model, window = self._require_model(), self.rag_config.max_context_length
        size = len(self._practice)
        self._practice, shortened, dropped = fit_to_window(
            self._practice, lambda e: len(model.lm.prompt_ids(e.question, [e.passage], model.config)[0]), window)
        if (shortened or dropped) and self.trainer.is_global_zero:
            logger.warning("reading practice: %d of %d prompts are longer than rag.max_context_length=%d; %d read as the "
                           "sentences around their answer that fit, %d dropped (the answer's sentence alone does not fit)",
                           shortened + dropped, size, window, shortened, dropped)
        if not self._practice:
            raise ConfigError(f"reading practice: none of its {size} examples fits rag.max_context_length={window} tokens; "
                              "raise rag.max_context_length (or set model.windows.max_context_length: auto)")

    def _use_windows(self, chosen: dict) -> None:
        """Read with the windows `chosen` (``max_context_length``, ``max_new_tokens``) from now on."""
        chosen = {k: int(v) for k, v in chosen.items() if k in ("max_context_length", "max_new_tokens")}
        self._chosen_windows = chosen
        if "max_context_length" in chosen:
            self.rag_config = dataclasses.replace(self.rag_config, max_context_length=chosen["max_context_length"])
            if self.model is not None:
                self.model.config = dataclasses.replace(self.model.config, max_context_length=chosen["max_context_length"])
        if "max_new_tokens" in chosen:
            self.decoding = dataclasses.replace(self.decoding, max_new_tokens=chosen["max_new_tokens"])

    def _measure_prompts(self, questions: list[str], limit: int = 64) -> TrainingPrompts:
        """The reader inputs of up to `limit` training questions (:func:`measure_training_prompts`), retrieved in eval
        mode without gradients; the random number generators are left as they were (the query encoder's dropout draws
        from them), so training is unchanged."""
        model = self._require_model()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        was = model.training
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model.eval()
            try:
                return measure_training_prompts(model, questions, limit=limit)
            finally:
                model.train(was)

    def _report_cut_prompts_up_front(self, questions: list[str], found: Optional[TrainingPrompts] = None) -> None:
        """Before the first step: the fraction of reader prompts longer than ``rag.max_context_length``, measured on the
        retrieval of up to 64 of the training questions (`found`, else measured now), and the window that would hold
        99% of them whole: one warning line when any is cut."""
        found = found or self._measure_prompts(questions)
        window = self.rag_config.max_context_length
        cut = CutPrompts(len(found.lengths), sum(n > window for n in found.lengths), {window})
        if cut.cut:
            logger.warning("train: %s (measured before training on %d of the %d training questions; %d tokens hold 99%% "
                           "of them whole: model.rag.max_context_length sets the window, model.windows.max_context_length: "
                           "auto chooses it)", cut.summary(), found.questions, found.of, found.covering(0.99))
        else:
            logger.info("train: no reader prompt is cut (%d prompts of %d training questions)", cut.prompts, found.questions)

    def decoding_defaults(self) -> dict:
        """This run's decoding settings (``num_beams``, ``max_new_tokens``, ``length_penalty``, resolved): validation, test
        and predict decode with them, and the exported model stores them (``RagModelConfig.generation``), so ``rag
        generate --model DIR`` answers as ``rag test`` scored."""
        d = self.decoding.resolved()
        return {"num_beams": d["num_beams"], "max_new_tokens": d["max_new_tokens"], "length_penalty": d["length_penalty"]}

    def export(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the model to `directory` as a reader export (:func:`rag.pipeline.exports.write_rag_export`) with
        :meth:`decoding_defaults` as its stored decoding defaults; returns the directory."""
        model = self._require_model()
        stored = model.config.generation
        model.config = dataclasses.replace(model.config, generation={**(stored or {}), **self.decoding_defaults()})
        try:
            return write_rag_export(model, directory, overwrite=overwrite)
        finally:
            model.config = dataclasses.replace(model.config, generation=stored)

    def on_train_end(self) -> None:
        self._release_encoder_cache()
        export_dir = self.hparams.export_dir
        if export_dir and self.trainer.is_global_zero:
            self.export(export_dir, overwrite=True)
            logger.info("trained model written to %s: rag generate --model %s", export_dir, export_dir)

    def save_rag_model(self, path: str | os.PathLike) -> None:
        """Write the trained :class:`RagModel` with ``save_pretrained`` (safetensors)."""
        self._require_model().save_pretrained(path)

