"""RagModelConfig: the typed options of a RagModel (saved in ``rag_config.json``, read by LightningCLI as ``model.rag``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from rag.generation.options import FALLBACK_DEFAULTS, GenerationConfig, check_option, option_specs
from rag.generation.prompts import DEFAULT_CLOSED_BOOK_TEMPLATE, DEFAULT_PROMPT_TEMPLATE, PromptFormat
from rag.utils.errors import ConfigError
from rag.utils.validate import check_bool, check_number, check_positive_int, is_number

__all__ = ["RagModelConfig", "check_overrides", "check_generation_settings"]

_MARGINALIZATIONS = ("sequence", "token")
_RETRIEVALS = ("dense", "bm25", "hybrid")
_TRUNCATIONS = ("keep_question", "hf")
_FUSIONS = ("score", "rrf")
_FOCUSES = ("none", "question")


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
    retrieval: Literal["dense", "bm25", "hybrid"] = "dense"
    """dense: DPR-style MIPS with trainable query encoder; bm25: BM25 scores as retrieval logits (RAG-BM25); hybrid: the
    dense and BM25 rankings fused as ``hybrid_fusion`` says (:mod:`rag.knowledge.hybrid`); the prior over the fused
    passages has the dense score q · d in it, so the query encoder still trains."""
    hybrid_fusion: Literal["score", "rrf"] = "score"
    """Hybrid retrieval: ``score`` ranks the union of both top-K lists by q · d + hybrid_bm25_weight · BM25 / (the
    query's best BM25 score), which is also the retrieval logit; ``rrf`` by reciprocal rank fusion, the logit q · d
    (:mod:`rag.knowledge.hybrid`). Configs saved before this field existed used ``rrf``."""
    hybrid_bm25_weight: float = 1.0
    """Hybrid score fusion: the weight of the normalised BM25 score, in units of the dense score (1 for a cosine
    encoder such as MiniLM; how it was chosen: docs/benchmarks.md, "Hybrid retrieval")."""
    hybrid_numeral_weight: float = 4.0
    """Hybrid score fusion: the factor on hybrid_bm25_weight for a question with a numeral (a number or a code such as
    486SX), whose exact match a word-piece encoder barely sees (:mod:`rag.knowledge.hybrid`). Configs saved before this
    field existed fused without it (1)."""
    hybrid_rrf_k: int = 60
    """Hybrid rrf fusion: the constant k of reciprocal rank fusion, score(d) = Σ 1 / (k + rank(d)) over the two rankings."""
    max_context_length: int = 300
    """Most generator input tokens per (question, passage) context."""
    max_target_length: int = 64
    """Most target tokens (longer answers are truncated, keeping EOS)."""
    max_question_length: int = 64
    """Most query-encoder tokens per question."""
    truncation: Literal["keep_question", "hf"] = "keep_question"
    """keep_question: shorten the passage so the question always fits; hf: cut on the right like transformers."""
    passage_focus: Literal["none", "question"] = "none"
    """none: each passage is read as stored. question: read from the sentence that shares the question's rarest words
    (:func:`~rag.generation.contexts.focus_on_question`; the text before it goes last), for passages that hold many
    short entries (glossaries, catalogues) where the reader must start at the entry the question names. Training,
    decoding and serving read the same focused text; provenance shows the passage as stored."""
    hf_compat: bool = False
    """Reproduce transformers' RAG exactly (contexts, question round trip, loss quirks, summed loss)."""
    mask_padded_contexts: bool = True
    """RAG-Sequence's per-passage search attends only to each context's own tokens. False reproduces
    transformers' ``RagSequenceForGeneration.generate`` (the importer sets it): its search runs on contexts padded
    to ``max_context_length`` with no attention mask, so encoder and cross-attention attend to the pad tokens;
    rescoring stays masked, as there. RAG-Token decoding always masks (transformers does too)."""
    retrieval_temperature: float = FALLBACK_DEFAULTS["retrieval_temperature"]
    """τ > 0 dividing the retrieval scores before the document prior, p(z|x) = softmax(s(z, x) / τ), in both
    marginalizations (training loss) and in decoding. 1 is the paper's plain softmax. With L2-normalised encoders
    (all-MiniLM-L6-v2) scores lie in [-1, 1], so the prior over K passages stays nearly flat unless τ is small
    (e.g. 0.05). The same setting as REPLUG's λ and LSR's γ (``retrieval_temperature`` there)."""
    learn_retrieval_temperature: bool = False
    """Learn τ (a log-scale parameter, like CLIP's logit scale, clamped to [0.01, 100]) with the query encoder's
    learning rate, starting at ``retrieval_temperature``; the learned value is saved as ``retrieval_temperature``."""
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """Causal (decoder-only) generators: the prompt before the answer, with ``{passage}`` and ``{question}`` (and
    optionally ``{title}``); it is the user message of the tokenizer's chat template when there is one
    (:mod:`rag.generation.prompts`). p(y | x, z) is the LM's likelihood of the answer tokens (and EOS) after it."""
    closed_book_template: str = DEFAULT_CLOSED_BOOK_TEMPLATE
    """Causal generators: the prompt without a passage (closed-book answers, RetRobust's no-retrieval answers), with
    ``{question}``."""
    system_prompt: Optional[str] = None
    """Causal generators with a chat template: its system message (None: the chat template's own default)."""
    chat_template: bool = True
    """Causal generators: put the prompt into the tokenizer's chat template when it has one."""
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
    generation: Optional[dict] = None
    """Decoding settings stored with the model (GenerationConfig field -> value, e.g. ``num_beams``, ``max_length``,
    ``no_repeat_ngram_size``, ``forced_bos_token_id``; the transformers importer carries those of the checkpoint): every
    path resolves a call's options over them (:func:`~rag.generation.options.resolve_generation`)."""

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            check_positive_int(getattr(self, name), f"RagModelConfig.{name}", error=ConfigError)

        for name in ("n_docs", "max_context_length", "max_target_length", "max_question_length", "hybrid_rrf_k"):
            positive_int(name)
        if self.marginalization not in _MARGINALIZATIONS:
            raise ConfigError(f"RagModelConfig.marginalization={self.marginalization!r}; choose one of {_MARGINALIZATIONS}")
        if self.retrieval not in _RETRIEVALS:
            raise ConfigError(f"RagModelConfig.retrieval={self.retrieval!r}; choose one of {_RETRIEVALS}")
        if self.hybrid_fusion not in _FUSIONS:
            raise ConfigError(f"RagModelConfig.hybrid_fusion={self.hybrid_fusion!r}; choose one of {_FUSIONS}")
        check_number(self.hybrid_bm25_weight, "RagModelConfig.hybrid_bm25_weight (1 for a cosine encoder)", low=0.0,
                     error=ConfigError)
        self.hybrid_bm25_weight = float(self.hybrid_bm25_weight)
        check_number(self.hybrid_numeral_weight, "RagModelConfig.hybrid_numeral_weight (1: numerals not weighed apart)",
                     low=0.0, error=ConfigError)
        self.hybrid_numeral_weight = float(self.hybrid_numeral_weight)
        if self.passage_focus not in _FOCUSES:
            raise ConfigError(f"RagModelConfig.passage_focus={self.passage_focus!r}; choose one of {_FOCUSES}")
        if self.truncation not in _TRUNCATIONS:
            raise ConfigError(f"RagModelConfig.truncation={self.truncation!r}; choose one of {_TRUNCATIONS}")
        if not is_number(self.label_smoothing) or not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"RagModelConfig.label_smoothing must be a number in [0, 1), got {self.label_smoothing!r}")
        self.label_smoothing = float(self.label_smoothing)
        for name in ("exclude_bos_score", "reduce_loss", "freeze_query_encoder", "hf_compat", "mask_padded_contexts",
                     "train_doc_encoder", "learn_retrieval_temperature"):
            check_bool(getattr(self, name), f"RagModelConfig.{name}", error=ConfigError)
        check_number(self.retrieval_temperature, "RagModelConfig.retrieval_temperature (1: the plain softmax over retrieval "
                     "scores; smaller: a sharper document prior)", low=0.01, high=100, error=ConfigError)
        self.retrieval_temperature = float(self.retrieval_temperature)
        for name in ("title_sep", "doc_sep"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"RagModelConfig.{name} must be a string, got {getattr(self, name)!r}")
        check_bool(self.chat_template, "RagModelConfig.chat_template", error=ConfigError)
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"RagModelConfig.system_prompt must be a string or null, got {self.system_prompt!r}")
        _ = self.prompt_format  # checks both templates' placeholders, naming the field
        if self.rerank_candidates is not None:
            positive_int("rerank_candidates")
            if self.rerank_candidates < self.n_docs:
                raise ConfigError(
                    f"RagModelConfig.rerank_candidates={self.rerank_candidates} is smaller than n_docs={self.n_docs}; "
                    "re-ranking keeps the best n_docs of rerank_candidates, so give at least n_docs (or null to disable)"
                )
        if self.generation is not None:
            check_generation_settings(self.generation, "RagModelConfig.generation")
        if self.retrieval != "dense" and self.uses_doc_encoder:
            raise ConfigError(
                "RagModelConfig.train_doc_encoder / rerank_candidates need dense retrieval (they re-rank the index's "
                "own neighbours); "
                "set retrieval: dense or disable them"
            )

    @property
    def prompt_format(self) -> PromptFormat:
        """How a causal generator's prompts are written (:class:`~rag.generation.prompts.PromptFormat`)."""
        return PromptFormat(template=self.prompt_template, closed_book=self.closed_book_template, system=self.system_prompt,
                            chat=self.chat_template)

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
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: the model config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        if "hybrid_rrf_k" in d and "hybrid_fusion" not in d:  # saved before score fusion existed: trained with rrf
            d = {**d, "hybrid_fusion": "rrf"}
        if d and "hybrid_numeral_weight" not in d:  # saved before the numeral factor existed: fused without it
            d = {**d, "hybrid_numeral_weight": 1.0}
        try:
            return cls(**d)
        except ConfigError as e:  # the field's own check, prefixed with the file it came from
            raise ConfigError(f"{where}: {e}") from None


