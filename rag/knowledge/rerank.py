"""A rerank stage between retrieval and reading: a cross-encoder rescores K retrieved candidates, the best k are read.

:class:`CrossEncoder` scores (question, passage) pairs with any transformers sequence-classification directory
(``AutoModelForSequenceClassification``, local files only), or with a LoRA adapter + head that ``rag fit --config
lightning_configs/reranker_demo.yaml`` writes (:mod:`rag.training.rerank_distill`) over a base named in its manifest.
:class:`Rerank` is the stage (a cross-encoder and its K); :class:`RerankingRetriever` wraps any
:class:`~rag.knowledge.types.Retriever` with it, and :func:`~rag.knowledge.retriever_kinds.retriever_for_kind` composes
the two, so a reader never asks whether its retrieval reranks. The reranked ``Retrieved`` carries the cross-encoder's
scores as its ``scores``: the readers' prior p(z|x) is the softmax of these (over their retrieval temperature).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from rag.knowledge.encoders import resolve_name_or_path
from rag.knowledge.passages import Passage
from rag.knowledge.rerank_options import check_stage_options
from rag.knowledge.types import Retrieved, Retriever
from rag.utils.checksums import sha256_file, verify_files
from rag.utils.errors import ConfigError, IntegrityError
from rag.utils.files import check_json_files, read_json, readable_model_files
from rag.utils.validate import check_positive_int

__all__ = ["CrossEncoder", "Rerank", "RerankingRetriever", "rerank_stage", "MANIFEST", "passage_text"]

MANIFEST = "rag_cross_encoder.json"
"""What a trained reranker directory records: its base model (name and SHA-256 of its weights), pair length, and the
SHA-256 of every file in the directory (checked on load)."""
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILES = ("config.json", "model.safetensors")
"""The base directory's files whose SHA-256 an adapter records (an adapter fits only those weights)."""
FIX = ("give a sequence-classification model directory (transformers AutoModelForSequenceClassification.save_pretrained) "
       "or a reranker that `rag fit --config lightning_configs/reranker_demo.yaml` wrote")


def passage_text(p: Passage) -> str:
    """The passage side of a pair: ``title`` and text on two lines (the text alone when untitled)."""
    return f"{p.title}\n{p.text}" if p.title else p.text


def _architectures(path: Path, where: str) -> list:
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"{where} {path}: has no config.json, so it is not a transformers model directory; {FIX}")
    arch = read_json(config, fix=FIX, error=ConfigError).get("architectures") or []
    if not isinstance(arch, list) or not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in arch):
        raise ConfigError(f"{where} {path}: is not a sequence-classification model (config.json architectures: {arch}); {FIX}")
    return arch


def base_identity(base: str) -> dict:
    """``{"name", "files": {file: sha256}}`` of the base model `base` (a name :func:`resolve_name_or_path` maps, or a dir)."""
    path = Path(resolve_name_or_path(base))
    return {"name": base, "files": {f: sha256_file(path / f) for f in BASE_FILES if (path / f).is_file()}}


