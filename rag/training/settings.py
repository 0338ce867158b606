"""Typed argument groups of the training modules (``model.optimizer``, ``model.decoding``, ...), read by LightningCLI.

Every group is a dataclass, so ``rag fit --print_config`` and ``rag fit --model.help CLASS`` list its fields, and a
config sets one field without restating the others (``optimizer: {lr: 1.0e-4}`` keeps the module's other defaults).
A module stores each group as a plain dict in its hyperparameters (checkpoints load with ``weights_only=True``) and
rebuilds the dataclass with :func:`as_settings`. :data:`RENAMED` maps the flat options of earlier releases to the
group field that replaced them: :func:`check_renamed` refuses an old key in one line naming the new one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.generation.options import FALLBACK_DEFAULTS, check_option
from rag.training.schedules import SCHEDULES, step_schedule
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

__all__ = ["Optimizer", "RagOptimizer", "RetrieverOptimizer", "RerankerOptimizer", "Decoding", "Evaluation",
           "KnowledgeBaseBuild", "RetrievalActors", "as_settings", "settings_dict", "RENAMED", "check_renamed",
           "upgrade_arguments", "decay_split"]


@dataclass
class Optimizer:
    """AdamW and its learning-rate schedule (every training module's ``model.optimizer``).

    Args:
        lr: learning rate (of the module's main component; the module's docs say which).
        weight_decay: AdamW weight decay (each module says which parameters it spares: biases and norms for most).
        adam_epsilon: AdamW epsilon.
        warmup_steps: optimizer steps of linear warm-up.
        warmup_ratio: warm-up as a fraction of all optimizer steps (instead of `warmup_steps`).
        schedule: after warm-up, ``linear`` decay to 0 at the last step, or ``constant``.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_epsilon: float = 1e-8
    warmup_steps: int = 0
    warmup_ratio: Optional[float] = None
    schedule: Literal["linear", "constant"] = "linear"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("lr"):
                check_number(getattr(self, f.name), f"model.optimizer.{f.name}", low=0, error=ConfigError)
        check_number(self.weight_decay, "model.optimizer.weight_decay", low=0, error=ConfigError)
        check_number(self.adam_epsilon, "model.optimizer.adam_epsilon", above=0, error=ConfigError)
        if self.warmup_ratio is not None and (not 0.0 <= self.warmup_ratio < 1.0):
            raise ConfigError(f"model.optimizer.warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ConfigError("set model.optimizer.warmup_steps or model.optimizer.warmup_ratio, not both")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"model.optimizer.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"model.optimizer.schedule={self.schedule!r}; choose one of {sorted(SCHEDULES)}")

    def build(self, module: pl.LightningModule, param_groups: Sequence[Any], *, first_steps: int = 0,
              first_factors: Optional[Sequence[float]] = None) -> dict:
        """Lightning's ``configure_optimizers`` answer: AdamW over `param_groups` (a group without its own ``lr`` or
        ``weight_decay`` takes this group's) and the warm-up + `schedule` stepped every optimizer step
        (:func:`~rag.training.schedules.step_schedule`; `first_steps` / `first_factors` as there)."""
        optimizer = torch.optim.AdamW(param_groups, lr=self.lr, eps=self.adam_epsilon, weight_decay=self.weight_decay)
        return {"optimizer": optimizer,
                "lr_scheduler": step_schedule(optimizer, module.trainer, warmup_ratio=self.warmup_ratio,
                                              warmup_steps=self.warmup_steps, schedule=self.schedule,
                                              first_steps=first_steps, first_factors=first_factors)}


@dataclass
class RagOptimizer(Optimizer):
    """:class:`Optimizer` of RagModule: ``lr`` is the generator's; the retrieval side has its own learning rates.

    Args:
        query_encoder_lr: learning rate of the query encoder.
        doc_encoder_lr: learning rate of the document encoder (``rag.train_doc_encoder``) and of a learnt retrieval
            temperature.
    """

    lr: float = 3e-5
    query_encoder_lr: float = 1e-5
    doc_encoder_lr: float = 1e-5


@dataclass
class RetrieverOptimizer(Optimizer):
    """:class:`Optimizer` of REPLUG LSR: ``lr`` is the query encoder's.

    Args:
        doc_encoder_lr: learning rate of the document encoder (``train_doc_encoder``).
    """

    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup_ratio: Optional[float] = 0.1
    doc_encoder_lr: float = 1e-5


@dataclass
class RerankerOptimizer(Optimizer):
    """:class:`Optimizer` of the predictive reranker: ``lr`` is the encoder's.

    Args:
        rank_prior_lr: learning rate of the per-rank biases (``rank_prior``), which at the encoder's rate barely move.
    """

    lr: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: Optional[float] = 0.1
    rank_prior_lr: float = 1e-2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.rank_prior_lr, "model.optimizer.rank_prior_lr", above=0, error=ConfigError)


