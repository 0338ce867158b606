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
(Table 6) uses BM25 scores as the retrieval logits; RAG-Frozen keeps the query encoder fixed. The
marginalization math lives in :mod:`rag.generation.marginalize` and the context
strings in :mod:`rag.generation.contexts`; this module wires them together.

Deliberate differences from ``transformers``' ``RagSequenceForGeneration`` / ``RagTokenForGeneration``
(``hf_compat=True`` reproduces transformers exactly, quirks included, for imported checkpoints):

* **Context truncation** (``truncation="keep_question"``, default): when "title / text // question"
  exceeds ``max_context_length`` tokens, the *passage* is shortened so the question is always kept.
  transformers truncates on the right, which can cut the question off entirely
  (``truncation="hf"``, implied by ``hf_compat``).
* **Question string**: by default the question goes into the context as the user wrote it.
  transformers decodes the question-encoder tokens back to text (lower-cased, re-spaced, truncated
  by the question tokenizer); ``hf_compat`` does the same round trip.
* **Single-token targets / document prior**: by default every target token is scored and
  log p(z|x) enters each document's sequence score exactly once (Eq. 1). transformers attaches the
  prior to the second target position, so for one-token targets the prior (and every retriever
  gradient) silently vanishes; see :mod:`rag.generation.marginalize` for the full list.
* **Targets**: ``forward`` takes target strings; they are tokenized by the generator tokenizer
  (BART: ``<s> … </s>``, T5: ``… </s>``), every token is scored, and the decoder reads them shifted
  right after ``decoder_start_token_id``. transformers instead expects ``labels`` that already begin
  with the start token (its fine-tuning script prepends it); the scored tokens are the same.
* **Reduction**: ``reduce_loss=True`` averages over the batch (independent of batch size);
  transformers sums, and so does ``hf_compat``.
* **Padding**: contexts are padded to the longest in the batch, not to a fixed 300 tokens, and the
  generator runs on length buckets of them (:mod:`rag.generation.buckets`), each padded only to its
  own longest context, so its cost follows the real context tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import torch
from torch import nn

from rag.errors import ConfigError, IntegrityError, KnowledgeBaseError, RagError
from rag.generation.buckets import DEFAULT_MAX_BUCKETS
from rag.io import atomic_directory, atomic_write_json, sha256_file
from rag.knowledge.types import Retrieved

logger = logging.getLogger(__name__)

__all__ = ["RagModelConfig", "RagOutput", "RagInputs", "RagModel", "CHECKPOINT_CONFIG", "CHECKPOINT_FORMAT"]

CHECKPOINT_CONFIG = "rag_config.json"
CHECKPOINT_FORMAT = 1
QUESTION_ENCODER_DIR = "question_encoder"
GENERATOR_DIR = "generator"
DOC_ENCODER_DIR = "doc_encoder"

_MARGINALIZATIONS = ("sequence", "token")
_RETRIEVALS = ("dense", "bm25")
_TRUNCATIONS = ("keep_question", "hf")


# --------------------------------------------------------------------------- configuration


@dataclass
class RagModelConfig:
    """Typed options of a :class:`RagModel` (saved in ``rag_config.json``)."""

    n_docs: int = 5
    """Top-k passages retrieved per question and marginalised over."""
    marginalization: Literal["sequence", "token"] = "sequence"
    """RAG-Sequence (Eq. 1: one passage per answer) or RAG-Token (Eq. 2: a passage per token)."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon in [0, 1) (fairseq/transformers definition)."""
    exclude_bos_score: bool = False
    """Do not score a first target token equal to the generator's BOS token."""
    reduce_loss: bool = True
    """Return a scalar loss (batch mean; sum under hf_compat) instead of per-example NLL (B,)."""
    freeze_query_encoder: bool = False
    """RAG-Frozen (Table 6): keep the query encoder fixed; only the generator trains."""
    retrieval: Literal["dense", "bm25"] = "dense"
    """dense: DPR-style MIPS with trainable query encoder; bm25: BM25 scores as retrieval logits (RAG-BM25)."""
    max_context_length: int = 300
    """Most generator input tokens per (question, passage) context."""
    max_target_length: int = 64
    """Most target tokens (longer answers are truncated, keeping EOS)."""
    max_question_length: int = 64
    """Most query-encoder tokens per question."""
    truncation: Literal["keep_question", "hf"] = "keep_question"
    """keep_question: shorten the passage so the question always fits; hf: cut on the right like transformers."""
    hf_compat: bool = False
    """Reproduce transformers' RAG exactly (contexts, question round trip, loss quirks, summed loss)."""
    title_sep: str = " / "
    """Separator between a passage's title and its text in the generator input."""
    doc_sep: str = " // "
    """Separator between the passage and the question in the generator input."""
    train_doc_encoder: bool = False
    """Train the document encoder end to end: re-embed the retrieved passages with gradients and score them
    with those fresh vectors (doc_scores = q · d_fresh); pair with the IndexRefresh callback so the index
    follows the encoder. Dense retrieval only."""
    rerank_candidates: Optional[int] = None
    """Stale-index re-ranking: search this many candidates (>= n_docs) in the index, re-embed them with the
    current document encoder and keep the n_docs best by fresh score. None: no re-ranking. Dense retrieval only."""

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"RagModelConfig.{name} must be a positive integer, got {v!r}")

        for name in ("n_docs", "max_context_length", "max_target_length", "max_question_length"):
            positive_int(name)
        if self.marginalization not in _MARGINALIZATIONS:
            raise ConfigError(f"RagModelConfig.marginalization={self.marginalization!r}; choose one of {_MARGINALIZATIONS}")
        if self.retrieval not in _RETRIEVALS:
            raise ConfigError(f"RagModelConfig.retrieval={self.retrieval!r}; choose one of {_RETRIEVALS}")
        if self.truncation not in _TRUNCATIONS:
            raise ConfigError(f"RagModelConfig.truncation={self.truncation!r}; choose one of {_TRUNCATIONS}")
        if isinstance(self.label_smoothing, bool) or not isinstance(self.label_smoothing, (int, float)) or not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"RagModelConfig.label_smoothing must be a number in [0, 1), got {self.label_smoothing!r}")
        self.label_smoothing = float(self.label_smoothing)
        for name in ("exclude_bos_score", "reduce_loss", "freeze_query_encoder", "hf_compat", "train_doc_encoder"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"RagModelConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("title_sep", "doc_sep"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"RagModelConfig.{name} must be a string, got {getattr(self, name)!r}")
        if self.rerank_candidates is not None:
            positive_int("rerank_candidates")
            if self.rerank_candidates < self.n_docs:
                raise ConfigError(
                    f"RagModelConfig.rerank_candidates={self.rerank_candidates} is smaller than n_docs={self.n_docs}; "
                    "re-ranking keeps the best n_docs of rerank_candidates, so give at least n_docs (or null to disable)"
                )
        if self.retrieval == "bm25" and self.uses_doc_encoder:
            raise ConfigError(
                "RagModelConfig.train_doc_encoder / rerank_candidates need dense retrieval (document vectors); "
                "BM25 has no document encoder — set retrieval: dense or disable them"
            )

    @property
    def uses_doc_encoder(self) -> bool:
        """True when the model re-embeds retrieved passages with its own document encoder
        (``train_doc_encoder`` or ``rerank_candidates``)."""
        return self.train_doc_encoder or self.rerank_candidates is not None

    @property
    def effective_truncation(self) -> str:
        """The truncation rule in force: hf_compat implies transformers' right truncation."""
        return "hf" if self.hf_compat else self.truncation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "RagModelConfig") -> "RagModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        return cls(**d)


