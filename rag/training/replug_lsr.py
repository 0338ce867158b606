"""REPLUG LSR with ``rag fit`` (Shi et al. 2023, §4): train the dense retriever from a frozen (black-box) LM's signal.

Per batch of inputs x with ground-truth continuations y (:class:`~rag.training.data.QADataModule` pairs: x = question,
y = answer; or any text split into a context and its continuation):

1. retrieve the top-k documents and their differentiable scores s(d, x) = q(x) · d
(:class:`~rag.knowledge.scoring.RetrievalScorer`,
   the only gradient path into the retriever);
2. score log P_LM(y | d ∘ x) with the frozen LM — a local transformers LM or an OpenAI-compatible completions endpoint
   (:mod:`rag.models.replug.lm_scorer`), every (LM, document, input, continuation) asked once
   (:class:`~rag.models.replug.lm_scorer.ScoreCache`);
3. minimise KL(P_R ‖ Q_LM) (:func:`rag.models.replug.lsr.lsr_loss`, temperatures γ (`retrieval_temperature`) and β);
4. with ``train_doc_encoder`` the retrieved documents are re-embedded with gradients, and the
   :class:`~rag.training.callbacks.IndexRefresh` callback re-encodes the corpus, rebuilds the index and hot-swaps it every
   T steps (§4.4).

The LM never receives gradients (it is not a submodule: checkpoints hold the retriever only). A failing endpoint raises
:class:`~rag.models.replug.lm_scorer.LMEndpointError` and stops training: no step ever trains on a missing score.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.demo.kb import resolve_knowledge_base
from rag.generation.marginalize import doc_log_prior
from rag.generators.load import load_generator
from rag.knowledge.refresh import load_document_encoder
from rag.knowledge.retriever import default_query_encoder
from rag.knowledge.scoring import RetrievalScorer
from rag.models.ralm.model import doc_text
from rag.models.replug.lm_scorer import CompletionsLMScorer, LMScorer, LocalLMScorer, ScoreCache, document_logprobs
from rag.models.replug.lsr import lsr_loss
from rag.training.distributed import check_same_knowledge_base, knowledge_base_of
from rag.training.ensure_kb import ensure_knowledge_base
from rag.training.reranker import ensure_tiny_gpt2
from rag.training.settings import KnowledgeBaseBuild, RetrieverOptimizer, as_settings, settings_dict
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["LsrSettings", "LsrRetriever", "ReplugLSRModule", "lm_scores"]

TINY_GPT2 = "tiny:gpt2"


@dataclass
class LsrSettings:
    """The :class:`~rag.knowledge.scoring.ScoringSettings` of LSR's retriever (dense, query encoder trained)."""

    max_question_length: int = 64
    train_doc_encoder: bool = False
    retrieval: str = "dense"
    freeze_query_encoder: bool = False
    rerank_candidates: Optional[int] = None

    @property
    def uses_doc_encoder(self) -> bool:
        return self.train_doc_encoder or self.rerank_candidates is not None


class LsrRetriever(torch.nn.Module):
    """Query encoder (+ optional document encoder) over a knowledge base: what REPLUG LSR trains.

    Exposes ``retriever``, ``doc_encoder``, ``knowledge_base`` and ``config.train_doc_encoder`` as
    :class:`~rag.training.callbacks.IndexRefresh` and :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` expect.
    """

    def __init__(self, question_encoder, knowledge_base, settings: LsrSettings, doc_encoder=None):
        super().__init__()
        self.config = settings
        self.question_encoder = question_encoder
        self.scoring = RetrievalScorer(question_encoder, knowledge_base, settings, doc_encoder)
        self.doc_encoder = self.scoring.doc_encoder

    @property
    def retriever(self):
        return self.scoring.retriever

    @retriever.setter
    def retriever(self, retriever) -> None:
        self.scoring.retriever = retriever

    @property
    def knowledge_base(self):
        return self.scoring.knowledge_base

    def forward(self, inputs: Sequence[str], k: int):
        """The top-k documents of each input and their ``(B, k)`` differentiable scores."""
        kb = self.knowledge_base
        if kb is not None and k > len(kb):
            raise ConfigError(f"model.k={k} documents per input but the knowledge base {kb.path} holds {len(kb)}; lower model.k")
        return self.scoring.score(list(inputs), k)


def lm_scores(lm: LMScorer, passages: Sequence[Sequence], inputs: Sequence[str], continuations: Sequence[str], *,
              cache: Optional[ScoreCache] = None) -> torch.Tensor:
    """``(B, k)`` float32 log P_LM(y | d ∘ x) of each input's continuation under each of its k documents (§4.2)."""
    b, k = len(passages), len(passages[0]) if passages else 0
    lps = document_logprobs(lm, [doc_text(p) for ps in passages for p in ps], [x for x in inputs for _ in range(k)],
                            [" " + y.lstrip() for y in continuations for _ in range(k)], cache=cache)
    return torch.tensor([float(lp.sum()) for lp in lps], dtype=torch.float32).view(b, k)


