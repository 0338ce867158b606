"""RAG (Lewis et al. 2020): a query encoder, a knowledge base and a seq2seq generator trained end to end.

Data flow of :meth:`RagModel.forward` (one call, one batch of B questions and K passages each)::

    questions ──tokenize once──► query encoder ──► q (B, D)        (with gradients unless frozen)
    q.detach() ──► knowledge-base search (no grad) ──► rows (B, K), stored doc_embeds (B, K, D), passages
    doc_scores = q · doc_embeds (B, K)                             (the ONLY gradient path into the retriever, §2.2)
    contexts "title / text // question" (B·K, padded to the longest)
        ──► length buckets ──► generator, once per bucket, each padded to its own longest ──► logits (B·K, T, V)
    per-document target log-probs (B, K, T) + log p(z|x) ──► RAG-Sequence (Eq. 1) | RAG-Token (Eq. 2) ──► NLL

By default the document encoder and the index stay frozen (§2.4): the knowledge base only supplies
stored vectors. ``train_doc_encoder=True`` trains the document encoder too (REALM/REPLUG-style):
the K retrieved passages are re-embedded *with gradients* by the model's current document
encoder and ``doc_scores = q · d_fresh``; the stored vectors then only serve the search, and an
:class:`~rag.training.callbacks.IndexRefresh` callback re-encodes the corpus and hot-swaps the
index every N steps (REPLUG §4.4). ``rerank_candidates=L`` searches L passages in the (stale)
index, re-embeds them with the current document encoder and keeps the best ``n_docs``. RAG-BM25
(Table 6) uses BM25 scores as the retrieval logits; RAG-Frozen keeps the query encoder fixed.

This module wires the seams together: retrieval with gradients is :mod:`rag.knowledge.scoring`
(:class:`~rag.knowledge.scoring.RetrievalScorer`), the context strings :mod:`rag.generation.contexts`,
the loss :func:`rag.generation.marginalize.rag_nll_from_logits`, the options :mod:`rag.models.rag.config`,
checkpoint I/O :mod:`rag.models.rag.checkpoint` and generator loading :mod:`rag.generators.load`.

Deliberate differences from ``transformers``' ``RagSequenceForGeneration`` / ``RagTokenForGeneration``
(``hf_compat=True`` reproduces transformers exactly, quirks included, for imported checkpoints):

* **Context truncation** (``truncation="keep_question"``, default): an over-long "title / text // question"
  loses passage tokens, never the question; transformers cuts on the right (``truncation="hf"``, implied by ``hf_compat``).
* **Question string**: the question enters the context as written; transformers (and ``hf_compat``) use its round
  trip through the question tokenizer (lower-cased, re-spaced, truncated).
* **Single-token targets / document prior**: every target token is scored and log p(z|x) enters each document's
  sequence score once (Eq. 1); transformers attaches the prior to the second target position, so for one-token
  targets it (and every retriever gradient) vanishes — the full list is in :mod:`rag.generation.marginalize`.
* **Targets** (two conventions): ``forward`` takes strings, tokenized by the generator tokenizer (BART ``<s> … </s>``,
  T5 ``… </s>``). Default (new models): every token is scored, decoded shifted right after ``decoder_start_token_id``
  (BART: ``</s> <s> …``), exactly as generation decodes. ``hf_compat``: transformers' convention for labels as its docs
  and fine-tuning script pass them for BART (``tokenizer(text_target=answer).input_ids``): ``<s> …`` is fed and
  scored from the second token (:func:`~rag.generation.marginalize.hf_label_convention`); up to several nats apart
  from the default on the same answer. T5 targets (no ``<s>``) score alike under both.
* **Reduction**: ``reduce_loss=True`` averages over the batch; transformers (and ``hf_compat``) sums.
* **Padding**: contexts are padded to the batch's longest, not to 300 tokens, and the generator runs on length
  buckets of them (:mod:`rag.generation.buckets`), so its cost follows the real context tokens.
* **RAG-Sequence search**: each passage's search attends only to its context's tokens; transformers searches
  contexts padded to ``max_combined_length`` with no attention mask, so they attend to the pads
  (``mask_padded_contexts=False``, set by the importer: :func:`rag.models.rag.generate.unmasked_contexts`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Literal, Optional, Sequence, Union

import torch
from torch import nn

from rag.generation.buckets import DEFAULT_MAX_BUCKETS
from rag.generation.contexts import build_contexts, focus_on_question
from rag.generation.marginalize import hf_label_convention, rag_nll_from_logits
from rag.generators.base import Generator
from rag.generators.load import as_generator, load_generator
from rag.generators.warm_start import is_warm_start
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.passages import Passage
from rag.knowledge.refresh import load_document_encoder
from rag.knowledge.retriever import default_query_encoder
from rag.knowledge.scoring import RetrievalScorer
from rag.knowledge.types import Retrieved, Retriever
from rag.models.rag.batch import RagInputs, RagOutput
from rag.models.rag.checkpoint import CHECKPOINT_CONFIG, CHECKPOINT_FORMAT, load_rag_model, open_knowledge_base, save_rag_model
from rag.models.rag.config import RagModelConfig, check_overrides
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_positive_int, check_strings

_LOG_TAU_MIN, _LOG_TAU_MAX = math.log(0.01), math.log(100.0)  # a learned retrieval temperature stays in [0.01, 100]

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from rag.knowledge.knowledge_base import KnowledgeBase

__all__ = ["RagModelConfig", "RagOutput", "RagInputs", "RagModel", "CHECKPOINT_CONFIG", "CHECKPOINT_FORMAT"]


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- the model


class RagModel(nn.Module):
    """Query encoder + generator (seq2seq or causal) + retriever; ``forward`` returns the marginal NLL (§2.4).

    Args:
        question_encoder: a :class:`~rag.knowledge.encoders.TextEncoder` (DPR question encoder,
            MiniLM, ...) whose output dimension matches the knowledge base.
        generator: a transformers seq2seq (BART, T5, ...) or causal (GPT-2, Llama, ...) LM; :attr:`lm` is it as a
            :class:`~rag.generators.base.Generator`.
        generator_tokenizer: its tokenizer.
        retriever: a :class:`~rag.knowledge.retriever.DenseRetriever`, a
            :class:`~rag.knowledge.bm25.BM25Retriever`, or a ``KnowledgeBase`` (wrapped in the
            retriever ``config.retrieval`` names).
        config: :class:`RagModelConfig` (defaults if None).
        doc_encoder: the document encoder (a ``TextEncoder``) that ``train_doc_encoder`` trains and
            ``rerank_candidates`` re-embeds with. None: when the config needs one, the encoder that built
            the knowledge base is loaded from its manifest (and its weights fingerprint checked).

    Raises:
        KnowledgeBaseError: the knowledge base's dimension differs from the query encoder's, or
            BM25 retrieval was asked of a knowledge base without a BM25 index, or the document
            encoder named by the manifest no longer has the weights the index was built with.
    """

    def __init__(self, question_encoder: "TextEncoder", generator: nn.Module, generator_tokenizer: "PreTrainedTokenizerBase",
                 retriever: Union[Retriever, "KnowledgeBase"], config: Optional[RagModelConfig] = None,
                 doc_encoder: Optional["TextEncoder"] = None):
        super().__init__()

        config = RagModelConfig() if config is None else config
        if not isinstance(config, RagModelConfig):
            raise ConfigError(f"config must be a RagModelConfig, got {type(config).__name__}")
        if not isinstance(question_encoder, TextEncoder):
            raise ConfigError(f"question_encoder must be a rag.knowledge.encoders.TextEncoder, got "
                              f"{type(question_encoder).__name__}")
        if not isinstance(generator, nn.Module):
            raise ConfigError(f"generator must be a transformers seq2seq (BART, T5) or causal (GPT-2, Llama) model, got "
                              f"{type(generator).__name__}")
        lm = as_generator(generator, generator_tokenizer)
        if config.hf_compat and not lm.transformers_rag:
            raise ConfigError("RagModelConfig.hf_compat reproduces transformers' RAG, whose generator is seq2seq; a causal "
                              "generator has no transformers counterpart: set hf_compat: false")
        self.question_encoder = question_encoder
        self.generator = generator
        self.generator_tokenizer = generator_tokenizer
        self.__dict__["_lm"] = lm
        self._check_generator_tokens()
        self.scoring = RetrievalScorer(question_encoder, retriever, config, doc_encoder)
        if self.query_encoder_frozen:
            self.question_encoder.requires_grad_(False)
            self.question_encoder.eval()
        self.doc_encoder = self.scoring.doc_encoder
        if config.learn_retrieval_temperature:
            self.log_retrieval_temperature = nn.Parameter(torch.tensor(math.log(config.retrieval_temperature)))

    @property
    def config(self) -> RagModelConfig:
        """The model's options; replacing them also replaces those retrieval reads."""
        return self.scoring.settings

    @config.setter
    def config(self, config: RagModelConfig) -> None:
        self.scoring.settings = config

    @property
    def retriever(self) -> Retriever:
        """The retriever in use (dense or BM25); hot swaps change its knowledge base in place."""
        return self.scoring.retriever

    @retriever.setter
    def retriever(self, retriever: Retriever) -> None:
        self.scoring.retriever = retriever

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_components(
        cls,
        question_encoder: Union[str, os.PathLike, "TextEncoder", None],
        generator: Union[str, os.PathLike],
        knowledge_base: Union[str, os.PathLike, "KnowledgeBase"],
        config: Optional[RagModelConfig] = None,
        *,
        document_encoder: Union[str, os.PathLike, "TextEncoder", None] = None,
        **config_overrides,
    ) -> "RagModel":
        """Build a model from separate checkpoints (local dirs or hub ids) and a knowledge-base directory.

        `question_encoder` None uses the query encoder the knowledge base's manifest names (else its
        document encoder, e.g. a shared MiniLM) with the pooling/normalisation it was built with.
        `document_encoder` (a name, path or TextEncoder) is the document encoder to train / re-rank with
        when the config asks for one (default: the one the manifest names, weights fingerprint checked).
        `config_overrides` replace fields of `config` (e.g. ``n_docs=10``). The knowledge base's
        dimension is checked against the query encoder here, not mid-epoch.
        """
        config = RagModelConfig() if config is None else config
        if config_overrides:
            config = dataclasses.replace(config, **check_overrides(config_overrides))
        kb = open_knowledge_base(knowledge_base)
        if isinstance(question_encoder, TextEncoder):
            qenc = question_encoder
        else:
            qenc = default_query_encoder(kb, None if question_encoder is None else os.fspath(question_encoder))
        gen, tok, _ = load_generator(generator)
        denc = None
        if document_encoder is not None and config.uses_doc_encoder:
            denc = load_document_encoder(kb, document_encoder)
        return cls(qenc, gen, tok, kb, config, doc_encoder=denc)

    def _check_generator_tokens(self) -> None:
        if getattr(self.generator_tokenizer, "pad_token_id", None) is None:
            raise ConfigError("the generator tokenizer has no pad token; set one (tokenizer.pad_token = ...) and save it again")
        self.lm.check_tokens()

    # ------------------------------------------------------------------ properties
    @property
    def lm(self) -> Generator:
        """The generator as a type (:class:`~rag.generators.base.Generator`, seq2seq or causal) over ``generator`` and
        ``generator_tokenizer``: how contexts are built, decoded and scored. It owns the caches computed with the
        current weights; replacing ``generator`` (e.g. with its LoRA-wrapped self) gives a new one of the same family."""
        lm = self.__dict__["_lm"]
        if lm.model is not self.generator or lm.tokenizer is not self.generator_tokenizer:
            texts = lm._token_texts if lm.tokenizer is self.generator_tokenizer else None
            lm = self.__dict__["_lm"] = type(lm)(self.generator, self.generator_tokenizer)
            lm._token_texts = texts
        return lm

    @property
    def generator_kind(self) -> str:
        """The generator's family, ``"seq2seq"`` or ``"causal"`` (recorded in checkpoints)."""
        return self.lm.kind

    @property
    def is_causal(self) -> bool:
        """True for a decoder-only generator: p(y | x, z) is the LM's likelihood of the answer after a prompt of z and x."""
        return self.lm.decoder_only

    @property
    def _prefix_cache(self):
        """The causal generator's kept passage KV caches (None before first use, and for a seq2seq generator)."""
        return self.lm.prefix_cache

    @property
    def query_encoder_frozen(self) -> bool:
        """True when the query encoder receives no gradients (RAG-Frozen or RAG-BM25)."""
        return self.scoring.query_encoder_frozen

    @property
    def knowledge_base(self):
        """The knowledge base the retriever currently reads (None for a BM25 retriever over bare passages)."""
        return self.scoring.knowledge_base

    @property
    def decoder_start_token_id(self) -> Optional[int]:
        """The seq2seq decoder's start token (None for a causal generator: it starts from its prompt's last token)."""
        return self.lm.decoder_start_token_id

    @property
    def pad_token_id(self) -> int:
        return int(self.generator_tokenizer.pad_token_id)

    @property
    def bos_token_id(self) -> Optional[int]:
        bos = getattr(self.generator.config, "bos_token_id", None)
        if bos is None:
            bos = getattr(self.generator_tokenizer, "bos_token_id", None)
        return bos

    def train(self, mode: bool = True) -> "RagModel":
        """Set train/eval mode; a frozen query encoder stays in eval mode (deterministic retrieval)."""
        super().train(mode)
        if is_warm_start(self.generator):  # its frozen encoder stays deterministic (and cacheable)
            self.generator.get_encoder().eval()
        if self.query_encoder_frozen:
            self.question_encoder.eval()
        if getattr(self, "doc_encoder", None) is not None and not self.config.train_doc_encoder:
            self.doc_encoder.eval()
        if mode:  # what the generator cached (passage KV caches) is of the old weights
            self.lm.clear_caches()
        return self

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by component, for separate learning rates:
        ``{"query_encoder": [...], "generator": [...]}`` (query_encoder empty when frozen / BM25), plus
        ``"doc_encoder"`` with ``train_doc_encoder``."""
        groups = {
            "query_encoder": [p for p in self.question_encoder.parameters() if p.requires_grad],
            "generator": [p for p in self.generator.parameters() if p.requires_grad],
        }
        if self.config.train_doc_encoder and self.doc_encoder is not None:
            groups["doc_encoder"] = [p for p in self.doc_encoder.parameters() if p.requires_grad]
        if self.config.learn_retrieval_temperature:  # the retrieval side's learning rate, frozen encoder or not
            groups["query_encoder"].append(self._log_temperature())
        return groups

    # ------------------------------------------------------------------ retrieval temperature
    def _log_temperature(self) -> nn.Parameter:
        param = getattr(self, "log_retrieval_temperature", None)
        if param is None:
            raise ConfigError("learn_retrieval_temperature was switched on after the model was built; set it in the "
                              "RagModelConfig the model is built (or loaded) with")
        return param

    @property
    def retrieval_temperature(self) -> float:
        """τ in force: ``config.retrieval_temperature``, or the learned value with ``learn_retrieval_temperature``."""
        if not self.config.learn_retrieval_temperature:
            return self.config.retrieval_temperature
        return float(self._log_temperature().detach().clamp(_LOG_TAU_MIN, _LOG_TAU_MAX).exp())

    def retrieval_logits(self, doc_scores: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` retrieval scores → the logits whose softmax is the document prior p(z|x): ``scores / τ``.

        Every consumer of the prior (both marginalizations' loss, RAG-Token and RAG-Sequence decoding, answer
        provenance) goes through here; τ = 1 returns `doc_scores` itself. A learned τ is differentiable.
        """
        if self.config.learn_retrieval_temperature:
            log_tau = self._log_temperature().clamp(_LOG_TAU_MIN, _LOG_TAU_MAX)
            return doc_scores / log_tau.exp().to(device=doc_scores.device, dtype=doc_scores.dtype)
        tau = self.config.retrieval_temperature
        return doc_scores if tau == 1.0 else doc_scores / tau

    # ------------------------------------------------------------------ retrieval
    def _n_docs(self, n_docs: Optional[int]) -> int:
        return check_positive_int(self.config.n_docs if n_docs is None else n_docs, "n_docs")

    def _tokenize_questions(self, questions: list[str]) -> dict[str, torch.Tensor]:
        """Query-encoder inputs ``(B, Lq)``, tokenized once and reused for the hf question round trip."""
        return self.scoring.tokenize_questions(questions)

    def retrieve(self, questions: Sequence[str], n_docs: Optional[int] = None) -> tuple[Retrieved, torch.Tensor]:
        """Top-k passages for B questions and their ``(B, K)`` doc scores.

        Dense: ``doc_scores = q · doc_embeds`` carries gradients into the query encoder when grad
        mode is on and the encoder is not frozen. BM25: the BM25 scores (no gradient).
        """
        questions = check_strings(questions, "questions")
        return self.scoring.score(questions, self._n_docs(n_docs), device=_device_of(self.generator))

    # ------------------------------------------------------------------ contexts
    def context_strings(self, questions: Sequence[str], retrieved: Retrieved,
                        question_input_ids: Optional[torch.Tensor] = None) -> list:
        """The B·K generator inputs "title / text // question" (row ``b*K + k``), as
        :class:`~rag.generation.contexts.Context` strings that know where the question starts.

        Under ``hf_compat`` the question is replaced by its round trip through the question
        tokenizer, as transformers' ``RagRetriever`` does: the query-encoder ids (``question_input_ids``
        ``(B, Lq)``, tokenized here if None) decoded with ``skip_special_tokens=True``.
        """
        questions = self._questions_as_read(list(questions), question_input_ids)
        return build_contexts(questions, self.reading_passages(questions, retrieved.passages), self.context_format)

    def _questions_as_read(self, questions: list[str], question_input_ids: Optional[torch.Tensor]) -> list[str]:
        """The questions as the generator reads them: as written, or under ``hf_compat`` their round trip through the
        question tokenizer (transformers' ``RagRetriever``), from the query-encoder ids ``(B, Lq)`` when given."""
        if not self.config.hf_compat:
            return questions
        if question_input_ids is None:
            question_input_ids = self._tokenize_questions(questions)["input_ids"]
        # Same strings as contexts.question_round_trip, without tokenizing a second time.
        return self.question_encoder.tokenizer.batch_decode(question_input_ids.tolist(), skip_special_tokens=True)

    def reading_passages(self, questions: Sequence[str], passages: Sequence[Sequence]) -> Sequence[Sequence]:
        """The passages as the generator reads them: B lists of K, unchanged, or each focused on its question
        (``config.passage_focus``; :func:`~rag.generation.contexts.focus_on_question`)."""
        if self.config.passage_focus == "none":
            return passages

        def focused(p, q):
            text = focus_on_question(p.text, q)
            if dataclasses.is_dataclass(p):
                return dataclasses.replace(p, text=text)
            return Passage(str(getattr(p, "id", "")), p.title, text)  # any object with title and text

        return [[focused(p, q) for p in docs] for q, docs in zip(questions, passages)]

    @property
    def context_format(self):
        """How this model joins a passage and a question (:class:`~rag.generation.contexts.ContextFormat`)."""
        return self.lm.context_format(self.config)

    def prepare_inputs(self, questions: Sequence[str], n_docs: Optional[int] = None, *,
                       retrieval: Optional[str] = None) -> RagInputs:
        """Retrieve and build the tokenized generator contexts for B questions (what decoding needs). `retrieval`:
        ``dense`` | ``bm25`` | ``hybrid`` for this call instead of ``config.retrieval`` (None: the configured one)."""
        questions = check_strings(questions, "questions")
        return self._prepare(questions, self._n_docs(n_docs), retrieval)

    def _prepare(self, questions: list[str], k: int, retrieval: Optional[str] = None) -> RagInputs:
        kind = self.config.retrieval if retrieval is None else retrieval
        need_q_tokens = kind != "bm25" or self.config.hf_compat
        q_inputs = self._tokenize_questions(questions) if need_q_tokens else None
        retrieved, doc_scores = self.scoring.score(questions, k, question_inputs=q_inputs, device=_device_of(self.generator),
                                                   retrieval=retrieval)
        device = _device_of(self.generator)
        asked = self._questions_as_read(questions, None if q_inputs is None else q_inputs["input_ids"])
        ids, mask, n_truncated, strings, width = self.lm.contexts(asked, self.reading_passages(asked, retrieved.passages),
                                                                  self.config)
        return RagInputs(ids.to(device), mask.to(device), doc_scores.to(device), retrieved, n_truncated, strings, width)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: Union[str, os.PathLike], overwrite: bool = False, *,
                        reference_query_encoder: bool = False) -> None:
        """Write a checkpoint directory, atomically: ``rag_config.json`` (config, component identities, the
        knowledge base's path and version, SHA-256 of every file), ``question_encoder/``, ``generator/`` and,
        with ``train_doc_encoder``, ``doc_encoder/`` (layout: :mod:`rag.models.rag.checkpoint`).

        ``reference_query_encoder=True`` writes no ``question_encoder/``: the checkpoint records the
        encoder's name (e.g. ``minilm``), its pooling settings and its weights fingerprint
        (:func:`~rag.knowledge.encoders.weights_fingerprint`), and :meth:`from_pretrained` loads it by
        that name and checks the fingerprint. For a query encoder that training left unchanged
        (RAG-Frozen), this keeps a checkpoint small (all-MiniLM-L6-v2 alone is ~90 MB in fp32). It is
        refused unless loading the encoder by its name now gives exactly the current weights.

        An existing directory is replaced only if it is empty or holds an earlier RagModel
        checkpoint; anything else is refused, with or without `overwrite` (kept for compatibility:
        it never replaces other data).

        Raises:
            RagError: `path` is unsuitable, or the query encoder cannot be referenced (its weights
                differ from those its name loads, e.g. after end-to-end training).
        """
        save_rag_model(self, path, overwrite, reference_query_encoder=reference_query_encoder)

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        knowledge_base: Union[str, os.PathLike, "KnowledgeBase", None] = None,
        *,
        verify: Literal["full", "size", "none"] = "full",
        allow_encoder_change: bool = False,
        **config_overrides,
    ) -> "RagModel":
        """Load a directory written by :meth:`save_pretrained` (or a hub id, where a hub is reachable).

        Every component file is checked against the recorded SHA-256 first (`verify="size"`: sizes
        only; `"none"`: trust). A query encoder saved by reference (``reference_query_encoder=True``)
        is loaded by its recorded name and its weights fingerprint checked (skipped by `"none"`).
        `knowledge_base` (a directory or KnowledgeBase) overrides the recorded path; a knowledge base
        embedded by a different document encoder than the one the model was trained against is refused
        unless `allow_encoder_change=True`. `config_overrides` replace config fields (e.g. ``n_docs=10``).
        The model is returned in eval mode.

        Raises:
            IntegrityError: a component file is missing or altered (names the file), or a referenced
                query encoder loads with other weights than the model was saved with.
            ConfigError: a referenced query encoder cannot be loaded by its name.
            KnowledgeBaseError: the knowledge base is missing or incompatible.
        """
        return load_rag_model(cls, path, knowledge_base, verify=verify, allow_encoder_change=allow_encoder_change,
                              **config_overrides)

    # ------------------------------------------------------------------ loss
    def tokenize_targets(self, targets: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Generator target ids ``(B, T)`` (padded to the longest, truncated to max_target_length,
        special tokens as the tokenizer adds them: ``<s> … </s>`` for BART, ``… </s>`` for T5) and
        their mask ``(B, T)`` bool. Every one of these tokens is scored (see :func:`marginalize.shift_right`)."""
        targets = check_strings(targets, "targets")
        ids, mask = self.lm.targets(targets, self.config)  # a causal generator: the answer's tokens and EOS
        device = _device_of(self.generator)
        return ids.to(device), mask.to(device)

    def training_targets(self, targets: Sequence[str]) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(decoder_input_ids, labels, label_mask)`` that :meth:`forward` decodes and scores for target strings.

        Default: decoder_input_ids None (labels shifted right after the start token, as generation decodes;
        every tokenized target token is scored). Under ``hf_compat`` with a tokenizer that starts targets with
        BOS (BART): transformers' convention for ``labels=tokenizer(text_target=answer).input_ids``
        (:func:`~rag.generation.marginalize.hf_label_convention`: ``<s> …`` fed, scored from the second token).
        T5-style targets (no BOS) are scored the same way under both conventions (transformers' fine-tuning
        script prepends the start token for them)."""
        labels, label_mask = self.tokenize_targets(targets)
        bos = self.bos_token_id
        if self.config.hf_compat and bos is not None and labels.shape[1] > 1 and bool((labels[:, 0] == bos).all()):
            return hf_label_convention(labels, label_mask, self.pad_token_id)
        return None, labels, label_mask

    def forward(self, questions: Sequence[str], targets: Sequence[str], n_docs: Optional[int] = None) -> RagOutput:
        """Negative marginal log-likelihood −log p(y|x) of each target (§2.4), over the top-k passages.

        Args:
            questions: B input strings (non-empty).
            targets: B target strings (non-empty), aligned with `questions`.
            n_docs: passages per question (default ``config.n_docs``).

        Returns:
            :class:`RagOutput` with ``loss`` scalar (``reduce_loss``) or ``(B,)``.
        """
        questions = check_strings(questions, "questions")
        targets = check_strings(targets, "targets")
        if len(questions) != len(targets):
            raise RagError(f"got {len(questions)} questions but {len(targets)} targets; give exactly one target per question")
        k = self._n_docs(n_docs)
        inputs = self._prepare(questions, k)
        decoder_inputs, labels, label_mask = self.training_targets(targets)
        logits = self.generator_logits(inputs, labels, decoder_input_ids=decoder_inputs)  # (B, K, T, V)
        loss = self.loss_from_logits(logits, labels, label_mask, self.retrieval_logits(inputs.doc_scores))
        return RagOutput(loss=loss, doc_scores=inputs.doc_scores, retrieved=inputs.retrieved, n_truncated=inputs.n_truncated)

    def generator_loss(self, questions: Sequence[str], targets: Sequence[str],
                       passages: Optional[Sequence] = None) -> torch.Tensor:
        """The configured loss of the generator alone, one given input per target (no retrieval, prior 1).

        With `passages` (one object with ``title`` and ``text`` per question) the input is the
        context the model would build for that passage (same format and truncation), so this is the
        RAG loss with K = 1 on a chosen passage: an auxiliary "read this passage" objective. Without,
        the input is the question alone: a closed-book seq2seq model (the paper's Table 1 baseline)
        trained and scored exactly like the RAG systems it is compared with.
        """
        questions = check_strings(questions, "questions")
        targets = check_strings(targets, "targets")
        if len(questions) != len(targets) or (passages is not None and len(passages) != len(questions)):
            raise RagError(f"got {len(questions)} questions, {len(targets)} targets and "
                           f"{'no' if passages is None else len(passages)} passages; give one target (and passage) per question")
        device = _device_of(self.generator)
        if passages is not None:
            passages = [docs[0] for docs in self.reading_passages(questions, [[p] for p in passages])]
        ids, mask, n_truncated, strings, _ = self.lm.loss_contexts(questions, passages, self.config)
        scores = torch.zeros(len(questions), 1, device=device)
        inputs = RagInputs(ids.to(device), mask.to(device), scores, None, n_truncated, strings)
        decoder_inputs, labels, label_mask = self.training_targets(targets)
        return self.loss_from_logits(self.generator_logits(inputs, labels, decoder_input_ids=decoder_inputs), labels, label_mask,
                                     scores)

    def generator_logits(self, inputs: RagInputs, labels: torch.Tensor, *, max_buckets: int = DEFAULT_MAX_BUCKETS,
                         decoder_input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced generator logits ``(B, K, T, V)``: every context row ``b*K + k`` decodes the
        targets ``labels`` ``(B, T)`` (decoder input = labels shifted right after the start token, or
        `decoder_input_ids` ``(B, T)`` when given, see :meth:`training_targets`).

        The encoder runs once per (question, passage). The B·K contexts are grouped into at most
        `max_buckets` length buckets (:func:`rag.generation.buckets.length_buckets`) and the generator
        runs once per bucket on its rows padded only to the bucket's longest context, so the encoder,
        the cross-attention keys/values and their backward cost follow the real context tokens, not
        ``B·K × longest``. Padding is masked and positions start at 0 in every row, so the logits
        equal one call over all rows up to float noise. ``max_buckets=1``: one call (trimmed to the
        longest context).
        """
        return self.lm.teacher_forced(inputs.context_input_ids, inputs.context_attention_mask, labels,
                                      inputs.doc_scores.shape[1], decoder_input_ids=decoder_input_ids, max_buckets=max_buckets)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
                         doc_scores: torch.Tensor) -> torch.Tensor:
        """The configured RAG loss from generator logits ``(B, K, T, V)``, targets ``labels`` ``(B, T)``
        with ``label_mask`` ``(B, T)`` (True on real tokens) and ``doc_scores`` ``(B, K)``.

        A thin call of :func:`rag.generation.marginalize.rag_nll_from_logits` with this model's options
        (without label smoothing only the target tokens' log-probabilities are computed).
        """
        cfg = self.config
        return rag_nll_from_logits(
            logits, labels, label_mask, doc_scores,
            marginalization=cfg.marginalization,
            label_smoothing=cfg.label_smoothing,
            reduce=("sum" if cfg.hf_compat else "mean") if cfg.reduce_loss else "none",
            exclude_bos_score=cfg.exclude_bos_score,
            bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
            hf_compat=cfg.hf_compat,
        )