# --------------------------------------------------------------------------- outputs


@dataclass
class RagInputs:
    """Everything the generator needs for a batch of B questions and K passages each.

    Row ``b * K + k`` of the context tensors is question b joined with its k-th passage.
    """

    context_input_ids: torch.Tensor
    """(B·K, L) generator input ids, padded to the longest context (L ≤ max_context_length)."""
    context_attention_mask: torch.Tensor
    """(B·K, L) 1 for real tokens."""
    doc_scores: torch.Tensor
    """(B, K) retrieval logits: q · doc_embeds (dense, differentiable) or BM25 scores."""
    retrieved: Retrieved
    """The retrieved passages (rows, stored scores, passages, doc_embeds, kb_version)."""
    n_truncated: int
    """How many of the B·K contexts were truncated to fit max_context_length."""
    context_strings: list[str] = field(default_factory=list)
    """The B·K context strings given to the generator tokenizer."""


@dataclass
class RagOutput:
    """Result of :meth:`RagModel.forward`."""

    loss: torch.Tensor
    """Scalar (reduce_loss) or (B,) per-example negative marginal log-likelihood."""
    doc_scores: torch.Tensor
    """(B, K) q · doc_embeds, recomputed in torch (differentiable into the query encoder)."""
    retrieved: Retrieved
    """The passages marginalised over."""
    n_truncated: int
    """Contexts truncated this call."""


# --------------------------------------------------------------------------- helpers


