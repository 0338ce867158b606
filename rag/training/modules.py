"""LightningModules for training retrieval-augmented models.

:class:`RagModule` fine-tunes a :class:`~rag.models.rag.model.RagModel` end to end
(Lewis et al. 2020, §2.4): the query encoder and the generator are trained jointly
on the marginal negative log-likelihood; the document encoder and the index stay
fixed unless ``rag.train_doc_encoder`` trains the document encoder too (then pair it
with the :class:`~rag.training.callbacks.IndexRefresh` callback, which re-encodes
the corpus and hot-swaps the index on a schedule). Validation/test generate answers
and report exact match and token F1 (SQuAD normalisation) and retrieval recall@k.

Construction is lazy: ``__init__`` only records the (typed, YAML-configurable)
arguments, so a config parses and instantiates without touching a model hub or the
disk; the model itself is built in :meth:`RagModule.configure_model`, which
Lightning calls before the first step and before restoring a checkpoint. A knowledge
base / query-encoder dimension mismatch therefore surfaces at setup, never mid-epoch.

Special generator value ``tiny:bart`` / ``tiny:t5``: a randomly initialised small
generator (sizes in ``tiny``) with a tokenizer trained on the knowledge base's own
passages — no hub needed (built and cached by :mod:`rag.generators.tiny_generator`). A
missing knowledge base is built by :func:`rag.training.ensure_kb.ensure_knowledge_base`
when ``build_knowledge_base_from`` names a corpus.
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

from rag.demo.kb import KNOWLEDGE_BASE_NAMES, resolve_knowledge_base
from rag.eval.metrics import GENERATION_METRICS, ExactMatch, RetrievalRecall, TokenF1
from rag.generators.lora import LoraSettings
from rag.generators.tiny_generator import TinyGenerator, WarmStartGenerator, check_tiny_name, resolve_generator
from rag.models.rag.config import RagModelConfig
from rag.training.reading_practice import ReadingPracticeSettings
from rag.training.schedules import SCHEDULES, step_schedule
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.truncation import sample_cut_prompts
from rag.utils.validate import check_number

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- decoding


def _no_repeat(model) -> int:
    """The model's stored setting, else the pipeline's default (no repeated bigram), except for imported transformers
    checkpoints."""
    from rag.pipeline.readers import DEFAULT_NO_REPEAT_NGRAM

    stored = (model.config.generation or {}).get("no_repeat_ngram_size")
    if stored is not None:
        return int(stored)
    return 0 if model.config.hf_compat else DEFAULT_NO_REPEAT_NGRAM


def generate_answers(model, questions: Sequence[str], *, num_beams: int = 1, max_new_tokens: int = 20,
                     sequence_decoding: Literal["fast", "thorough"] = "fast", length_penalty: float = 1.0):
    """Answer strings for B questions, plus the :class:`Retrieved` passages used and the truncated-context count.

    Decodes through :func:`rag.models.rag.generate.generate_for_questions` (the pipeline's path too) with the
    model's marginalization (RAG-Token: greedy/beam over the marginal; RAG-Sequence: per-passage search + fast
    or thorough rescoring, Lewis et al. 2020 §2.5).
    """
    from rag.generation.decoding import GenerationConfig
    from rag.generation.detokenize import decode_answer
    from rag.models.rag.generate import generate_for_questions

    cfg = GenerationConfig(num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                           no_repeat_ngram_size=_no_repeat(model))
    found = generate_for_questions(model, questions, cfg, decoding=sequence_decoding)
    texts = [decode_answer(model.generator_tokenizer, row[1:]) for row in found.output.sequences.tolist()]  # after the start token
    return texts, found.inputs.retrieved, found.inputs.n_truncated


# ---------------------------------------------------------------------------- the module


# Defaults of RagModule's nested options: typed dataclasses (not Optional), so that `rag fit --print_config` and
# `--model.help` list their fields; never mutated (RagModule copies them into plain dicts).
_DEFAULT_RAG, _DEFAULT_TINY, _DEFAULT_WARM = RagModelConfig(), TinyGenerator(), WarmStartGenerator()


class RagModule(pl.LightningModule):
    """End-to-end RAG fine-tuning (query encoder + generator) with QA evaluation.

    Args:
        generator: seq2seq or causal generator: a local ``save_pretrained`` directory, a hub id
            (``facebook/bart-large``, ``t5-base``), ``smollm2`` (the demo causal LM, RAG over a decoder-only reader:
            see ``rag.prompt_template``), or ``tiny:bart`` / ``tiny:t5`` for a random small model (sizes in `tiny`).
        question_encoder: query encoder (DPR question encoder dir/hub id, ``minilm``), or
            None to use the one the knowledge base's manifest names.
        knowledge_base: knowledge-base directory (``rag index build``), or ``demo`` (the bundled Elements knowledge base).
        build_knowledge_base_from: if `knowledge_base` does not exist, build it first
            from this corpus: ``demo`` (the bundled Elements corpus) or a corpus path.
        knowledge_base_encoder: document encoder for that build (default: the question
            encoder, right for shared encoders such as MiniLM; DPR needs its context encoder).
        knowledge_base_index: FAISS index spec for that build (``flat``, ``hnsw``, ...).
        rag: RAG options (n_docs, marginalization, label smoothing, truncation lengths, ...).
        tiny: sizes of the ``tiny:*`` generator.
        document_encoder: document encoder trained by ``rag.train_doc_encoder`` / used by
            ``rag.rerank_candidates`` (default: the one that built the knowledge base, from its manifest).
        doc_encoder_lr: learning rate of the document encoder (``rag.train_doc_encoder``).
        query_encoder_lr: learning rate of the query encoder.
        generator_lr: learning rate of the generator.
        weight_decay: AdamW weight decay (not applied to biases and norm weights).
        adam_epsilon: AdamW epsilon.
        warmup_steps: optimizer steps of linear warm-up.
        warmup_ratio: warm-up as a fraction of all optimizer steps (instead of `warmup_steps`).
        schedule: after warm-up, ``linear`` decay to 0 at the last step, or ``constant``.
        num_beams: beam width for validation/test/predict generation (1 = greedy).
        max_new_tokens: most generated answer tokens.
        length_penalty: beams are ranked by log-probability / length ** length_penalty (> 1 favours longer answers).
            ``num_beams``, ``max_new_tokens`` and ``length_penalty`` are also the exported model's decoding defaults.
        sequence_decoding: RAG-Sequence decoding for evaluation: ``fast`` or ``thorough`` (§2.5).
        recall_at: the k of retrieval recall@k reported on validation/test.
        generate_on_validation: generate and score EM/F1 during validation (off: loss + recall only).
        closed_book: the closed-book baseline (Lewis et al. 2020, Table 1): the generator is trained and evaluated on the
            questions alone (``RagModel.generator_loss`` without passages), nothing is retrieved and the query encoder is
            not trained; compare it with a RAG run of the same config.
        warm_start: the generator built for ``generator: warm:<encoder>`` (e.g. ``warm:minilm``): frozen pretrained encoder,
            fresh decoder, copy head (:class:`~rag.generators.tiny_generator.WarmStartGenerator`).
        reading_practice: an auxiliary generator loss on examples only reading their passage answers, mixed into every
            step (:class:`~rag.training.reading_practice.ReadingPracticeSettings`; built from the knowledge base's passages),
            and with ``pretrain_steps`` the run's first steps on practice alone (the reader's pre-training).
        gold_passage: also train the generator on each training pair's gold passage alone
            (:mod:`rag.training.gold_passages`): ``named`` by the data's ``passage_ids`` (``data.passage_field``; an id not
            in the knowledge base is an error), ``unique_answer`` where the answer occurs in exactly one passage, ``auto``
            the first when the data names passages, else the second; ``off``.
        retrieval_actors: serve the knowledge base's search from this many Ray actors
            (:class:`~rag.knowledge.ray_pool.RayRetrievalPool`: restarted on failure, a query retried once on another
            actor) instead of this process; 0 searches here. Needs ``pip install -e ".[ray]"``.
        ray_address: the Ray cluster of the retrieval actors (``host:port``); None starts or joins a local Ray.
        cache_encoder: memoise a frozen generator encoder's outputs per distinct context while training (warm-started
            generators; each context is encoded once per run).
        generation_metrics: metrics added to EM and F1 in validation and test for generation tasks: ``bleu1`` (BLEU-1),
            ``rougeL`` (ROUGE-L F), both torchmetrics' (:data:`rag.eval.metrics.GENERATION_METRICS`).
        predictions_file: where ``rag predict`` writes its predictions, one JSON object per question with provenance
            (answer, passages with ids, titles and scores, knowledge-base version); default
            ``<trainer.default_root_dir>/predictions.jsonl``. The path is printed.
        generator_lora: LoRA adapters on a causal generator (:class:`~rag.generators.lora.LoraSettings`: ``r``, ``alpha``,
            ``dropout``, ``target_modules``, ``layers``): only they train, and the export holds them alone, naming the base
            model with its checksums; null trains every generator weight (full fine-tuning).
        export_dir: write the trained model there at the end of ``fit`` (:func:`rag.models.rag.checkpoint.save_model_directory`:
            ``rag generate --model DIR`` reads it); an earlier export there is replaced, any other content refused.
    """

    def __init__(
        self,
        generator: str = "facebook/bart-large",
        question_encoder: Optional[str] = "facebook/dpr-question_encoder-single-nq-base",
        knowledge_base: str = "kb",
        build_knowledge_base_from: Optional[str] = None,
        knowledge_base_encoder: Optional[str] = None,
        knowledge_base_index: str = "flat",
        rag: RagModelConfig = _DEFAULT_RAG,
        tiny: TinyGenerator = _DEFAULT_TINY,
        document_encoder: Optional[str] = None,
        doc_encoder_lr: float = 1e-5,
        query_encoder_lr: float = 1e-5,
        generator_lr: float = 3e-5,
        weight_decay: float = 0.0,
        adam_epsilon: float = 1e-8,
        warmup_steps: int = 0,
        warmup_ratio: Optional[float] = None,
        schedule: Literal["linear", "constant"] = "linear",
        num_beams: int = 1,
        max_new_tokens: int = 20,
        length_penalty: float = 1.0,
        sequence_decoding: Literal["fast", "thorough"] = "fast",
        recall_at: Sequence[int] = (1, 5),
        generate_on_validation: bool = True,
        closed_book: bool = False,
        export_dir: Optional[str] = None,
        predictions_file: Optional[str] = None,
        generation_metrics: Sequence[Literal["bleu1", "rougeL"]] = (),
        warm_start: WarmStartGenerator = _DEFAULT_WARM,
        reading_practice: Optional[ReadingPracticeSettings] = None,
        cache_encoder: bool = True,
        gold_passage: Literal["off", "auto", "named", "unique_answer"] = "off",
        retrieval_actors: int = 0,
        ray_address: Optional[str] = None,
        generator_lora: Optional[LoraSettings] = None,
    ) -> None:
        super().__init__()
        # Hyperparameters are stored as plain dicts/lists so that checkpoints load with
        # torch.load(weights_only=True) (Lightning's default when resuming).
        rag = _as_dict(rag, RagModelConfig, "rag")
        tiny = _as_dict(tiny, TinyGenerator, "tiny")
        warm_start = _as_dict(warm_start, WarmStartGenerator, "warm_start")
        reading_practice = None if reading_practice is None else _as_dict(reading_practice, ReadingPracticeSettings, "reading_practice")
        generator_lora = None if generator_lora is None else _as_dict(generator_lora, LoraSettings, "generator_lora")
        recall_at = [int(k) for k in recall_at]
        generation_metrics = list(generation_metrics)
        unknown = [m for m in generation_metrics if m not in GENERATION_METRICS]
        if unknown:
            raise ConfigError(f"model.generation_metrics: unknown {unknown}; choose from {sorted(GENERATION_METRICS)}")
        for name, lr in (("query_encoder_lr", query_encoder_lr), ("generator_lr", generator_lr), ("doc_encoder_lr", doc_encoder_lr)):
            check_number(lr, f"model.{name}", low=0, error=ConfigError)
        if warmup_ratio is not None and (not 0.0 <= warmup_ratio < 1.0):
            raise ConfigError(f"model.warmup_ratio must be in [0, 1), got {warmup_ratio!r}")
        if warmup_ratio is not None and warmup_steps:
            raise ConfigError("set model.warmup_steps or model.warmup_ratio, not both")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"model.warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if schedule not in SCHEDULES:
            raise ConfigError(f"model.schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
        check_number(retrieval_actors, "model.retrieval_actors (0: search in this process)", integer=True, low=0, error=ConfigError)
        if ray_address is not None and not retrieval_actors:
            raise ConfigError("model.ray_address is the cluster of the retrieval actors; set model.retrieval_actors too")
        check_tiny_name(generator, "model.generator")
        self.rag_config = RagModelConfig(**rag)  # validates the RAG options now, at parse time
        self.tiny_spec = TinyGenerator(**tiny)
        self.warm_spec = WarmStartGenerator(**warm_start)
        self.practice_settings = None if reading_practice is None else ReadingPracticeSettings(**reading_practice)
        self.lora_settings = None if generator_lora is None else LoraSettings(**generator_lora)
        self._practice: list = []  # built in on_fit_start
        self._practice_rng = random.Random(0 if self.practice_settings is None else self.practice_settings.seed)
        self._encoder_cache = None
        self._gold = None  # GoldPassages, built in on_fit_start
        self._search_pool = None  # RayRetrievalPool (retrieval_actors), started in configure_model
        self.save_hyperparameters()
        self.model = None  # built in configure_model()
        self.val_em, self.val_f1, self.val_recall = ExactMatch(), TokenF1(), RetrievalRecall(recall_at)
        self.test_em, self.test_f1, self.test_recall = ExactMatch(), TokenF1(), RetrievalRecall(recall_at)
        self.generation_metrics = torch.nn.ModuleDict({f"{stage}_{name}": GENERATION_METRICS[name]()
                                                       for stage in ("val", "test") for name in generation_metrics})
        self._truncated = {"train": 0, "val": 0, "test": 0}  # contexts truncated this epoch
        self._contexts = {"train": 0, "val": 0, "test": 0}  # contexts built this epoch
        self._samples: list[tuple[str, str, list[str]]] = []
        self._predictions: list[dict] = []

    # ------------------------------------------------------------------ model construction
    def prepare_data(self) -> None:
        """Build the knowledge base / tiny generator once (rank 0) before setup on every rank."""
        self._ensure_artifacts()

    def _ensure_artifacts(self) -> tuple[str, str]:
        from rag.training.ensure_kb import ensure_knowledge_base

        h = self.hparams
        kb = h.knowledge_base
        if kb in KNOWLEDGE_BASE_NAMES:  # "demo": the bundled Elements knowledge base (dense + BM25), built on first use
            kb = str(resolve_knowledge_base(kb).path)
        elif h.build_knowledge_base_from is not None:
            enc = h.knowledge_base_encoder or h.question_encoder
            if enc is None:
                raise ConfigError("model.build_knowledge_base_from needs model.knowledge_base_encoder or model.question_encoder")
            ensure_knowledge_base(kb, h.build_knowledge_base_from, enc, index=h.knowledge_base_index,
                                  query_encoder=h.question_encoder if h.knowledge_base_encoder else None,
                                  bm25=self.rag_config.retrieval != "dense")
        return kb, resolve_generator(h.generator, self.tiny_spec, kb, self.warm_spec)

    def configure_model(self) -> None:
        """Build the :class:`RagModel` (called by Lightning before training/eval and before a
        checkpoint is restored). Raises a clear error for a KB / query-encoder dimension mismatch."""
        if self.model is not None:
            return
        from rag.models.rag.model import RagModel

        kb, gen = self._ensure_artifacts()
        model = RagModel.from_components(self.hparams.question_encoder, gen, kb, self.rag_config,
                                         document_encoder=self.hparams.get("document_encoder"))
        if self.lora_settings is not None:  # only the adapters train; the export holds them alone
            from rag.generators.lora import apply_lora

            model.generator = apply_lora(model.generator, self.lora_settings)
        if self.hparams.get("retrieval_actors"):
            self._start_search_pool(model.knowledge_base)
        if self._trains_without_retrieval():
            # Every training step reads the generator alone: the retrieval side never gets a gradient, so it is frozen
            # (before DDP wraps the model, which otherwise waits for gradients that never come).
            model.question_encoder.requires_grad_(False)
            for extra in (model.doc_encoder, getattr(model, "log_retrieval_temperature", None)):
                if extra is not None:
                    extra.requires_grad_(False)
        # from_pretrained returns modules in eval mode; Lightning keeps module modes as they are,
        # so switch to train mode here (dropout on; a frozen query encoder stays in eval).
        self.model = model.train(self.training)

    def _trains_without_retrieval(self) -> bool:
        """True when no training step retrieves: the closed-book baseline, or RetRobust's context mixing (the data gives
        each pair its passage)."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return bool(self.hparams.get("closed_book")) or getattr(datamodule, "context_mixing", None) is not None

    @property
    def ddp_find_unused_parameters(self) -> bool:
        """Whether DDP must search for parameters without a gradient: only when some steps leave trainable ones unused,
        i.e. the reader's pre-training (``reading_practice.pretrain_steps``) trains the generator alone for its first
        steps while the query encoder (or the document encoder) trains afterwards. ``rag fit --trainer.strategy ddp``
        then uses ``ddp_find_unused_parameters_true`` (:mod:`rag.cli.train`); every other run uses plain DDP."""
        if self.practice_settings is None or not self.practice_settings.pretrain_steps or self.hparams.get("closed_book"):
            return False
        rag = self.rag_config
        return not (rag.freeze_query_encoder or rag.retrieval == "bm25") or rag.train_doc_encoder or rag.learn_retrieval_temperature

    def _start_search_pool(self, kb) -> None:
        """``retrieval_actors`` Ray actors serving `kb`'s search (:class:`~rag.knowledge.ray_pool.RayRetrievalPool`)."""
        from rag.knowledge.ray_pool import RayRetrievalPool

        self._stop_search_pool()
        self._search_pool = RayRetrievalPool(kb.path, self.hparams.retrieval_actors, address=self.hparams.get("ray_address"))
        kb.use_search_pool(self._search_pool)

    def _stop_search_pool(self) -> None:
        if self._search_pool is not None:
            self._search_pool.close()
            self._search_pool = None

    def on_knowledge_base_swapped(self, kb) -> None:
        """Called by :class:`~rag.training.callbacks.IndexRefresh` after a swap: the actors move to the new version."""
        if self._search_pool is not None:
            self._start_search_pool(kb)

    def teardown(self, stage: str) -> None:
        """Stop the retrieval actors this module started (the Ray cluster itself keeps running)."""
        if self._search_pool is not None and self.model is not None:
            self.model.knowledge_base.use_search_pool(None)
        self._stop_search_pool()

    def _require_model(self):
        if self.model is None:
            self.configure_model()
        return self.model

    # ------------------------------------------------------------------ steps
    def forward(self, questions: Sequence[str], targets: Sequence[str]):
        return self._require_model()(list(questions), list(targets))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under DDP, refuse to step unless every rank retrieves from the same knowledge-base version."""
        from rag.training.distributed import check_same_knowledge_base, knowledge_base_of

        check_same_knowledge_base(self.trainer, knowledge_base_of(self), self.trainer.global_step)

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        questions, targets = batch["questions"], batch["targets"]
        if self.global_step < self._pretrain_steps():  # the reader's pre-training: practice alone, nothing retrieved
            loss, n = self._practice_loss(self.practice_settings.pretrain_batch)
            self.log("train/practice_loss", loss, prog_bar=True, batch_size=n)
            return loss
        if self.hparams.get("closed_book"):
            if "contexts" in batch:
                raise ConfigError("model.closed_book trains on the questions alone, but the data gives each question a passage "
                                  "(data.context_mixing): drop one of them")
            loss = self._require_model().generator_loss(questions, targets)
        elif "contexts" in batch:  # RetRobust context mixing: the generator reads the one drawn passage (no retrieval)
            loss = self._require_model().generator_loss(questions, targets, batch["contexts"])
        else:
            out = self(questions, targets)
            self._count_contexts("train", out)
            loss = out.loss
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
            practice, n = self._practice_loss(self.practice_settings.per_step)
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
        bs = len(questions)
        if self.hparams.get("closed_book"):
            self._closed_book_eval_step(questions, batch["targets"], answers, stage)
            return
        out = self(questions, batch["targets"])
        self.log(f"{stage}/loss", out.loss, prog_bar=stage == "val", batch_size=bs, sync_dist=True)
        self._count_contexts(stage, out)
        em, f1, recall = (self.val_em, self.val_f1, self.val_recall) if stage == "val" else (self.test_em, self.test_f1, self.test_recall)
        retrieved = out.retrieved
        if stage == "test" or self.hparams.generate_on_validation:
            preds, retrieved, _ = self._generate(questions)
            em.update(preds, answers)
            f1.update(preds, answers)
            self._update_generation_metrics(stage, preds, answers)
            if len(self._samples) < 3:
                self._samples.extend(zip(questions, preds, answers))
        recall.update(self._recall_passages(questions, retrieved), answers)

    def _update_generation_metrics(self, stage: str, preds, answers) -> None:
        for name, metric in self.generation_metrics.items():
            if name.startswith(stage + "_"):
                metric.update(preds, answers)

    def _closed_book_eval_step(self, questions, targets, answers, stage: str) -> None:
        """Loss, EM and F1 of the generator on the bare questions (no retrieval, so no recall)."""
        em, f1 = (self.val_em, self.val_f1) if stage == "val" else (self.test_em, self.test_f1)
        model = self._require_model()
        with torch.no_grad():
            self.log(f"{stage}/loss", model.generator_loss(questions, targets), prog_bar=stage == "val", batch_size=len(questions),
                     sync_dist=True)
        if stage == "test" or self.hparams.generate_on_validation:
            preds = self._generate_closed_book(questions)
            em.update(preds, answers)
            f1.update(preds, answers)
            self._update_generation_metrics(stage, preds, answers)
            if len(self._samples) < 3:
                self._samples.extend(zip(questions, preds, answers))

    def _generate_closed_book(self, questions: Sequence[str]) -> list[str]:
        from rag.generation.decoding import GenerationConfig
        from rag.generation.detokenize import decode_answer
        from rag.models.rag.generate import generate_closed_book

        model = self._require_model()
        with torch.no_grad():
            out = generate_closed_book(model, list(questions),
                                       GenerationConfig(**self.decoding_defaults(), no_repeat_ngram_size=_no_repeat(model)))
        return [decode_answer(model.generator_tokenizer, row[1:]) for row in out.sequences.tolist()]

    def _recall_passages(self, questions, retrieved) -> list[list]:
        """Ranked passages for recall@k: those already retrieved, or a deeper search if max k > n_docs."""
        want = max(self.hparams.recall_at)
        if retrieved.k >= want:
            return retrieved.passages
        kb = self.model.knowledge_base
        k = min(want, len(kb)) if kb is not None else want
        with torch.no_grad():
            deeper, _ = self.model.retrieve(list(questions), n_docs=k)
        return deeper.passages

    def _generate(self, questions: Sequence[str]):
        with torch.no_grad():
            return generate_answers(self._require_model(), questions, sequence_decoding=self.hparams.sequence_decoding,
                                    **self.decoding_defaults())

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
        if self.hparams.get("closed_book"):
            preds, passages, scores, version = self._generate_closed_book(questions), [[] for _ in questions], None, None
        else:
            preds, retrieved, _ = self._generate(questions)
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
        from rag.utils.io import atomic_write_text, to_json

        path = self.hparams.get("predictions_file") or os.path.join(self.trainer.default_root_dir, "predictions.jsonl")
        if self.trainer.world_size > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{self.trainer.global_rank}{ext}"
        atomic_write_text(path, "".join(to_json(r) + "\n" for r in self._predictions))
        print(f"rag predict: wrote {len(self._predictions)} predictions to {path}")

    # ------------------------------------------------------------------ epoch ends
    def _log_eval(self, stage: str) -> None:
        em, f1, recall = (self.val_em, self.val_f1, self.val_recall) if stage == "val" else (self.test_em, self.test_f1, self.test_recall)
        if int(em.count) > 0 or stage == "test":
            self.log(f"{stage}/em", em.compute(), prog_bar=True)
            self.log(f"{stage}/f1", f1.compute())
        if not self.hparams.get("closed_book"):  # closed-book runs retrieve nothing
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
            print("test samples:\n" + "\n".join(f"  Q: {q}\n     predicted: {p!r}   gold: {' | '.join(a)}" for q, p, a in self._samples[:5]))
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
        """AdamW with one learning rate per component (``RagModel.parameter_groups()``) and a
        warm-up + linear-decay (or constant) schedule stepped every optimizer step."""
        h = self.hparams
        groups = self._require_model().parameter_groups()
        lrs = {"query_encoder": h.query_encoder_lr, "generator": h.generator_lr, "doc_encoder": h.get("doc_encoder_lr", 1e-5)}
        unknown = sorted(set(groups) - set(lrs))
        if unknown:
            raise ConfigError(f"RagModel.parameter_groups() returned unknown group(s) {unknown}; expected {sorted(lrs)}")
        if h.get("closed_book"):  # nothing is retrieved: only the generator learns
            lrs = {"generator": h.generator_lr}
        param_groups = []
        for name, lr in lrs.items():
            params = [p for p in groups.get(name, []) if p.requires_grad]
            if not params:
                continue
            if h.weight_decay > 0:
                decay = [p for p in params if p.ndim >= 2]
                plain = [p for p in params if p.ndim < 2]  # biases and LayerNorm weights
                param_groups.append({"params": decay, "lr": lr, "weight_decay": h.weight_decay, "name": name})
                if plain:
                    param_groups.append({"params": plain, "lr": lr, "weight_decay": 0.0, "name": f"{name}_no_decay"})
            else:
                param_groups.append({"params": params, "lr": lr, "weight_decay": 0.0, "name": name})
        if not param_groups:
            raise ConfigError("nothing to train: the query encoder is frozen and the generator has no trainable parameters")
        optimizer = torch.optim.AdamW(param_groups, eps=h.adam_epsilon)
        first = self._pretrain_steps()
        factors = [self.practice_settings.pretrain_lr / g["lr"] if g["name"].startswith("generator") else 0.0
                   for g in param_groups] if first else None
        return {"optimizer": optimizer, "lr_scheduler": step_schedule(optimizer, self.trainer, warmup_ratio=h.warmup_ratio,
                                                                      warmup_steps=h.warmup_steps, schedule=h.schedule,
                                                                      first_steps=first, first_factors=factors)}

    def _pretrain_steps(self) -> int:
        return 0 if self.practice_settings is None else self.practice_settings.pretrain_steps

    # ------------------------------------------------------------------ checkpoints
    def on_train_start(self) -> None:
        """A warm-started generator's frozen encoder runs once per distinct context (``model.cache_encoder``)."""
        from rag.generators.warm_start import cache_encoder_outputs, is_warm_start

        gen = self._require_model().generator
        if self.hparams.get("cache_encoder", True) and self._encoder_cache is None and is_warm_start(gen) \
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
        checkpoint["rag"] = {"kb_version": getattr(kb, "version", None), "kb_path": str(getattr(kb, "path", ""))}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("rag", {}).get("kb_version")
        kb = self.model.knowledge_base if self.model is not None else None
        if saved and kb is not None and kb.version != saved:
            logger.warning("checkpoint was trained against knowledge base %s, now using %s (%s)", saved, kb.version, kb.path)

    def on_fit_start(self) -> None:
        train = getattr(getattr(self.trainer, "datamodule", None), "_datasets", {}).get("train")
        pairs = getattr(train, "pairs", [])  # the training (question, answer) pairs: gold passages, reading practice
        if self.hparams.get("gold_passage", "off") != "off" and self._gold is None:
            from rag.training.gold_passages import GoldPassages

            self._gold = GoldPassages(self._require_model().knowledge_base.all_passages(), [a for _, a in pairs],
                                      self.hparams.gold_passage)
            if getattr(train, "passage_ids", None) is not None:
                self._gold.check_ids(train.passage_ids)  # every named passage, before the first step
            elif self.hparams.gold_passage == "named":
                raise ConfigError("model.gold_passage=named, but the training data names no passages; set data.passage_field "
                                  "(the record field holding each answer's passage id), or use gold_passage: auto")
        if self.practice_settings is not None and not self._practice:
            from rag.training.reading_practice import practice_pool

            model = self._require_model()
            self._practice = practice_pool(self.practice_settings, model.knowledge_base, model.generator_tokenizer,
                                           pairs=pairs)
            logger.info("reading practice: %d examples (%s), %d per step", len(self._practice), self.practice_settings.source,
                        self.practice_settings.per_step)
        if pairs and not self.hparams.get("closed_book") and self.trainer.is_global_zero:
            self._report_cut_prompts_up_front([q for q, _ in pairs])
        export_dir = self.hparams.get("export_dir")
        if export_dir and self.trainer.is_global_zero:  # refuse a bad target now, not after the whole run
            from rag.utils.io import check_output_dir

            check_output_dir(export_dir, True, replaces=lambda p: (p / "rag_config.json").is_file(), kind="RAG model directory",
                             option="model.export_dir")

    def _report_cut_prompts_up_front(self, questions: list[str]) -> None:
        """Before the first step: the fraction of reader prompts longer than ``rag.max_context_length``, measured on the
        retrieval of up to 64 of the training questions (one warning line when any is cut). The random number
        generators are left as they were (the query encoder's dropout draws from them), so training is unchanged."""
        model = self._require_model()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            cut, n = sample_cut_prompts(model.prepare_inputs, questions)
        if cut.cut:
            logger.warning("train: %s (measured before training on %d of the %d training questions; "
                           "model.rag.max_context_length sets the window)", cut.summary(), n, len(set(questions)))
        else:
            logger.info("train: no reader prompt is cut (%d prompts of %d training questions)", cut.prompts, n)

    def decoding_defaults(self) -> dict:
        """This run's decoding settings (``num_beams``, ``max_new_tokens``, ``length_penalty``): validation, test and
        predict decode with them, and the exported model stores them (``RagModelConfig.generation``), so ``rag generate
        --model DIR`` answers as ``rag test`` scored."""
        h = self.hparams
        return {"num_beams": h.num_beams, "max_new_tokens": h.max_new_tokens, "length_penalty": float(h.get("length_penalty", 1.0))}

    def export(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the model to `directory` (:func:`rag.models.rag.checkpoint.save_model_directory`) with
        :meth:`decoding_defaults` as its stored decoding defaults; returns the directory."""
        from rag.models.rag.checkpoint import save_model_directory

        model = self._require_model()
        stored = model.config.generation
        model.config = dataclasses.replace(model.config, generation={**(stored or {}), **self.decoding_defaults()})
        try:
            return save_model_directory(model, directory, overwrite=overwrite)
        finally:
            model.config = dataclasses.replace(model.config, generation=stored)

    def on_train_end(self) -> None:
        self._release_encoder_cache()
        export_dir = self.hparams.get("export_dir")
        if export_dir and self.trainer.is_global_zero:
            self.export(export_dir, overwrite=True)
            logger.info("trained model written to %s: rag generate --model %s", export_dir, export_dir)

    def save_rag_model(self, path: str | os.PathLike) -> None:
        """Write the trained :class:`RagModel` with ``save_pretrained`` (safetensors)."""
        self._require_model().save_pretrained(path)


def _as_dict(value: Any, cls: type, name: str) -> dict:
    """A dataclass instance, a dict (from a YAML config or checkpoint) or None -> plain dict."""
    if value is None:
        return {}
    if isinstance(value, cls):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"model.{name}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        return dict(value)
    raise ConfigError(f"model.{name} must be a {cls.__name__} or a mapping, got {type(value).__name__}")