class CrossEncoder:
    """Relevance ``f(question, passage)`` from a sequence-classification model: its one logit (``num_labels == 1``), or
    the log-probability of its last label (2+ labels, e.g. an NLI-style "relevant" class).

    Args:
        model: a ``*ForSequenceClassification`` module (or a peft model around one, for training).
        tokenizer: its tokenizer.
        max_length: word pieces per (question, passage) pair; the passage is cut, never the question.
        batch_size: pairs per forward pass in :meth:`score`.
        name: what the cross-encoder was loaded from (shown in messages).
    """

    def __init__(self, model, tokenizer, *, max_length: int = 256, batch_size: int = 32, name: str = ""):
        check_positive_int(max_length, "max_length (the reranker's pair length)", error=ConfigError)
        check_positive_int(batch_size, "batch_size (the reranker's pairs per pass)", error=ConfigError)
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size, self.name = int(max_length), int(batch_size), name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def pair_logits(self, questions: Sequence[str], texts: Sequence[str]) -> torch.Tensor:
        """``(N,)`` relevance of N aligned (question, passage text) pairs, with gradients when grad mode is on."""
        enc = self.tokenizer(list(questions), list(texts), truncation="only_second", max_length=self.max_length,
                             padding=True, return_tensors="pt").to(self.device)
        logits = self.model(**enc).logits.float()
        return logits[:, 0] if logits.shape[-1] == 1 else torch.log_softmax(logits, dim=-1)[:, -1]

    def pair_texts_logits(self, questions: Sequence[str], texts: Sequence[Sequence[str]]) -> torch.Tensor:
        """``(B, K)`` relevance of B questions' K candidate texts each (one pass, gradients when grad mode is on)."""
        k = len(texts[0]) if texts else 0
        if len(texts) != len(questions) or any(len(row) != k for row in texts):
            raise ConfigError("cross-encoder: give B questions and B lists of the same K passages")
        flat_q = [q for q, row in zip(questions, texts) for _ in row]
        return self.pair_logits(flat_q, [t for row in texts for t in row]).view(len(questions), k)

    @torch.no_grad()
    def score(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> torch.Tensor:
        """``(B, K)`` float32 CPU relevance of B questions' K passages, in eval mode, `batch_size` pairs at a time."""
        k = len(passages[0]) if passages else 0
        if len(passages) != len(questions) or any(len(ps) != k for ps in passages):
            raise ConfigError("cross-encoder: give B questions and B lists of the same K passages")
        flat_q = [q for q, ps in zip(questions, passages) for _ in ps]
        flat_t = [passage_text(p) for ps in passages for p in ps]
        was = self.model.training
        self.model.eval()
        try:
            parts = [self.pair_logits(flat_q[i:i + self.batch_size], flat_t[i:i + self.batch_size]).cpu()
                     for i in range(0, len(flat_t), self.batch_size)]
        finally:
            self.model.train(was)
        return (torch.cat(parts) if parts else torch.zeros(0)).view(len(questions), k)

    @classmethod
    def load(cls, directory: str | os.PathLike, *, device: Optional[str | torch.device] = None,
             where: str = "--reranker") -> "CrossEncoder":
        """A cross-encoder from `directory`: a sequence-classification model, or a reranker with :data:`MANIFEST`
        (every file's SHA-256 and the base's checked first; the adapter merged into the base). Local files only.

        Raises:
            ConfigError: not a directory, or not a sequence-classification model (one line naming `where`).
            IntegrityError: a file that differs from the manifest, a base with other weights, a damaged file.
        """
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(f"{where} {directory}: no such directory; {FIX}")
        check_json_files(path, fix=FIX, error=ConfigError)
        _architectures(path, where)
        manifest = path / MANIFEST
        settings: dict = {}
        if manifest.is_file():
            settings = read_json(manifest, fix="restore the reranker directory or train it again")
            if not isinstance(settings, dict):
                raise IntegrityError(f"{manifest}: not a JSON object; restore the reranker directory or train it again")
            verify_files(path, settings.get("files"), "full", record=manifest, incomplete="restore the reranker directory",
                         fix="restore the reranker directory or train it again", required=("config.json",))
        fix = "restore the reranker directory, or train it again"
        with readable_model_files(path, f"the reranker {os.fspath(directory)!r}", fix):
            if (path / ADAPTER_CONFIG).is_file():
                model = cls._adapter_model(path, manifest, settings)
            else:
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, config=AutoConfig.from_pretrained(path, local_files_only=True), local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        longest = min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512,
                      int(getattr(model.config, "max_position_embeddings", 512) or 512))
        max_length = settings.get("max_length", longest)
        out = cls(model.eval(), tokenizer, max_length=max_length, name=os.fspath(directory))
        return out if device is None else out.to(device)

    @staticmethod
    def _adapter_model(path: Path, manifest: Path, settings: dict):
        """The base the manifest names, checked against its recorded SHA-256s, with the adapter merged in."""
        from peft import PeftModel
        from transformers import AutoConfig, AutoModelForSequenceClassification

        base = settings.get("base")
        if not isinstance(base, dict) or not isinstance(base.get("name"), str):
            raise IntegrityError(f"{path}: holds a LoRA adapter but no {MANIFEST} naming its base; {FIX}")
        found = base_identity(base["name"])
        if found["files"] != base.get("files"):
            raise IntegrityError(f"{manifest}: the adapter was trained on base {base['name']!r} with other weights than the "
                                 f"ones found at {resolve_name_or_path(base['name'])}; restore that base or train it again")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(resolve_name_or_path(base["name"]), config=config,
                                                                   local_files_only=True)
        return PeftModel.from_pretrained(model, path, local_files_only=True).merge_and_unload()

    def to(self, device) -> "CrossEncoder":
        self.model.to(device)
        return self