def check_overrides(overrides: dict) -> dict:
    """`overrides` (field name -> value) unchanged, or ConfigError naming the unknown fields."""
    known = {f.name for f in dataclasses.fields(RagModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown RagModelConfig field(s) {unknown}; valid fields are {sorted(known)}")
    return overrides


def check_generation_settings(settings, where: str) -> dict:
    """`settings` unchanged if it maps GenerationConfig field names to valid values (each option checked as a call's
    would be, without the per-call cost bounds), else ConfigError naming the bad key."""
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} must be an object of decoding options, got {type(settings).__name__}")
    known = {f.name for f in dataclasses.fields(GenerationConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown decoding option(s) {unknown}; valid options are {sorted(known)}")
    specs = option_specs()
    for key, value in settings.items():
        if key not in specs or value is None:
            continue
        if isinstance(value, str) and specs[key].type is not str and not specs[key].choices:
            # jsonargparse keeps `--model.rag.generation.extractive true` a string inside a free-form mapping
            kind = {bool: "true or false", int: "an integer"}.get(specs[key].type, "a number")
            raise ConfigError(f"{where}.{key} must be {kind}, got the string {value!r}; write it unquoted (on the rag fit "
                              f"command line give the mapping whole: --model.rag.generation '{{{key}: {value}}}')")
        check_option(key, value, f"{where}.{key}={value!r}", per_call=False)
    return settings
