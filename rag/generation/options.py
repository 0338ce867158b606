"""One schema of per-call generation options: `rag generate`'s flags and `rag serve`'s request fields derive from it.

Every option defaults to None, which means "the model's stored default" everywhere (an exported model keeps the
decoding settings its `rag fit` run was scored with: ``num_beams``, ``length_penalty``, ``max_new_tokens``), then the
reader's own default. Only options a caller sets reach the reader, so a flag nobody typed never overrides a stored
setting. :class:`GenerationOptions` validates what is set (types, ranges, choices) and names the option and its flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from rag.utils.errors import ConfigError
from rag.utils.validate import check_bool, check_choice, check_number

__all__ = ["GenerationOptions", "OptionSpec", "option_specs", "reader_options", "retrieval_options"]


@dataclass(frozen=True)
class OptionSpec:
    """How one option is checked and offered: its type, bounds, choices, help, and which readers take it."""

    type: type
    help: str
    low: Optional[float] = None  # inclusive
    high: Optional[float] = None  # inclusive; the server may lower it (ServeLimits)
    choices: tuple = ()
    reader: Optional[Literal["seq2seq", "causal"]] = None  # None: every reader
    retrieval: bool = False  # says how to retrieve or mix passages: refused by a generation without retrieval
    name: str = ""  # set by option_specs()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _opt(type_: type, help: str, **kw: Any) -> Any:
    return field(default=None, metadata={"spec": OptionSpec(type_, help, **kw)})


@dataclass(frozen=True)
class GenerationOptions:
    """Per-call generation options (None: the model's stored default, then the reader's).

    RAG (seq2seq): ``n_docs`` passages marginalized by ``marginalization`` (Eq. 1 RAG-Sequence / Eq. 2 RAG-Token),
    RAG-Sequence ``decoding`` thorough or fast (§2.5). In-Context RALM (causal): re-retrieve every ``stride`` tokens
    with the last ``query_length`` tokens as the query. REPLUG: ``ensemble=K`` documents mixed with weights
    softmax(scores / ``retrieval_temperature``).
    """

    n_docs: Optional[int] = _opt(int, "passages to retrieve per question (default: the model's)", low=1, high=100,
                                 reader="seq2seq", retrieval=True)
    num_beams: Optional[int] = _opt(int, "beam width (default: the model's stored setting, else 1)", low=1, high=16)
    marginalization: Optional[str] = _opt(str, "RAG-Sequence (Eq. 1) or RAG-Token (Eq. 2) (default: the model's)",
                                          choices=("sequence", "token"), reader="seq2seq", retrieval=True)
    decoding: Optional[str] = _opt(str, "RAG-Sequence decoding (§2.5; default thorough)", choices=("thorough", "fast"),
                                   reader="seq2seq", retrieval=True)
    max_new_tokens: Optional[int] = _opt(int, "most tokens per answer (default: the model's stored setting, else 32)",
                                         low=1, high=256)
    min_new_tokens: Optional[int] = _opt(int, "fewest tokens per answer (default 0)", low=0, high=256)
    num_return_sequences: Optional[int] = _opt(int, "answers per question, best first (at most num_beams; default 1)",
                                               low=1, high=16)
    length_penalty: Optional[float] = _opt(float, "beam score = log p / length**penalty (default: the model's, else 1)",
                                           low=-10.0, high=10.0)
    no_repeat_ngram_size: Optional[int] = _opt(int, "never repeat an n-gram of this size (0: off; default: the model's)",
                                               low=0, high=16)
    early_stopping: Optional[Union[bool, str]] = _opt(object, "beam search stops when num_beams answers are done (true), "
                                                              "by a heuristic (false), or never", choices=(True, False, "never"))
    stride: Optional[int] = _opt(int, "causal LM: generated tokens between retrievals (default 4)", low=1, high=256,
                                 reader="causal", retrieval=True)
    query_length: Optional[int] = _opt(int, "causal LM: the last this-many tokens are the query (default 32)", low=1,
                                       high=4096, reader="causal", retrieval=True)
    retrieval: Optional[str] = _opt(str, "retriever: dense, bm25, or hybrid (both fused: as a RAG model's config says, "
                                         "else by score); default: a RAG model's configured one; a causal LM's bm25 "
                                         "when the knowledge base has a BM25 index, else dense",
                                    choices=("bm25", "dense", "hybrid"), retrieval=True)
    ensemble: Optional[int] = _opt(int, "REPLUG (Shi et al. 2023): mix the next-token distributions of the top-K "
                                        "documents (a RAG model: RAG-Token over K passages)", low=1, high=100, retrieval=True)
    retrieval_temperature: Optional[float] = _opt(float, "causal LM with ensemble: temperature T of the REPLUG weights "
                                                         "softmax(scores / T) (default 1; at least 1e-4); a RAG model's is "
                                                         "part of its config",
                                                  low=1e-4, high=1e6, retrieval=True)
    do_sample: Optional[bool] = _opt(bool, "sample instead of greedy decoding (num_beams 1)")
    temperature: Optional[float] = _opt(float, "sampling (do_sample): the next-token scores are divided by T before top-p "
                                               "(default 1)", low=1e-3, high=100.0)
    top_p: Optional[float] = _opt(float, "sampling (do_sample): draw from the smallest set of most likely tokens whose "
                                         "probability reaches P (nucleus sampling; default 1: all tokens)", low=1e-6, high=1.0)
    seed: Optional[int] = _opt(int, "causal LM: seed of sampling", low=0, high=2**32 - 1, reader="causal")
    extractive: Optional[bool] = _opt(bool, "answer with a span of a retrieved passage: each answer is a run of whole "
                                            "words from the title or text of the passages read, not starting with a word "
                                            "of the question (default: the model's, else off)", reader="seq2seq", retrieval=True)

    def __post_init__(self) -> None:
        for name, spec in option_specs().items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check(name, spec, value))
        for small, large in (("num_return_sequences", "num_beams"), ("min_new_tokens", "max_new_tokens")):
            a, b = getattr(self, small), getattr(self, large)
            if a is not None and b is not None and a > b:
                raise ConfigError(f"{small} ({a}) must not exceed {large} ({b})")
        for name in ("temperature", "top_p"):  # they shape a sampled draw: set without sampling they would do nothing
            if getattr(self, name) is not None and self.do_sample is not True:
                raise ConfigError(f"{name}={getattr(self, name)!r} ({option_specs()[name].flag}) applies to sampling only: "
                                  "set do_sample=true (--sample) too, or drop it")

    @classmethod
    def from_dict(cls, options: dict, *, where: str = "generation options") -> "GenerationOptions":
        """Options from a mapping (a request, a config); an unknown name is a :class:`ConfigError` listing the known."""
        unknown = sorted(set(options) - set(option_specs()))
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(option_specs())}")
        return cls(**options)

    def set_options(self) -> dict:
        """``{name: value}`` of the options that were set (the rest take the model's defaults)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def option_specs() -> dict[str, OptionSpec]:
    """``{name: OptionSpec}`` of every option, in declaration order."""
    return {f.name: dataclasses.replace(f.metadata["spec"], name=f.name) for f in dataclasses.fields(GenerationOptions)}


def reader_options(kind: str) -> dict[str, str]:
    """``{name: flag}`` of the options only the `kind` reader takes ("seq2seq" or "causal")."""
    return {n: s.flag for n, s in option_specs().items() if s.reader == kind}


def retrieval_options() -> dict[str, str]:
    """``{name: flag}`` of the options that say how to retrieve or mix passages."""
    return {n: s.flag for n, s in option_specs().items() if s.retrieval}


def _check(name: str, spec: OptionSpec, value: Any) -> Union[int, float, str, bool]:
    what = f"{name}={value!r} ({spec.flag} {value})"
    if spec.choices:
        return check_choice(value, what, spec.choices, error=ConfigError)
    if spec.type is bool:
        return check_bool(value, what, error=ConfigError)
    return check_number(value, what, integer=spec.type is int, low=spec.low, high=spec.high, error=ConfigError)


FALLBACK_DEFAULTS: dict[str, Any] = {"num_beams": 1, "max_new_tokens": 32, "length_penalty": 1.0, "no_repeat_ngram_size": 2,
                                     "decoding": "thorough"}
"""What an option resolves to when neither the call nor the model's stored settings set it (``no_repeat_ngram_size``:
for a model trained here; an imported transformers checkpoint stores its own)."""