def _check_strings(items: Any, what: str) -> list[str]:
    """A non-empty list of non-blank strings, or RagError naming the bad item."""
    if isinstance(items, str):
        raise RagError(f"{what} must be a list of strings, got a single string; wrap it in a list")
    try:
        items = list(items)
    except TypeError as e:
        raise RagError(f"{what} must be a list of strings, got {type(items).__name__}") from e
    if not items:
        raise RagError(f"{what} is empty; give at least one item")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise RagError(f"{what}[{i}] is a {type(s).__name__}, not a string")
        if not s.strip():
            raise RagError(f"{what}[{i}] is an empty string; remove the example or give it text")
    return items


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _file_checksums(root: Path, subdirs: Sequence[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for sub in subdirs:
        for f in sorted((root / sub).rglob("*")):
            if f.is_file():
                rel = f.relative_to(root).as_posix()
                out[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


def _verify_checksums(root: Path, files: dict, verify: str) -> None:
    if verify not in ("full", "size", "none"):
        raise ConfigError(f"verify={verify!r}; choose 'full', 'size' or 'none'")
    if verify == "none":
        return
    if not isinstance(files, dict) or not files:
        raise IntegrityError(f"{root / CHECKPOINT_CONFIG}: records no file checksums; save the model again")
    for rel, meta in files.items():
        f = root / rel
        if not f.is_file():
            raise IntegrityError(f"{f}: listed in {root / CHECKPOINT_CONFIG} but missing; the checkpoint is incomplete — save it again")
        size = f.stat().st_size
        if size != meta.get("bytes"):
            raise IntegrityError(f"{f}: {size} bytes, {CHECKPOINT_CONFIG} says {meta.get('bytes')} (truncated or altered); restore the checkpoint")
        if verify == "full" and sha256_file(f) != meta.get("sha256"):
            raise IntegrityError(f"{f}: SHA-256 does not match {root / CHECKPOINT_CONFIG} (the file was altered or damaged); restore the checkpoint")


def _resolve_checkpoint_dir(path: Union[str, os.PathLike], what: str) -> Path:
    """A local directory as is; otherwise try it as a hub repository id (works only where a hub is reachable)."""
    p = Path(os.fspath(path))
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"{p}: is a file; {what} must be a checkpoint directory or a hub repository id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=os.fspath(path)))
    except Exception as e:  # offline, unknown repo, bad id — all the same to the user
        raise ConfigError(
            f"{path!s}: no such {what} directory, and it could not be fetched as a hub repository id ({type(e).__name__}: {e}); "
            "pass a local directory written by save_pretrained"
        ) from e


def _open_knowledge_base(kb, verify: str = "full"):
    from rag.knowledge.knowledge_base import KnowledgeBase

    if isinstance(kb, KnowledgeBase):
        return kb
    if isinstance(kb, (str, os.PathLike)):
        return KnowledgeBase.open(kb, verify=verify)
    raise ConfigError(f"knowledge_base must be a KnowledgeBase or a directory path, got {type(kb).__name__}")


def _make_retriever(kb, question_encoder, retrieval: str, *, allow_encoder_change: bool = False):
    """DenseRetriever (dim checked now, not mid-epoch) or a BM25Retriever over the KB's stored BM25 index."""
    from rag.knowledge.retriever import DenseRetriever, check_compatible

    if retrieval == "bm25":
        from rag.knowledge.bm25 import BM25Retriever

        if kb.bm25 is None:
            raise KnowledgeBaseError(
                f"{kb.path}: has no BM25 index, but retrieval='bm25'; rebuild the knowledge base with bm25=True "
                "(`rag index build --bm25`) or use retrieval='dense'"
            )
        return BM25Retriever(kb.bm25, kb.get_passages, kb_version=kb.version, knowledge_base=kb)
    check_compatible(kb, question_encoder.dim, None)
    return DenseRetriever(kb, question_encoder, allow_encoder_change=allow_encoder_change)


# --------------------------------------------------------------------------- the model


class RagModel(nn.Module):
    """Query encoder + seq2seq generator + retriever; ``forward`` returns the marginal NLL (§2.4).

    Args:
        question_encoder: a :class:`~rag.knowledge.encoders.TextEncoder` (DPR question encoder,
            MiniLM, ...) whose output dimension matches the knowledge base.
        generator: any ``AutoModelForSeq2SeqLM`` (BART, T5, ...).
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

    def __init__(self, question_encoder, generator, generator_tokenizer, retriever, config: Optional[RagModelConfig] = None,
                 doc_encoder=None):
        super().__init__()
        from rag.knowledge.bm25 import BM25Retriever
        from rag.knowledge.encoders import TextEncoder
        from rag.knowledge.knowledge_base import KnowledgeBase
        from rag.knowledge.retriever import DenseRetriever, check_compatible

        config = RagModelConfig() if config is None else config
        if not isinstance(config, RagModelConfig):
            raise ConfigError(f"config must be a RagModelConfig, got {type(config).__name__}")
        if not isinstance(question_encoder, TextEncoder):
            raise ConfigError(f"question_encoder must be a rag.knowledge.encoders.TextEncoder, got {type(question_encoder).__name__}")
        if not isinstance(generator, nn.Module) or not getattr(getattr(generator, "config", None), "is_encoder_decoder", False):
            raise ConfigError(
                f"generator must be a seq2seq (encoder-decoder) transformers model such as BART or T5, got {type(generator).__name__}; "
                "decoder-only LMs belong to rag.models.ralm"
            )
        self.config = config
        self.question_encoder = question_encoder
        self.generator = generator
        self.generator_tokenizer = generator_tokenizer
        self._check_generator_tokens()

        if isinstance(retriever, KnowledgeBase):
            retriever = _make_retriever(retriever, question_encoder, config.retrieval)
        if config.retrieval == "bm25":
            if not isinstance(retriever, BM25Retriever):
                raise ConfigError(f"config.retrieval='bm25' needs a BM25Retriever (or a KnowledgeBase built with bm25=True), got {type(retriever).__name__}")
        else:
            if not isinstance(retriever, DenseRetriever):
                raise ConfigError(f"config.retrieval='dense' needs a DenseRetriever or a KnowledgeBase, got {type(retriever).__name__}")
            check_compatible(retriever.knowledge_base, question_encoder.dim, None)
            if retriever.query_encoder is not question_encoder:
                # Retrieve with the model's own (trainable) encoder, keeping the retriever's embedding space.
                space = retriever.space
                retriever = DenseRetriever(retriever.knowledge_base, question_encoder, allow_encoder_change=retriever.allow_encoder_change)
                retriever.space = space
        self.retriever = retriever

        if self.query_encoder_frozen:
            self.question_encoder.requires_grad_(False)
            self.question_encoder.eval()
        self.doc_encoder = self._setup_doc_encoder(doc_encoder)

    def _setup_doc_encoder(self, doc_encoder):
        """The document encoder module (or None): given, or loaded from the knowledge base's manifest when the
        config re-embeds passages; frozen and in eval mode unless ``train_doc_encoder``."""
        from rag.knowledge.encoders import TextEncoder

        if doc_encoder is None and self.config.uses_doc_encoder:
            from rag.knowledge.refresh import load_document_encoder

            doc_encoder = load_document_encoder(self.retriever.knowledge_base)
        if doc_encoder is None:
            return None
        if not isinstance(doc_encoder, TextEncoder):
            raise ConfigError(f"doc_encoder must be a rag.knowledge.encoders.TextEncoder, got {type(doc_encoder).__name__}")
        if doc_encoder.dim != self.question_encoder.dim:
            raise ConfigError(
                f"the document encoder {doc_encoder.name_or_path!r} outputs dim={doc_encoder.dim} but the query encoder "
                f"outputs dim={self.question_encoder.dim}; pair encoders of the same dimension"
            )
        if not self.config.train_doc_encoder:
            doc_encoder.requires_grad_(False)
            doc_encoder.eval()
        return doc_encoder

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_components(
        cls,
        question_encoder: Optional[str],
        generator: str,
        knowledge_base,
        config: Optional[RagModelConfig] = None,
        *,
        document_encoder: Optional[str] = None,
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
        from rag.knowledge.encoders import TextEncoder, resolve_name_or_path
        from rag.knowledge.retriever import default_query_encoder
        from rag.models.warm_start import load_seq2seq

        config = RagModelConfig() if config is None else config
        if config_overrides:
            config = dataclasses.replace(config, **_check_overrides(config_overrides))
        kb = _open_knowledge_base(knowledge_base)
        if isinstance(question_encoder, TextEncoder):
            qenc = question_encoder
        else:
            qenc = default_query_encoder(kb, None if question_encoder is None else os.fspath(question_encoder))
        gen_path = resolve_name_or_path(os.fspath(generator))
        try:
            gen, tok = load_seq2seq(gen_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the generator {generator!r} as a seq2seq model and tokenizer: {e}") from e
        denc = None
        if document_encoder is not None and config.uses_doc_encoder:
            from rag.knowledge.refresh import load_document_encoder

            denc = load_document_encoder(kb, document_encoder)
        return cls(qenc, gen, tok, kb, config, doc_encoder=denc)

    def _check_generator_tokens(self) -> None:
        if getattr(self.generator_tokenizer, "pad_token_id", None) is None:
            raise ConfigError("the generator tokenizer has no pad token; set one (tokenizer.pad_token = ...) and save it again")
        if self.decoder_start_token_id is None:
            raise ConfigError("the generator config has no decoder_start_token_id; set generator.config.decoder_start_token_id")

    # ------------------------------------------------------------------ properties
    @property
    def query_encoder_frozen(self) -> bool:
        """True when the query encoder receives no gradients (RAG-Frozen or RAG-BM25)."""
        return self.config.freeze_query_encoder or self.config.retrieval == "bm25"

    @property
    def knowledge_base(self):
        """The knowledge base the retriever currently reads (None for a BM25 retriever over bare passages)."""
        return getattr(self.retriever, "knowledge_base", None)

    @property
    def decoder_start_token_id(self) -> Optional[int]:
        gcfg = self.generator.config
        start = getattr(gcfg, "decoder_start_token_id", None)
        if start is None:
            gen_cfg = getattr(self.generator, "generation_config", None)
            start = getattr(gen_cfg, "decoder_start_token_id", None)
        return start

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
        from rag.models.warm_start import is_warm_start

        super().train(mode)
        if is_warm_start(self.generator):  # its frozen encoder stays deterministic (and cacheable)
            self.generator.get_encoder().eval()
        if self.query_encoder_frozen:
            self.question_encoder.eval()
        if getattr(self, "doc_encoder", None) is not None and not self.config.train_doc_encoder:
            self.doc_encoder.eval()
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
        return groups

    # ------------------------------------------------------------------ retrieval
    def _n_docs(self, n_docs: Optional[int]) -> int:
        k = self.config.n_docs if n_docs is None else n_docs
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise RagError(f"n_docs must be a positive integer, got {k!r}")
        return k

    def _tokenize_questions(self, questions: list[str]) -> dict[str, torch.Tensor]:
        """Query-encoder inputs ``(B, Lq)``, tokenized once and reused for the hf question round trip."""
        tok = self.question_encoder.tokenizer
        batch = tok(questions, padding=True, truncation=True, max_length=self.config.max_question_length, return_tensors="pt")
        device = self.question_encoder.device
        return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def _retrieve(self, questions: list[str], k: int, question_inputs: Optional[dict]) -> tuple[Retrieved, torch.Tensor]:
        if self.config.retrieval == "bm25":
            retrieved = self.retriever.retrieve(questions, k)
            doc_scores = retrieved.scores.to(device=_device_of(self.generator), dtype=torch.float32)
            return retrieved, doc_scores
        if question_inputs is None:
            question_inputs = self._tokenize_questions(questions)
        grad = torch.is_grad_enabled() and not self.query_encoder_frozen
        with torch.set_grad_enabled(grad):
            q = self.question_encoder(**question_inputs)  # (B, D)
        if self.doc_encoder is not None and self.config.uses_doc_encoder:
            n_search = k
            if self.config.rerank_candidates is not None:
                n_search = max(k, min(self.config.rerank_candidates, len(self.retriever.knowledge_base)))
            retrieved = self.retriever.search(q.detach(), n_search)  # index search: no gradient
            retrieved, doc_embeds = self._fresh_doc_embeds(q, retrieved, k)  # (B, K, D) current doc encoder
        else:
            retrieved = self.retriever.search(q.detach(), k)  # index search: no gradient
            if retrieved.doc_embeds is None:
                raise KnowledgeBaseError("the dense retriever returned no doc_embeds; cannot compute differentiable doc scores")
            doc_embeds = retrieved.doc_embeds.to(device=q.device, dtype=q.dtype)  # (B, K, D), frozen
        # The only path by which gradients reach the query encoder (§2.2, p_η(z|x) ∝ exp(d(z)ᵀ q(x))).
        doc_scores = torch.bmm(q.unsqueeze(1), doc_embeds.transpose(1, 2)).squeeze(1)  # (B, K)
        return retrieved, doc_scores

    def _fresh_doc_embeds(self, q: torch.Tensor, retrieved: Retrieved, k: int) -> tuple[Retrieved, torch.Tensor]:
        """Re-embed the ``(B, L)`` retrieved passages with the current document encoder -> ``(B, L, D)``
        (with gradients under ``train_doc_encoder``), and keep the k best by ``q · d_fresh`` when L > k.

        Passages are encoded as DPR title/text pairs, exactly as :meth:`TextEncoder.encode_passages` built
        the index. Re-ranking scores all L candidates without gradients (eval mode, batched), then only the
        k kept passages are re-encoded with gradients, so memory grows with k, not L. Returns the Retrieved
        for the kept passages — its ``doc_embeds`` are the fresh vectors (detached), its ``scores`` the
        fresh scores when re-ranked (else the index's) — and the fresh ``(B, K, D)`` embeddings that
        doc_scores are computed from.
        """
        b, n = retrieved.rows.shape
        rows, scores, passages = retrieved.rows, retrieved.scores, retrieved.passages
        grad = torch.is_grad_enabled() and self.config.train_doc_encoder
        d = None
        if n > k:  # stale-index re-ranking: the k best of L by fresh score
            cand = torch.from_numpy(self.doc_encoder.encode_passages([p for ps in passages for p in ps], show_progress=False))
            cand = cand.view(b, n, -1).to(device=q.device, dtype=q.dtype)  # (B, L, D), no gradient
            with torch.no_grad():
                fresh = torch.bmm(q.detach().unsqueeze(1), cand.transpose(1, 2)).squeeze(1)  # (B, L)
                top_scores, top = fresh.topk(k, dim=1)  # (B, K), best first
            top_cpu = top.cpu()
            rows = rows.gather(1, top_cpu)
            scores = top_scores.to("cpu", torch.float32)
            passages = [[passages[i][j] for j in top_cpu[i].tolist()] for i in range(b)]
            if not grad:
                d = cand.gather(1, top.unsqueeze(-1).expand(-1, -1, cand.shape[-1]))  # (B, K, D)
        if d is None:
            flat = [p for ps in passages for p in ps]
            with torch.set_grad_enabled(grad):
                batch = self.doc_encoder.tokenize([p.title for p in flat], [p.text for p in flat])
                d = self.doc_encoder(**batch).view(b, k, -1).to(device=q.device, dtype=q.dtype)  # (B, K, D)
        kept = Retrieved(rows=rows, scores=scores, passages=passages, doc_embeds=d.detach().to("cpu", torch.float32),
                         kb_version=retrieved.kb_version)
        return kept, d

    def retrieve(self, questions: Sequence[str], n_docs: Optional[int] = None) -> tuple[Retrieved, torch.Tensor]:
        """Top-k passages for B questions and their ``(B, K)`` doc scores.

        Dense: ``doc_scores = q · doc_embeds`` carries gradients into the query encoder when grad
        mode is on and the encoder is not frozen. BM25: the BM25 scores (no gradient).
        """
        questions = _check_strings(questions, "questions")
        return self._retrieve(questions, self._n_docs(n_docs), None)

    # ------------------------------------------------------------------ contexts
    def context_strings(self, questions: Sequence[str], retrieved: Retrieved, question_input_ids: Optional[torch.Tensor] = None) -> list:
        """The B·K generator inputs "title / text // question" (row ``b*K + k``), as
        :class:`~rag.generation.contexts.Context` strings that know where the question starts.

        Under ``hf_compat`` the question is replaced by its round trip through the question
        tokenizer, as transformers' ``RagRetriever`` does: the query-encoder ids (``question_input_ids``
        ``(B, Lq)``, tokenized here if None) decoded with ``skip_special_tokens=True``.
        """
        from rag.generation.contexts import build_contexts

        questions = list(questions)
        if self.config.hf_compat:
            if question_input_ids is None:
                question_input_ids = self._tokenize_questions(questions)["input_ids"]
            # Same strings as contexts.question_round_trip, without tokenizing a second time.
            questions = self.question_encoder.tokenizer.batch_decode(question_input_ids.tolist(), skip_special_tokens=True)
        return build_contexts(questions, retrieved.passages, self.context_format)

    @property
    def context_format(self):
        """How this model joins a passage and a question (:class:`~rag.generation.contexts.ContextFormat`)."""
        from rag.generation.contexts import ContextFormat

        # transformers reads the prefix from the generator's config (T5 task prefixes), not RagConfig.
        prefix = getattr(self.generator.config, "prefix", None) or ""
        return ContextFormat(title_sep=self.config.title_sep, doc_sep=self.config.doc_sep, prefix=prefix)

    def prepare_inputs(self, questions: Sequence[str], n_docs: Optional[int] = None) -> RagInputs:
        """Retrieve and build the tokenized generator contexts for B questions (what decoding needs)."""
        questions = _check_strings(questions, "questions")
        return self._prepare(questions, self._n_docs(n_docs))

    def _prepare(self, questions: list[str], k: int) -> RagInputs:
        need_q_tokens = self.config.retrieval == "dense" or self.config.hf_compat
        q_inputs = self._tokenize_questions(questions) if need_q_tokens else None
        retrieved, doc_scores = self._retrieve(questions, k, q_inputs)
        strings = self.context_strings(questions, retrieved, None if q_inputs is None else q_inputs["input_ids"])
        ids, mask, n_truncated = self._tokenize_contexts(strings)
        device = _device_of(self.generator)
        return RagInputs(ids.to(device), mask.to(device), doc_scores.to(device), retrieved, n_truncated, strings)

    def _tokenize_contexts(self, strings) -> tuple[torch.Tensor, torch.Tensor, int]:
        from rag.generation.contexts import tokenize_contexts

        enc = tokenize_contexts(
            self.generator_tokenizer, strings, self.config.max_context_length,
            truncation=self.config.effective_truncation, padding="longest",
        )
        return enc["input_ids"], enc["attention_mask"], int(enc["truncated"].sum())

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: Union[str, os.PathLike], overwrite: bool = False, *,
                        reference_query_encoder: bool = False) -> None:
        """Write a checkpoint directory, atomically::

            rag_config.json     RagModelConfig, component identities, the knowledge base's path and
                                version (referenced, not copied) and SHA-256 of every component file
            question_encoder/   TextEncoder.save_pretrained (safetensors + tokenizer + pooling settings)
            generator/          generator.save_pretrained (safetensors) + its tokenizer
            doc_encoder/        the trained document encoder (only with ``train_doc_encoder``)

        ``reference_query_encoder=True`` writes no ``question_encoder/``: the checkpoint records the
        encoder's name (e.g. ``minilm``), its pooling settings and its weights fingerprint
        (:func:`~rag.knowledge.encoders.weights_fingerprint`), and :meth:`from_pretrained` loads it by
        that name and checks the fingerprint. For a query encoder that training left unchanged
        (RAG-Frozen), this keeps a checkpoint small (all-MiniLM-L6-v2 alone is ~90 MB in fp32). It is
        refused unless loading the encoder by its name now gives exactly the current weights.

        An existing directory is replaced only if it is empty, holds an earlier RagModel
        checkpoint, or `overwrite` is true.

        Raises:
            RagError: `path` is unsuitable, or the query encoder cannot be referenced (its weights
                differ from those its name loads, e.g. after end-to-end training).
        """
        from rag.models.warm_start import is_warm_start, save_generator

        path = Path(path)
        if path.exists():
            if not path.is_dir():
                raise RagError(f"{path} exists and is not a directory; choose another path")
            if any(path.iterdir()) and not (path / CHECKPOINT_CONFIG).is_file() and not overwrite:
                raise RagError(f"{path} holds files that are not a RagModel checkpoint; choose another path or pass overwrite=True")
        kb = self.knowledge_base
        kb_ref = None
        if kb is not None:
            kb_ref = {
                "path": str(Path(kb.path).resolve()),
                "version": kb.version,
                "dim": kb.dim,
                "encoder": kb.encoder,
                "space": getattr(self.retriever, "space", kb.encoder.get("fingerprint")),
            }
        qenc_meta = self._referenced_query_encoder() if reference_query_encoder else None
        with atomic_directory(path, overwrite=True) as tmp:
            if qenc_meta is None:
                self.question_encoder.save_pretrained(tmp / QUESTION_ENCODER_DIR)
                qenc_meta = {"dir": QUESTION_ENCODER_DIR, **self.question_encoder.identity()}
            gdir = tmp / GENERATOR_DIR
            if is_warm_start(self.generator):  # trained weights only; the frozen encoder is referenced
                save_generator(self.generator, self.generator_tokenizer, gdir)
            else:
                self.generator.save_pretrained(gdir, safe_serialization=True)
                self.generator_tokenizer.save_pretrained(gdir)
            saved_dirs = [GENERATOR_DIR] if "dir" not in qenc_meta else [QUESTION_ENCODER_DIR, GENERATOR_DIR]
            denc_meta = None
            if self.doc_encoder is not None and self.config.train_doc_encoder:  # trained weights: keep them
                self.doc_encoder.save_pretrained(tmp / DOC_ENCODER_DIR)
                denc_meta = {"dir": DOC_ENCODER_DIR, **self.doc_encoder.identity()}
                saved_dirs.append(DOC_ENCODER_DIR)
            meta = {
                "format": CHECKPOINT_FORMAT,
                "config": self.config.to_dict(),
                "question_encoder": qenc_meta,
                "generator": {
                    "dir": GENERATOR_DIR,
                    "class": type(self.generator).__name__,
                    "model_type": getattr(self.generator.config, "model_type", None),
                    "name": getattr(self.generator.config, "_name_or_path", None) or None,
                },
                "knowledge_base": kb_ref,
                "doc_encoder": denc_meta,
                "files": _file_checksums(tmp, saved_dirs),
            }
            atomic_write_json(tmp / CHECKPOINT_CONFIG, meta)

    def _referenced_query_encoder(self) -> dict:
        """The ``rag_config.json`` entry that references the query encoder by name instead of
        copying it; RagError unless loading that name reproduces the current weights exactly."""
        from rag.knowledge.encoders import TextEncoder

        qenc = self.question_encoder
        identity = qenc.identity()
        try:
            fresh = TextEncoder(qenc.name_or_path, pooling=qenc.pooling, normalize=qenc.normalize, max_length=qenc.max_length)
        except RagError as e:
            raise RagError(
                f"reference_query_encoder=True, but the query encoder's name {qenc.name_or_path!r} cannot be loaded ({e}); "
                "save its weights instead (reference_query_encoder=False)"
            ) from e
        fresh_fingerprint = fresh.identity()["fingerprint"]
        if fresh_fingerprint != identity["fingerprint"]:
            raise RagError(
                f"reference_query_encoder=True, but the query encoder's weights differ from those {qenc.name_or_path!r} loads "
                f"(fingerprint {identity['fingerprint'][:12]}… vs {fresh_fingerprint[:12]}…), e.g. after end-to-end training; "
                "save its weights instead (reference_query_encoder=False), or train with freeze_query_encoder=True"
            )
        return {"reference": True, **identity}

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, os.PathLike],
        knowledge_base=None,
        *,
        verify: Literal["full", "size", "none"] = "full",
        allow_encoder_change: bool = False,
        **config_overrides,
    ) -> "RagModel":
        """Load a directory written by :meth:`save_pretrained` (or a hub id, where a hub is reachable).

        Every component file is checked against the recorded SHA-256 first (`verify="size"`: sizes
        only; `"none"`: trust). A query encoder saved by reference (``reference_query_encoder=True``)
        is loaded by its recorded name and its weights fingerprint checked (skipped by `"none"`). `knowledge_base` (a directory or KnowledgeBase) overrides the
        recorded path; a knowledge base embedded by a different document encoder than the one the
        model was trained against is refused unless `allow_encoder_change=True`. `config_overrides`
        replace config fields (e.g. ``n_docs=10``). The model is returned in eval mode.

        Raises:
            IntegrityError: a component file is missing or altered (names the file), or a referenced
                query encoder loads with other weights than the model was saved with.
            ConfigError: a referenced query encoder cannot be loaded by its name.
            KnowledgeBaseError: the knowledge base is missing or incompatible.
        """
        from rag.knowledge.encoders import TextEncoder
        from rag.knowledge.retriever import check_compatible
        from rag.models.warm_start import load_seq2seq

        root = _resolve_checkpoint_dir(path, "RagModel checkpoint")
        cfg_file = root / CHECKPOINT_CONFIG
        if not cfg_file.is_file():
            from rag.models.hf_compat import is_hf_rag_checkpoint

            hint = (" It looks like a transformers RAG checkpoint: load it with rag.models.hf_compat.load_hf_rag"
                    if is_hf_rag_checkpoint(root) else "")
            raise ConfigError(f"{cfg_file}: missing; {root} is not a RagModel checkpoint (save one with RagModel.save_pretrained).{hint}")
        try:
            meta = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IntegrityError(f"{cfg_file}: cannot be read ({e}); restore the checkpoint") from e
        if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(f"{cfg_file}: unknown checkpoint format {meta.get('format') if isinstance(meta, dict) else meta!r} (expected {CHECKPOINT_FORMAT})")
        _verify_checksums(root, meta.get("files"), verify)
        config = RagModelConfig.from_dict(meta.get("config", {}), str(cfg_file))
        if config_overrides:
            config = dataclasses.replace(config, **_check_overrides(config_overrides))

        kb_ref = meta.get("knowledge_base") or {}
        kb_source = knowledge_base if knowledge_base is not None else kb_ref.get("path")
        if kb_source is None:
            raise ConfigError(f"{cfg_file}: records no knowledge base; pass knowledge_base=<directory>")
        kb = _open_knowledge_base(kb_source)
        if kb_ref.get("version") and kb.version != kb_ref["version"]:
            logger.warning("%s: knowledge base %s is version %s; the model was saved with %s", root, kb.path, kb.version, kb_ref["version"])

        qenc = _load_query_encoder(root, meta.get("question_encoder") or {}, verify)
        if config.retrieval == "dense":
            check_compatible(kb, qenc.dim, kb_ref.get("space"), allow_encoder_change=allow_encoder_change)
        gdir = root / meta["generator"].get("dir", GENERATOR_DIR)
        gen, tok = load_seq2seq(gdir)
        denc_meta = meta.get("doc_encoder")
        denc = TextEncoder.from_pretrained(root / denc_meta.get("dir", DOC_ENCODER_DIR)) if denc_meta and config.uses_doc_encoder else None
        model = cls(qenc, gen, tok, kb, config, doc_encoder=denc)
        if config.retrieval == "dense":
            model.retriever.allow_encoder_change = allow_encoder_change
        return model.eval()

    # ------------------------------------------------------------------ loss
    def tokenize_targets(self, targets: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Generator target ids ``(B, T)`` (padded to the longest, truncated to max_target_length,
        special tokens as the tokenizer adds them: ``<s> … </s>`` for BART, ``… </s>`` for T5) and
        their mask ``(B, T)`` bool. Every one of these tokens is scored (see :func:`marginalize.shift_right`)."""
        targets = _check_strings(targets, "targets")
        enc = self.generator_tokenizer(
            targets, padding=True, truncation=True, max_length=self.config.max_target_length, return_tensors="pt"
        )
        device = _device_of(self.generator)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()

    def forward(self, questions: Sequence[str], targets: Sequence[str], n_docs: Optional[int] = None) -> RagOutput:
        """Negative marginal log-likelihood −log p(y|x) of each target (§2.4), over the top-k passages.

        Args:
            questions: B input strings (non-empty).
            targets: B target strings (non-empty), aligned with `questions`.
            n_docs: passages per question (default ``config.n_docs``).

        Returns:
            :class:`RagOutput` with ``loss`` scalar (``reduce_loss``) or ``(B,)``.
        """
        questions = _check_strings(questions, "questions")
        targets = _check_strings(targets, "targets")
        if len(questions) != len(targets):
            raise RagError(f"got {len(questions)} questions but {len(targets)} targets; give exactly one target per question")
        k = self._n_docs(n_docs)
        inputs = self._prepare(questions, k)
        labels, label_mask = self.tokenize_targets(targets)
        logits = self.generator_logits(inputs, labels)  # (B, K, T, V)
        loss = self.loss_from_logits(logits, labels, label_mask, inputs.doc_scores)
        return RagOutput(loss=loss, doc_scores=inputs.doc_scores, retrieved=inputs.retrieved, n_truncated=inputs.n_truncated)

    def generator_loss(self, questions: Sequence[str], targets: Sequence[str], passages: Optional[Sequence] = None) -> torch.Tensor:
        """The configured loss of the generator alone, one given input per target (no retrieval, prior 1).

        With `passages` (one object with ``title`` and ``text`` per question) the input is the
        context the model would build for that passage (same format and truncation), so this is the
        RAG loss with K = 1 on a chosen passage: an auxiliary "read this passage" objective. Without,
        the input is the question alone: a closed-book seq2seq model (the paper's Table 1 baseline)
        trained and scored exactly like the RAG systems it is compared with.
        """
        questions = _check_strings(questions, "questions")
        targets = _check_strings(targets, "targets")
        if len(questions) != len(targets) or (passages is not None and len(passages) != len(questions)):
            raise RagError(f"got {len(questions)} questions, {len(targets)} targets and "
                           f"{'no' if passages is None else len(passages)} passages; give one target (and passage) per question")
        fmt = self.context_format
        if passages is None:
            strings = [fmt.prefix + q for q in questions]
        else:
            strings = [fmt.context(p.title, p.text, q) for q, p in zip(questions, passages)]
        ids, mask, n_truncated = self._tokenize_contexts(strings)
        device = _device_of(self.generator)
        scores = torch.zeros(len(questions), 1, device=device)
        inputs = RagInputs(ids.to(device), mask.to(device), scores, None, n_truncated, strings)
        labels, label_mask = self.tokenize_targets(targets)
        return self.loss_from_logits(self.generator_logits(inputs, labels), labels, label_mask, scores)

    def generator_logits(self, inputs: RagInputs, labels: torch.Tensor, *, max_buckets: int = DEFAULT_MAX_BUCKETS) -> torch.Tensor:
        """Teacher-forced generator logits ``(B, K, T, V)``: every context row ``b*K + k`` decodes the
        targets ``labels`` ``(B, T)`` (decoder input = labels shifted right after the start token).

        The encoder runs once per (question, passage). The B·K contexts are grouped into at most
        `max_buckets` length buckets (:func:`rag.generation.buckets.length_buckets`) and the generator
        runs once per bucket on its rows padded only to the bucket's longest context, so the encoder,
        the cross-attention keys/values and their backward cost follow the real context tokens, not
        ``B·K × longest``. Padding is masked and positions start at 0 in every row, so the logits
        equal one call over all rows up to float noise. ``max_buckets=1``: one call (trimmed to the
        longest context).
        """
        from rag.generation.buckets import length_buckets, run_in_buckets, take_bucket
        from rag.generation.marginalize import shift_right

        b, t = labels.shape
        k = inputs.doc_scores.shape[1]
        ids, mask = inputs.context_input_ids, inputs.context_attention_mask
        decoder_input_ids = shift_right(labels, int(self.decoder_start_token_id), self.pad_token_id)  # (B, T)

        def run(bucket) -> torch.Tensor:  # (n, T, V) for the bucket's rows
            out = self.generator(
                input_ids=take_bucket(ids, bucket),
                attention_mask=take_bucket(mask, bucket),
                decoder_input_ids=decoder_input_ids[bucket.rows // k],  # row b*K + k decodes target b
                use_cache=False,
                return_dict=True,
            )
            return out.logits

        logits = run_in_buckets(run, length_buckets(mask, max_buckets=max_buckets))  # (B·K, T, V)
        return logits.view(b, k, t, -1)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, doc_scores: torch.Tensor) -> torch.Tensor:
        """The configured RAG loss from generator logits ``(B, K, T, V)``, targets ``labels`` ``(B, T)``
        with ``label_mask`` ``(B, T)`` (True on real tokens) and ``doc_scores`` ``(B, K)``.

        Without label smoothing (and outside hf_compat) only the target tokens' log-probabilities
        are computed — ``logit[y] - logsumexp(logits)`` — instead of a ``(B, K, T, V)`` log-softmax;
        smoothing needs the whole distribution. The math is :mod:`rag.generation.marginalize`'s.
        """
        from rag.generation import marginalize as M

        cfg = self.config
        b, k, t, _ = logits.shape
        prior = M.doc_log_prior(doc_scores)  # (B, K) log p(z|x)
        reduce = ("sum" if cfg.hf_compat else "mean") if cfg.reduce_loss else "none"

        if cfg.label_smoothing == 0.0 and not cfg.hf_compat:
            index = labels.unsqueeze(1).expand(b, k, t).unsqueeze(-1)
            target_lp = logits.gather(-1, index).squeeze(-1).float() - torch.logsumexp(logits.float(), dim=-1)  # (B, K, T)
            mask = label_mask.bool()
            if cfg.exclude_bos_score and self.bos_token_id is not None:
                # per row, as marginalize's default exclude_bos_score
                mask = mask.clone()
                mask[:, 0] &= labels[:, 0].ne(self.bos_token_id)
            ll_fn = M.rag_sequence_log_likelihood if cfg.marginalization == "sequence" else M.rag_token_log_likelihood
            loss = -ll_fn(target_lp, prior, mask=mask)  # (B,)
            return loss.mean() if reduce == "mean" else loss.sum() if reduce == "sum" else loss

        nll_fn = M.rag_sequence_nll if cfg.marginalization == "sequence" else M.rag_token_nll
        token_lp = torch.log_softmax(logits.float(), dim=-1)
        # hf_compat: transformers masks `target == pad`, which for right-padded targets is label_mask.
        return nll_fn(
            token_lp, labels, prior,
            mask=None if cfg.hf_compat else label_mask.bool(),
            pad_token_id=self.pad_token_id,
            epsilon=cfg.label_smoothing,
            reduce=reduce,
            exclude_bos_score=cfg.exclude_bos_score,
            bos_token_id=self.bos_token_id,
            hf_compat=cfg.hf_compat,
        )


def _load_query_encoder(root: Path, entry: dict, verify: str):
    """The checkpoint's query encoder: its saved copy, or the encoder it references by name, whose
    weights fingerprint must then equal the recorded one (unless ``verify="none"``)."""
    from rag.knowledge.encoders import TextEncoder

    if not entry.get("reference"):
        return TextEncoder.from_pretrained(root / entry.get("dir", QUESTION_ENCODER_DIR))
    cfg_file = root / CHECKPOINT_CONFIG
    missing = [k for k in ("name", "fingerprint", "pooling", "normalize", "max_length") if k not in entry]
    if missing:
        raise IntegrityError(f"{cfg_file}: the referenced query encoder lacks field(s) {missing}; save the model again")
    name = entry["name"]
    try:
        qenc = TextEncoder(name, pooling=entry["pooling"], normalize=entry["normalize"], max_length=entry["max_length"])
    except RagError as e:
        raise ConfigError(
            f"{cfg_file}: references the query encoder {name!r} by name (its weights are not in the checkpoint), "
            f"and it cannot be loaded here: {e}"
        ) from e
    if verify != "none":
        found = qenc.identity()["fingerprint"]
        if found != entry["fingerprint"]:
            raise IntegrityError(
                f"{cfg_file}: references the query encoder {name!r} with weights fingerprint {entry['fingerprint'][:16]}…, "
                f"but {name!r} loads here with fingerprint {found[:16]}… (a different version of the encoder); install the "
                "version the model was saved with, or load with verify='none' to accept it unchecked"
            )
    return qenc


def _check_overrides(overrides: dict) -> dict:
    known = {f.name for f in dataclasses.fields(RagModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown RagModelConfig field(s) {unknown}; valid fields are {sorted(known)}")
    return overrides