def decay_split(params: Sequence[torch.nn.Parameter], weight_decay: float, **group: Any) -> list[dict]:
    """AdamW parameter groups sparing biases and norm weights (``ndim < 2``) the weight decay; each group gets the
    extra keys `group` (``lr``, ``name``, ...)."""
    decay = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay, **group},
            {"params": plain, "weight_decay": 0.0, **group}]


_OPTION = {"sequence_decoding": "decoding"}
"""A ``model.decoding`` field named otherwise than its generation option."""


@dataclass
class Decoding:
    """How validation, test and predict decode, and the decoding settings an export stores (``model.decoding``).

    A field left null takes the generation options' default (:data:`rag.generation.options.FALLBACK_DEFAULTS`, the
    values ``rag generate`` falls back to for a model that stores none).

    Args:
        num_beams: beam width (1 = greedy).
        max_new_tokens: most generated answer tokens.
        length_penalty: beams are ranked by log-probability / length ** length_penalty (> 1 favours longer answers).
            ``num_beams``, ``max_new_tokens`` and ``length_penalty`` are also the exported model's decoding defaults.
        sequence_decoding: RAG-Sequence decoding: ``fast`` or ``thorough`` (Lewis et al. 2020, §2.5).
    """

    num_beams: Optional[int] = None
    max_new_tokens: Optional[int] = None
    length_penalty: Optional[float] = None
    sequence_decoding: Optional[Literal["fast", "thorough"]] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # each by its generation option's range (the one check of a value)
            if getattr(self, f.name) is not None:
                check_option(_OPTION.get(f.name, f.name), getattr(self, f.name), f"model.decoding.{f.name}", per_call=False)

    def resolved(self) -> dict:
        """Every field with its value: the one set, else the generation options' default."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = FALLBACK_DEFAULTS[_OPTION.get(f.name, f.name)] if value is None else value
        out["length_penalty"] = float(out["length_penalty"])
        return out


@dataclass
class Evaluation:
    """What validation and test measure (``model.evaluation``).

    Args:
        recall_at: the k of retrieval recall@k reported on validation/test.
        generate_on_validation: generate and score EM/F1 during validation (off: loss + recall only).
        generation_metrics: metrics added to EM and F1: ``bleu1`` (BLEU-1), ``rougeL`` (ROUGE-L F), both torchmetrics'.
        predictions_file: where ``rag predict`` writes its predictions, one JSON object per question with provenance;
            default ``<trainer.default_root_dir>/predictions.jsonl``.
    """

    recall_at: Sequence[int] = (1, 5)
    generate_on_validation: bool = True
    generation_metrics: Sequence[Literal["bleu1", "rougeL"]] = ()
    predictions_file: Optional[str] = None

    def __post_init__(self) -> None:
        self.recall_at = [int(k) for k in self.recall_at]
        self.generation_metrics = list(self.generation_metrics)
        if not self.recall_at or any(k < 1 for k in self.recall_at):
            raise ConfigError(f"model.evaluation.recall_at={self.recall_at!r}: give one or more k >= 1")


@dataclass
class KnowledgeBaseBuild:
    """Build the module's ``knowledge_base`` directory first when it does not exist (``model.build_knowledge_base``).

    Args:
        corpus: ``demo`` (the bundled Elements corpus) or a corpus path.
        encoder: the document encoder of the build (default: the module's question encoder, right for shared
            encoders such as MiniLM; DPR needs its context encoder).
        index: FAISS index spec (``flat``, ``hnsw``, ...).
    """

    corpus: str = "demo"
    encoder: Optional[str] = None
    index: str = "flat"


@dataclass
class RetrievalActors:
    """Serve the knowledge base's search from Ray actors instead of this process (``model.retrieval_actors``).

    Args:
        count: actors (:class:`~rag.knowledge.ray_pool.RayRetrievalPool`: restarted on failure, a query retried once on
            another actor); 0 searches in this process. Needs ``pip install -e ".[ray]"``.
        ray_address: the Ray cluster of the actors (``host:port``); None starts or joins a local Ray.
    """

    count: int = 0
    ray_address: Optional[str] = None

    def __post_init__(self) -> None:
        check_number(self.count, "model.retrieval_actors.count (0: search in this process)", integer=True, low=0,
                     error=ConfigError)
        if self.ray_address is not None and not self.count:
            raise ConfigError("model.retrieval_actors.ray_address is the cluster of the retrieval actors; set "
                              "model.retrieval_actors.count too")


def settings_dict(value: Any, cls: type, name: str) -> Optional[dict]:
    """A group given as a dataclass instance, a mapping (a YAML config, a checkpoint) or None, as a plain dict (None
    stays None); an unknown field is a :class:`ConfigError` naming the valid ones, and a renamed one its new name."""
    if value is None:
        return None
    if isinstance(value, cls):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"model.{name}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        return dict(value)
    raise ConfigError(f"model.{name} must be a {cls.__name__} or a mapping, got {type(value).__name__}")


def as_settings(value: Any, cls: type, name: str) -> Any:
    """The group `value` (instance, mapping or None) as a validated `cls` instance (None stays None)."""
    plain = settings_dict(value, cls, name)
    return None if plain is None else cls(**plain)


_OPTIMIZER_FIELDS = ("weight_decay", "adam_epsilon", "warmup_steps", "warmup_ratio", "schedule")

RENAMED: dict[str, dict[str, str]] = {
    "RagModule": {
        "generator_lr": "optimizer.lr", "query_encoder_lr": "optimizer.query_encoder_lr",
        "doc_encoder_lr": "optimizer.doc_encoder_lr", **{k: f"optimizer.{k}" for k in _OPTIMIZER_FIELDS},
        **{k: f"decoding.{k}" for k in ("num_beams", "max_new_tokens", "length_penalty", "sequence_decoding")},
        **{k: f"evaluation.{k}" for k in ("recall_at", "generate_on_validation", "generation_metrics", "predictions_file")},
        "build_knowledge_base_from": "build_knowledge_base.corpus", "knowledge_base_encoder": "build_knowledge_base.encoder",
        "knowledge_base_index": "build_knowledge_base.index", "ray_address": "retrieval_actors.ray_address",
    },
    "ReplugLSRModule": {
        "query_encoder_lr": "optimizer.lr", "doc_encoder_lr": "optimizer.doc_encoder_lr",
        **{k: f"optimizer.{k}" for k in _OPTIMIZER_FIELDS},
        "build_knowledge_base_from": "build_knowledge_base.corpus", "knowledge_base_index": "build_knowledge_base.index",
    },
    "PredictiveRerankerModule": {"lr": "optimizer.lr", "rank_prior_lr": "optimizer.rank_prior_lr",
                                 **{k: f"optimizer.{k}" for k in _OPTIMIZER_FIELDS}},
    "CausalReaderModule": {"learning_rate": "optimizer.lr", **{k: f"optimizer.{k}" for k in _OPTIMIZER_FIELDS}},
    "NLIModule": {"learning_rate": "optimizer.lr", **{k: f"optimizer.{k}" for k in _OPTIMIZER_FIELDS}},
}
"""``{module class name: {old option: its new place}}``: the flat options of earlier releases."""

_RENAMED_VALUES = {"retrieval_actors": "retrieval_actors.count"}  # same name, now a group: refused when given a number


def check_renamed(class_path: str, options: dict, where: str) -> None:
    """Raise a :class:`ConfigError` naming the new key when `options` (a module's ``init_args`` from `where`, a config
    file or the command line) uses an option of an earlier release."""
    table = RENAMED.get(class_path.rsplit(".", 1)[-1], {})
    for key, value in options.items():
        new = table.get(key)
        if (new is None and class_path.endswith("RagModule") and key in _RENAMED_VALUES
                and not isinstance(value, (dict, type(None)))):
            new = _RENAMED_VALUES[key]
        if new is not None:
            raise ConfigError(f"{where}: model.{key} is now model.{new}; rename it (docs/training.md lists every option)")


def upgrade_arguments(class_path: str, arguments: dict) -> dict:
    """A module's arguments recorded by an earlier release (a checkpoint's hyperparameters) in today's groups: each old
    flat option moved to its group field (:data:`RENAMED`); what is already current is kept as it is."""
    table = RENAMED.get(class_path.rsplit(".", 1)[-1], {})
    out = {k: v for k, v in arguments.items() if k not in table}
    if class_path.endswith("RagModule") and isinstance(out.get("retrieval_actors"), int):
        out["retrieval_actors"] = {"count": out["retrieval_actors"]}
    for key, value in arguments.items():
        if key in table:
            group, name = table[key].split(".")
            if group == "build_knowledge_base" and arguments.get("build_knowledge_base_from") is None:
                continue  # nothing was to be built
            current = out.get(group)
            out[group] = {**(current if isinstance(current, dict) else {}), name: value}
    return out