def rerank_stage(candidates: Optional[int], reranker: Any, *, device=None) -> Optional["Rerank"]:
    """The stage that ``--rerank K --reranker DIR`` (``rag.load(rerank=K, reranker=DIR)``) asks for; None for neither.
    `reranker`: a directory (loaded with :meth:`CrossEncoder.load`) or a :class:`CrossEncoder`.

    Raises:
        ConfigError: one given without the other, K not a positive integer, or a directory :meth:`CrossEncoder.load` refuses.
    """
    if not check_stage_options(candidates, reranker):
        return None
    encoder = reranker if isinstance(reranker, CrossEncoder) else CrossEncoder.load(reranker, device=device)
    return Rerank(encoder, int(candidates))


@dataclass(frozen=True)
class Rerank:
    """The rerank stage: `candidates` (K) retrieved passages per question rescored by `cross_encoder`, the best k kept."""

    cross_encoder: CrossEncoder
    candidates: int

    def candidates_for(self, k: int, size: Optional[int] = None) -> int:
        """How many to retrieve for `k` kept: K, or every passage of a knowledge base of `size` < K.

        Raises:
            ConfigError: ``k > K`` (the stage keeps k of K).
        """
        if k > self.candidates:
            raise ConfigError(f"--rerank {self.candidates} rescores {self.candidates} candidates and keeps the best k={k} "
                              f"(--n-docs / k): give --rerank at least {k}")
        return self.candidates if size is None else max(k, min(self.candidates, int(size)))

    def rerank(self, questions: Sequence[str], retrieved: Retrieved, k: int) -> Retrieved:
        """The best `k` of `retrieved`'s passages for each question by the cross-encoder, best first (the
        :class:`~rag.knowledge.types.Reranker` protocol); ``scores`` are the cross-encoder's, ``prior_bias`` None."""
        if k > retrieved.k:
            raise ConfigError(f"the reranker keeps k={k} of {retrieved.k} retrieved passages; retrieve at least {k}")
        scores = self.cross_encoder.score(list(questions), retrieved.passages)  # (B, K)
        top_scores, top = scores.topk(k, dim=1)  # (B, k), best first; ties keep the retriever's order
        embeds = retrieved.doc_embeds
        if embeds is not None:
            embeds = embeds.gather(1, top.to(embeds.device).unsqueeze(-1).expand(-1, -1, embeds.shape[-1]))
        return Retrieved(rows=retrieved.rows.gather(1, top.to(retrieved.rows.device)), scores=top_scores.float(),
                         passages=[[ps[j] for j in row] for ps, row in zip(retrieved.passages, top.tolist())],
                         doc_embeds=embeds, kb_version=retrieved.kb_version)


class RerankingRetriever:
    """`retriever`'s top `candidates` passages, reranked by `cross_encoder`, the best k returned (a
    :class:`~rag.knowledge.types.Retriever`). Everything else (its knowledge base, swaps) is the wrapped retriever's."""

    def __init__(self, retriever: Retriever, cross_encoder: CrossEncoder, candidates: int):
        check_positive_int(candidates, "rerank (--rerank, candidates rescored)", error=ConfigError)
        self.retriever, self.stage = retriever, Rerank(cross_encoder, int(candidates))

    @property
    def kb_version(self) -> str:
        return self.retriever.kb_version

    @property
    def knowledge_base(self):
        return self.retriever.knowledge_base

    def retrieve(self, queries: Sequence[str], k: int) -> Retrieved:
        """Top-k of the reranked top-K: ``(B, k)`` rows and cross-encoder scores, best first."""
        kb = self.knowledge_base
        n = self.stage.candidates_for(k, len(kb) if kb is not None else None)
        return self.stage.rerank(queries, self.retriever.retrieve(queries, n), k)

    def rerank(self, queries: Sequence[str], retrieved: Retrieved, k: int) -> Retrieved:
        return self.stage.rerank(queries, retrieved, k)

    def __getattr__(self, name: str):  # the wrapped retriever's other attributes (options, space, swaps)
        if name in ("retriever", "stage"):
            raise AttributeError(name)
        return getattr(self.retriever, name)

