"""Question-answering data for training: torch datasets and the LightningDataModule over
:mod:`rag.eval.qa_data` (which reads the files, formats listed there)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset

from rag.demo.kb import resolve_knowledge_base
from rag.eval.qa_data import OnEmpty, QADataError, QAExample, expand_answers, read_qa
from rag.training.context_mixing import ContextMixing, open_knowledge_base, retrieve_rows, sample_context_choices
from rag.training.reading_practice import cloze_practice
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_positive_int

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- torch datasets


class QAPairsDataset(Dataset):
    """Training items ``{"question", "target"}``: one per (question, gold answer).

    With `contexts` (one passage per pair) and `context_kinds`, items also hold ``"context"`` and
    ``"context_kind"`` (RetRobust context mixing, :mod:`rag.training.context_mixing`).
    """

    def __init__(self, examples: Sequence[QAExample], contexts: Optional[Sequence[Any]] = None,
                 context_kinds: Optional[Sequence[str]] = None) -> None:
        self.pairs = expand_answers(examples)
        ids = [ex.passage_id for ex in examples for _ in ex.answers]
        self.passage_ids = ids if any(i is not None for i in ids) else None
        if contexts is not None and (len(contexts) != len(self.pairs) or len(context_kinds or ()) != len(self.pairs)):
            raise RagError(f"{len(self.pairs)} training pairs but {len(contexts)} contexts; give one context (and kind) per pair")
        self.contexts, self.context_kinds = contexts, context_kinds

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        q, a = self.pairs[i]
        item = {"question": q, "target": a}
        if self.contexts is not None:
            item["context"], item["context_kind"] = self.contexts[i], self.context_kinds[i]
        if self.passage_ids is not None:
            item["passage_id"] = self.passage_ids[i]
        return item


class QAEvalDataset(Dataset):
    """Evaluation items ``{"question", "target", "answers"}``: one per question; `target`
    is its first answer (for the validation loss), `answers` all of them (for EM/F1)."""

    def __init__(self, examples: Sequence[QAExample]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        return {"question": ex.question, "target": ex.answers[0] if ex.answers else "", "answers": list(ex.answers)}


def collate_qa(items: list[dict]) -> dict:
    """Batch of dicts -> dict of lists: ``questions`` (B), ``targets`` (B)[, ``answers`` (B lists)]
    [, ``contexts`` (B passages) and ``context_kinds`` (B of ``top1``/``low``/``random``) under context mixing]."""
    batch = {"questions": [it["question"] for it in items], "targets": [it["target"] for it in items]}
    if items and "answers" in items[0]:
        batch["answers"] = [it["answers"] for it in items]
    if items and "context" in items[0]:
        batch["contexts"] = [it["context"] for it in items]
        batch["context_kinds"] = [it["context_kind"] for it in items]
    if items and "passage_id" in items[0]:
        batch["passage_ids"] = [it["passage_id"] for it in items]
    return batch


def batch_contexts(batch: dict) -> Optional[list]:
    """The passage RetRobust context mixing gave each pair of a training batch (``data.context_mixing``: the reader reads
    it alone, nothing is retrieved), or None when the batch has none."""
    contexts = batch.get("contexts")
    return None if contexts is None else list(contexts)


class QADataModule(pl.LightningDataModule):
    """Question-answer pairs for RAG fine-tuning and evaluation.

    Args:
        train: training source (path, ``demo:train``, ``X.source``, saved dataset dir[#split]).
        val: validation source (generation EM/F1 + recall@k run on it).
        test: test source.
        predict: questions to answer with ``rag predict`` (answers optional).
        data_dir: directory with ``{train,val,test}.{source,target}`` (transformers RAG
            example layout); fills whichever of train/val/test is not given.
        question_field: question field of JSONL / dataset records.
        answers_field: answers field; default ``answers``, else ``answer`` (NQ-open).
        on_empty: ``skip`` (count + one warning per file) or ``error`` for empty questions/answers.
        batch_size: training batch size (pairs); the effective batch is
            ``batch_size × accumulate_grad_batches × devices``.
        eval_batch_size: batch size for val/test/predict (default: `batch_size`).
        max_eval_examples: evaluate on the first N questions only (quick validation).
        num_workers: DataLoader workers.
        shuffle: shuffle the training pairs each epoch (off: file order; under DDP rank r then reads pairs
            r, r + N, r + 2N, ... so N ranks' batches together are one single-process batch of N × `batch_size`).
        context_mixing: RetRobust training contexts (Yoran et al. 2024, §2.2): each training pair gets its
            question's top-1, a low-ranked or a random passage (:class:`~rag.training.context_mixing.ContextMixing`),
            drawn once (seeded) in ``setup``; batches then hold ``contexts`` and ``context_kinds`` and
            :class:`~rag.training.modules.RagModule` trains the generator on that one passage instead of
            retrieving. A decoder-only reader reads the same fields (one passage per question).
        passage_field: the record field naming the knowledge-base passage that holds the answer (JSONL / datasets);
            training batches then carry ``passage_ids`` (RagModule's ``gold_passage`` loss reads them).
        self_supervised_kb: the corpus-only recipe: with no `train` data, the training pairs are cloze questions made from
            this knowledge base's passages (:func:`~rag.training.reading_practice.cloze_practice`), and validation
            (when `val` is not given) the pairs of passages held out from them. `rag fit` sets it from
            ``model.knowledge_base`` when no ``--data.train`` is given for a knowledge base other than the demo's.
        self_supervised_pairs: the most cloze pairs made for the corpus-only recipe.
        self_supervised_val: about how many of them (whole passages' pairs) are held out for validation.
    """

    def __init__(
        self,
        train: Optional[str] = None,
        val: Optional[str] = None,
        test: Optional[str] = None,
        predict: Optional[str] = None,
        data_dir: Optional[str] = None,
        question_field: str = "question",
        answers_field: Optional[str] = None,
        on_empty: OnEmpty = "skip",
        batch_size: int = 8,
        eval_batch_size: Optional[int] = None,
        max_eval_examples: Optional[int] = None,
        num_workers: int = 0,
        shuffle: bool = True,
        context_mixing: Optional[ContextMixing] = None,
        passage_field: Optional[str] = None,
        self_supervised_kb: Optional[str] = None,
        self_supervised_pairs: int = 4000,
        self_supervised_val: int = 64,
    ) -> None:
        super().__init__()
        if context_mixing is not None:
            context_mixing.validate()
        for name, v in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                        ("max_eval_examples", max_eval_examples), ("self_supervised_pairs", self_supervised_pairs),
                        ("self_supervised_val", self_supervised_val)):
            if v is not None:
                check_positive_int(v, f"data.{name}", error=ConfigError)
        if on_empty not in ("skip", "error"):
            raise ConfigError(f"data.on_empty={on_empty!r}; choose 'skip' or 'error'")
        self.save_hyperparameters()
        sources = {"train": train, "val": val, "test": test}
        if data_dir is not None:
            d = Path(data_dir)
            for split in sources:
                # A missing directory is reported when data is read, not at config-parse time.
                if sources[split] is None and (not d.is_dir() or (d / f"{split}.source").is_file()):
                    sources[split] = str(d / f"{split}.source")
        self.sources = {**sources, "predict": predict}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.max_eval_examples = max_eval_examples
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.context_mixing = context_mixing
        self.knowledge_base = self_supervised_kb
        self._datasets: dict[str, Dataset] = {}

    @property
    def train_pairs(self) -> Optional[QAPairsDataset]:
        """The training pairs once ``setup("fit")`` has read them (``pairs``: (question, answer); ``passage_ids`` when the
        data names each answer's passage), else None."""
        return self._datasets.get("train")

    def _read(self, split: str) -> list[QAExample]:
        src = self.sources[split]
        if self.hparams.data_dir is not None and not Path(self.hparams.data_dir).is_dir():
            raise ConfigError(f"data.data_dir={self.hparams.data_dir!r} is not a directory")
        if src is None:
            raise ConfigError(f"no {split} data configured; set data.{split} (or data.data_dir) in the config")
        return read_qa(
            src, stage=split, question_field=self.hparams.question_field, answers_field=self.hparams.answers_field,
            on_empty=self.hparams.on_empty, require_answers=split != "predict",
            passage_field=self.hparams.get("passage_field") if split == "train" else None,
        )

    @property
    def corpus_only(self) -> bool:
        """Whether the training pairs are made from the knowledge base (no `train` data given)."""
        return self.sources["train"] is None and self.knowledge_base is not None

    def _self_supervised(self) -> tuple[list[QAExample], list[QAExample]]:
        """The cloze pairs of the knowledge base's passages: (training, validation), split by passage."""
        kb = resolve_knowledge_base(self.knowledge_base, verify="size")
        passages = kb.all_passages()
        where = f"model.knowledge_base {kb.path}"
        if not passages:
            raise ConfigError(f"{where} holds no passage, and without --data.train the corpus-only recipe trains on its "
                              "passages; build it from a corpus with text (rag index build --corpus ...)")
        found = cloze_practice(passages, self.hparams.self_supervised_pairs, seed=0, max_answer_words=24)
        if not found:
            raise ConfigError(f"{where}: none of its {len(passages)} passages has a sentence that yields a self-supervised "
                              "pair (a year, number, name or 'used in ...' phrase to ask about); give question-answer pairs "
                              "with --data.train")
        examples = [QAExample(e.question, (e.answer,), f"{where}, passage {e.passage.id}", passage_id=e.passage.id)
                    for e in found]
        order = list(dict.fromkeys(e.passage_id for e in examples))  # seeded order of first appearance
        want = min(self.hparams.self_supervised_val, len(examples) // 5) if self.sources["val"] is None else 0
        count: dict[str, int] = {}
        for e in examples:
            count[e.passage_id] = count.get(e.passage_id, 0) + 1
        held: set = set()
        taken = 0
        for pid in order:
            if taken >= want:
                break
            held.add(pid)
            taken += count[pid]
        train = [e for e in examples if e.passage_id not in held]
        val = [e for e in examples if e.passage_id in held]
        logger.warning("no --data.train: training on %d self-supervised cloze pairs made from the %d passages of %s "
                       "(%d pairs of %d held-out passages validate)", len(train), len(passages), kb.path, len(val), len(held))
        return train, val

    def setup(self, stage: Optional[str] = None) -> None:
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
        if self.corpus_only and stage in ("fit", None) and "train" not in self._datasets:
            train, val = self._self_supervised()
            self._datasets["train"] = QAPairsDataset(train)
            if val:
                self._datasets["val"] = QAEvalDataset(val[: self.max_eval_examples] if self.max_eval_examples else val)
                self.sources["val"] = f"{self.knowledge_base} (held-out cloze pairs)"
        for split in splits.get(stage or "", ("train", "val", "test")):
            if split in self._datasets:
                continue
            if self.sources[split] is None and (stage is None or (stage == "fit" and split == "val")):
                continue  # optional here: no validation during fit, or everything-that-exists for stage=None
            examples = self._read(split)
            if not examples:
                raise QADataError(f"{self.sources[split]}: no usable examples for {split}")
            if split == "train":
                self._datasets[split] = self._train_dataset(examples)
                logger.info("train: %d questions -> %d (question, answer) pairs", len(examples), len(self._datasets[split]))
            else:
                if self.max_eval_examples is not None:
                    examples = examples[: self.max_eval_examples]
                self._datasets[split] = QAEvalDataset(examples)

    def _train_dataset(self, examples: list[QAExample]) -> QAPairsDataset:
        mixing = self.context_mixing
        if mixing is None:
            return QAPairsDataset(examples)

        kb = open_knowledge_base(mixing.knowledge_base)
        questions = list(dict.fromkeys(ex.question for ex in examples))
        rows = dict(zip(questions, retrieve_rows(kb, questions, mixing.top_k, mixing.query_encoder)))
        pairs = expand_answers(examples)
        choices = sample_context_choices([rows[q] for q, _ in pairs], mixing)
        passages = kb.get_passages([[c.row for c in choices]])[0]
        kinds = [c.kind for c in choices]
        logger.info("context mixing: %s", {k: kinds.count(k) for k in ("top1", "low", "random")})
        return QAPairsDataset(examples, passages, kinds)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self._datasets:
            self.setup({"train": "fit", "val": "validate", "test": "test", "predict": "predict"}[split])
        sampler = None
        trainer = getattr(self, "trainer", None)
        if split == "train" and not shuffle and trainer is not None and trainer.world_size > 1:
            # Lightning's own distributed sampler always shuffles the training set; keep the file order across ranks.
            from torch.utils.data.distributed import DistributedSampler

            sampler = DistributedSampler(self._datasets[split], num_replicas=trainer.world_size, rank=trainer.global_rank,
                                         shuffle=False)
        return DataLoader(
            self._datasets[split], batch_size=self.batch_size if split == "train" else self.eval_batch_size,
            shuffle=shuffle if sampler is None else None, sampler=sampler, num_workers=self.num_workers, collate_fn=collate_qa,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=self.shuffle)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """QA batches hold strings and :class:`~rag.knowledge.passages.Passage` s (frozen dataclasses, which Lightning's
        generic mover refuses), never tensors: the models tokenize on their own device, so nothing is moved."""
        return batch

    def val_dataloader(self):
        if self.sources["val"] is None:
            return []
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict", shuffle=False)
