"""The generator as a type: what retrieval-augmented reading asks of an LM, whatever its family.

A :class:`Generator` wraps one transformers LM and its tokenizer and turns questions and passages into its inputs
(``contexts``), those inputs into what the shared search reads (``decoder``: a
:class:`~rag.generation.decoding.DecodingContexts`, whose rows are :class:`~rag.generation.search.Decoder` rows), and
target strings into teacher-forced logits (``targets``, ``teacher_forced``). Two families implement it,
:class:`~rag.generators.seq2seq.Seq2SeqGenerator` (BART, T5, the warm-start reader) and
:class:`~rag.generators.causal.CausalGenerator` (GPT-2, Llama, SmolLM2); :func:`rag.generators.load.as_generator`
picks one. Only this folder knows which family a reader holds: a new family is one new file here.

`settings` is the reading configuration (a :class:`~rag.models.rag.config.RagModelConfig` or anything with its
``max_context_length``, ``effective_truncation``, ``max_target_length``, ``title_sep``, ``doc_sep`` and
``prompt_format``), passed per call so that a replaced configuration takes effect at once.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Literal, NamedTuple, Optional, Protocol, Sequence

from torch import Tensor

from rag.generation.contexts import ContextFormat
from rag.generation.search import GenerationConfig
from rag.generation.spans import TokenTexts
from rag.knowledge.passages import Passage

__all__ = ["Generator", "GeneratorInputs", "GeneratorBase", "QUESTION_TOKENS", "prompt_lengths", "layout_fingerprint"]

QUESTION_TOKENS = 32
"""The question length a reader's window keeps room for when passages are measured against it."""

PromptIds = Callable[[str, Sequence], list]
"""``(question, passages) -> ids``: the whole (uncut) token ids of the question's input with each passage."""


def _probe_question(tokenizer, tokens: int) -> tuple[str, int]:
    """A question string and its own token count (without special tokens), about `tokens` tokens long."""
    question = " ".join(["x"] * max(int(tokens), 1))
    return question, len(tokenizer(question, add_special_tokens=False)["input_ids"])


def prompt_lengths(prompt_ids: PromptIds, tokenizer, passages: Sequence, question_tokens: int = QUESTION_TOKENS,
                   batch: int = 512) -> list[int]:
    """Per passage, the tokens of a reader input made of it and a question of `question_tokens` tokens, whole (what a
    window must hold for the passage to be read to its end), measured in batches of `batch` passages."""
    question, bare = _probe_question(tokenizer, question_tokens)
    passages = list(passages)
    out: list[int] = []
    for i in range(0, len(passages), batch):
        out += [len(row) - bare + int(question_tokens) for row in prompt_ids(question, passages[i:i + batch])]
    return out


def layout_fingerprint(prompt_ids: PromptIds, tokenizer) -> str:
    """A short SHA-256 of a probe prompt's token ids: equal for two readers whose prompts are laid out and tokenized
    alike, so a length measured for one holds for the other."""
    question, _ = _probe_question(tokenizer, 8)
    [ids] = prompt_ids(question, [Passage("probe", "Probe title", "A probe passage, 1774: the first sentence. And a second.")])
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class GeneratorInputs(NamedTuple):
    """A generator's tokenized inputs for ``N`` (question, passage) rows (row ``b·K + k``), or ``B`` bare questions."""

    input_ids: Tensor
    """``(N, L)`` ids (seq2seq: right-padded contexts; causal: left-padded prompts)."""
    attention_mask: Tensor
    """``(N, L)`` 1 on real tokens."""
    n_truncated: int
    """How many rows were shortened to ``settings.max_context_length``."""
    strings: list
    """The ``N`` strings tokenized."""
    prefix_width: int
    """The width of the question-independent segment at the left (causal prompts), else 0."""