_DEFAULT_OPTIMIZER = RetrieverOptimizer()


class ReplugLSRModule(pl.LightningModule):
    """REPLUG LSR (§4): the query encoder (and optionally the document encoder) trained by KL(P_R ‖ Q_LM), the LM frozen.

    Args:
        lm: the frozen LM: a causal LM directory / name (``smollm2``), or ``tiny:gpt2`` (random, tokenizer trained on the
            knowledge base's passages; no hub).
        lm_endpoint: instead of `lm`, an OpenAI-compatible API root (``http://host:8000/v1``) returning prompt log-probs.
        lm_endpoint_model: the endpoint's model name.
        lm_timeout: seconds per endpoint request.
        lm_max_retries: endpoint retries before the error that stops training.
        lm_batch_size: (document, input) pairs per LM call.
        cache_lm_scores: memoise LM scores by (LM, document, input, continuation).
        question_encoder: query encoder to train (``minilm``, a directory), None: the knowledge base's.
        knowledge_base: knowledge-base directory.
        build_knowledge_base: build `knowledge_base` first when missing (:class:`~rag.training.settings.KnowledgeBaseBuild`:
            ``corpus`` ``demo`` or a path, ``encoder`` default the question encoder, ``index`` its FAISS spec).
        k: documents retrieved per input (paper: 20).
        retrieval_temperature: γ, temperature of P_R (paper: 0.1); the same setting as REPLUG's and RAG's.
        gamma: deprecated alias of `retrieval_temperature` (warns).
        beta: β, temperature of Q_LM (paper: 0.1).
        train_doc_encoder: re-embed the retrieved documents with gradients (pair with IndexRefresh).
        document_encoder: the document encoder to train (default: the knowledge base's).
        max_question_length: query-encoder tokens per input.
        optimizer: AdamW and its schedule (:class:`~rag.training.settings.RetrieverOptimizer`: ``lr`` the query
            encoder's, paper 2e-5; ``doc_encoder_lr``; warm-up over ``warmup_ratio`` of the steps, paper 0.1, then linear
            decay).
        export_dir: where the trained query encoder is written at the end of ``fit`` (``TextEncoder.save_pretrained``).
    """

    def __init__(self, lm: str = TINY_GPT2, lm_endpoint: Optional[str] = None, lm_endpoint_model: Optional[str] = None,
                 lm_timeout: float = 30.0, lm_max_retries: int = 3, lm_batch_size: int = 16, cache_lm_scores: bool = True,
                 question_encoder: Optional[str] = "minilm", knowledge_base: str = "kb",
                 build_knowledge_base: Optional[KnowledgeBaseBuild] = None, k: int = 20, retrieval_temperature: float = 0.1,
                 beta: float = 0.1,
                 train_doc_encoder: bool = False, document_encoder: Optional[str] = None, max_question_length: int = 64,
                 optimizer: RetrieverOptimizer = _DEFAULT_OPTIMIZER, export_dir: Optional[str] = None,
                 gamma: Optional[float] = None):
        super().__init__()
        if gamma is not None:
            warnings.warn("model.gamma is deprecated: it is now model.retrieval_temperature (one name for RAG, REPLUG and LSR)",
                          FutureWarning, stacklevel=2)
            retrieval_temperature, gamma = gamma, None
        check_positive_int(k, "model.k (documents retrieved per input)", error=ConfigError)
        for name, v in (("retrieval_temperature", retrieval_temperature), ("beta", beta)):
            check_number(v, f"model.{name} (a softmax temperature, §4.1-4.2; the paper uses 0.1)", above=0, error=ConfigError)
        optimizer = settings_dict(optimizer, RetrieverOptimizer, "optimizer")  # plain dicts in the hyperparameters
        build_knowledge_base = settings_dict(build_knowledge_base, KnowledgeBaseBuild, "build_knowledge_base")
        self.optimizer_settings = RetrieverOptimizer(**optimizer)
        self.build_settings = as_settings(build_knowledge_base, KnowledgeBaseBuild, "build_knowledge_base")
        if lm_endpoint is not None and not lm_endpoint_model:
            raise ConfigError("model.lm_endpoint needs model.lm_endpoint_model (the model name the endpoint serves)")
        self.save_hyperparameters()
        self.model: Optional[LsrRetriever] = None  # built in configure_model()
        self.lm: Optional[LMScorer] = None  # a plain attribute: never a submodule, never in a checkpoint
        self.cache = ScoreCache() if cache_lm_scores else None

    # ------------------------------------------------------------------ construction
    def prepare_data(self) -> None:
        self._ensure_kb()

    def _ensure_kb(self) -> str:
        h, build = self.hparams, self.build_settings
        if build is not None:
            encoder = build.encoder or h.question_encoder
            if encoder is None:
                raise ConfigError("model.build_knowledge_base needs model.build_knowledge_base.encoder or model.question_encoder "
                                  "(the encoder that embeds the passages)")
            ensure_knowledge_base(h.knowledge_base, build.corpus, encoder, index=build.index, show_progress=False)
        return h.knowledge_base

    def configure_model(self) -> None:
        if self.model is not None:
            return

        h = self.hparams
        kb = resolve_knowledge_base(self._ensure_kb())
        if h.k > len(kb):
            raise ConfigError(f"model.k={h.k} documents per input but the knowledge base {kb.path} holds "
                              f"{len(kb)}; lower model.k")
        qenc = default_query_encoder(kb, h.question_encoder)
        denc = None
        if h.train_doc_encoder:
            denc = load_document_encoder(kb, h.document_encoder)
        model = LsrRetriever(qenc, kb,
                             LsrSettings(max_question_length=h.max_question_length, train_doc_encoder=h.train_doc_encoder), denc)
        self.model = model.train(self.training)
        self.lm = self._load_lm(kb)

    def _load_lm(self, kb) -> LMScorer:
        h = self.hparams
        if h.lm_endpoint is not None:
            return CompletionsLMScorer(h.lm_endpoint, h.lm_endpoint_model, timeout=h.lm_timeout, max_retries=h.lm_max_retries,
                                       batch_size=h.lm_batch_size)

        path = h.lm
        if path == TINY_GPT2:
            path = ensure_tiny_gpt2([p.text for p in kb.all_passages()])
        model, tok, _ = load_generator(path, kind="causal")
        model.requires_grad_(False)
        return LocalLMScorer(model.eval(), tok, batch_size=h.lm_batch_size, name=str(h.lm))

    def on_fit_start(self) -> None:
        lm_model = getattr(self.lm, "model", None)
        if lm_model is not None:
            lm_model.to(self.device)

    # ------------------------------------------------------------------ steps
    def _loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.model is None:
            self.configure_model()
        inputs, targets = batch["questions"], batch["targets"]
        retrieved, doc_scores = self.model(inputs, self.hparams.k)
        ll = lm_scores(self.lm, retrieved.passages, inputs, targets, cache=self.cache).to(doc_scores.device)
        return lsr_loss(doc_scores, ll, retrieval_temperature=self.hparams.retrieval_temperature,
                        beta=self.hparams.beta), doc_scores, ll

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under DDP, refuse to step unless every rank retrieves from the same knowledge-base version."""
        check_same_knowledge_base(self.trainer, knowledge_base_of(self), self.trainer.global_step)

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        b = len(batch["questions"])
        self.log("train/loss", loss, prog_bar=True, batch_size=b)
        if self.cache is not None:
            self.log("train/lm_cache_hits", float(self.cache.hits), batch_size=b)
        return loss

    @without_cudnn_attention
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, scores, ll = self._loss(batch)
        b = len(batch["questions"])
        self.log("val/loss", loss, prog_bar=True, batch_size=b)
        # how often the retriever's first document is the one the LM likes best
        self.log("val/top1_agreement", (scores.argmax(-1) == ll.argmax(-1)).float().mean(), batch_size=b)
        # log-likelihood of y under the REPLUG ensemble with the retriever's weights (temperature γ)

        mix = torch.logsumexp(doc_log_prior(scores.detach(), temperature=self.hparams.retrieval_temperature) + ll, dim=-1)
        self.log("val/replug_loglik", mix.mean(), batch_size=b)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict:
        h, o = self.hparams, self.optimizer_settings
        if self.model is None:
            self.configure_model()
        groups = [{"params": [p for p in self.model.question_encoder.parameters() if p.requires_grad], "lr": o.lr,
                   "name": "query_encoder"}]
        if h.train_doc_encoder and self.model.doc_encoder is not None:
            groups.append({"params": [p for p in self.model.doc_encoder.parameters() if p.requires_grad], "lr": o.doc_encoder_lr,
                           "name": "doc_encoder"})
        return o.build(self, groups)

    def on_train_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.export(self.hparams.export_dir)

    def export(self, directory: str | os.PathLike) -> Path:
        """Write the trained query encoder (``TextEncoder.save_pretrained``): use it as the knowledge base's query encoder."""
        self.model.question_encoder.save_pretrained(directory, overwrite=True)
        logger.info("trained query encoder written to %s", directory)
        return Path(directory)