class Generator(Protocol):
    """What RAG, its decoding and its answers need of a generator (shapes: `B` questions, `K` passages each)."""

    kind: str
    """``"seq2seq"`` | ``"causal"``: what a checkpoint records and a server reports; never branched on above here."""
    sequence_convention: Literal["transformers", "paper"]
    """How RAG-Sequence's thorough rescoring sums a candidate (:func:`~rag.generation.decoding.rag_sequence_generate`)."""
    transformers_rag: bool
    """Whether transformers has a RAG over this family (so ``hf_compat`` can reproduce it)."""
    decoder_only: bool
    """True for a causal LM: p(y | x, z) is its likelihood of the answer after a prompt of z and x."""
    model: Any
    tokenizer: Any

    @property
    def pad_token_id(self) -> int: ...

    @property
    def eos_token_id(self) -> Optional[int]: ...

    @property
    def decoder_start_token_id(self) -> Optional[int]: ...

    @property
    def prefix_cache(self) -> Any: ...

    def check_tokens(self) -> None:
        """ConfigError naming the missing special token (the pad token is checked by the caller)."""

    def context_format(self, settings) -> ContextFormat: ...

    def contexts(self, questions: Sequence[str], passages: Optional[Sequence[Sequence]], settings) -> GeneratorInputs:
        """The ``B·K`` inputs of `questions` with their `passages` (B lists of K), or the ``B`` bare questions (None)."""

    def prompt_ids(self, question: str, passages: Sequence, settings) -> list[list[int]]:
        """The token ids of `question`'s input with each of `passages` (one row per passage), laid out as
        :meth:`contexts` lays them out but whole: no row is cut to ``settings.max_context_length``."""

    def prompt_lengths(self, passages: Sequence, settings, question_tokens: int = QUESTION_TOKENS) -> list[int]:
        """Per passage, the tokens of its input with a question of `question_tokens` tokens, whole
        (:func:`prompt_lengths` over :meth:`prompt_ids`)."""

    def layout_fingerprint(self, settings) -> str:
        """:func:`layout_fingerprint` of this generator's prompts with `settings`."""

    def loss_contexts(self, questions: Sequence[str], passages: Optional[Sequence], settings) -> GeneratorInputs:
        """The ``B`` inputs a generator-only loss reads: each question with its one passage, or alone (None)."""

    def with_bare_rows(self, questions: Sequence[str], inputs, settings) -> tuple[Tensor, Tensor, int]:
        """`inputs`' ``B·K`` rows followed by ``B·K`` rows without a passage (K per question): ids, mask, prefix width."""

    def decoder(self, input_ids: Tensor, attention_mask: Tensor, share_cache: bool = True, prefix_width: int = 0):
        """What the shared search reads for rows ``(N, L)`` (a :class:`~rag.generation.decoding.DecodingContexts`)."""

    def decoding_config(self, config: GenerationConfig) -> GenerationConfig:
        """`config` completed with what this family's answers need (a causal LM's EOS)."""

    def targets(self, targets: Sequence[str], settings) -> tuple[Tensor, Tensor]:
        """The scored target ids ``(B, T)`` and their mask ``(B, T)`` bool."""

    def teacher_forced(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_docs: int, *,
                       decoder_input_ids: Optional[Tensor] = None, max_buckets: int = 1) -> Tensor:
        """Logits ``(B, K, T, V)``: position t of row ``b·K + k`` is the distribution of ``labels[b, t]``."""

    def token_texts(self) -> TokenTexts: ...

    def clear_caches(self) -> None:
        """Forget what was computed with the current weights (call when they change)."""


class GeneratorBase:
    """What both families share: the module, its tokenizer, the tokenizer's texts for extractive decoding."""

    kind = ""
    sequence_convention: Literal["transformers", "paper"] = "transformers"
    transformers_rag = False
    decoder_only = False

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self._token_texts: Optional[TokenTexts] = None

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> Optional[int]:
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def decoder_start_token_id(self) -> Optional[int]:
        return None

    @property
    def prefix_cache(self):
        return None

    def context_format(self, settings) -> ContextFormat:
        """How a passage and a question are joined (transformers reads the prefix from the generator's config)."""
        prefix = getattr(self.model.config, "prefix", None) or ""
        return ContextFormat(title_sep=settings.title_sep, doc_sep=settings.doc_sep, prefix=prefix)

    def decoding_config(self, config: GenerationConfig) -> GenerationConfig:
        return config

    def prompt_lengths(self, passages: Sequence, settings, question_tokens: int = QUESTION_TOKENS) -> list[int]:
        """Per passage, the tokens of its input with a question of `question_tokens` tokens, whole."""
        return prompt_lengths(lambda q, ps: self.prompt_ids(q, ps, settings), self.tokenizer, passages, question_tokens)

    def layout_fingerprint(self, settings) -> str:
        """:func:`layout_fingerprint` of this generator's prompts with `settings`."""
        return layout_fingerprint(lambda q, ps: self.prompt_ids(q, ps, settings), self.tokenizer)

    def token_texts(self) -> TokenTexts:
        """The tokenizer's :class:`TokenTexts` (extractive decoding), built on first use."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts

    def clear_caches(self) -> None:
        pass
